"""Block sparsity speed vs sparsity: each block-sparse kernel dense, with forced block lists, with the predictor, and
the predictor alone, against torch SDPA cuDNN bf16 (``python -m benchmarks.attention_ops --block-sparse``).

    python -m benchmarks.attention_ops --block-sparse                                  # 4 shapes, 2 kernels, 6 keeps
    python -m benchmarks.attention_ops --block-sparse --shapes wan14b-720p --keep 1,0.5,0.25 --kernels gluon_sage
    python -m benchmarks.attention_ops --block-sparse --plot bench_out/bs.png --skip-json bench_out/skip_softmax.json
    python -m benchmarks.attention_ops --block-sparse --shapes wan14b-720p --keep 1,0.5 --kernels gluon_sage \
        --configs "auto;128,2,ahead,permk,mmasum"   # the tuner's choice beside a forced config

**Inputs** (per shape): structured as for Skip-Softmax (:func:`benchmarks.common.local_qkv`: local attention along
the token order over ``--width`` tokens, ``--sharpness``, ``--sink`` attention-sink keys), quantized with
``--recipe`` as the compiled graph feeds the kernel (a kernel that quantizes Q itself, ``KernelInfo.quantizes_q``,
gets the bf16 Q, so its time includes that quantization; ``--prequant-q`` gives it the int8 Q instead).

**Per kernel** (``--kernels``; a kernel runs only where ``qattn_fx.kernels.info(kernel).block_sparse`` is true and
this GPU serves it, otherwise its rows say why it was skipped) and **per keep fraction** (``--keep``):

* ``dense ms``: (a) the kernel without lists (``block_index=None``), once per shape and kernel;
* ``lists ms``: (b) the kernel with **forced lists** of that keep fraction (``--pattern``): ``predicted`` (default)
  the predictor's ``top_k`` lists on these inputs (``ceil(keep · NK)`` key tiles per query tile, the ones of highest
  pooled score: a band around the diagonal plus the sink, no guard, no forced tiles), ``banded`` a band of exactly
  ``round(keep · NK)`` key tiles centred on the diagonal (shifted inside ``[0, NK)``), ``random`` exactly
  ``round(keep · NK)`` key tiles per query tile drawn uniformly (seeded);
* ``pred ms``: (c) the predictor alone (``qattn::predict_blocks`` as a compiled model runs it: the fused Triton
  pooling and selection; ``--mode`` with keep, no sink tiles, no diagonal, similarity guard off) on the bf16 Q and K;
* ``both ms``: (d) predictor then kernel on its lists, as a compiled graph runs them.

All timings are CUDA-graph replays (``--timer graph``, :func:`benchmarks.common.time_ms`): the GPU's time without
the host's; a call that cannot be captured is timed with CUDA events instead and its note says so. ``keep = 1``
lists every block: its ``lists ms`` against ``dense ms`` is what reading the lists costs.

**Configs** (``--configs``, gluon_sage only): the list calls (b) and (d) run once per config given, ``;``-separated
(``auto``: the tuner's choice, the default; else a ``GluonConfig`` forced with ``gluon_sage.use_config``, e.g.
``128,2,ahead,permk,mmasum``, beside ``auto``); the ``config``
column names the config that ran. The dense row (a) always runs the tuner's choice, so every config's ``x dense``
is over the same dense time.

**Columns**: ``skip`` achieved sparsity of the forced lists (``1 - Σ count / (B·H·NQ·NK)``) and ``skip pred`` of the
predictor's; ``x dense`` / ``x dense+pred``: ``dense ms / lists ms`` and ``dense ms / both ms`` (speedup over the
same kernel dense); ``x cudnn`` / ``x cudnn+pred``: the same over SDPA cuDNN bf16; ``pred %``: ``pred ms / dense
ms · 100`` (the predictor's share of the dense kernel's time); ``cos`` / ``rel-L1``: the forced-lists output against
fp32 dense attention on ``--acc-rows`` query rows; ``cos dense``: against the same kernel without lists.

Outputs: one markdown table (printed), JSON (``--out``), and with ``--plot PATH`` a PNG (matplotlib; skipped with a
message without it): speedup over the same kernel dense vs achieved sparsity, one panel per shape, a line per kernel
for lists and for lists + predictor, the ideal ``1 / (1 - s)``, and Skip-Softmax's curve from ``--skip-json`` (a
``--skip-softmax`` JSON) beside it. ``--max-seconds`` stops starting new measurements once exceeded, so a run
inside a device window still prints its table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import common
from .shapes import Shape
from .shapes import select as select_shapes

#: Presets measured by default (``--shapes``).
DEFAULT_SHAPES = "wan14b-720p,wan1.3b-480p,flux-1024,d64"
#: Keep fractions swept by default (1.0: every block listed, the lists' own cost).
KEEPS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15)
#: Kernels timed by default (each gated on ``kernels.info(name).block_sparse``).
KERNELS = ("gluon_sage", "triton_sage")
PATTERNS = ("predicted", "banded", "random")
BASELINE = "sdpa_cudnn_bf16"

COLUMNS = [("shape", "shape", ""), ("kernel", "kernel", ""), ("config", "config", ""), ("keep", "keep", ".2f"),
           ("sparsity", "skip", ".3f"),
           ("sparsity_pred", "skip pred", ".3f"), ("ms_dense", "dense ms", ".3f"), ("ms_lists", "lists ms", ".3f"),
           ("ms_pred", "pred ms", ".3f"), ("ms_both", "both ms", ".3f"), ("speedup", "x dense", ".3f"),
           ("speedup_pred", "x dense+pred", ".3f"), ("speedup_cudnn", "x cudnn", ".3f"),
           ("speedup_cudnn_pred", "x cudnn+pred", ".3f"), ("pred_pct", "pred %", ".1f"), ("cos", "cos", ".6f"),
           ("rel_l1", "rel-L1", ".4f"), ("cos_dense", "cos dense", ".6f"), ("note", "note", "")]


# ------------------------------------------------------------------------------------------------------------------
# Block lists
# ------------------------------------------------------------------------------------------------------------------


def tiles_kept(keep: float, nk: int) -> int:
    """Key tiles per query tile of the ``banded`` / ``random`` patterns: ``round(keep · nk)``, at least 1."""
    return max(1, min(nk, int(round(keep * nk))))


def forced_blocks(pattern: str, keep: float, b: int, h: int, sq: int, skv: int, device, *, seed: int = 0):
    """The ``banded`` or ``random`` lists (the module docstring) as :class:`qattn_fx.block_sparse.Blocks`."""
    from qattn_fx import block_sparse  # noqa: PLC0415

    nq, nk = block_sparse.tiles(sq, skv)
    n = tiles_kept(keep, nk)
    if pattern == "banded":
        middle = (torch.arange(nq, device=device) * block_sparse.BLOCK_ROWS + block_sparse.BLOCK_ROWS // 2)
        centre = (middle.clamp(max=sq - 1) * skv // sq) // block_sparse.BLOCK_KEYS
        start = (centre - (n - 1) // 2).clamp(0, nk - n)
        cols = torch.arange(nk, device=device)
        visit = (cols >= start[:, None]) & (cols < start[:, None] + n)
        visit = visit.expand(b, h, nq, nk)
    elif pattern == "random":
        g = torch.Generator(device="cpu").manual_seed(seed)
        order = torch.rand(b, h, nq, nk, generator=g).argsort(-1)[..., :n]
        visit = torch.zeros(b, h, nq, nk, dtype=torch.bool).scatter(-1, order, True).to(device)
    else:
        raise ValueError(f"pattern={pattern!r} is invalid here; valid: banded, random")
    return block_sparse.from_mask(visit.contiguous())


def forced_config(kernel: str, config: str):
    """The context a list call of ``kernel`` runs in under ``--configs`` entry ``config``: ``auto`` (or a kernel
    other than gluon_sage) none, else ``gluon_sage.use_config(config)``."""
    import contextlib  # noqa: PLC0415

    if kernel != "gluon_sage" or config == "auto":
        return contextlib.nullcontext()
    from qattn_fx.kernels import gluon_sage  # noqa: PLC0415

    return gluon_sage.use_config(config)


def ran_config(kernel: str) -> str | None:
    """The config gluon_sage's latest launch ran (``None`` for other kernels)."""
    if kernel != "gluon_sage":
        return None
    from qattn_fx.kernels import gluon_sage  # noqa: PLC0415

    config = gluon_sage.last_config()
    return None if config is None else str(config)


