"""Attention-op benchmark: torch SDPA (bf16) against qattn_fx's quantized kernels, speed and accuracy side by side.

Run on a CUDA machine from the repository root (qattn_fx installed, GPU libraries importable)::

    python -m benchmarks.attention_ops                                  # every preset shape, every available method
    python -m benchmarks.attention_ops --shapes flux-1024,cross-512 --only cudnn_fp8,triton_sage
    python -m benchmarks.attention_ops --shape mine:2:24:4096:4096:128 --shapes none --outliers
    python -m benchmarks.attention_ops --list                           # shapes and methods, then exit

It prints progress lines while it runs and ONE table at the end, writes JSON (``--out``, default
``bench_out/attention_ops.json``) and, when matplotlib is importable, a speed-vs-accuracy PNG beside it.

Preset shapes (``--shapes``, :mod:`benchmarks.shapes`; all D=128 unless stated): flux-1024 B1 H24 S4608;
wan1.3b-480p B1 H12 S32760; wan14b-720p B1 H40 S75600; cross-512 B1 H40 Sq32760 Skv512; d64 B2 H16 S16384 D64.
``--shape name:B:H:Sq:Skv:D`` adds more (repeatable; ``--shapes none`` drops the presets).

Methods (``--only`` / ``--skip`` take comma-separated substrings of these names; the cuDNN bf16 baseline always runs
because every speedup is relative to it). A method that cannot run here (library missing, wrong GPU, head dim) is
listed as skipped with the reason:

* ``sdpa_cudnn_bf16`` / ``sdpa_flash_bf16``: ``F.scaled_dot_product_attention`` on bf16 BSHD-strided views, with
  ``sdpa_kernel`` pinned to the cuDNN / flash backend.
* ``cudnn_fp8``: ``Recipe("fp8", "fp8")`` (per-tensor FP8 Q/K/V, smoothed K) on kernel ``cudnn_fp8``.
* ``flashinfer_fa3_fp8``: ``Recipe("fp8", "fp8", scale_scope="head")`` on kernel ``flashinfer_fa3_fp8`` (the first
  call per head dim JIT-compiles FlashInfer's FA3 kernels, ~100 s; it is outside the timings).
* ``triton_sage/int8-1-16-1``, ``triton_sage/fp8-1-16-1``: SageAttention recipes (per-token Q, 16-token K blocks,
  per-channel fp8 V, smoothed K) on kernel ``triton_sage``; ``triton_sage/bf16qk-fp8v``: bf16 Q/K with per-channel
  fp8 V (``Recipe("bf16", "fp8", 0, 0, 1)``). ``gluon_sage/...``: the same recipes on the warp-specialized Gluon
  kernel ``gluon_sage`` (sm_90).
* ``sageattention_1.0.6``: ``sageattention.sageattn`` (Triton, INT8 Q·K, fp16 P·V) on fp16 NHD copies, when
  importable.

Every qattn_fx method is measured twice: (a) **kernel** — the attention op alone on pre-quantized inputs (captured by
running ``qattn_fx.ops.quantized_attention`` with an emitter that executes the quantize ops and returns the attention
op's arguments; a kernel that quantizes Q itself, ``KernelInfo.quantizes_q``, gets the bf16 Q, so its kernel time
includes that quantization); (b) **total** — ``torch.compile(fullgraph=True)`` of a function calling
``qattn_fx.ops.quantized_attention``, so smooth-K and the quantize nodes are fused by Inductor (compile time is
reported, not timed).

Columns:

* ``kernel ms`` — median ms of (a) (for SDPA / sageattention: of the call itself); CUDA events unless ``--timer
  do_bench`` or ``--timer graph`` (CUDA-graph replays: the GPU's time without the host's per-call work, which
  the other timers include wherever the host is slower than the GPU, i.e. for short calls); the number of timed
  calls adapts to ``--budget-ms``.
* ``total ms`` — median ms of (b), quantization included (same as ``kernel ms`` for SDPA / sageattention).
* ``TFLOP/s`` — ``4·B·H·Sq·Skv·D / kernel time`` (every method counts the same FLOPs).
* ``spd kern`` / ``spd total`` — ``sdpa_cudnn_bf16 ms / kernel ms`` and ``/ total ms``.
* ``cos`` / ``rel L1`` — cosine similarity and Σ|o−r|/Σ|r| of the method's output (the compiled one for qattn_fx)
  against fp32 attention of the same bf16 inputs. The fp32 reference is computed in query chunks; for shapes with more
  than ``--acc-rows`` query rows (default 4096) it and the metrics use a fixed random subset of rows (the ``acc rows``
  column says how many).
* ``quant %`` — quantization overhead ``(total − kernel) / kernel · 100``.
* ``note`` — ``compile N s`` for the compiled path, or why a method was skipped / failed.

``--rounds N`` (default 1) times every method of a shape N times in turn (kernel and total alternating, methods in
the same order each round) and reports medians; the JSON rows keep each round (``ms_kernel_rounds``,
``ms_total_rounds``). Kernel and total are separate measurements, and with one round the GPU's clock can drift
between them (a one-round run has measured a total 0.6 % *below* its kernel alone).

``--outliers`` replaces the Gaussian inputs by DiT-like channel outliers: a per-(head, channel) bias shared by all
tokens, ×10 on K and ×3 on Q (the pattern SageAttention reports for DiT activations), to compare accuracy.
``--skip-softmax`` runs :mod:`benchmarks.skip_softmax` (speed vs sparsity of the tile test) and ``--block-sparse``
:mod:`benchmarks.block_sparse` (block-sparse kernels dense, with block lists and with the predictor); each takes
its own arguments (``--skip-softmax --help``).

``--max-seconds`` (default 330) stops starting new measurements once exceeded, so a run inside a 6-minute device
window still prints its table.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from qattn_fx.ops import attention as _attention_ops
from qattn_fx.ops import quantized_attention
from qattn_fx.recipes import Recipe

from . import common
from .shapes import Shape
from .shapes import select as select_shapes

BASELINE = "sdpa_cudnn_bf16"


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "sdpa" | "qattn" | "sageattn"
    kernel: str | None = None
    recipe: Recipe | None = None
    sdpa_backend: str | None = None
    note: str = ""


METHODS: tuple[Method, ...] = (
    Method(BASELINE, "sdpa", sdpa_backend="CUDNN_ATTENTION"),
    Method("sdpa_flash_bf16", "sdpa", sdpa_backend="FLASH_ATTENTION"),
    Method("cudnn_fp8", "qattn", "cudnn_fp8", Recipe("fp8", "fp8")),
    Method("flashinfer_fa3_fp8", "qattn", "flashinfer_fa3_fp8", Recipe("fp8", "fp8", scale_scope="head")),
    Method("triton_sage/int8-1-16-1", "qattn", "triton_sage", Recipe("int8", "fp8", 1, 16, 1)),
    Method("triton_sage/fp8-1-16-1", "qattn", "triton_sage", Recipe("fp8", "fp8", 1, 16, 1)),
    Method("triton_sage/bf16qk-fp8v", "qattn", "triton_sage", Recipe("bf16", "fp8", 0, 0, 1)),
    Method("gluon_sage/int8-1-16-1", "qattn", "gluon_sage", Recipe("int8", "fp8", 1, 16, 1)),
    Method("gluon_sage/fp8-1-16-1", "qattn", "gluon_sage", Recipe("fp8", "fp8", 1, 16, 1)),
    Method("gluon_sage/bf16qk-fp8v", "qattn", "gluon_sage", Recipe("bf16", "fp8", 0, 0, 1)),
    Method("sageattention_1.0.6", "sageattn"),
)


# ------------------------------------------------------------------------------------------------------------------
# Selection and availability
# ------------------------------------------------------------------------------------------------------------------


def select_methods(only: str, skip: str) -> list[Method]:
    def tokens(s: str) -> list[str]:
        return [t.strip() for t in s.split(",") if t.strip()]

    only_t, skip_t = tokens(only), tokens(skip)
    for t in only_t + skip_t:
        if not any(t in m.name for m in METHODS):
            raise ValueError(f"--only/--skip: {t!r} matches no method; valid: {', '.join(m.name for m in METHODS)}")
    out = []
    for m in METHODS:
        keep = (not only_t or any(t in m.name for t in only_t)) and not any(t in m.name for t in skip_t)
        if keep or m.name == BASELINE:
            out.append(m)
    return out


def unavailable(method: Method, cap: tuple[int, int] | None, d: int) -> str | None:
    """Why ``method`` cannot run on this machine for head dim ``d`` (None: it can)."""
    if cap is None:
        return "no CUDA device"
    if method.kind == "sdpa":
        return None
    if method.kind == "sageattn":
        return None if d in (64, 96, 128) and common.importable("sageattention") is None else (
            common.importable("sageattention") or f"head_dim {d} not in 64/96/128")
    return common.kernel_unavailable(method.kernel, cap, d)


# ------------------------------------------------------------------------------------------------------------------
# Inputs and callables
# ------------------------------------------------------------------------------------------------------------------


def make_inputs(b: int, h: int, sq: int, skv: int, d: int, outliers: bool, seed: int = 0):
    """bf16 ``(B, H, S, D)`` views of ``(B, S, H, D)`` buffers (diffusers' layout). ``outliers``: per-(head, channel)
    bias shared by all tokens, ×10 on K and ×3 on Q."""
    torch.manual_seed(seed)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev)
    k = torch.randn(b, skv, h, d, device=dev)
    v = torch.randn(b, skv, h, d, device=dev)
    if outliers:
        q += 3.0 * torch.randn(1, 1, h, d, device=dev)
        k += 10.0 * torch.randn(1, 1, h, d, device=dev)
    return tuple(x.to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))


def capture_attention_call(q, k, v, recipe: Recipe, kernel: str) -> tuple[Callable, tuple]:
    """Run ``quantized_attention`` eagerly up to the attention op and return ``(op, args)`` — the pre-quantized
    call."""
    box: dict[str, Any] = {}

    def emit(target, args, name):
        if target in _attention_ops.ATTENTION_OPS:
            box["call"] = (target, args)
            return None
        return target(*args)

    quantized_attention(q, k, v, recipe, kernel=kernel, emit=emit)
    return box["call"]


def compiled_recipe(recipe: Recipe, kernel: str) -> Callable:
    """``torch.compile(fullgraph=True)`` of ``quantized_attention`` for one recipe and kernel (static shapes)."""
    torch._dynamo.reset()  # a fresh cache per (method, shape): no recompile-limit surprises

    def attend(q, k, v):
        return quantized_attention(q, k, v, recipe, kernel=kernel)

    return torch.compile(attend, fullgraph=True, dynamic=False)


def sdpa_callable(q, k, v, backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    backend = getattr(SDPBackend, backend_name)
    gqa = q.shape[1] != k.shape[1]

    kwargs = {"enable_gqa": True} if gqa else {}

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


# ------------------------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    acc_rows: int = 4096
    iters: int = 20
    budget_ms: float = 1000.0
    timer: str = "events"
    compile: bool = True
    max_seconds: float = 330.0
    rounds: int = 1
    started: float = field(default_factory=time.perf_counter)

    def out_of_time(self) -> bool:
        return self.max_seconds > 0 and time.perf_counter() - self.started > self.max_seconds


def _ms(fn: Callable, s: Settings) -> float:
    return common.time_ms(fn, iters=s.iters, budget_ms=s.budget_ms, method=s.timer)


def measure_method(m: Method, q, k, v, ref, rows, s: Settings) -> tuple[dict, dict[str, Callable]]:
    """The method's row (first timing round, accuracy, notes) and its timed callables by row field, kept for the
    further ``--rounds`` (a field that is not timed again, such as SDPA's ``ms_total``, mirrors ``ms_kernel``)."""
    row: dict[str, Any] = {"method": m.name, "kernel": m.kernel, "recipe": m.recipe.name if m.recipe else None}
    if m.kind == "sdpa":
        fn = sdpa_callable(q, k, v, m.sdpa_backend)
        row.update(common.accuracy(fn(), ref, rows))
        row["ms_kernel"] = row["ms_total"] = _ms(fn, s)
        return row, {"ms_kernel": fn}
    if m.kind == "sageattn":
        from sageattention import sageattn  # noqa: PLC0415

        # fp16 NHD copies as in the baseline probe; sageattn smooths K in place, so it gets its own K.
        qh, kh, vh = (x.transpose(1, 2).to(torch.float16).contiguous() for x in (q, k, v))
        out = sageattn(qh, kh.clone(), vh, tensor_layout="NHD", is_causal=False)
        row.update(common.accuracy(out.transpose(1, 2), ref, rows))
        del out
        call = lambda: sageattn(qh, kh, vh, tensor_layout="NHD", is_causal=False)  # noqa: E731
        row["ms_kernel"] = row["ms_total"] = _ms(call, s)
        return row, {"ms_kernel": call}
    # qattn_fx: (a) kernel only on pre-quantized inputs
    op, args = capture_attention_call(q, k, v, m.recipe, m.kernel)
    out_a = op(*args)  # first call: builds graphs / JIT
    torch.cuda.synchronize()
    kernel_call = lambda: op(*args)  # noqa: E731
    row["ms_kernel"] = _ms(kernel_call, s)
    timers = {"ms_kernel": kernel_call}
    eager_acc = common.accuracy(out_a, ref, rows)
    del out_a
    # (b) Inductor-compiled quantize + kernel
    if not s.compile:
        row.update(eager_acc)
        row["note"] = "eager accuracy; --no-compile"
        return row, timers
    try:
        fn = compiled_recipe(m.recipe, m.kernel)
        t0 = time.perf_counter()
        out_b = fn(q, k, v)
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - t0
        row.update(common.accuracy(out_b, ref, rows))
        del out_b
        timers["ms_total"] = lambda: fn(q, k, v)
        row["ms_total"] = _ms(timers["ms_total"], s)
        row["note"] = f"compile {row['compile_s']:.0f} s"
        if m.kernel == "gluon_sage":  # the config the autotuner (or a forced one) ran, for the table and JSON
            from qattn_fx.kernels import gluon_sage  # noqa: PLC0415

            row["config"] = str(gluon_sage.last_config())
            row["note"] += f"; {row['config']}"
            tail = gluon_sage.last_tail_plan()
            if tail:
                row["tail_split"] = {"main": tail.main, "tail": tail.tail, "splits": tail.splits,
                                     "kv_split": tail.kv_split}
                row["note"] += f"; tail {tail.tail}x{tail.splits}"
    except Exception as exc:  # noqa: BLE001 — the kernel-only number still stands
        row.update(eager_acc)
        row["note"] = f"compile failed: {type(exc).__name__}: {str(exc)[:120]}"
    return row, timers


def merge_rounds(row: dict, samples: dict[str, list[float]]) -> None:
    """Put the median of each timed field's rounds in ``row`` (``samples[field]``: ms per round, the first being
    the row's own) and keep the rounds as ``<field>_rounds``; SDPA-like rows, timed once per round, get
    ``ms_total = ms_kernel``."""
    for name, times in samples.items():
        row[name] = statistics.median(times)
        row[f"{name}_rounds"] = list(times)
    if "ms_total" not in samples and "ms_kernel" in samples and row.get("ms_total") is not None:
        row["ms_total"] = row["ms_kernel"]


def run_shape(name: str, dims: Shape, methods: list[Method], cap, s: Settings, outliers: bool) -> list[dict]:
    b, h, sq, skv, d = dims
    flops = Shape(*dims).flops
    common.log(f"[{name}] B{b} H{h} Sq{sq} Skv{skv} D{d}: {flops / 1e12:.1f} TFLOP per call")
    q, k, v = make_inputs(b, h, sq, skv, d, outliers)
    rows_idx = common.reference_rows(sq, s.acc_rows, device=q.device)
    t0 = time.perf_counter()
    ref = common.fp32_attention_rows(q, k, v, rows_idx)
    n_rows = sq if rows_idx is None else len(rows_idx)
    common.log(f"  fp32 reference on {n_rows}/{sq} query rows: {time.perf_counter() - t0:.1f} s")
    results = []
    timed: list[tuple[dict, dict[str, Callable]]] = []  # (row, its timed callables) for the further rounds
    for m in methods:
        base = {"shape": name, "B": b, "H": h, "Sq": sq, "Skv": skv, "D": d, "acc_rows": n_rows,
                "inputs": "outliers" if outliers else "gaussian", "method": m.name, "kernel": m.kernel,
                "recipe": m.recipe.name if m.recipe else None}
        why = unavailable(m, cap, d)
        if why is None and s.out_of_time() and m.name != BASELINE:
            why = f"--max-seconds {s.max_seconds:.0f} reached"
        if why is not None:
            results.append({**base, "note": f"skipped: {why}"})
            common.log(f"  {m.name}: skipped ({why})")
            continue
        if m.kernel == "flashinfer_fa3_fp8":
            common.log(f"  {m.name}: first use per head dim may JIT-compile (~100 s) ...")
        t1 = time.perf_counter()
        try:
            measured, timers = measure_method(m, q, k, v, ref, rows_idx, s)
            row = {**base, **measured}
            if s.rounds > 1:
                timed.append((row, timers))
            del timers
        except Exception as exc:  # noqa: BLE001 — keep going; the table shows the failure
            row = {**base, "note": f"failed: {type(exc).__name__}: {str(exc)[:160]}"}
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        results.append(row)
        common.log(f"  {m.name}: kernel {_f(row.get('ms_kernel'))} ms, total {_f(row.get('ms_total'))} ms, "
                   f"cos {_f(row.get('cos'), '.5f')}, rel L1 {_f(row.get('rel_l1'), '.4f')} "
                   f"({time.perf_counter() - t1:.0f} s){'; ' + row['note'] if row.get('note') else ''}")
    if timed:  # rounds 2..N: every method again, in the same order, so drift hits them all alike
        samples = [{name: [row[name]] for name in timers} for row, timers in timed]
        for i in range(1, s.rounds):
            if s.out_of_time():
                common.log(f"  rounds stopped after {i} of {s.rounds}: --max-seconds {s.max_seconds:.0f} reached")
                break
            try:
                extra = [{name: _ms(call, s) for name, call in timers.items()} for _, timers in timed]
            except Exception as exc:  # noqa: BLE001 — the completed rounds still stand
                common.log(f"  round {i + 1} failed ({type(exc).__name__}: {str(exc)[:120]}); medians of {i}")
                break
            for got, times in zip(samples, extra):
                for name, ms in times.items():
                    got[name].append(ms)
            common.log(f"  round {i + 1}/{s.rounds} done")
        for (row, _), got in zip(timed, samples):
            merge_rounds(row, got)
        timed.clear()
    for r in results:
        r["tflops"] = common.tflops(flops, r.get("ms_kernel"))
    base_ms = next((r.get("ms_kernel") for r in results if r["method"] == BASELINE), None)
    for r in results:
        if base_ms and r.get("ms_kernel"):
            r["speedup_kernel"] = base_ms / r["ms_kernel"]
        if base_ms and r.get("ms_total"):
            r["speedup"] = base_ms / r["ms_total"]
        if r.get("ms_total") and r.get("ms_kernel") and r.get("kernel"):
            r["quant_pct"] = (r["ms_total"] - r["ms_kernel"]) / r["ms_kernel"] * 100.0
    del q, k, v, ref
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = [
    ("shape", "shape", ""), ("method", "method", ""), ("ms_kernel", "kernel ms", ".3f"),
    ("ms_total", "total ms", ".3f"), ("tflops", "TFLOP/s", ".0f"), ("speedup_kernel", "spd kern", ".2f"),
    ("speedup", "spd total", ".2f"), ("cos", "cos", ".5f"), ("rel_l1", "rel L1", ".4f"),
    ("quant_pct", "quant %", ".1f"), ("acc_rows", "acc rows", "d"), ("note", "note", ""),
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--skip-softmax" in argv:  # the speed-vs-sparsity curve (benchmarks/skip_softmax.py)
        from . import skip_softmax  # noqa: PLC0415

        return skip_softmax.run([x for x in argv if x != "--skip-softmax"])
    if "--block-sparse" in argv:  # block sparsity: speed vs sparsity, predictor cost (benchmarks/block_sparse.py)
        from . import block_sparse  # noqa: PLC0415

        return block_sparse.run([x for x in argv if x != "--block-sparse"])
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_ops",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all", help="comma-separated preset names, 'all' or 'none' (default all)")
    p.add_argument("--shape", action="append", default=[], help="extra shape name:B:H:Sq:Skv:D (repeatable)")
    p.add_argument("--only", default="", help="comma-separated substrings of method names to run")
    p.add_argument("--skip", default="", help="comma-separated substrings of method names to leave out")
    p.add_argument("--outliers", action="store_true", help="K bias x10, Q bias x3 per (head, channel)")
    p.add_argument("--acc-rows", type=int, default=4096, help="query rows for accuracy on long shapes (default 4096)")
    p.add_argument("--iters", type=int, default=20, help="max timed calls per measurement (default 20)")
    p.add_argument("--budget-ms", type=float, default=1000.0, help="timed-call budget per measurement (ms)")
    p.add_argument("--timer", choices=("events", "do_bench", "graph"), default="events",
                   help="events: CUDA events around each call; do_bench: triton's (flushes L2); graph: CUDA-graph "
                        "replays, the GPU's time without host overhead")
    p.add_argument("--no-compile", action="store_true", help="skip (b), the Inductor-compiled path")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds per shape: after the first, every method's kernel and total are timed again "
                        "in turn, and the tables show medians (default 1)")
    p.add_argument("--max-seconds", type=float, default=330.0, help="start no new measurement after this (0: no limit)")
    p.add_argument("--out", default="bench_out/attention_ops.json", help="JSON output path")
    p.add_argument("--png", default=None, help="PNG path (default: next to --out)")
    p.add_argument("--list", action="store_true", help="print shapes and methods, then exit")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} is invalid; valid: an integer >= 1")

    shapes = select_shapes(a.shapes, a.shape)
    methods = select_methods(a.only, a.skip)
    if a.list:
        for name, dims in shapes:
            print(f"shape  {name:14s} B{dims[0]} H{dims[1]} Sq{dims[2]} Skv{dims[3]} D{dims[4]}")
        for m in methods:
            print(f"method {m.name:26s} {m.kind:8s} {m.kernel or ''} {m.recipe.name if m.recipe else ''}")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.attention_ops needs a CUDA device", file=sys.stderr)
        return 2
    cap = tuple(torch.cuda.get_device_capability())
    s = Settings(a.acc_rows, a.iters, a.budget_ms, a.timer, not a.no_compile, a.max_seconds, a.rounds)
    env = common.environment()
    common.log(f"attention_ops: {env.get('device')} sm_{cap[0]}{cap[1]}, torch {env['torch']}, "
               f"{len(shapes)} shape(s), {len(methods)} method(s), inputs {'outliers' if a.outliers else 'gaussian'}")
    results: list[dict] = []
    for name, dims in shapes:
        results += run_shape(name, dims, methods, cap, s, a.outliers)
    print()
    print(f"attention_ops ({'outlier' if a.outliers else 'Gaussian'} inputs; accuracy vs fp32 attention; "
          f"speedups vs {BASELINE}; total = Inductor-compiled quantize + kernel)")
    print(common.format_table(results, COLUMNS), flush=True)
    out_dir = os.path.dirname(a.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    tuning = {}
    if any(m.kernel == "gluon_sage" for m in methods):
        from qattn_fx.kernels import gluon_sage  # noqa: PLC0415

        tuning["gluon_sage"] = gluon_sage.TUNER.timings()  # ms per candidate, per key timed in this run
    common.write_json(a.out, {"env": env, "settings": vars(a), "rows": results, "tuning": tuning})
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    if common.plot_speed_accuracy(results, png):
        print(f"wrote {a.out} and {png}")
    else:
        print(f"wrote {a.out} (no PNG: matplotlib not importable or nothing to plot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
