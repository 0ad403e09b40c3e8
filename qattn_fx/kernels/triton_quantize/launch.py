"""triton_quantize's host side: loading the kernels (compiled or interpreted), checks, grids, launches."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import torch

from ... import formats
from . import layout

try:  # GPU libraries are optional at import time; a launch raises a clear error without them.
    import triton

    _TRITON_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only without triton
    triton = None
    _TRITON_ERROR = exc

#: Tokens per scale that :func:`quantize_per_block` serves (one block is a reshape of a power-of-two tile).
BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Largest head_dim (channels are one tile of the next power of two).
MAX_HEAD_DIM = 256
#: Input dtypes.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Column pass: programs aimed at (about four per SM of an H200) and at most this many partial rows per head, which
#: every program of the quantize pass reads back.
TARGET_PROGRAMS = 528
MAX_PARTIALS = 32
#: Quantize passes: tokens per tile (at least one block), Q's and K's (with the mean to read, two tiles per
#: program), and V's (at head_dim 128). H200, flux-1024 / wan1.3b-480p (``benchmarks.quantize --sweep``, 2026-12-01):
#: Q 18.5 / 55.8 µs at 32 rows against 19.7 / 59.7 at 64; K 34.2 / 109.2 at 64 rows, two tiles, slower at 32 or
#: 128 rows and at one or four tiles; V 30.8 / 96.2 at 64 rows against 39.8 / 124.0 at 128.
BLOCK_ROWS = 32
SMOOTH_ROWS = 64
SMOOTH_TILES = 2
CHANNEL_ROWS = 64
#: Warps per program: one per this many tile elements, 4 to 8.
WARP_ELEMENTS = 2048

_KERNEL_SOURCE = Path(__file__).with_name("kernel.py")
_MODULES: dict[bool, object] = {}


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), read now."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def kernel_module(interpret: bool):
    """:mod:`.kernel` loaded with ``@triton.jit`` in interpreter (``interpret``) or compiled mode, once each."""
    if triton is None:
        raise RuntimeError(f"triton_quantize needs triton: {_TRITON_ERROR}")
    module = _MODULES.get(interpret)
    if module is None:
        name = f"{__package__}._kernel_{'interpreted' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, _KERNEL_SOURCE)
        module = importlib.util.module_from_spec(spec)
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
        _MODULES[interpret] = module
    return module


def _check(op: str, x: torch.Tensor, device_check: bool = True) -> bool:
    """Validates ``x``; returns whether the launch is interpreted."""
    if x.dim() != 4:
        raise ValueError(f"{op} expects a (B, H, S, D) tensor; got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{op}: x.dtype={x.dtype} is not served; valid: {', '.join(map(str, DTYPES))}")
    if x.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim={x.shape[-1]} is not served; valid: at most {MAX_HEAD_DIM}")
    interpret = interpreter_active()
    if device_check and x.device.type != "cuda" and not interpret:
        raise RuntimeError(f"{op} runs on CUDA tensors (or under TRITON_INTERPRET=1); got device {x.device}")
    return interpret


def _warps(elements: int) -> int:
    return max(4, min(8, elements // WARP_ELEMENTS))


#: One kernel launch: (kernel name in :mod:`.kernel`, grid, positional args, keyword args incl. ``num_warps``).
Call = tuple[str, tuple, list, dict]


def _column_call(x: torch.Tensor, reduce: str, interpret: bool) -> tuple[torch.Tensor, Call]:
    batch, heads, seq, dim = x.shape
    block_d = triton.next_power_of_2(dim)
    rows = max(8, 8192 // block_d)
    chunks = max(1, min(MAX_PARTIALS, -(-TARGET_PROGRAMS // (batch * heads)), layout.blocks(seq, rows)))
    chunk = layout.padded(layout.blocks(seq, chunks), rows)
    chunks = layout.blocks(seq, chunk)
    part = torch.empty((batch, heads, chunks, dim), dtype=torch.float32, device=x.device)
    meta = dict(SUM=reduce == "sum", ROWS=rows, BLOCK_D=block_d, INTERPRET=interpret,
                INTERP_CHUNK=chunk if interpret else 0, num_warps=_warps(rows * block_d))
    return part, ("_column_pass", (batch * heads, chunks), [x, part, heads, seq, dim, chunk, chunks, *x.stride()],
                  meta)


def _per_block_calls(x, block, dtype, smooth, mean, interpret) -> tuple[torch.Tensor, torch.Tensor, list[Call]]:
    qmax = formats.qmax(dtype)  # raises with the valid choices
    if block not in BLOCKS:
        raise ValueError(f"quantize_per_block: block={block} is not served; valid: {', '.join(map(str, BLOCKS))}")
    if mean is not None and not smooth:
        raise ValueError("quantize_per_block: mean= is only read with smooth=True")
    batch, heads, seq, dim = x.shape
    data, scale = layout.per_block(x, block, dtype)
    calls = []
    if not smooth:
        part, chunks = scale, 1  # not read
    elif mean is None:
        part, call = _column_call(x, "sum", interpret)
        chunks = part.shape[2]
        calls.append(call)
    else:
        if mean.shape != (batch, heads, dim) or mean.dtype != torch.float32 or not mean.is_contiguous():
            raise ValueError(f"quantize_per_block: mean must be contiguous fp32 {(batch, heads, dim)}; got "
                             f"{mean.dtype} {tuple(mean.shape)}")
        part, chunks = mean, 1
    block_d = triton.next_power_of_2(dim)
    rows = max(SMOOTH_ROWS if smooth else BLOCK_ROWS, block)
    tiles = SMOOTH_TILES if smooth else 1
    meta = dict(BLOCK=block, ROWS=rows, TILES=tiles, BLOCK_D=block_d, NC_PAD=triton.next_power_of_2(chunks),
                SMOOTH=smooth, MEAN_GIVEN=mean is not None, INT8=dtype == torch.int8, QMAX=qmax,
                INV_QMAX=formats.inv_qmax(dtype), INTERPRET=interpret, num_warps=_warps(rows * block_d))
    args = [x, part, data, scale, heads, seq, dim, layout.blocks(seq, block), scale.shape[-1], chunks,
            *x.stride(), *data.stride()]
    calls.append(("_quantize_blocks", (batch * heads, layout.blocks(seq, rows * tiles)), args, meta))
    return data, scale, calls


def _per_channel_calls(x, dtype, seq_major, interpret) -> tuple[torch.Tensor, torch.Tensor, list[Call]]:
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"quantize_per_channel: dtype={dtype} is not served; valid: torch.float8_e4m3fn")
    batch, heads, seq, dim = x.shape
    data, scale = layout.per_channel(x, dtype, seq_major)
    part, column = _column_call(x, "amax", interpret)
    chunks = part.shape[2]
    block_d = triton.next_power_of_2(dim)
    rows = max(16, CHANNEL_ROWS * 128 // block_d)
    seq_out = data.shape[-2]
    meta = dict(ROWS=rows, BLOCK_D=block_d, NC_PAD=triton.next_power_of_2(chunks), QMAX=formats.FP8_E4M3_MAX,
                INV_QMAX=formats.inv_qmax(dtype), INTERPRET=interpret, num_warps=_warps(rows * block_d))
    args = [x, part, data, scale, heads, seq, seq_out, dim, chunks, *x.stride(), *data.stride()]
    return data, scale, [column, ("_quantize_channels", (batch * heads, layout.blocks(seq_out, rows)), args, meta)]


def _run(calls: list[Call], interpret: bool) -> None:
    module = kernel_module(interpret)
    for name, grid, args, meta in calls:
        getattr(module, name)[grid](*args, **meta)


def column_pass(x: torch.Tensor, reduce: str) -> torch.Tensor:
    """Per-channel partial statistics of ``x (B, H, S, D)`` over chunks of tokens: fp32 ``(B, H, NC, D)``,
    ``reduce`` ``"sum"`` (of ``x`` in fp32) or ``"amax"`` (of ``|x|``); the sum or max over ``NC`` is the whole."""
    if reduce not in ("sum", "amax"):
        raise ValueError(f"column_pass: reduce={reduce!r} is invalid; valid: sum, amax")
    interpret = _check("column_pass", x)
    part, call = _column_call(x, reduce, interpret)
    _run([call], interpret)
    return part


def quantize_per_block(x: torch.Tensor, block: int, dtype: torch.dtype, smooth: bool = False,
                       mean: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``qattn::quantize_per_block(x, block, dtype)`` in one pass over ``x`` (layouts: :func:`.layout.per_block`).

    ``smooth``: of ``x - mean_S(x)`` in fp32 (``qattn::smooth_k`` first), the mean from :func:`column_pass` (a
    second, cheaper pass over ``x``) or, when given, ``mean`` (fp32 ``(B, H, D)``, contiguous).
    """
    interpret = _check("quantize_per_block", x)
    data, scale, calls = _per_block_calls(x, block, dtype, smooth, mean, interpret)
    if x.numel() == 0:
        return data, scale.zero_()
    _run(calls, interpret)
    return data, scale