def sparsity(count: torch.Tensor, index: torch.Tensor) -> float:
    """Achieved sparsity of lists: the fraction of blocks not visited."""
    return 1.0 - int(count.sum()) / index.numel() if index.numel() else 0.0


# ------------------------------------------------------------------------------------------------------------------
# Availability and timing
# ------------------------------------------------------------------------------------------------------------------


def unavailable(kernel: str, device: str, d: int) -> str | None:
    """Why ``kernel`` cannot be timed with block lists here (None: it can)."""
    from qattn_fx import kernels  # noqa: PLC0415

    try:
        info = kernels.info(kernel)
    except ValueError as exc:
        return str(exc)
    if not info.block_sparse:
        return (f"kernels.info({kernel!r}).block_sparse is False (block-sparse kernels: "
                f"{kernels.names_with('block_sparse') or 'none'})")
    if device != "cuda":
        return None if kernel == "reference" else f"{kernel} needs a CUDA device"
    return common.kernel_unavailable(kernel, tuple(torch.cuda.get_device_capability()), d)


@dataclass
class Settings:
    device: str = "cuda"
    timer: str = "graph"
    iters: int = 20
    budget_ms: float = 600.0
    max_seconds: float = 480.0
    started: float = field(default_factory=time.perf_counter)

    def out_of_time(self) -> bool:
        return self.max_seconds > 0 and time.perf_counter() - self.started > self.max_seconds


