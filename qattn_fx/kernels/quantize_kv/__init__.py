"""The fused K/V quantize of a Sage site: ``qattn::quantize_kv`` on CUDA, one Triton launch (:mod:`._kernel`).

What the graph computes with four or five Inductor kernels (``smooth_k``, ``quantize_per_block`` of K, ``mask_keys``
and ``quantize_per_channel`` of V) this does in one pass over K and V, given the statistics that need the whole
sequence (``qattn::kv_stats``: K's mean over kept keys, V's per-channel scales, left to Inductor's reductions):

* inputs ``k (B, H, S, Dk)``, ``v (B, H, S, Dv)`` bf16/fp16/fp32 of any strides (head dims up to
  :data:`MAX_HEAD_DIM`), ``k_mean (B, H, 1, Dk)`` and ``v_scale (B, H, Dv)`` fp32, ``key_bias (B|1, S)`` or None
  (``-inf``: a masked key, whose rows are 0 in both outputs);
* K: ``k - k_mean`` in fp32, one scale per ``k_block`` tokens (a power of two up to :data:`TILE`,
  :data:`K_BLOCKS`), int8 or e4m3 data; V: e4m3 data ``v · (1/v_scale)``;
* outputs written into tensors the caller allocates (the op allocates them in the unfused ops' layouts: K's data in
  K's memory order, K's scales ``(B, H, NB4)`` contiguous with each row zero-padded to 4, V's data D-major or
  sequence-major with the sequence padded to 16 tokens); :func:`outputs` allocates that layout for the common
  cases (the op's own allocation, from the unfused ops' strides, is the definition).

One program per (batch · head, tile of :data:`TILE` tokens), :data:`NUM_WARPS` warps. The data and scales are
bitwise those of the unfused ops given the same ``k_mean`` and ``v_scale`` on finite inputs (the interpreter test,
``tests/kernels/test_quantize_kv_interpret.py``, and on the GPU ``tests/gpu/test_quantize_kv.py``). Compiled, NaN
and inf reach the same scales as there (the maxima and clamps keep a NaN; the interpreter's maxima leave it out);
their 8-bit codes are not pinned. Needs triton (imported on the first launch, not with this package) and, compiled,
a GPU of compute capability 8.9 or newer (e4m3 converts); CPU tensors run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ... import formats
from .._compiled_launch import compiled
from .._cuda_utils import FifoCache, TritonSource, bias_args, capability, next_power_of_2, triton_interpreting

#: Tokens per program (a K block is at most one tile).
TILE = 128
#: Warps per program.
NUM_WARPS = 8
#: The ``k_block`` values the kernel serves: powers of two up to a tile.
K_BLOCKS = tuple(2**i for i in range(TILE.bit_length()))
#: Largest head dim of K or V (a row of a tile is one block of channels).
MAX_HEAD_DIM = 256
#: Input dtypes of K and V.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Oldest compute capability (e4m3 converts in hardware).
MIN_CAPABILITY = (8, 9)
#: Sequence-major V's padding (tokens), as :func:`qattn_fx.ops.quantize._layout` stores it.
SEQ_PAD = 16
#: K's scale rows' padding (entries), as ``qattn::quantize_per_block`` stores them.
SCALE_PAD = 4


@functools.cache
def _source() -> TritonSource:
    """The kernel's source, made on first use (trying ``import triton`` then, not when this package imports)."""
    return TritonSource(__package__, Path(__file__).with_name("_kernel.py"), "_kernel", "qattn::quantize_kv on CUDA",
                        "the fused K/V quantize kernel, qattn_fx.kernels.quantize_kv")


def require() -> None:
    """``RuntimeError`` naming the requirement unless triton imports."""
    _source().require()


def check_k_block(k_block: int) -> None:
    if k_block not in K_BLOCKS:
        raise ValueError(f"quantize_kv: k_block={k_block} is invalid; valid: a power of 2 up to {TILE} "
                         f"({', '.join(map(str, K_BLOCKS))})")


