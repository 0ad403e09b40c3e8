"""The Triton source of the predictor's selection (:mod:`.triton_select` loads it once per Triton mode, as
:mod:`.triton` loads the pooling kernel, so ``TRITON_INTERPRET=1`` set before the first call runs it under the
interpreter).

Only builtins (``tl.reduce``, ``tl.associative_scan``) and this file's own ``@jit`` helpers are called: ``tl.sum``,
``tl.max``, ``tl.cumsum`` and ``tl.sort`` are ``@jit`` functions of ``triton.language.standard``, compiled-mode
objects when triton was imported before ``TRITON_INTERPRET=1`` was set, which the interpreter cannot call. The rank
threshold is found by bisection instead of a sort (:func:`_select_rows`).
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum(x, axis):
    return tl.reduce(x, axis, _add)


@triton.jit
def _scores_by_rows(q_row, k_row, col_ok_row, row0, NQ, stride_q_n, stride_q_d, stride_k_d, D: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL_D: tl.constexpr):
    """``(ROWS, BLOCK_N)`` fp32 ``q̄ · k̄`` from one ``(1, BLOCK_N)`` row of k̄ per ``d`` and ``ROWS`` scalars of q̄: the
    accumulator keeps the row load's layout (no layout conversion, so no barrier, in the loop; the ``UNROLL_D`` steps'
    loads are all in flight at once). ``q_row``: query tile ``row0``'s q̄; ``k_row``: ``(1, BLOCK_N)`` pointers to
    each key tile's k̄ (masked by ``col_ok_row``)."""
    pick = tl.arange(0, ROWS)[:, None]
    acc = tl.full((ROWS, BLOCK_N), 0.0, tl.float32)
    for d0 in range(0, D, UNROLL_D):
        for dd in tl.static_range(UNROLL_D):
            d_ok = d0 + dd < D
            kd = tl.load(k_row + (d0 + dd) * stride_k_d, mask=col_ok_row & d_ok, other=0.0)
            qd = tl.full((ROWS, 1), 0.0, tl.float32)
            for r in tl.static_range(ROWS):
                q_r = tl.load(q_row + r * stride_q_n + (d0 + dd) * stride_q_d, mask=d_ok & (row0 + r < NQ),
                              other=0.0)
                qd = tl.where(pick == r, q_r, qd)
            acc += qd * kd
    return acc