def time_call(fn: Callable[[], Any], s: Settings) -> tuple[float, str]:
    """``(median ms, note)`` of ``fn``: on CUDA :func:`benchmarks.common.time_ms` with ``s.timer`` (a graph that
    cannot be captured falls back to CUDA events, noted); on the CPU (tests) wall-clock medians of a few calls."""
    if s.device != "cuda":
        fn()
        times = []
        for _ in range(max(1, min(s.iters, 3))):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "cpu wall clock"
    try:
        return common.time_ms(fn, iters=s.iters, budget_ms=s.budget_ms, method=s.timer), ""
    except Exception as exc:  # noqa: BLE001 — e.g. a host synchronization inside graph capture
        if s.timer != "graph":
            raise
        torch.cuda.synchronize()
        ms = common.time_ms(fn, iters=s.iters, budget_ms=s.budget_ms, method="events")
        return ms, f"events (graph capture failed: {type(exc).__name__})"


def sdpa_baseline(q, k, v, device: str) -> Callable[[], torch.Tensor]:
    """torch SDPA pinned to cuDNN (on the CPU, for tests: unpinned)."""
    if device != "cuda":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return common.sdpa_callable(q, k, v, "CUDNN_ATTENTION")


# ------------------------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------------------------


def kernel_args(q, k, v, recipe: str, kernel: str, prequant_q: bool) -> tuple:
    """The op's operands ``(q, q_scale, k, k_scale, v, v_scale, q_block, k_block)`` as the compiled graph feeds
    ``kernel``: the bf16 Q for a kernel that quantizes Q itself (unless ``prequant_q``)."""
    from qattn_fx import kernels  # noqa: PLC0415

    args = common.quantize_qkv(q, k, v, recipe)
    qk, q_block = common.KERNEL_RECIPES[recipe][:2]
    if not prequant_q and qk == "int8" and q_block in kernels.info(kernel).quantizes_q:
        return (q, None, *args[2:])
    return args