def check(k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor, v_scale: torch.Tensor,
          key_bias: torch.Tensor | None, k_block: int, k_dtype: torch.dtype) -> None:
    """``ValueError`` naming the argument unless the operands fit together (every device: ``qattn::quantize_kv``
    runs this before either implementation)."""
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4 or not x.dtype.is_floating_point:
            raise ValueError(f"quantize_kv: {name} must be a (B, H, S, D) float tensor; got {x.dtype} of shape "
                             f"{tuple(x.shape)}")
    b, h, s, dk = k.shape
    if tuple(v.shape[:3]) != (b, h, s):
        raise ValueError(f"quantize_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must share B, H and S")
    for name, x, shape in (("k_mean", k_mean, (b, h, 1, dk)), ("v_scale", v_scale, (b, h, v.shape[3]))):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"quantize_kv: {name} must be fp32 of shape {shape} (qattn::kv_stats); got {x.dtype} of "
                             f"shape {tuple(x.shape)}")
    if key_bias is not None and (key_bias.dim() != 2 or key_bias.shape[1] != s or key_bias.shape[0] not in (1, b)
                                 or not key_bias.dtype.is_floating_point):
        raise ValueError(f"quantize_kv: key_bias must be a float (B|1, S) = ({b}|1, {s}) tensor; got "
                         f"{key_bias.dtype} of shape {tuple(key_bias.shape)}")
    check_k_block(k_block)
    formats.qmax(k_dtype)  # raises with the valid choices


