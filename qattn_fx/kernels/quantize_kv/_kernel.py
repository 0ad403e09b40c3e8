"""The Triton source of the fused K/V quantize (:mod:`qattn_fx.kernels.quantize_kv` loads it once per Triton mode,
as the predictor loads its pooling, so ``TRITON_INTERPRET=1`` set before the first call runs it under the
interpreter).

Every rounding is the one :mod:`qattn_fx.formats` defines: a scale is ``amax · fp32(1/qmax)`` (one rounded multiply),
data is ``x · (1/scale)`` with the correctly rounded reciprocal (``div_rn``) and one rounded multiply, clamped to
``±qmax``, then rounded to nearest even (int8 through the ``1.5 · 2^23`` magic number, e4m3 by the hardware's
saturating convert). The launcher turns off Triton's fp fusion, so no multiply and add become one fma.
"""

import triton
import triton.language as tl


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(x, axis, INTERPRET: tl.constexpr):
    """The max over ``axis``, keeping a NaN as ``torch.amax`` does. The interpreter runs ``tl.standard``'s max
    natively (a NaN-keeping combine there runs element by element, far slower), NaN left out; ``tl.max`` itself is a
    compiled-mode object when triton was imported before ``TRITON_INTERPRET=1`` was set."""
    if INTERPRET:
        out = tl.reduce(x, axis, tl.standard._elementwise_max)
    else:
        out = tl.reduce(x, axis, _max_combine)
    return out


@triton.jit
def _clamp(y, limit):
    """``y`` clamped to ``±limit``, NaN kept (``torch.clamp``)."""
    return tl.clamp(y, -limit, limit, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _reciprocal(scale):
    """``1 / scale`` correctly rounded, with 1 for a scale of 0 (whose block is all zeros)."""
    safe = tl.where(scale == 0.0, 1.0, scale)
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe)  # div_rn does not broadcast


@triton.jit
def _int8(y):
    """``y`` (fp32, within ±127) rounded to nearest even: adding and removing ``1.5 · 2^23`` leaves the integer."""
    return ((y + 12582912.0) - 12582912.0).to(tl.int8)


@triton.jit
def _e4m3(y, INTERPRET: tl.constexpr):
    """``y`` (fp32, within ±448) as float8e4nv, rounded to nearest even. Compiled: the hardware's convert. The
    interpreter's cast rounds ties away from zero, so there the bits are built from ``|y|`` rounded onto the e4m3
    grid in fp32 (exact: a power-of-two scaling and the magic-number rounding) and ``y``'s sign bit."""
    if INTERPRET:
        a = tl.abs(y)
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # biased exponent, floor 2^-6 (subnormals)
        ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)  # the e4m3 spacing there, 2^(e - 127 - 3)
        inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)
        r = ((a * inv_ulp + 8388608.0) - 8388608.0) * ulp
        bits = r.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        code = tl.where(exponent >= 121, ((exponent - 120) << 3) | ((bits >> 20) & 7), (r * 512.0).to(tl.int32))
        code = code | (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7)
        out = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        out = y.to(tl.float8e4nv)
    return out


@triton.jit
def _tile(ptr, b, h, rows, stride_b, stride_h, stride_s, stride_d, BLOCK_D: tl.constexpr):
    """Pointers to the ``BLOCK_D`` channels of ``rows`` of head ``(b, h)`` (64-bit offsets)."""
    d = tl.arange(0, BLOCK_D)
    return ptr + b * stride_b + h * stride_h + rows.to(tl.int64)[:, None] * stride_s + d[None, :] * stride_d