def measure_shape(name: str, dims: Shape, a: argparse.Namespace, s: Settings) -> list[dict]:
    """Every row of one shape: the baseline row, then per kernel its dense row and one row per keep fraction."""
    import qattn_fx.ops  # noqa: F401,PLC0415  (registers qattn::*)

    ops = torch.ops.qattn
    b, h, sq, skv, d = dims
    base = {"shape": name, "B": b, "H": h, "Sq": sq, "Skv": skv, "D": d}
    common.log(f"[{name}] {Shape(*dims)}: {Shape(*dims).flops / 1e12:.2f} TFLOP per dense call")
    q, k, v = common.local_qkv(b, h, sq, skv, d, sharpness=a.sharpness, width=a.width, sink=a.sink,
                               device=s.device)
    sm_scale = 1.0 / math.sqrt(d)
    acc_rows = common.reference_rows(sq, a.acc_rows, device=s.device)
    ref = common.fp32_attention_rows(q, k, v, acc_rows, sm_scale)
    rows: list[dict] = []
    base_call = sdpa_baseline(q, k, v, s.device)
    cudnn_ms, note = time_call(base_call, s)
    acc = common.accuracy(base_call(), ref, acc_rows)
    rows.append({**base, "kernel": BASELINE, "ms_dense": cudnn_ms, "cos": acc["cos"], "rel_l1": acc["rel_l1"],
                 "note": note or None})
    common.log(f"  {BASELINE}: {cudnn_ms:.3f} ms")

    def predict(keep: float):
        keep_t = torch.tensor([keep], dtype=torch.float32)  # on the CPU: the op reads it without a device sync
        return ops.predict_blocks(q, k, None, sm_scale, None, keep_t, a.mode, 0, False, 0.0, "")

    def predicted_attention(keep: float):  # (d): the predictor, then the kernel on its lists
        index, count = predict(keep)
        return ops.scaled_attention(*args, block_index=index, block_count=count)

    for kernel in a.kernels:
        why = unavailable(kernel, s.device, d)
        if why is None and s.out_of_time():
            why = f"--max-seconds {s.max_seconds:.0f} reached"
        if why is not None:
            rows.append({**base, "kernel": kernel, "note": f"skipped: {why}"})
            common.log(f"  {kernel}: skipped ({why})")
            continue
        try:
            args = (*kernel_args(q, k, v, a.recipe, kernel, a.prequant_q), sm_scale, torch.bfloat16, kernel)
            plain = ops.scaled_attention(*args)
            dense_ms, note = time_call(lambda: ops.scaled_attention(*args), s)
        except Exception as exc:  # noqa: BLE001 — the table shows the failure
            rows.append({**base, "kernel": kernel, "note": f"failed dense: {type(exc).__name__}: {str(exc)[:160]}"})
            common.log(f"  {kernel}: dense failed ({type(exc).__name__}: {exc})")
            continue
        acc = common.accuracy(plain, ref, acc_rows)
        plain_rows = (plain if acc_rows is None else plain.index_select(2, acc_rows)).float()
        rows.append({**base, "kernel": kernel, "config": ran_config(kernel), "ms_dense": dense_ms,
                     "speedup_cudnn": cudnn_ms / dense_ms,
                     "cos": acc["cos"], "rel_l1": acc["rel_l1"], "note": "dense (no lists)" + (
                         f"; {note}" if note else "")})
        common.log(f"  {kernel} dense: {dense_ms:.3f} ms ({cudnn_ms / dense_ms:.3f}x cudnn)")
        configs = a.configs if kernel == "gluon_sage" else ["auto"]
        for config in configs:
            for keep in a.keep:
                if s.out_of_time():
                    rows.append({**base, "kernel": kernel, "keep": keep, "config": config,
                                 "note": f"skipped: --max-seconds {s.max_seconds:.0f} reached"})
                    continue
                row: dict[str, Any] = {**base, "kernel": kernel, "keep": keep, "pattern": a.pattern, "mode": a.mode,
                                       "ms_dense": dense_ms, "ms_cudnn": cudnn_ms, "config": config}
                notes = []
                try:
                    pred_index, pred_count = predict(keep)
                    row["sparsity_pred"] = sparsity(pred_count, pred_index)
                    if a.pattern == "predicted":
                        index, count = pred_index, pred_count
                    else:
                        index, count = forced_blocks(a.pattern, keep, b, h, sq, skv, s.device)
                    row["sparsity"] = sparsity(count, index)
                    with forced_config(kernel, config):
                        out = ops.scaled_attention(*args, block_index=index, block_count=count)
                    row["config"] = ran_config(kernel) or config
                    acc = common.accuracy(out, ref, acc_rows)
                    row.update(cos=acc["cos"], rel_l1=acc["rel_l1"],
                               cos_dense=common.accuracy(out, plain_rows, acc_rows)["cos"])
                    del out
                    timed = {
                        "ms_lists": lambda: ops.scaled_attention(*args, block_index=index, block_count=count),
                        "ms_pred": lambda: predict(keep),
                        "ms_both": lambda: predicted_attention(keep),
                    }
                    for key, fn in timed.items():
                        with forced_config(kernel, config):
                            row[key], note = time_call(fn, s)
                        if note and note not in notes:
                            notes.append(f"{key}: {note}" if s.device == "cuda" else note)
                except Exception as exc:  # noqa: BLE001 — keep going; the table shows the failure
                    notes.append(f"failed: {type(exc).__name__}: {str(exc)[:160]}")
                finally:
                    gc.collect()
                    if s.device == "cuda":
                        torch.cuda.empty_cache()
                derive(row)
                row["note"] = "; ".join(notes) or None
                rows.append(row)
                common.log(f"  {kernel} [{row.get('config')}] keep {keep:g}: skip {_f(row.get('sparsity'))}, lists "
                           f"{_f(row.get('ms_lists'))} ms ({_f(row.get('speedup'))}x), pred {_f(row.get('ms_pred'))} "
                           f"ms, both {_f(row.get('ms_both'))} ms ({_f(row.get('speedup_pred'))}x), cos "
                           f"{_f(row.get('cos'), '.6f')}" + (f"; {row['note']}" if row["note"] else ""))
        del plain, plain_rows
    del q, k, v, ref
    gc.collect()
    if s.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def derive(row: dict) -> None:
    """The speedup and share columns of one keep row from its timings (missing timings leave them out)."""
    dense, cudnn = row.get("ms_dense"), row.get("ms_cudnn")
    for key, source, over in (("speedup", "ms_lists", dense), ("speedup_pred", "ms_both", dense),
                              ("speedup_cudnn", "ms_lists", cudnn), ("speedup_cudnn_pred", "ms_both", cudnn)):
        if over and row.get(source):
            row[key] = over / row[source]
    if dense and row.get("ms_pred"):
        row["pred_pct"] = row["ms_pred"] / dense * 100.0


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