def unsupported(k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel does not take these K and V (their dtypes, head dims), or None when it does."""
    for name, x in (("k", k), ("v", v)):
        if x.dtype not in DTYPES:
            return f"{name}.dtype={x.dtype} is not served; valid: {', '.join(map(str, DTYPES))}"
        if x.shape[-1] > MAX_HEAD_DIM:
            return f"{name} has head_dim {x.shape[-1]}; valid: at most {MAX_HEAD_DIM}"
    return None


def device_supported(device: torch.device) -> bool:
    """Whether the kernel compiles for ``device``: a CUDA device of compute capability :data:`MIN_CAPABILITY` or
    newer (asked of ``torch.cuda`` now)."""
    return device.type == "cuda" and capability(device) >= MIN_CAPABILITY


def outputs(k: torch.Tensor, v: torch.Tensor, k_block: int, k_dtype: torch.dtype,
            seq_major: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(k_data, k_scale, v_data)`` for these operands: K's data like K (``empty_like``), the scales
    ``(B, H, NB4)`` contiguous, V's data like V or, ``seq_major``, stored ``(B, H, Dv, S16)`` and viewed as
    ``(B, H, S16, Dv)``."""
    b, h, s, _ = k.shape
    # (lengths rounded up as qattn_fx.formats.pad_to_multiple writes them, so symbolic ones match the separate ops')
    nb4 = ((s + k_block - 1) // k_block + SCALE_PAD - 1) // SCALE_PAD * SCALE_PAD
    k_data = torch.empty_like(k, dtype=k_dtype)
    k_scale = torch.empty((b, h, nb4), dtype=torch.float32, device=k.device)
    if seq_major:
        s16 = (s + SEQ_PAD - 1) // SEQ_PAD * SEQ_PAD
        v_data = torch.empty((b, h, v.shape[3], s16), dtype=torch.float8_e4m3fn, device=v.device).transpose(-1, -2)
    else:
        v_data = torch.empty_like(v, dtype=torch.float8_e4m3fn)
    return k_data, k_scale, v_data


def _launch_args(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, k_data, k_scale, v_data, interpret: bool):
    """``(grid, args, meta)`` of the :func:`._kernel._kv_quantize` launch."""
    b, h, s, dk = k.shape
    dv = v.shape[3]
    tiles = -(-s // TILE)
    bias, stride_bias_b, stride_bias_s = bias_args(key_bias, k)
    args = [k, v, k_mean, v_scale, bias, k_data, k_scale, v_data,
            h, s, v_data.shape[2], dk, dv, -(-s // k_block), k_scale.shape[2], tiles,
            *k.stride(), *v.stride(), k_mean.stride(0), k_mean.stride(1), k_mean.stride(3), *v_scale.stride(),
            stride_bias_b, stride_bias_s, *k_data.stride(), *v_data.stride()]
    meta = dict(TILE=TILE, K_BLOCK=k_block, BLOCK_DK=next_power_of_2(dk), BLOCK_DV=next_power_of_2(dv),
                HAS_BIAS=key_bias is not None, K_INT8=k_dtype == torch.int8, K_QMAX=formats.qmax(k_dtype),
                K_INV_QMAX=formats.inv_qmax(k_dtype), V_QMAX=formats.FP8_E4M3_MAX, INTERPRET=interpret)
    return (b * h * tiles,), args, meta


#: Options of every compile: no fp fusion (an fma would round a product and a sum once, not twice as torch does).
OPTIONS = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)

_CHECKED_DEVICES = FifoCache(maxsize=16)


def _require_device(*tensors: torch.Tensor) -> bool:
    """Whether the launch is interpreted; ``RuntimeError`` unless the tensors are on one device it runs on."""
    interpret = triton_interpreting()
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise RuntimeError(f"qattn::quantize_kv: all tensors must be on one device; got {t.device} and {device}")
    if interpret:
        return True
    if device.type != "cuda":
        raise RuntimeError(f"qattn::quantize_kv's kernel runs on CUDA tensors (or under TRITON_INTERPRET=1); got "
                           f"{device}")

    def probe():
        if not device_supported(device):
            cap = capability(device)
            raise RuntimeError(f"qattn::quantize_kv's kernel needs compute capability {MIN_CAPABILITY[0]}."
                               f"{MIN_CAPABILITY[1]} or newer (e4m3 converts); device {device} has {cap[0]}.{cap[1]}")
        return True

    _CHECKED_DEVICES.get_or_build(str(device), probe)
    return False


def launch(k, v, k_mean, v_scale, key_bias, k_block: int, k_dtype: torch.dtype, k_data, k_scale, v_data) -> None:
    """Write K's data and scales and V's data into the given outputs (:func:`outputs`' shapes, any strides) for
    operands :func:`check` accepted."""
    require()
    why = unsupported(k, v)
    if why is not None:
        raise ValueError(f"quantize_kv: {why}")
    if not k_scale.is_contiguous():
        raise ValueError(f"quantize_kv: k_scale must be contiguous; got strides {k_scale.stride()}")
    interpret = _require_device(k, v, k_mean, v_scale, k_data, k_scale, v_data,
                                *(() if key_bias is None else (key_bias,)))
    grid, args, meta = _launch_args(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, k_data, k_scale, v_data,
                                    interpret)
    if grid[0] == 0:
        return
    compiled(_source().module()._kv_quantize)[grid](*args, **meta, **OPTIONS)


def quantize_kv(k, v, k_mean, v_scale, key_bias, k_block: int, k_dtype: torch.dtype, seq_major: bool,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """``(k_data, k_scale, v_data)``: :func:`check`, then :func:`launch` into ``out`` (default :func:`outputs`)."""
    check(k, v, k_mean, v_scale, key_bias, k_block, k_dtype)
    out = outputs(k, v, k_block, k_dtype, seq_major) if out is None else out
    launch(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, *out)
    return out


def compile_for(cap: tuple[int, int], k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None = None,
                k_block: int = 16, k_dtype: torch.dtype = torch.int8, seq_major: bool = True):
    """Compile (not run) the kernel a CUDA launch on these operands would use, for compute capability ``cap``
    (operands may be on the ``meta`` device; needs Triton's bundled ptxas, not a GPU). Returns Triton's compiled
    kernel (``.asm["ptx"]``, ``.metadata``)."""
    from .._offline import compile_offline  # noqa: PLC0415

    b, h, _, dk = k.shape
    k_mean = torch.empty((b, h, 1, dk), dtype=torch.float32, device=k.device)
    v_scale = torch.empty((b, h, v.shape[3]), dtype=torch.float32, device=k.device)
    out = outputs(k, v, k_block, k_dtype, seq_major)
    _, args, meta = _launch_args(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, *out, False)
    return compile_offline(_source().module(False)._kv_quantize, args, meta, cap, dict(OPTIONS))


__all__ = ["DTYPES", "K_BLOCKS", "MAX_HEAD_DIM", "MIN_CAPABILITY", "NUM_WARPS", "TILE", "check", "check_k_block",
           "compile_for", "device_supported", "launch", "outputs", "quantize_kv", "require", "unsupported"]
