"""triton_quantize's device code: a per-channel column pass and the two quantize passes (layouts: the package
docstring).

Loaded by :mod:`.launch` once per Triton mode (compiled or interpreted), like triton_sage's kernel source. A scale
is ``amax · INV_QMAX`` (``INV_QMAX`` = ``fp32(1/qmax)``, qmax 127 for int8, 448 for e4m3, as
:func:`qattn_fx.formats.amax_to_scale`); every division is IEEE round-to-nearest (``div_rn``), as torch's ``/``
between tensors.
"""

import triton
import triton.language as tl


@triton.jit
def _sum0(x, INTERPRET: tl.constexpr):
    """Sum over axis 0 (the interpreter runs ``tl.reduce`` natively; ``tl.sum`` may be a compiled-mode object)."""
    if INTERPRET:
        return tl.reduce(x, 0, tl.standard._sum_combine)
    return tl.sum(x, 0)


@triton.jit
def _max(x, axis: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.reduce(x, axis, tl.standard._elementwise_max)
    return tl.max(x, axis)


@triton.jit
def _to_8bit(y, INT8: tl.constexpr, QMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """``y`` (fp32, already divided by its scale) saturated to ``±QMAX`` and rounded to nearest even: int8, or e4m3
    (``.to(float8e4nv)`` is RNE and saturating on the GPU; the interpreter's cast is not, so there the e4m3 bits
    are built from ``y`` rounded onto the e4m3 grid in fp32, exactly)."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT8:
        # |y| <= 127 < 2^22: adding and removing 1.5·2^23 rounds to an integer, ties to even (torch.round)
        out = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    elif INTERPRET:  # the e4m3 bits from |y| rounded onto the e4m3 grid in fp32 (exact), and y's sign bit
        a = tl.abs(y)
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # biased exponent, floor 2^-6 (subnormals)
        ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)  # e4m3 spacing: 2^(e-127-3)
        inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)
        r = ((a * inv_ulp + 8388608.0) - 8388608.0) * ulp
        rb = r.to(tl.int32, bitcast=True)
        re = (rb >> 23) & 0xFF
        code = tl.where(re >= 121, ((re - 120) << 3) | ((rb >> 20) & 7), (r * 512.0).to(tl.int32))
        code = code | (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7)
        out = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        out = y.to(tl.float8e4nv)
    return out


@triton.jit
def _column_pass(x_ptr, part_ptr, H, S, D, CHUNK, NC,
                 sx_b, sx_h, sx_s, sx_d,
                 SUM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
                 INTERP_CHUNK: tl.constexpr):
    """Per channel over tokens ``[c·CHUNK, (c+1)·CHUNK)`` of one (b, h): the fp32 sum (``SUM``) or the amax of
    ``|x|``, into ``part[b, h, c, :]`` (fp32, contiguous ``(B, H, NC, D)``). Grid ``(B·H, NC)``. Under the
    interpreter every scalar is a 1-element numpy array, which numpy >= 2.4 refuses to turn into a Python int for
    ``range()``, so there the host passes ``CHUNK`` as the constexpr ``INTERP_CHUNK`` too."""
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    base = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.full((ROWS, BLOCK_D), 0.0, tl.float32)
    start = pid_c * CHUNK
    for r0 in range(0, INTERP_CHUNK if INTERPRET else CHUNK, ROWS):
        rows = start + r0 + tl.arange(0, ROWS)
        ok = (rows < S)[:, None] & d_ok[None, :]
        x = tl.load(base + rows.to(tl.int64)[:, None] * sx_s + d[None, :] * sx_d, mask=ok, other=0.0)
        x = x.to(tl.float32)
        if SUM:
            acc = acc + x
        else:
            acc = tl.maximum(acc, tl.abs(x))
    if SUM:
        col = _sum0(acc, INTERPRET)
    else:
        col = _max(acc, 0, INTERPRET)
    tl.store(part_ptr + (pid_bh.to(tl.int64) * NC + pid_c) * D + d, col, mask=d_ok)


@triton.jit
def _quantize_blocks(x_ptr, part_ptr, data_ptr, scale_ptr, H, S, D, NB, NB4, NC,
                     sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, so_d,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                     NC_PAD: tl.constexpr, SMOOTH: tl.constexpr, MEAN_GIVEN: tl.constexpr, INT8: tl.constexpr,
                     QMAX: tl.constexpr, INV_QMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-``BLOCK``-token scales and 8-bit data of ``TILES`` tiles of ``ROWS`` tokens of one (b, h).

    ``SMOOTH``: ``x - mean`` first, in fp32, the mean the sum of ``part[b, h, :NC, :]`` divided by ``S`` (or
    ``part[b, h, :]`` itself when ``MEAN_GIVEN``). Writes
    ``scale[b, h, blk] = amax_blk · INV_QMAX`` (contiguous ``(B, H, NB4)``, entries ``NB..NB4`` zero) and
    ``data = x / scale`` (0 where the scale is 0) in the 8-bit format at the output strides. Grid
    ``(B·H, ceil(S / (ROWS·TILES)))``.
    """
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    base = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    out = data_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
    scales = scale_ptr + pid_bh.to(tl.int64) * NB4
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # the first tile's load is issued before the mean's reduction, so the two latencies overlap
    rows0 = pid_t * TILES * ROWS + tl.arange(0, ROWS)
    ok0 = (rows0 < S)[:, None] & d_ok[None, :]
    x0 = tl.load(base + rows0.to(tl.int64)[:, None] * sx_s + d[None, :] * sx_d, mask=ok0, other=0.0)
    if SMOOTH and MEAN_GIVEN:
        mean = tl.load(part_ptr + pid_bh.to(tl.int64) * D + d, mask=d_ok, other=0.0)
    elif SMOOTH:
        c = tl.arange(0, NC_PAD)
        part = tl.load(part_ptr + (pid_bh.to(tl.int64) * NC + c[:, None]) * D + d[None, :],
                       mask=(c < NC)[:, None] & d_ok[None, :], other=0.0)
        mean = tl.math.div_rn(_sum0(part, INTERPRET), tl.full((BLOCK_D,), 0.0, tl.float32) + S)
    for i in tl.static_range(TILES):
        rows = (pid_t * TILES + i) * ROWS + tl.arange(0, ROWS)
        ok = (rows < S)[:, None] & d_ok[None, :]
        if i == 0:
            x = x0
        else:
            x = tl.load(base + rows.to(tl.int64)[:, None] * sx_s + d[None, :] * sx_d, mask=ok, other=0.0)
        x = x.to(tl.float32)
        if SMOOTH:
            x = tl.where(ok, x - mean[None, :], 0.0)
        amax = _max(tl.reshape(tl.abs(x), (ROWS // BLOCK, BLOCK * BLOCK_D)), 1, INTERPRET)
        scale = amax * INV_QMAX
        blk = (pid_t * TILES + i) * (ROWS // BLOCK) + tl.arange(0, ROWS // BLOCK)
        tl.store(scales + blk, scale, mask=blk < NB)
        safe = tl.where(scale == 0.0, 1.0, scale)
        x3 = tl.reshape(x, (ROWS // BLOCK, BLOCK, BLOCK_D))
        y3 = tl.math.div_rn(x3, tl.broadcast_to(safe[:, None, None], x3.shape))
        y = tl.reshape(y3, (ROWS, BLOCK_D))
        tl.store(out + rows.to(tl.int64)[:, None] * so_s + d[None, :] * so_d, _to_8bit(y, INT8, QMAX, INTERPRET),
                 mask=ok)
    # the zero padding of the scale row (at most 3 entries), by the row's last program
    pad = NB + tl.arange(0, 4)
    tl.store(scales + pad, tl.full((4,), 0.0, tl.float32), mask=(pad < NB4) & (pid_t == tl.num_programs(1) - 1))


@triton.jit
def _quantize_channels(x_ptr, part_ptr, data_ptr, scale_ptr, H, S, S_OUT, D, NC,
                       sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, so_d,
                       ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NC_PAD: tl.constexpr, QMAX: tl.constexpr,
                       INV_QMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-channel e4m3 data of ``ROWS`` tokens of one (b, h), the channel amax the max of ``part[b, h, :NC, :]``.

    Writes ``scale[b, h, :] = amax · INV_QMAX`` (contiguous ``(B, H, D)``, by the first tile's program) and
    ``data = x / scale`` at the output strides for tokens ``< S_OUT`` (tokens ``S..S_OUT``, the sequence-major
    padding, are zeros). Grid ``(B·H, ceil(S_OUT / ROWS))``.
    """
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    base = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    out = data_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    rows = pid_t * ROWS + tl.arange(0, ROWS)
    ok = (rows < S)[:, None] & d_ok[None, :]
    x = tl.load(base + rows.to(tl.int64)[:, None] * sx_s + d[None, :] * sx_d, mask=ok, other=0.0)  # before the
    c = tl.arange(0, NC_PAD)  # scales' reduction, so the two latencies overlap
    part = tl.load(part_ptr + (pid_bh.to(tl.int64) * NC + c[:, None]) * D + d[None, :],
                   mask=(c < NC)[:, None] & d_ok[None, :], other=0.0)
    amax = _max(part, 0, INTERPRET)
    scale = amax * INV_QMAX
    tl.store(scale_ptr + pid_bh.to(tl.int64) * D + d, scale, mask=d_ok & (pid_t == 0))
    safe = tl.where(scale == 0.0, 1.0, scale)
    y = tl.math.div_rn(x.to(tl.float32), tl.broadcast_to(safe[None, :], (ROWS, BLOCK_D)))
    tl.store(out + rows.to(tl.int64)[:, None] * so_s + d[None, :] * so_d, _to_8bit(y, False, QMAX, INTERPRET),
             mask=(rows < S_OUT)[:, None] & d_ok[None, :])