# ------------------------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------------------------


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    """A markdown (pipe) table; missing values print ``-``."""
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "|".join("---" if not spec else "---:" for _, _, spec in columns) + "|"]
    for row in rows:
        cells = [common._fmt(row.get(key), spec).replace("|", "/") for key, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def skip_softmax_curves(path: str) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Skip-Softmax's ``(sparsity, speedup over the same config)`` points by shape and config from a
    ``--skip-softmax`` JSON (rows with a λ)."""
    with open(path) as f:
        payload = json.load(f)
    curves: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in payload.get("rows", []):
        if r.get("lambda") in (None, "-") or r.get("sparsity") is None or r.get("speedup") is None:
            continue
        curves.setdefault(r["shape"], {}).setdefault(str(r.get("config", "")), []).append(
            (float(r["sparsity"]), float(r["speedup"])))
    return {shape: {cfg: sorted(pts) for cfg, pts in by_cfg.items()} for shape, by_cfg in curves.items()}


def plot(rows: list[dict], path: str, skip: dict | None = None) -> str | None:
    """The speedup-vs-sparsity PNG at ``path``; None when written, else why not."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 — optional
        return f"matplotlib not importable ({type(exc).__name__})"
    points = [r for r in rows if r.get("keep") is not None and r.get("sparsity") is not None
              and (r.get("speedup") or r.get("speedup_pred"))]
    if not points:
        return "no measured keep row to plot"
    shapes = list(dict.fromkeys(r["shape"] for r in points))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in points if r["shape"] == shape]
        top = max(r["sparsity"] for r in mine)
        xs = [i / 50 * max(top, 0.05) for i in range(51)]
        ax.plot(xs, [1 / (1 - x) for x in xs], ":", color="grey", lw=1, label="ideal 1/(1-s)")
        series = lambda r: r["kernel"] + (f" {r['config']}" if r.get("config") else "")  # noqa: E731
        for i, kernel in enumerate(dict.fromkeys(series(r) for r in mine)):
            pts = sorted((r for r in mine if series(r) == kernel), key=lambda r: r["sparsity"])
            color = f"C{i}"
            ax.plot([r["sparsity"] for r in pts if r.get("speedup")], [r["speedup"] for r in pts if r.get("speedup")],
                    "o-", color=color, label=f"{kernel} lists")
            ax.plot([r["sparsity"] for r in pts if r.get("speedup_pred")],
                    [r["speedup_pred"] for r in pts if r.get("speedup_pred")], "s--", color=color,
                    label=f"{kernel} + predictor")
        for j, (cfg, pts) in enumerate((skip or {}).get(shape, {}).items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "^-.", color=f"C{5 + j}", alpha=0.8,
                    label=f"Skip-Softmax {cfg}"[:48])
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(shape)
        ax.set_xlabel("achieved sparsity (blocks not visited)")
        ax.set_ylabel("speedup vs same kernel dense")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    out_dir = os.path.dirname(path)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 < x <= 1.0 for x in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every keep fraction must be in (0, 1]")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_ops --block-sparse",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated preset names, all, none (default "
                                                            f"{DEFAULT_SHAPES})")
    p.add_argument("--shape", action="append", default=[], help="extra shape name:B:H:Sq:Skv:D (repeatable)")
    p.add_argument("--keep", type=_floats, default=list(KEEPS),
                   help="keep fractions, comma-separated, each in (0, 1] (default " + ",".join(map(str, KEEPS)) + ")")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help="kernels, comma-separated (default gluon_sage,triton_sage; each runs only where "
                        "kernels.info(name).block_sparse is true)")
    p.add_argument("--configs", default="auto",
                   help="gluon_sage configs of the list calls, ';'-separated: auto (the tuner's choice, default) "
                        "and/or GluonConfigs, e.g. 'auto;128,2,ahead,permk,mmasum'; "
                        "the dense row always runs auto")
    p.add_argument("--pattern", choices=PATTERNS, default="predicted",
                   help="forced lists of (b): predicted (the predictor's top_k lists, default), banded, random")
    p.add_argument("--mode", choices=("top_k", "cdf"), default="top_k",
                   help="the predictor's mode for (c), (d) and the predicted pattern (default top_k: keep is the "
                        "fraction of key tiles; cdf: the pooled probability mass)")
    p.add_argument("--recipe", default="int8-1-16", help="Q/K recipe (benchmarks.common.KERNEL_RECIPES)")
    p.add_argument("--prequant-q", action="store_true",
                   help="give a kernel that quantizes Q itself the int8 Q instead of the bf16 one")
    p.add_argument("--sharpness", type=float, default=4.0, help="local_qkv sharpness (default 4)")
    p.add_argument("--width", type=float, default=2048.0, help="local_qkv width in tokens (default 2048)")
    p.add_argument("--sink", type=int, default=128, help="local_qkv attention-sink keys (default 128: one tile)")
    p.add_argument("--acc-rows", type=int, default=2048, help="query rows for accuracy (default 2048)")
    p.add_argument("--timer", choices=("events", "do_bench", "graph"), default="graph",
                   help="graph (default): CUDA-graph replays; events; do_bench")
    p.add_argument("--iters", type=int, default=20, help="max timed calls per measurement (default 20)")
    p.add_argument("--budget-ms", type=float, default=600.0, help="timed-call budget per measurement (ms)")
    p.add_argument("--max-seconds", type=float, default=480.0,
                   help="start no new measurement after this (0: no limit; default 480)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default); cpu only runs the reference kernel, for the tests of this script")
    p.add_argument("--out", default="bench_out/block_sparse.json", help="JSON output path")
    p.add_argument("--plot", default=None, help="PNG path: speedup vs sparsity per shape (matplotlib)")
    p.add_argument("--skip-json", default=None, help="a --skip-softmax JSON whose curves the PNG shows beside")
    a = p.parse_args(argv)
    a.kernels = [t.strip() for t in a.kernels.split(",") if t.strip()]
    a.configs = [t.strip() for t in a.configs.split(";") if t.strip()] or ["auto"]
    for config in a.configs:
        if config != "auto":
            from qattn_fx.kernels.gluon_sage.config import GluonConfig  # noqa: PLC0415

            try:
                GluonConfig.parse(config)
            except ValueError as exc:
                p.error(f"--configs {config!r}: {exc}")
    if a.recipe not in common.KERNEL_RECIPES:
        p.error(f"--recipe {a.recipe!r} is invalid; valid: {', '.join(common.KERNEL_RECIPES)}")
    if a.mode == "cdf" and a.pattern != "predicted":
        p.error("--mode cdf gives no tile count per query tile: use it with --pattern predicted")
    if a.skip_json and not os.path.exists(a.skip_json):
        p.error(f"--skip-json {a.skip_json!r}: no such file")
    return a