@triton.jit
def _scores_by_dot(q_row, k_row, col_ok_row, row0, NQ, stride_q_n, stride_q_d, stride_k_d, D: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_scores_by_rows`' sums as FMA ``tl.dot`` s (fp32, ``ieee``: one FMA per ``d``, in order) of ``(ROWS,
    16)`` q̄ and ``(16, BLOCK_N)`` k̄ chunks, each a 2-D load: no scalar loads (``ROWS`` at least 16)."""
    dc = tl.arange(0, 16)
    q_rows = q_row + tl.arange(0, ROWS)[:, None].to(tl.int64) * stride_q_n
    q_ok = (row0 + tl.arange(0, ROWS) < NQ)[:, None]
    acc = tl.full((ROWS, BLOCK_N), 0.0, tl.float32)
    for d0 in range(0, D, 16):
        d_ok = d0 + dc < D
        qc = tl.load(q_rows + (d0 + dc)[None, :] * stride_q_d, mask=q_ok & d_ok[None, :], other=0.0)
        kc = tl.load(k_row + (d0 + dc)[:, None] * stride_k_d, mask=col_ok_row & d_ok[:, None], other=0.0)
        acc = tl.dot(qc, kc, acc, input_precision="ieee")
    return acc


@triton.jit
def _select_rows(q_ptr, q_sim_ptr, k_ptr, k_sim_ptr, kept_ptr, keep_ptr, index_ptr, count_ptr,
                 HQ, G, NQ, NK, SQ, SKV, ROW_BLOCKS,
                 stride_q_b, stride_q_h, stride_q_n, stride_q_d,
                 stride_k_b, stride_k_h, stride_k_n, stride_k_d,
                 stride_kept_b, sm_scale, keep_f32, keep_bits, similarity, sink_tiles,
                 D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr,
                 KEEP_ON_DEVICE: tl.constexpr, ALL: tl.constexpr, GUARD: tl.constexpr, DIAGONAL: tl.constexpr,
                 SLACK: tl.constexpr, BISECT_HI: tl.constexpr, BISECT_STEPS: tl.constexpr, TILE_Q: tl.constexpr,
                 TILE_K: tl.constexpr, UNROLL_D: tl.constexpr, DOT: tl.constexpr):
    """One program per (b, hq, ``ROWS`` query tiles): steps 2-5 of :mod:`.reference` for those query tiles over
    all ``NK`` key tiles (padded to ``BLOCK_N``, a power of two), writing ``index (B, HQ, NQ, NK)`` and ``count (B,
    HQ, NQ)`` int32 in :class:`~qattn_fx.block_sparse.Blocks` format.

    * Scores: ``q̄_i · k̄_j`` summed over ``d`` in order (one fp32 FMA per ``d``, the loads of ``UNROLL_D`` steps
      issued together; ``DOT``: as FMA ``tl.dot`` s of ``(ROWS, 16) x (16, BLOCK_N)`` chunks of ``d``, which sum in
      the same order), times ``sm_scale``; empty key tiles (``kept`` 0) at ``-inf``; softmax with a correctly
      rounded division; a row of no non-empty tile has probability 0 everywhere (the reference's ``nan_to_num``).
    * Rank: tile ``i`` is above tile ``j`` when ``p_i > p_j`` or ``p_i == p_j`` and ``i < j`` (a stable descending
      sort). For probabilities ``>= 0`` their fp32 bits order as integers, so with weights ``w`` (``p`` for cdf, 1 for
      top_k; 0 for empty tiles under cdf and for padding) and a budget (``keep``, or ``n_keep`` tiles) a tile is
      chosen iff the weight ranked above it is below the budget. ``F(P) = Σ_{bits_i > P} w_i`` falls as ``P`` grows,
      so the smallest ``P*`` with ``F(P*) < budget`` is found by bisection over ``[0, BISECT_HI]`` (the bits of 1.0;
      ``BISECT_STEPS`` halvings): tiles of bits above ``P*`` are chosen, below it not, and of the tiles of bits
      ``P*`` those whose ``F(P*)`` plus the exclusive prefix sum (by index) of their tied weights is below the
      budget. Sums of non-negative terms in a fixed order are monotone in which terms take part, so the rule is
      consistent; they differ from torch's cumsum of the sorted row only in fp32 summation order.
    * ``keep >= 1`` (``ALL``, a host keep; or read from ``keep_ptr`` on the device): every non-empty tile.
    * Guard, sinks, diagonal as the reference; empty tiles are never visited.
    * Lists: the visited tiles ascending at the inclusive prefix count of the visit mask minus one, ``-1`` after.
    """
    pid = tl.program_id(0)
    rb = pid % ROW_BLOCKS
    bh = pid // ROW_BLOCKS
    b = (bh // HQ).to(tl.int64)
    h = (bh % HQ).to(tl.int64)
    hk = h // G
    rows = rb * ROWS + tl.arange(0, ROWS)
    row_ok = rows < NQ
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < NK
    kept = tl.load(kept_ptr + b * stride_kept_b + cols, mask=col_ok, other=0) != 0
    kept2 = tl.broadcast_to(kept[None, :], (ROWS, BLOCK_N))
    if ALL:
        visit = kept2
    else:
        # step 2: scores and softmax
        row0 = rb * ROWS
        q_row = q_ptr + b * stride_q_b + h * stride_q_h + row0.to(tl.int64) * stride_q_n
        k_row = k_ptr + b * stride_k_b + hk * stride_k_h + tl.arange(0, BLOCK_N)[None, :].to(tl.int64) * stride_k_n
        col_ok_row = (tl.arange(0, BLOCK_N) < NK)[None, :]
        if DOT:
            acc = _scores_by_dot(q_row, k_row, col_ok_row, row0, NQ, stride_q_n, stride_q_d, stride_k_d, D, ROWS,
                                 BLOCK_N)
        else:
            acc = _scores_by_rows(q_row, k_row, col_ok_row, row0, NQ, stride_q_n, stride_q_d, stride_k_d, D, ROWS,
                                  BLOCK_N, UNROLL_D)
        scores = tl.where(kept2, acc * sm_scale, float("-inf"))
        top = tl.reduce(scores, 1, _max)
        any_kept = top > float("-inf")
        top = tl.where(any_kept, top, 0.0)
        e = tl.where(kept2, tl.exp(scores - top[:, None]), 0.0)
        den = tl.broadcast_to(tl.maximum(_sum(e, 1), 1e-30)[:, None], (ROWS, BLOCK_N))  # div_rn does not broadcast
        probs = tl.where(kept2, tl.div_rn(e, den), 0.0)
        # step 4: the rank threshold
        n = _sum(kept.to(tl.int32), 0)
        if KEEP_ON_DEVICE:
            keep = tl.load(keep_ptr).to(tl.float32)
            keep_d = keep.to(tl.float64)
        else:
            keep = keep_f32
            keep_d = (tl.full([], 0, tl.int64) + keep_bits).to(tl.float64, bitcast=True)  # the host's double
        if TOP_K:
            n_d = n.to(tl.float64)
            n_keep = tl.maximum(tl.ceil(n_d * keep_d - n_d * tl.full([], SLACK, tl.float64)), 1.0)
            budget = n_keep.to(tl.float32)
            w = tl.where(col_ok[None, :], 1.0, 0.0) + tl.full((ROWS, BLOCK_N), 0.0, tl.float32)
        else:
            budget = keep
            w = probs
        bits = probs.to(tl.int32, bitcast=True)
        lo = tl.full((ROWS,), 0, tl.int32)
        hi = tl.full((ROWS,), 0, tl.int32) + BISECT_HI
        for _ in range(0, BISECT_STEPS):
            mid = lo + (hi - lo) // 2
            above = _sum(tl.where(bits > mid[:, None], w, 0.0), 1)
            ok = above < budget
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        above = _sum(tl.where(bits > hi[:, None], w, 0.0), 1)
        tied = bits == hi[:, None]
        tied_w = tl.where(tied, w, 0.0)
        tied_before = tl.associative_scan(tied_w, 1, _add) - tied_w
        chosen = (bits > hi[:, None]) | (tied & (above[:, None] + tied_before < budget))
        visit = chosen & kept2
        if KEEP_ON_DEVICE:
            visit = tl.where(tl.full((ROWS, BLOCK_N), 0.0, tl.float32) + keep >= 1.0, kept2, visit)
        if GUARD:
            q_sim = tl.load(q_sim_ptr + (b * HQ + h) * NQ + rows, mask=row_ok, other=1.0)
            k_sim = tl.load(k_sim_ptr + (b * (HQ // G) + hk) * NK + cols, mask=col_ok, other=1.0)
            visit = visit | (q_sim < similarity)[:, None] | (k_sim < similarity)[None, :]
    # step 5: always kept
    visit = visit | (cols < sink_tiles)[None, :]
    if DIAGONAL:
        middle = tl.minimum(rows.to(tl.int64) * TILE_Q + TILE_Q // 2, SQ - 1)
        diag = (middle * SKV // SQ) // TILE_K
        visit = visit | (cols[None, :].to(tl.int64) == diag[:, None])
    visit = visit & kept2
    # the lists
    flags = visit.to(tl.int32)
    slot = tl.associative_scan(flags, 1, _add) - 1
    count = _sum(flags, 1)
    out_row = ((b * HQ + h) * NQ + rows.to(tl.int64)) * NK
    col2 = tl.broadcast_to(cols[None, :], (ROWS, BLOCK_N))
    ok2 = row_ok[:, None] & col_ok[None, :]
    tl.store(index_ptr + out_row[:, None] + slot, col2, mask=ok2 & visit)
    tl.store(index_ptr + out_row[:, None] + col2, tl.full((ROWS, BLOCK_N), -1, tl.int32),
             mask=ok2 & (col2 >= count[:, None]))
    tl.store(count_ptr + (b * HQ + h) * NQ + rows, count, mask=row_ok)