def quantize_per_channel(x: torch.Tensor, dtype: torch.dtype, seq_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``qattn::quantize_per_channel(x, dtype, seq_major)`` for e4m3: an amax pass (:func:`column_pass`) and one
    quantize pass (layouts: :func:`.layout.per_channel`)."""
    interpret = _check("quantize_per_channel", x)
    data, scale, calls = _per_channel_calls(x, dtype, seq_major, interpret)
    if x.numel() == 0:
        return data, scale
    _run(calls, interpret)
    return data, scale


def compile_for(capability: tuple[int, int], x: torch.Tensor, op: str, **kwargs) -> list:
    """Compile (not run) the kernels that ``op`` (``"quantize_per_block"`` with ``block``, ``dtype``, ``smooth``;
    ``"quantize_per_channel"`` with ``dtype``, ``seq_major``) launches for ``x`` (a ``meta`` tensor will do), for
    ``capability``, with Triton's bundled ptxas (no GPU). Returns the compiled kernels in launch order."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from .._offline import launch_signature  # noqa: PLC0415

    _check(op, x, device_check=False)
    if op == "quantize_per_block":
        *_, calls = _per_block_calls(x, kwargs["block"], kwargs["dtype"], kwargs.get("smooth", False), None, False)
    elif op == "quantize_per_channel":
        *_, calls = _per_channel_calls(x, kwargs["dtype"], kwargs["seq_major"], False)
    else:
        raise ValueError(f"op={op!r} is invalid; valid: quantize_per_block, quantize_per_channel")
    module = kernel_module(False)
    compiled = []
    for name, _, args, meta in calls:
        kernel = getattr(module, name)
        meta = dict(meta)
        num_warps = meta.pop("num_warps")
        signature, constexprs, attrs = launch_signature(kernel, args, meta)
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled.append(triton.compile(source, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                                       options={"num_warps": num_warps}))
    return compiled
