"""Element formats and their exact encode/decode rules, written in plain aten ops.

These helpers are the single definition of every quantized format in qattn_fx. The registered quantize ops
(:mod:`qattn_fx.ops.quantize`), the reference attention (:mod:`qattn_fx.kernels.reference`) and the kernel
adapters' layout packers all call them; nothing else re-implements a rounding rule.

Conventions (all tensors are logical ``(B, H, S, D)`` unless stated):

* **Scaled int8 / fp8 e4m3** (Sage, cuDNN FP8, FA3 FP8): ``x ≈ data * scale``. ``scale = amax · fp32(1/qmax)``
  with qmax 127 (int8) or 448 (e4m3), fp32, one rounded multiply (:func:`amax_to_scale`: torch's CUDA division by a
  scalar is that multiply while its CPU one divides, so the definition names the multiply: every device, Inductor
  and the kernels that quantize Q themselves give the same scale). ``data = x · (1/scale)`` (the IEEE reciprocal,
  then one rounded multiply: :func:`cast_scaled`) in int8 rounds half to even and saturates at ±127; e4m3
  saturates at ±448 and rounds to nearest even. A block whose amax is 0 gets scale 0 and data 0.
* **MXFP8** (OCP MX, cuDNN/TE convention): 32 elements share an E8M0 scale ``2^e`` with
  ``e = ceil(log2(amax · fp32(1/448)))`` (round *up*, so no element overflows), byte ``e + 127``; amax 0 gives byte
  0. Data ``e4m3(clamp(x · 2^-e, ±448))``. Scales are stored as their E8M0 bytes in ``torch.uint8`` (what
  ``torch.float8_e8m0fnu`` holds; Inductor's C++ backend has no such dtype, so a CPU compile of an emulated MXFP8
  recipe cannot carry it), which a kernel that wants the dtype views as ``float8_e8m0fnu`` at its boundary.
* **NVFP4**: E2M1 elements (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, round to nearest, ties to even code), 16 elements
  share an E4M3 block scale, and one fp32 tensor scale ``g = amax / (448 · 6)`` keeps block scales in range:
  ``x ≈ e2m1 · e4m3_block_scale · g``. Two elements per byte along the last axis, element ``2i`` in the low
  nibble; bit 3 of a nibble is the sign.

Block counts along the sequence (per-block Q/K scales, MXFP8 and NVFP4 V scales) are zero-padded to a multiple
of 4 blocks where the quantize ops produce them (``blocks_multiple`` / ``scale_multiple`` below; 16 bytes of fp32
scales, the 4 scale columns of Blackwell's 128x4 scale tiles). Besides alignment, this is what lets one compiled
graph serve every length: under symbolic lengths a tensor with a dim of ``ceil(S/block)`` — which may be 1 —
makes the compiler guard on that dim being 1 (every contiguity check does, and every traced node's metadata is
checked), so the graph would recompile when a call crosses ``S = block``; ``4·ceil(S/(4·block))`` is never 1.
Padded blocks hold zeros (scale 0, E8M0 byte 0) and are never read.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
MX_BLOCK = 32
NVFP4_BLOCK = 16
#: Fixed scale that maps softmax probabilities P ∈ [0, 1] onto the e4m3 range before P·V (Sage2, cuDNN, FA3).
P_FP8_SCALE = FP8_E4M3_MAX

_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: FP8_E4M3_MAX}


def torch_dtype(name: str) -> torch.dtype:
    """``"int8"`` → ``torch.int8``; ``"fp8"`` → ``torch.float8_e4m3fn``."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not a scaled 8-bit format; valid: {', '.join(_DTYPES)}") from None


def inv_qmax(dtype: torch.dtype) -> float:
    """``1 / qmax(dtype)`` (a Python float; torch applies it as fp32, ``fp32(1/qmax)``)."""
    return 1.0 / qmax(dtype)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale of a block whose largest magnitude is ``amax``: ``amax · fp32(1/qmax)``."""
    return amax.float() * inv_qmax(dtype)


def qmax(dtype: torch.dtype) -> float:
    try:
        return _QMAX[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype} is not a scaled 8-bit format; valid: torch.int8, "
                         "torch.float8_e4m3fn") from None


# ------------------------------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------------------------------


def pad_to_multiple(x: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``axis`` to a multiple of ``multiple`` elements.

    Works on symbolic lengths without adding guards: a length that is a plain int and already a multiple returns
    ``x`` itself; a symbolic one is always padded (by a symbolic amount that may be 0), so one compiled graph
    serves every length (a Python ``if pad:`` would specialize the graph on ``length % multiple``).
    """
    axis = axis % x.dim()
    n = x.shape[axis]
    pad = (n + multiple - 1) // multiple * multiple - n  # as (-n) % multiple, in a form sympy sees is a multiple
    if isinstance(pad, int) and pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - axis) + [0, pad]
    out = torch.nn.functional.pad(x, widths)
    if not isinstance(pad, int):
        # a pad of 0 at run time makes constant_pad_nd return a clone in x's memory order, any other pad a
        # contiguous tensor; the traced graph assumes contiguous, so it is made so (a no-op copy for Inductor)
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def take_first(x: torch.Tensor, axis: int, n) -> torch.Tensor:
    """The first ``n`` entries of ``axis``: a view for a static length, a gather for a symbolic one.

    A view of the first ``n`` of ``m`` entries is contiguous exactly when ``n == m``; tracing one under symbolic
    lengths makes the compiler guard on that, and the guard recompiles the graph for the next length.
    """
    if isinstance(n, int) and isinstance(x.shape[axis], int):
        return x.narrow(axis, 0, n)
    return x.index_select(axis, torch.arange(n, device=x.device))