def run(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.attention_ops --block-sparse needs a CUDA device")
        return 2
    try:
        shapes = select_shapes(a.shapes, a.shape)
    except ValueError as exc:
        print(f"benchmarks.attention_ops --block-sparse: {exc}")
        return 2
    s = Settings(a.device, a.timer, a.iters, a.budget_ms, a.max_seconds)
    env = common.environment()
    common.log(f"block_sparse: {env.get('device', a.device)}, recipe {a.recipe}, kernels {','.join(a.kernels)}, "
               f"keep {','.join(f'{x:g}' for x in a.keep)}, pattern {a.pattern}, predictor mode {a.mode}, "
               f"local_qkv sharpness {a.sharpness} width {a.width} sink {a.sink}, timer {a.timer}")
    rows: list[dict] = []
    for name, dims in shapes:
        rows += measure_shape(name, dims, a, s)
    print()
    print(f"block sparsity ({a.pattern} lists, predictor {a.mode}; speedups over the same kernel dense and over "
          f"{BASELINE}; pred % = predictor / dense kernel)")
    print(markdown_table(rows), flush=True)
    out_dir = os.path.dirname(a.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    common.write_json(a.out, {"env": env, "settings": vars(a), "rows": rows,
                              "elapsed_s": time.perf_counter() - s.started})
    print(f"wrote {a.out}")
    if a.plot:
        why = plot(rows, a.plot, skip_softmax_curves(a.skip_json) if a.skip_json else None)
        print(f"wrote {a.plot}" if why is None else f"no PNG: {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
