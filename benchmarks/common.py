"""Timing, accuracy, input and reporting helpers shared by the benchmarks and tools (importable without a GPU).

* :func:`time_ms`: median milliseconds of a CUDA callable (CUDA events, CUDA-graph replays, or
  ``triton.testing.do_bench``), with the number of timed calls adapted to a time budget so video-length shapes stay
  affordable; :func:`capture_graph`: one call captured in a CUDA graph.
* :func:`tflops`: TFLOP/s from a FLOP count (:attr:`benchmarks.shapes.Shape.flops`, ``4·B·H·Sq·Skv·D``) and ms.
* :func:`reference_rows` / :func:`fp32_attention_rows`: an fp32 attention reference for a (sub)set of query rows,
  computed in query chunks so the score matrix never exceeds a memory bound.
* :func:`accuracy`: cosine similarity and relative L1 of an output against that reference on the same rows.
* :func:`local_qkv` / :func:`grid_qkv`: structured inputs whose attention is local along the token order / in a
  video's (frames, height, width) grid, with attention-sink keys.
* :func:`quantized_inputs`: a kernel's op-level arguments (quantized Q/K/V and scales) for one shape and recipe, as
  the compiled graph feeds them (what the tuner and the profiling tools time); qattn_fx is imported when called.
* :func:`format_table`, :func:`write_json`, :func:`plot_speed_accuracy`: one side-by-side table, JSON, optional PNG.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import torch


def log(message: str) -> None:
    """Progress line, flushed at once (a device run's output is watched while it runs)."""
    print(message, flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 20, budget_ms: float = 1500.0,
            min_iters: int = 3, method: str = "events", before: Callable[[], Any] | None = None) -> float:
    """Median time of ``fn()`` in milliseconds.

    ``events``: ``warmup`` untimed calls, then up to ``iters`` calls each bracketed by CUDA events, fewer when one
    call is long (the count is chosen so the timed calls take about ``budget_ms``, at least ``min_iters``);
    ``before`` (``events`` only) is queued ahead of each timed call, outside its events (e.g. the work a call follows
    in a model).
    ``do_bench``: ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")`` with the same budget (it flushes
    the L2 cache between calls). ``graph``: one call captured in a CUDA graph (after ``warmup`` calls on a side
    stream), then replays timed like ``events``: the GPU's time alone, without the host's per-call work (Python,
    Dynamo guards, descriptor building, launches), which the other two include wherever the host is slower than the
    GPU (short calls).
    """
    if before is not None and method != "events":
        raise ValueError(f"before= is only taken by the events timer; got method={method!r}")
    if method == "do_bench":
        from triton.testing import do_bench  # noqa: PLC0415

        once = _one_call_ms(fn)
        rep = max(budget_ms, min_iters * once)
        return float(do_bench(fn, warmup=max(1.0, once * warmup), rep=rep, return_mode="median"))
    if method == "graph":
        fn = capture_graph(fn, warmup)
    elif method != "events":
        raise ValueError(f"timer method={method!r} is invalid; valid: events, do_bench, graph")
    for _ in range(max(0, warmup - 1)):
        fn()
    once = _one_call_ms(fn)  # also the last warm-up call
    n = int(max(min_iters, min(iters, budget_ms // max(once, 1e-3))))
    start = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        if before is not None:
            before()
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def capture_graph(fn: Callable[[], Any], warmup: int = 1) -> Callable[[], Any]:
    """``fn``'s replay from a CUDA graph of one call (warmed up first on a side stream, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _one_call_ms(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------------------------
# Accuracy
# ------------------------------------------------------------------------------------------------------------------


def reference_rows(sq: int, max_rows: int | None, seed: int = 0,
                   device: str | torch.device = "cpu") -> torch.Tensor | None:
    """Sorted query-row indices to evaluate accuracy on (``None``: all rows, when ``sq <= max_rows``)."""
    if max_rows is None or sq <= max_rows:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(sq, generator=g)[:max_rows].sort().values.to(device)


def fp32_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None,
                        sm_scale: float | None = None, max_bytes: int = 1 << 30) -> torch.Tensor:
    """Exact fp32 softmax attention of ``q (B,Hq,Sq,D)``, ``k``, ``v (B,Hkv,Skv,·)`` for query ``rows`` (all if None).

    Computed in query chunks so one chunk's fp32 scores take at most ``max_bytes``; TF32 is disabled while it runs.
    GQA repeats K/V heads. Returns ``(B, Hq, R, Dv)`` fp32.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qs = q if rows is None else q.index_select(2, rows.to(q.device))
    kf, vf = k.float(), v.float()
    if hkv != hq:
        kf = kf.repeat_interleave(hq // hkv, dim=1)
        vf = vf.repeat_interleave(hq // hkv, dim=1)
    n = qs.shape[2]
    chunk = max(1, int(max_bytes // max(1, b * hq * skv * 4)))
    out = torch.empty(b, hq, n, vf.shape[-1], dtype=torch.float32, device=q.device)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for s in range(0, n, chunk):
            sc = torch.matmul(qs[:, :, s:s + chunk].float(), kf.transpose(-1, -2)) * scale
            out[:, :, s:s + chunk] = torch.matmul(torch.softmax(sc, dim=-1), vf)
            del sc
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def accuracy(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None) -> dict:
    """``cos`` (cosine similarity of the flattened outputs) and ``rel_l1`` (Σ|o−r| / Σ|r|) on the reference rows.

    ``out`` is ``(B, H, Sq, Dv)`` (any strides); ``ref`` is the matching :func:`fp32_attention_rows` result.
    """
    o = out if rows is None else out.index_select(2, rows.to(out.device))
    o = o.float().reshape(-1)
    r = ref.reshape(-1)
    finite = bool(torch.isfinite(o).all())
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    rel_l1 = ((o - r).abs().sum() / r.abs().sum().clamp_min(1e-30)).item()
    return {"cos": cos, "rel_l1": rel_l1, "finite": finite}


# ------------------------------------------------------------------------------------------------------------------
# Kernel inputs
# ------------------------------------------------------------------------------------------------------------------

#: Recipes of :func:`quantized_inputs`: name → (Q/K dtype, q block, k block, V scale). Block 0 is one scale per
#: tensor; V is e4m3 with a per-channel (``channel``) or per-tensor (``tensor``) scale.
KERNEL_RECIPES: dict[str, tuple[str, int, int, str]] = {
    "int8-1-16": ("int8", 1, 16, "channel"),
    "int8-1-1": ("int8", 1, 1, "channel"),
    "int8-0-0": ("int8", 0, 0, "tensor"),
    "fp8-1-16": ("fp8", 1, 16, "channel"),
    "bf16": ("bf16", 0, 0, "channel"),
}


def local_qkv(b: int, h: int, sq: int, skv: int, d: int, *, sharpness: float = 4.0, width: float = 512.0,
              noise: float = 1.0, sink: int = 0, seed: int = 0, device: str = "cuda") -> tuple:
    """Structured attention inputs whose maps concentrate (for Skip-Softmax): **local** attention along the token
    order. Q and K are ``sharpness · φ(position) + noise · N(0, 1)`` with ``φ`` random Fourier features of the token
    index (frequencies ~ N(0, 1 / width²) per head, ``φ·φ`` a Gaussian kernel of the distance), so a query's
    logits peak at its own position (at about ``sharpness²`` above the bulk, in units of the scaled logits) and
    fall off over ``width`` tokens; V is N(0, 1). ``sink``: the first ``sink`` keys are an **attention sink**, a
    direction shared by every query, at the same logit height as the local peak (so the running max is high from
    the first key tile on, as with the sink tokens of trained DiTs). bf16 ``(B, H, S, D)`` views of ``(B, S, H, D)``
    buffers (diffusers' layout), as :func:`make_inputs` gives them."""
    g = torch.Generator(device=device).manual_seed(seed)
    omega = torch.randn(1, 1, h, d // 2, generator=g, device=device) / width
    phase = 2 * math.pi * torch.rand(1, 1, h, d // 2, generator=g, device=device)

    def features(n: int) -> torch.Tensor:
        angle = torch.arange(n, device=device, dtype=torch.float32)[None, :, None, None] * omega + phase
        return torch.cat([angle.cos(), angle.sin()], -1).expand(b, n, h, d) * (2.0 / d) ** 0.5 * d ** 0.25

    return _features_qkv(features(sq), features(skv), b, sharpness=sharpness, noise=noise, sink=sink, g=g)


def _features_qkv(q_feats: torch.Tensor, k_feats: torch.Tensor, b: int, *, sharpness: float, noise: float, sink: int,
                  g: torch.Generator) -> tuple:
    """Q and K as ``sharpness · features + noise · N(0, 1)`` (features ``(1|B, S, H, D)``, fp32), the first ``sink``
    keys sharing a direction with every query (at the local peak's height), V ~ N(0, 1): bf16 ``(B, H, S, D)`` views
    of ``(B, S, H, D)`` buffers. Draws from ``g`` in the order noise Q, noise K, sink, V."""
    sq, skv, h, d = q_feats.shape[1], k_feats.shape[1], q_feats.shape[2], q_feats.shape[3]
    device = q_feats.device
    q = sharpness * q_feats + noise * torch.randn(b, sq, h, d, generator=g, device=device)
    k = sharpness * k_feats + noise * torch.randn(b, skv, h, d, generator=g, device=device)
    if sink:
        u = torch.randn(1, 1, h, d, generator=g, device=device)
        u = u / u.norm(dim=-1, keepdim=True) * d ** 0.25  # u·u / sqrt(d) = 1
        q = q + sharpness * u
        k[:, :sink] += sharpness * u
    v = torch.randn(b, skv, h, d, generator=g, device=device)
    return tuple(x.to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))


def grid_qkv(b: int, h: int, grid: tuple[int, int, int], d: int, *, windows=((1.0, 2.0, 2.0),),
             sharpness: float = 4.0, noise: float = 1.0, sink: int = 0, seed: int = 0,
             device: str = "cuda") -> tuple:
    """Structured attention inputs for block sparsity: **local** attention in a video's ``(frames, height, width)``
    token grid (tokens in raster order, ``S = F·H·W``), with a window per head. As :func:`local_qkv` but with random
    Fourier features of the 3-D position: head ``i``'s frequencies are ~ ``N(0, diag(1/σ²))`` for its window
    ``σ = windows[i % len(windows)]`` (grid cells along frames, height, width), so ``φ·φ`` is a Gaussian kernel of
    the grid distance and a query's logits peak at its own position (about ``sharpness²`` above the bulk) and fall
    off over the window (a spatial, a temporal or a wide head). ``sink``: the first ``sink`` keys are an attention
    sink shared by every query, at the local peak's height. bf16 ``(B, H, S, D)`` views of ``(B, S, H, D)``
    buffers (Q, K and V: N(0, 1))."""
    g = torch.Generator(device=device).manual_seed(seed)
    f, hh, ww = grid
    sigma = torch.tensor([windows[i % len(windows)] for i in range(h)], dtype=torch.float32, device=device)
    omega = torch.randn(h, d // 2, 3, generator=g, device=device) / sigma[:, None, :]  # (H, D/2, 3)
    phase = 2 * math.pi * torch.rand(h, d // 2, generator=g, device=device)
    pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(hh), torch.arange(ww), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float().to(device)  # (S, 3), raster order
    angle = torch.einsum("sc,hkc->shk", pos, omega) + phase  # (S, H, D/2)
    feats = torch.cat([angle.cos(), angle.sin()], -1)[None] * (2.0 / d) ** 0.5 * d ** 0.25
    return _features_qkv(feats, feats, b, sharpness=sharpness, noise=noise, sink=sink, g=g)


def quantized_inputs(shape, recipe: str, seed: int = 0, *, bf16_q: bool = False) -> tuple:
    """``(q, q_scale, k, k_scale, v, v_scale, q_block, k_block)`` for ``scaled_attention(*args, sm_scale,
    out_dtype)`` of a Sage kernel: random bf16 Q/K/V of ``shape`` (``(B, H, Sq, Skv, D)``, BSHD storage) quantized
    by the recipe's ops (smoothed K, BSHD Q/K views, sequence-major V), as the compiled graph feeds the kernel.
    ``bf16_q``: Q stays bf16 with ``q_scale`` ``None``, as the graph feeds a kernel that quantizes Q itself
    (``KernelInfo.quantizes_q``: int8 recipes with a scale per token)."""
    b, h, sq, skv, d = shape
    if recipe not in KERNEL_RECIPES:
        raise ValueError(f"recipe {recipe!r} is invalid; valid: {', '.join(KERNEL_RECIPES)}")
    if bf16_q and KERNEL_RECIPES[recipe][:2] != ("int8", 1):
        raise ValueError(f"bf16_q: recipe {recipe!r} is not quantized in the kernel; valid: int8 recipes with "
                         "q_block 1, e.g. 'int8-1-16'")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for s in (sq, skv, skv))
    args = quantize_qkv(q, k, v, recipe)
    return (q, None, *args[2:]) if bf16_q else args


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: str) -> tuple:
    """bf16 ``q, k, v`` as :func:`quantized_inputs` gives them (the recipe's ops: smoothed K, sequence-major V)."""
    import qattn_fx.ops  # noqa: F401,PLC0415  (registers qattn::*)
    from qattn_fx import formats  # noqa: PLC0415

    ops = torch.ops.qattn
    if recipe not in KERNEL_RECIPES:
        raise ValueError(f"recipe {recipe!r} is invalid; valid: {', '.join(KERNEL_RECIPES)}")
    qk, q_block, k_block, v_scale = KERNEL_RECIPES[recipe]
    fp8 = torch.float8_e4m3fn
    if qk == "bf16":
        qd, qs, kd, ks = q, None, k, None
    else:
        dtype = formats.torch_dtype(qk)
        k = ops.smooth_k(k)
        if q_block:
            qd, qs = ops.quantize_per_block(q, q_block, dtype)
            kd, ks = ops.quantize_per_block(k, k_block, dtype)
        else:
            qd, qs = ops.quantize_per_tensor(q, dtype)
            kd, ks = ops.quantize_per_tensor(k, dtype)
    quant_v = ops.quantize_per_channel if v_scale == "channel" else ops.quantize_per_tensor
    vd, vs = quant_v(v, fp8, True)
    return qd, qs, kd, ks, vd, vs, q_block, k_block


# ------------------------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A fixed-width text table. ``columns``: ``(key, header, format spec)``; missing values print ``-``."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([_fmt(row.get(key), spec) for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    numeric = [bool(spec) for _, _, spec in columns]  # formatted columns are right-aligned, text left-aligned
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if j and numeric[i] else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def environment() -> dict:
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
        env["torch_cudnn"] = torch.backends.cudnn.version()
    for mod in ("triton", "flashinfer", "cudnn", "sageattention"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
            if mod == "cudnn":
                env["cudnn_backend"] = m.backend_version()
        except Exception as exc:  # noqa: BLE001 — informational
            env[mod] = f"unavailable ({type(exc).__name__})"
    return env


def plot_speed_accuracy(rows: Iterable[dict], path: str, *, x: str = "speedup", y: str = "rel_l1",
                        label: str = "method", group: str = "shape") -> bool:
    """Scatter of speedup (x) against relative L1 error (y, log scale), one marker per method; False without
    matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except Exception:  # noqa: BLE001 — optional
        return False
    rows = [r for r in rows if r.get(x) is not None and r.get(y) is not None and r.get(y) > 0]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    methods = list(dict.fromkeys(r[label] for r in rows))
    markers = "os^Dv<>pP*Xh"
    for i, m in enumerate(methods):
        pts = [r for r in rows if r[label] == m]
        ax.scatter([r[x] for r in pts], [r[y] for r in pts], label=m, marker=markers[i % len(markers)], s=40)
        for r in pts:
            ax.annotate(str(r.get(group, "")), (r[x], r[y]), fontsize=6, alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("speedup vs torch SDPA cuDNN bf16 (kernel incl. quantization)")
    ax.set_ylabel("relative L1 vs fp32 attention")
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def importable(module: str) -> str | None:
    """None when ``module`` imports, else the reason."""
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # noqa: BLE001 — reported as a skip reason
        return f"{module} not importable ({type(exc).__name__}: {str(exc)[:80]})"


def kernel_unavailable(kernel: str, cap: tuple[int, int], d: int) -> str | None:
    """Why the qattn_fx kernel ``kernel`` cannot run on a GPU of capability ``cap`` at head dim ``d`` (None: it
    can, as far as its arch and imports say)."""
    if kernel == "cudnn_fp8":
        from qattn_fx.kernels import cudnn as kc  # noqa: PLC0415

        if cap not in kc.FP8_ARCHS:
            return f"sm_{cap[0]}{cap[1]} not in {kc.FP8_ARCHS}"
        return importable("cudnn")
    if kernel == "flashinfer_fa3_fp8":
        if cap != (9, 0):
            return f"FA3 FP8 needs sm_90, this is sm_{cap[0]}{cap[1]}"
        if d not in (64, 128, 256):
            return f"head_dim {d} not in 64/128/256"
        return importable("flashinfer")
    if kernel == "gluon_sage":
        if cap != (9, 0):
            return f"gluon_sage targets sm_90, this is sm_{cap[0]}{cap[1]}"
        return importable("triton.experimental.gluon")
    if kernel == "triton_sage":
        if cap not in ((8, 9), (9, 0)):
            return f"triton_sage targets sm_89/sm_90, this is sm_{cap[0]}{cap[1]}"
        return importable("qattn_fx.kernels.triton_sage")
    return None