# ------------------------------------------------------------------------------------------------------------------
# Scaled int8 / fp8
# ------------------------------------------------------------------------------------------------------------------


def cast_scaled(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x · (1 / scale)`` rounded and saturated into ``dtype``: the IEEE reciprocal of each scale, then one rounded
    multiply per element (what a kernel computes once per row and applies cheaply); ``scale`` broadcasts against
    ``x``; 0 scale → 0."""
    inverse = torch.reciprocal(torch.where(scale == 0, torch.ones_like(scale), scale))
    y = x.float() * inverse
    limit = qmax(dtype)
    if dtype == torch.int8:
        return y.round().clamp(-limit, limit).to(torch.int8)
    return y.clamp(-limit, limit).to(dtype)


def seq_block_amax(x: torch.Tensor, block: int, multiplier: float = 1.0, blocks_multiple: int = 1) -> torch.Tensor:
    """Amax of ``x (B,H,S,D)`` over blocks of ``block`` tokens and all channels, times ``multiplier`` (in fp32)
    → ``(B, H, NB)``: ``NB = ceil(S/block)`` zero-padded to a multiple of ``blocks_multiple`` (padded blocks are 0).

    The product is taken per element before the reduction (the same fp32 result: rounding is monotonic), so no
    elementwise op touches the block axis. Under symbolic lengths, ``blocks_multiple`` > 1 keeps that axis off 1
    (the module docstring): the padding is made before the split, so no tensor has ``ceil(S/block)`` as a dim.
    """
    a = pad_to_multiple(x.abs().float() * multiplier, -2, block * blocks_multiple)
    return a.unflatten(-2, (a.shape[-2] // block, block)).amax(dim=(-2, -1))  # splitting S is a view in any layout


def expand_seq_scale(scale: torch.Tensor, block: int, seq_len: int) -> torch.Tensor:
    """Per-token values of a ``(Bs, Hs, NB)`` Q/K scale: ``(Bs, Hs, S, 1)``; ``block == 0`` means one scale.

    ``NB`` may exceed ``ceil(S / block)`` (rows padded for alignment): the extra entries are never read. A gather
    rather than a slice, so no view of ambiguous contiguity appears under symbolic lengths.
    """
    if block == 0:
        return scale[..., :1].unsqueeze(-1)
    token_block = torch.arange(seq_len, device=scale.device) // block
    return scale.index_select(-1, token_block).unsqueeze(-1)


def dequantize_scaled(data: torch.Tensor, scale: torch.Tensor | None, block: int) -> torch.Tensor:
    """fp32 values of a scaled Q/K tensor (``scale is None``: ``data`` is not quantized)."""
    if scale is None:
        return data.float()
    return data.float() * expand_seq_scale(scale, block, data.shape[-2])


def dequantize_v(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of an fp8 V with a ``(Bs, Hs, D or 1)`` scale (per channel, per head or per tensor)."""
    return data.float() * scale.unsqueeze(-2)


def round_p_fp8(p: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities as the FP8 P·V sees them: ``e4m3(P · 448) / 448`` (P ∈ [0, 1])."""
    return (p * P_FP8_SCALE).to(torch.float8_e4m3fn).float() / P_FP8_SCALE


# ------------------------------------------------------------------------------------------------------------------
# MXFP8
# ------------------------------------------------------------------------------------------------------------------


def _blocks_along(x: torch.Tensor, axis: int, block: int, multiple: int = 1) -> torch.Tensor:
    """``x`` with ``axis`` (zero-padded to a multiple of ``block · multiple``) split into ``(..., nblocks, block)``
    last (``nblocks`` a multiple of ``multiple``)."""
    xp = pad_to_multiple(x, axis, block * multiple).movedim(axis, -1)
    return xp.reshape(*xp.shape[:-1], xp.shape[-1] // block, block)


def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent ``ceil(log2(amax · fp32(1/448)))`` as int32, computed exactly with frexp (amax > 0)."""
    v = amax.float() * (1.0 / FP8_E4M3_MAX)  # the scalar is applied in fp32, as fp32(1/448)
    mantissa, exponent = torch.frexp(v)  # v = m · 2^e, m ∈ [0.5, 1)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def quantize_mxfp8(x: torch.Tensor, axis: int, scale_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 with 32-element blocks along ``axis`` → ``(e4m3 data like x, E8M0 scale bytes as uint8)``.

    Scales have ``x``'s shape with ``axis`` replaced by ``ceil(n/32)`` blocks (Q/K: ``axis=-1`` →
    ``(B,H,S,ceil(D/32))``; V: ``axis=-2`` → ``(B,H,ceil(S/32),D)``), zero-padded (byte 0) to a multiple of
    ``scale_multiple`` blocks (``qattn::quantize_mxfp8`` pads V's to 4: the module docstring).
    """
    axis = axis % x.dim()
    blocks = _blocks_along(x.float(), axis, MX_BLOCK, scale_multiple)
    amax = blocks.abs().amax(dim=-1)
    exp = mx_exponent(amax).clamp(-127, 127)
    byte = torch.where(amax == 0, torch.zeros_like(exp), exp + 127)
    scale = torch.exp2(-(byte - 127).float())  # 1 / 2^e
    data = (blocks * scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    n = x.shape[axis]
    data = take_first(data.reshape(*data.shape[:-2], -1), -1, n).movedim(-1, axis).to(torch.float8_e4m3fn)
    scales = byte.to(torch.uint8).movedim(-1, axis)  # no view as float8_e8m0fnu here: see the module docstring
    return data.contiguous(), scales.contiguous()


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """``2^(byte - 127)`` as fp32 (byte 0 → 2^-127, treated as the scale of an all-zero block); ``scales``: E8M0
    bytes, ``uint8`` or ``float8_e8m0fnu``."""
    return torch.exp2(scales.view(torch.uint8).float() - 127.0)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, axis: int) -> torch.Tensor:
    axis = axis % data.dim()
    s = take_first(e8m0_to_float(scales).repeat_interleave(MX_BLOCK, dim=axis), axis, data.shape[axis])
    return data.float() * s


# ------------------------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------------------------

_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round ``y`` (already scaled, |y| saturates at 6) to E2M1 codes 0..15 (uint8), ties to the even code.

    Elementwise comparisons only (no lookup tables), so Inductor fuses it with its producer.
    """
    a = y.abs().float()
    lo = torch.zeros_like(a, dtype=torch.int32)  # number of midpoints strictly below a
    hi = torch.zeros_like(a, dtype=torch.int32)  # number of midpoints at or below a
    for mid in _E2M1_MIDPOINTS:
        lo = lo + (a > mid).to(torch.int32)
        hi = hi + (a >= mid).to(torch.int32)
    code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)  # exact tie: take the even code
    sign = ((y < 0) & (code > 0)).to(torch.int32) * 8
    return (code + sign).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pairs along the last axis into bytes: element ``2i`` in the low nibble, ``2i+1`` in the high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor scale ``amax / (448 · 6)`` (1 for an all-zero tensor), shape ``()``."""
    amax = x.abs().amax().float()
    g = amax / (FP8_E4M3_MAX * E2M1_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, scale_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 along the last axis → ``(packed uint8 (..., N16/2), e4m3 block scales (..., NB), fp32 g)``.

    ``N16`` is the last axis zero-padded to a multiple of 16; ``NB`` its ``N16/16`` blocks, zero-padded to a
    multiple of ``scale_multiple`` (``qattn::quantize_nvfp4`` pads V's to 4: the module docstring).
    ``global_scale`` defaults to :func:`nvfp4_global_scale` of ``x``.
    """
    if global_scale is None:
        g = nvfp4_global_scale(x)
    elif isinstance(global_scale, float):
        g = torch.full((), global_scale, dtype=torch.float32, device=x.device)
    else:
        g = global_scale.float()
    blocks = _blocks_along(x.float(), -1, NVFP4_BLOCK, scale_multiple)
    amax = blocks.abs().amax(dim=-1)
    sf = (amax / E2M1_MAX / g).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = sf.float() * g
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    codes = e2m1_encode(blocks / safe.unsqueeze(-1))
    codes = codes.reshape(*codes.shape[:-2], -1)
    if scale_multiple > 1:  # the data keeps N16 elements (a gather under symbolic lengths: take_first)
        codes = take_first(codes, -1, (x.shape[-1] + NVFP4_BLOCK - 1) // NVFP4_BLOCK * NVFP4_BLOCK)
    return pack_nibbles(codes).contiguous(), sf.contiguous(), g.reshape(())


def dequantize_nvfp4(packed: torch.Tensor, sf: torch.Tensor, global_scale: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 values of the first ``n`` elements along the last axis (``sf`` may hold padded blocks past the data)."""
    values = e2m1_decode(unpack_nibbles(packed))
    s = take_first(sf.float().repeat_interleave(NVFP4_BLOCK, dim=-1), -1, values.shape[-1]) * global_scale.float()
    return (values * s)[..., :n]


#: P quantized to NVFP4 (NVFP4 P·V): rows of P have max 1, so the tensor scale is fixed at 1/(448·6).
P_NVFP4_GLOBAL = 1.0 / (FP8_E4M3_MAX * E2M1_MAX)


def round_p_nvfp4(p: torch.Tensor) -> torch.Tensor:
    packed, sf, g = quantize_nvfp4(p, P_NVFP4_GLOBAL)
    return dequantize_nvfp4(packed, sf, g, p.shape[-1])