@triton.jit
def _kv_quantize(k_ptr, v_ptr, mean_ptr, v_scale_ptr, bias_ptr, k_data_ptr, k_scale_ptr, v_data_ptr,
                 H, S, S_OUT, DK, DV, NB, NB4, NT,
                 stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
                 stride_mean_b, stride_mean_h, stride_mean_d, stride_vsc_b, stride_vsc_h, stride_vsc_d,
                 stride_bias_b, stride_bias_s,
                 stride_okb, stride_okh, stride_oks, stride_okd, stride_ovb, stride_ovh, stride_ovs, stride_ovd,
                 TILE: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 HAS_BIAS: tl.constexpr, K_INT8: tl.constexpr, K_QMAX: tl.constexpr, K_INV_QMAX: tl.constexpr,
                 V_QMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per (b, h, tile of ``TILE`` tokens) quantizes the tile's K and V.

    A token is kept when it is inside ``S`` and (with ``HAS_BIAS``) its key bias is not ``-inf``; other tokens are
    0 in both tensors. K: ``x = k - mean`` in fp32 (0 for tokens not kept), the scale of each block of ``K_BLOCK``
    tokens ``amax(|x|) · K_INV_QMAX`` into ``k_scale (B, H, NB4)`` (contiguous; entries ``NB..NB4``, the row's
    padding, 0, written by the head's last tile), data ``x · (1/scale)`` as int8 (``K_INT8``) or e4m3 at K's output
    strides. V: ``v · (1/v_scale)`` per channel as e4m3 at the output strides, for tokens below ``S_OUT`` (tokens
    ``S..S_OUT``, the sequence-major padding, 0)."""
    pid = tl.program_id(0)
    tile = pid % NT
    bh = pid // NT
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tile * TILE + tl.arange(0, TILE)
    kept = rows < S
    if HAS_BIAS:
        bias = tl.load(bias_ptr + b * stride_bias_b + rows.to(tl.int64) * stride_bias_s, mask=kept, other=0.0)
        kept = kept & (bias != float("-inf"))

    # K: smoothed, one scale per block of K_BLOCK tokens
    dk = tl.arange(0, BLOCK_DK)
    dk_ok = dk < DK
    k_ok = kept[:, None] & dk_ok[None, :]
    k = tl.load(_tile(k_ptr, b, h, rows, stride_kb, stride_kh, stride_ks, stride_kd, BLOCK_DK), mask=k_ok,
                other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + b * stride_mean_b + h * stride_mean_h + dk * stride_mean_d, mask=dk_ok, other=0.0)
    x = tl.where(k_ok, k - mean[None, :], 0.0)
    amax = _amax(tl.reshape(_amax(tl.abs(x), 1, INTERPRET), (TILE // K_BLOCK, K_BLOCK)), 1, INTERPRET)
    scale = amax * K_INV_QMAX
    blocks = tile * (TILE // K_BLOCK) + tl.arange(0, TILE // K_BLOCK)
    scale_row = k_scale_ptr + bh.to(tl.int64) * NB4
    tl.store(scale_row + blocks, scale, mask=blocks < NB)
    pad = NB + tl.arange(0, 4)  # the row's zero padding (at most 3 entries), by its last tile
    tl.store(scale_row + pad, tl.full((4,), 0.0, tl.float32), mask=(pad < NB4) & (tile == NT - 1))
    inverse = tl.reshape(tl.broadcast_to(_reciprocal(scale)[:, None], (TILE // K_BLOCK, K_BLOCK)), (TILE,))
    y = _clamp(x * inverse[:, None], K_QMAX)
    if K_INT8:
        k_out = _int8(y)
    else:
        k_out = _e4m3(y, INTERPRET)
    tl.store(_tile(k_data_ptr, b, h, rows, stride_okb, stride_okh, stride_oks, stride_okd, BLOCK_DK), k_out,
             mask=(rows < S)[:, None] & dk_ok[None, :])

    # V: per-channel scales given
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    v = tl.load(_tile(v_ptr, b, h, rows, stride_vb, stride_vh, stride_vs, stride_vd, BLOCK_DV),
                mask=kept[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    v_scale = tl.load(v_scale_ptr + b * stride_vsc_b + h * stride_vsc_h + dv * stride_vsc_d, mask=dv_ok, other=0.0)
    v_out = _e4m3(_clamp(v * _reciprocal(v_scale)[None, :], V_QMAX), INTERPRET)
    tl.store(_tile(v_data_ptr, b, h, rows, stride_ovb, stride_ovh, stride_ovs, stride_ovd, BLOCK_DV), v_out,
             mask=(rows < S_OUT)[:, None] & dv_ok[None, :])
