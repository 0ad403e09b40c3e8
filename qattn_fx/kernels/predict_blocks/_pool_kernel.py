"""The Triton source of the predictor's pooling (:mod:`.triton` loads it once per Triton mode, as triton_sage loads
its kernel, so ``TRITON_INTERPRET=1`` set before the first call runs it under the interpreter)."""

import triton
import triton.language as tl


@triton.jit
def _sum(x, axis):
    """``tl.sum`` spelled as its reduction: ``tl.sum`` is itself a ``@jit`` function, a compiled-mode object when
    triton was imported before ``TRITON_INTERPRET=1`` was set, which the interpreter cannot call."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _pool_tiles(x_ptr, bias_ptr, mean_ptr, sim_ptr, kept_ptr, H, S, D, N,
                stride_b, stride_h, stride_s, stride_d, stride_bias_b, stride_bias_s, stride_mean_n, stride_mean_d,
                BIAS_ROWS, TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One program per (b, h, tile) of ``TILE`` tokens: the mean of the tile's kept tokens and ``‖mean(x · (1 /
    ‖x‖))‖²`` over them, in fp32, read in chunks of ``ROWS`` tokens. A token is kept when it is inside ``S`` and
    (with ``HAS_BIAS``) its ``key_bias`` is not ``-inf``; other tokens take no part, whatever their data. Writes
    ``mean (B, H, N, D)``, each (b, h) a block of ``N · D`` with strides ``stride_mean_n, stride_mean_d`` (``D, 1``
    or, for the selection kernel's column reads, ``1, N``), ``sim (B, H, N)``, contiguous, and with ``HAS_BIAS``
    ``kept (BIAS_ROWS, N)`` uint8, contiguous: whether the tile holds a kept token (the programs of head 0 and
    ``b < BIAS_ROWS``, the bias's batch rows, write it)."""
    pid = tl.program_id(0)
    tile = pid % N
    bh = pid // N
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    base = x_ptr + b * stride_b + h * stride_h
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # (ROWS, BLOCK_D) running sums, reduced over their rows once after the loop: a row sum per step would cross the
    # program's warps (its rows lie across them) through shared memory and a barrier before every next load
    total = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
    unit_total = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
    kept_rows = tl.full([ROWS], 0.0, tl.float32)
    for r0 in range(0, TILE, ROWS):
        rows = tile * TILE + r0 + tl.arange(0, ROWS)
        kept = rows < S
        if HAS_BIAS:
            bias = tl.load(bias_ptr + b * stride_bias_b + rows.to(tl.int64) * stride_bias_s, mask=kept, other=0.0)
            kept = kept & (bias > float("-inf"))
        x = tl.load(base + rows.to(tl.int64)[:, None] * stride_s + d[None, :] * stride_d,
                    mask=kept[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        # one correctly rounded reciprocal per token, then a multiply per element (the reference's x · (1 / ‖x‖))
        inverse = tl.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.maximum(tl.sqrt_rn(_sum(x * x, 1)), 1e-20))
        total += x
        unit_total += x * inverse[:, None]
        kept_rows += kept.to(tl.float32)
    kept_count = _sum(kept_rows, 0)
    if HAS_BIAS:
        tl.store(kept_ptr + b * N + tile, (kept_count > 0).to(tl.uint8), mask=(h == 0) & (b < BIAS_ROWS))
    count = tl.broadcast_to(tl.maximum(kept_count, 1.0), (BLOCK_D,))  # div_rn does not broadcast
    mean = tl.div_rn(_sum(total, 0), count)
    unit_mean = tl.div_rn(_sum(unit_total, 0), count)
    out = pid.to(tl.int64)
    tl.store(mean_ptr + bh.to(tl.int64) * N * D + tile * stride_mean_n + d * stride_mean_d, mean, mask=d_ok)
    tl.store(sim_ptr + out, _sum(unit_mean * unit_mean, 0))
