"""gluon_sage's consumer mainloop (FlashAttention-3's split: :mod:`.consumer` prologue, this loop,
:mod:`.epilogue`): the MMAs and slot releases (:func:`_qk`, :func:`_pv_issue`, :func:`_release`), one tile's softmax
and P·V (:func:`_softmax_pv`, behind Skip-Softmax's test :func:`_softmax_pv_skip`), the ``ahead`` step
(:func:`_ahead_step`), and the loops over the key tiles (:func:`_mainloop`).

A step takes the tile's visit position ``i`` (what the rings' slots, phases and release events count) and its key
tile ``j`` (keys ``j · BLOCK_N + [0, BLOCK_N)`` from the CTA's first key): the same number but in block-sparse
launches, whose CTAs visit the listed tiles only (:func:`.sparse._key_tile`).
"""

from ._gluon import async_copy, gl, jit, mbarrier, sum_layout, warpgroup_mma, warpgroup_mma_wait
from .sparse import Visits, _key_tile
from .state import _SCALAR, _named
from .softmax import (KeyBias, KeyScales, _add_bias, _exp_sum, _k_scales_ahead, _k_scales_at_use, _key_bias,
                      _running_max, _scale_logits, _scales_read_early, _softmax, _tile_k_scales, _tile_max)


@_named
class SkipTest:
    """Skip-Softmax's tile test for one consumer warpgroup (:func:`_softmax_pv_skip`): ``log2_thr`` (``log2 λ``),
    ``row_out`` (its rows past ``SEQ_Q``: they do not vote), and with ``SKIP == 2`` the skipped-tile counter
    ``count_ptrs`` that one lane, ``count_lane``, adds to; constexpr zeros in a launch without the test."""
    log2_thr: _SCALAR
    row_out: _SCALAR
    count_ptrs: _SCALAR
    count_lane: _SCALAR


@_named
class RowSums:
    """``MMASUM``'s row sums (:func:`_pv_issue`): the ``(8, BLOCK_N)`` e4m3 ones in ``ones`` and the ``(64, 8)`` fp32
    accumulator's zero ``l_zero``; aliases, unused, without ``MMASUM``."""
    ones: gl.shared_memory_descriptor
    l_zero: gl.tensor


@_named
class TileLoop:
    """What every key-tile step of one consumer warpgroup reads: its Q tile ``q`` (shared memory), row scales
    ``rs`` (``q_scale · sm_scale · log2 e``, times K's scale when it is one per head), the accumulators' initial
    values ``s_init`` (int8: ``1.5·2^23`` read as fp32) and ``pv_zero``, the CTA's keys ``SEQ_KV``, the K/V rings
    and their barriers, and the sources of the K scales ``ksrc`` (:class:`~.softmax.KeyScales`) and of the key bias
    ``kbsrc`` (:class:`~.softmax.KeyBias`), Skip-Softmax's test ``skip`` (:class:`SkipTest`), ``MMASUM``'s row
    sums ``sums`` (:class:`RowSums`), the key tiles visited, ``visits`` (:class:`~.sparse.Visits`; unused in a
    dense launch), and ``first``, the ring position of the work item's first visit (0 but in a persistent launch, whose
    CTAs count their rings across items, :mod:`.schedule`)."""
    q: gl.shared_memory_descriptor
    rs: gl.tensor
    s_init: gl.tensor
    pv_zero: gl.tensor
    SEQ_KV: gl.tensor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    kv_free: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    ksrc: KeyScales
    kbsrc: KeyBias
    skip: SkipTest
    sums: RowSums
    visits: Visits
    first: gl.tensor | gl.constexpr


@jit
def _release(i, kv_free, STAGES: gl.constexpr, TARRIVE: gl.constexpr):
    """Release event ``i`` of this consumer: tile ``i``'s K slot and tile ``i-1``'s V slot are free (both are
    released at the same point of every schedule, so one mbarrier per slot, ``kv_free[i % STAGES]`` with count 2,
    serves both rings: one warpgroup barrier and one arrive per tile instead of two of each)."""
    if TARRIVE:
        # every thread arrives by itself (cp.async.mbarrier.arrive.noinc: with no cp.async in flight, at once), so
        # no warpgroup bar.sync precedes it as it does Gluon's one-thread mbarrier.arrive; count 128 per consumer
        async_copy.mbarrier_arrive(kv_free.index(i % STAGES), increment_count=False)
    else:
        mbarrier.arrive(kv_free.index(i % STAGES), count=1)


@jit
def _qk(j, q, s_init, k_smem, k_ready, kv_free, QK_KIND: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, TARRIVE: gl.constexpr):
    """``S`` of tile ``j`` (wgmma from shared memory, waited), then release event ``j`` (tile ``j``'s K slot and
    tile ``j-1``'s V slot, whose P·V the caller has waited for)."""
    s = _qk_issue(j, q, s_init, k_smem, k_ready, QK_KIND, BLOCK_N, STAGES)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    _release(j, kv_free, STAGES, TARRIVE)
    return s


@jit
def _qk_issue(j, q, s_init, k_smem, k_ready, QK_KIND: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue (async) ``S`` of tile ``j``; the caller waits for it and releases the K slot."""
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, q.type.shape[1]]).permute((1, 0)), s_init,
                         use_acc=QK_KIND == 0, is_async=True)


@jit
def _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              PERMK: gl.constexpr = 0, ones_smem=None, l_zero=None, MMASUM: gl.constexpr = 0, ACC: gl.constexpr = 0):
    """Issue (async) ``P8 · V8`` of tile ``j`` into a fresh fp32 accumulator ``pv_zero`` (``ACC``: added to the
    accumulator ``pv_zero`` holds, an earlier tile's P·V of the same ``pair`` step), P being the register A operand
    (converted to the wgmma operand layout). ``PERMK``: the tile's K rows were loaded permuted
    (:func:`_permuted_k`), so accumulator column ``16h + 8i + 2c + e`` holds key ``16h + 4c + 2i + e``: relabeling
    P's registers puts every key at its operand position (no shuffles).

    Returns ``(pv, pl)``: ``MMASUM`` also issues ``P8 · 1`` (B: ``ones_smem``, ``(8, BLOCK_N)`` e4m3 ones) into
    a fresh (``ACC``: into ``l_zero``'s) ``(64, 8)`` accumulator ``pl``, every column of which is the row sum of the
    e4m3 P that P·V multiplies (accumulated over the tile as P·V's own products are); else ``pl`` is 0."""
    slot = j % STAGES
    v_tile = v_smem.index(slot).reshape([v_smem.type.shape[3], BLOCK_N]).permute((1, 0))
    if PERMK:  # keys back in operand order (a relabeling of P's registers)
        BM: gl.constexpr = p8.type.shape[0]
        p8 = gl.reshape(gl.permute(gl.reshape(p8, [BM, BLOCK_N // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]),
                        [BM, BLOCK_N])
        p_op = gl.convert_layout(p8, p_layout, assert_trivial=True)
    else:
        p_op = gl.convert_layout(p8, p_layout)
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    pv = warpgroup_mma(p_op, v_tile, pv_zero, use_acc=ACC == 1, is_async=True)
    if MMASUM:
        p_l = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=sum_layout(gl.num_warps()),
                                                          k_width=4), assert_trivial=True)
        pl = warpgroup_mma(p_l, ones_smem.permute((1, 0)), l_zero, use_acc=ACC == 1, is_async=True)
    else:
        pl = 0.0
    return pv, pl


@jit
def _accumulate(acc, l_i, alpha, pv, pl, row_o: gl.constexpr, MMASUM: gl.constexpr):
    """``acc · alpha + pv`` (fp32: the two-level accumulation) and, with ``MMASUM``, ``l · alpha + pl`` (``l`` a
    ``(64, 8)`` tile, each column the running denominator)."""
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
    if MMASUM:
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + pl
    return acc, l_i


@jit
def _softmax_pv(i, j, s, ks, kb, m_i, l_i, acc, lp, p_layout: gl.constexpr, row_o: gl.constexpr, flags,
                MASK: gl.constexpr, LAST: gl.constexpr, PERMK: gl.constexpr, BIAS: gl.constexpr):
    """Softmax of key tile ``j`` (visit ``i``) and its P·V (waited), added to ``acc`` in fp32 (two-level
    accumulation). ``LAST``: the row's last tile, whose V slot is released here (event ``i + 1``); otherwise the
    next Q·Kᵀ releases it.
    ``flags``: the kernel's :class:`~.state.KernelFlags` (``PERMK`` apart: the last tile is loaded in key order;
    ``BIAS`` apart: whether this tile adds the key bias ``kb``); ``lp``: the warpgroup's :class:`TileLoop` (its
    ``sums``: :class:`RowSums`, :func:`_pv_issue`)."""
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    MMASUM: gl.constexpr = flags.MMASUM
    p8, alpha, l_i, m_i = _softmax(s, ks, kb, m_i, l_i, lp.rs, j * BLOCK_N, lp.SEQ_KV, flags.QK_KIND, flags.K_BLOCK,
                                   BLOCK_N, MASK, MMASUM, BIAS)
    pv, pl = _pv_issue(i, p8, lp.pv_zero, lp.v_smem, lp.v_ready, p_layout, BLOCK_N, flags.STAGES, PERMK,
                       lp.sums.ones, lp.sums.l_zero, MMASUM)
    if MMASUM:
        pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pl))
    else:
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    if LAST:
        _release(i + 1, lp.kv_free, flags.STAGES, flags.TARRIVE)
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
    return m_i, l_i, acc


@jit
def _softmax_pv_skip(i, j, s, ks, kb, m_i, l_i, acc, lp, p_layout: gl.constexpr, row_o: gl.constexpr, flags,
                     MASK: gl.constexpr, LAST: gl.constexpr, PERMK: gl.constexpr, BIAS: gl.constexpr):
    """:func:`_softmax_pv` behind Skip-Softmax's tile test (:mod:`qattn_fx.skip_softmax`): when every valid row of
    this warpgroup has ``max z - m < log2 λ`` (``m``: the running max before the tile), the exponentials and P·V
    are not run and ``m``, ``l``, ``acc`` stay as they were; only V's ready barrier is waited (the ring's protocol:
    a slot is released once its load has landed). ``lp.skip``: :class:`SkipTest` (``log2 λ``, the rows past
    ``SEQ_Q``, which do not vote); ``flags.SKIP == 2`` also adds 1 per skipped tile at its ``count_ptrs`` (one
    lane: ``count_lane``). The test is one compare per row and a warpgroup-wide min."""
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    MMASUM: gl.constexpr = flags.MMASUM
    skip = lp.skip
    t, rs_t = _scale_logits(s, ks, lp.rs, flags.QK_KIND, flags.K_BLOCK, BLOCK_N)
    t = _add_bias(t, rs_t, kb, BIAS)
    tile_max = _tile_max(t, rs_t, j * BLOCK_N, lp.SEQ_KV, BLOCK_N, MASK, BIAS)
    vote = ((tile_max - m_i) < skip.log2_thr) | skip.row_out  # NaN (a row with every key so far masked) votes no
    if gl.min(vote.to(gl.int32), axis=0) == 0:  # some row needs the tile
        m_new = gl.maximum(m_i, tile_max)
        p8, alpha, l_i = _exp_sum(t, rs_t, m_new, m_i, l_i, j * BLOCK_N, lp.SEQ_KV, BLOCK_N, MASK, MMASUM, BIAS)
        pv, pl = _pv_issue(i, p8, lp.pv_zero, lp.v_smem, lp.v_ready, p_layout, BLOCK_N, STAGES, PERMK,
                           lp.sums.ones, lp.sums.l_zero, MMASUM)
        if MMASUM:
            pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pl))
        else:
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
        m_i = m_new
    else:
        mbarrier.wait(lp.v_ready.index(i % STAGES), (i // STAGES) & 1)
        if flags.SKIP == 2:
            gl.atomic_add(skip.count_ptrs, gl.full(skip.count_ptrs.type.shape, 1, gl.int32,
                                                   skip.count_lane.type.layout), mask=skip.count_lane)
    if LAST:
        _release(i + 1, lp.kv_free, STAGES, flags.TARRIVE)
    return m_i, l_i, acc


@jit
def _ahead_step(i, j, j_next, s, ks, m_i, l_i, acc, lp, p_layout: gl.constexpr, row_o: gl.constexpr,
                col_s: gl.constexpr, grp_layout: gl.constexpr, flags, BIAS: gl.constexpr):
    """Full key tile ``j`` (visit ``i``, ``S`` given) with the next visit's (key tile ``j_next``) Q·Kᵀ in flight
    during its softmax; returns that ``S`` and (:func:`_k_scales_ahead`) its K scales. ``flags``, ``lp``: as
    :func:`_softmax_pv`'s; with ``BIAS`` the tile's key bias (:func:`_key_bias`) is added to its logits."""
    QK_KIND: gl.constexpr = flags.QK_KIND
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    MMASUM: gl.constexpr = flags.MMASUM
    if flags.KS_TMA:
        EARLY: gl.constexpr = _scales_read_early(flags.KS_TMA, flags.K_BLOCK)
        if not EARLY:  # else ks holds tile j's scales, read from the ring in the previous step
            ks = _k_scales_at_use(i, j, ks, lp.ksrc, col_s, grp_layout, flags)
        # first: S_{j+1} then takes S_j's registers
        t, rs_t = _scale_logits(s, ks, lp.rs, QK_KIND, flags.K_BLOCK, BLOCK_N)
        s_next = _qk_issue(i + 1, lp.q, lp.s_init, lp.k_smem, lp.k_ready, QK_KIND, BLOCK_N, STAGES)
        if EARLY:  # tile j+1's K and scales have arrived (waited just above): the shared load's latency then
            # passes under this tile's exponentials instead of stalling the next tile's scaling
            ks_next = _tile_k_scales(i + 1, j_next, lp.ksrc, col_s, grp_layout, flags)
        else:
            ks_next = _k_scales_ahead(i + 1, j_next, lp.ksrc, col_s, grp_layout, flags)
    else:  # the global load first, as early as possible (this order measured faster for this path)
        ks_next = _k_scales_ahead(i + 1, j_next, lp.ksrc, col_s, grp_layout, flags)
        s_next = _qk_issue(i + 1, lp.q, lp.s_init, lp.k_smem, lp.k_ready, QK_KIND, BLOCK_N, STAGES)
        t, rs_t = _scale_logits(s, ks, lp.rs, QK_KIND, flags.K_BLOCK, BLOCK_N)
    t = _add_bias(t, rs_t, _key_bias(j, lp.kbsrc, col_s, BLOCK_N, BIAS, flags.PERMK), BIAS)
    m_new = _running_max(t, rs_t, m_i, j * BLOCK_N, lp.SEQ_KV, BLOCK_N, False, BIAS)
    p8, alpha, l_i = _exp_sum(t, rs_t, m_new, m_i, l_i, j * BLOCK_N, lp.SEQ_KV, BLOCK_N, False, MMASUM, BIAS)
    m_i = m_new
    pv, pl = _pv_issue(i, p8, lp.pv_zero, lp.v_smem, lp.v_ready, p_layout, BLOCK_N, STAGES, flags.PERMK,
                       lp.sums.ones, lp.sums.l_zero, MMASUM)
    if MMASUM:
        s_next, pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, pv, pl))
    else:
        s_next, pv = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, pv))
    _release(i + 1, lp.kv_free, STAGES, flags.TARRIVE)  # tile j+1's K slot and tile j's V slot: one barrier, one arrive
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
    return m_i, l_i, acc, s_next, ks_next


@jit
def _serial_tiles(j0, j1, ks, m_i, l_i, acc, lp, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
                  col_s: gl.constexpr, grp_layout: gl.constexpr, SKIP: gl.constexpr, BIAS: gl.constexpr):
    """Full tiles at visits ``[j0, j1)`` of the serial schedule (``SKIP``: behind Skip-Softmax's test; ``BIAS``:
    adding the key bias); ``ks``: visit ``j0``'s K scales as :func:`_k_scales_ahead` gives them; returns ``(ks, m,
    l, acc)``, ``ks`` being visit ``j1``'s."""
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    for i in range(j0, j1):
        j = _key_tile(i - lp.first, lp.visits, flags)
        ks_next = _k_scales_ahead(i + 1, _key_tile(i + 1 - lp.first, lp.visits, flags), lp.ksrc, col_s, grp_layout,
                                  flags)
        s = _qk(i, lp.q, lp.s_init, lp.k_smem, lp.k_ready, lp.kv_free, flags.QK_KIND, BLOCK_N, flags.STAGES,
                flags.TARRIVE)
        ks = _k_scales_at_use(i, j, ks, lp.ksrc, col_s, grp_layout, flags)
        kb = _key_bias(j, lp.kbsrc, col_s, BLOCK_N, BIAS, flags.PERMK)
        if SKIP:
            m_i, l_i, acc = _softmax_pv_skip(i, j, s, ks, kb, m_i, l_i, acc, lp, p_layout, row_o, flags, False,
                                             False, flags.PERMK, BIAS)
        else:
            m_i, l_i, acc = _softmax_pv(i, j, s, ks, kb, m_i, l_i, acc, lp, p_layout, row_o, flags, False, False,
                                        flags.PERMK, BIAS)
        ks = ks_next
    return ks, m_i, l_i, acc


@jit
def _ahead_tiles(j0, j1, s, ks, m_i, l_i, acc, lp, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
                 col_s: gl.constexpr, grp_layout: gl.constexpr, BIAS: gl.constexpr):
    """Full tiles at visits ``[j0, j1)`` of the ``ahead`` schedule (:func:`_ahead_step`; ``BIAS``: adding the key
    bias), ``s`` and ``ks`` being visit ``j0``'s; returns ``(m, l, acc, s, ks)`` with visit ``j1``'s ``s`` and
    ``ks``."""
    for i in range(j0, j1):
        m_i, l_i, acc, s, ks = _ahead_step(i, _key_tile(i - lp.first, lp.visits, flags),
                                           _key_tile(i + 1 - lp.first, lp.visits, flags), s,
                                           ks, m_i, l_i, acc, lp, p_layout, row_o, col_s, grp_layout, flags, BIAS)
    return m_i, l_i, acc, s, ks


@jit
def _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, lp, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
              col_s: gl.constexpr, grp_layout: gl.constexpr, SKIP: gl.constexpr):
    """Every key tile of this warpgroup's rows, Q·Kᵀ through P·V: the ``ahead`` or the serial schedule (``SKIP``:
    the serial one with Skip-Softmax's test, :func:`_softmax_pv_skip`; 0 even in a Skip-Softmax kernel: the loop
    without it); ``flags``: the kernel's :class:`~.state.KernelFlags`; returns ``(m, l, acc)`` for the epilogue.
    ``n_tiles``: ``cdiv(SEQ_KV, BLOCK_N)`` (``SPARSE``: the tiles visited, at least one); ``bias_tiles``: ``(b0,
    b1)``, with ``HAS_BIAS`` the full tiles at visits ``[b0, b1)`` add the key bias and the others run without it
    (their bias is 0);
    ``lp``: the warpgroup's :class:`TileLoop`."""
    QK_KIND: gl.constexpr = flags.QK_KIND
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    TARRIVE: gl.constexpr = flags.TARRIVE
    HAS_BIAS: gl.constexpr = flags.HAS_BIAS
    # Tiles 0 .. n_tiles-2 are full; the last one is masked (a branch per tile inside the loop miscompiles in
    # Triton 3.6's Gluon: wrong values on the H200, so the tail is peeled, and the biased tiles run in a loop of
    # their own). K scales: _k_scales_ahead(j) a tile before use, _k_scales_at_use(j, ks) where S_j is scaled.
    # Visits 0 .. n_tiles-1 in a block-sparse launch: its last visited tile is handled as the last tile.
    f = lp.first  # this work item's first visit position (0 but in a persistent launch)
    j0 = _key_tile(0, lp.visits, flags)
    ks = _k_scales_ahead(f, j0, lp.ksrc, col_s, grp_layout, flags)
    if flags.AHEAD:
        s = _qk(f, lp.q, lp.s_init, lp.k_smem, lp.k_ready, lp.kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
        # the ahead steps carry the scales of the tile they get S of
        if _scales_read_early(flags.KS_TMA, flags.K_BLOCK):
            ks = _tile_k_scales(f, j0, lp.ksrc, col_s, grp_layout, flags)
        if HAS_BIAS:
            b0, b1 = bias_tiles
            m_i, l_i, acc, s, ks = _ahead_tiles(f, f + b0, s, ks, m_i, l_i, acc, lp, flags, p_layout, row_o,
                                                col_s, grp_layout, 0)
            m_i, l_i, acc, s, ks = _ahead_tiles(f + b0, f + b1, s, ks, m_i, l_i, acc, lp, flags, p_layout, row_o,
                                                col_s, grp_layout, 1)
            m_i, l_i, acc, s, ks = _ahead_tiles(f + b1, f + n_tiles - 1, s, ks, m_i, l_i, acc, lp, flags, p_layout,
                                                row_o, col_s, grp_layout, 0)
        else:
            m_i, l_i, acc, s, ks = _ahead_tiles(f, f + n_tiles - 1, s, ks, m_i, l_i, acc, lp, flags, p_layout,
                                                row_o, col_s, grp_layout, 0)
    else:
        if HAS_BIAS:
            b0, b1 = bias_tiles
            ks, m_i, l_i, acc = _serial_tiles(f, f + b0, ks, m_i, l_i, acc, lp, flags, p_layout, row_o, col_s,
                                              grp_layout, SKIP, 0)
            ks, m_i, l_i, acc = _serial_tiles(f + b0, f + b1, ks, m_i, l_i, acc, lp, flags, p_layout, row_o, col_s,
                                              grp_layout, SKIP, 1)
            ks, m_i, l_i, acc = _serial_tiles(f + b1, f + n_tiles - 1, ks, m_i, l_i, acc, lp, flags, p_layout,
                                              row_o, col_s, grp_layout, SKIP, 0)
        else:
            ks, m_i, l_i, acc = _serial_tiles(f, f + n_tiles - 1, ks, m_i, l_i, acc, lp, flags, p_layout, row_o,
                                              col_s, grp_layout, SKIP, 0)
        s = _qk(f + n_tiles - 1, lp.q, lp.s_init, lp.k_smem, lp.k_ready, lp.kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
    # the last (masked) tile
    j_last = _key_tile(n_tiles - 1, lp.visits, flags)
    # (with the ahead schedule's early reads, ks already holds the last tile's scales)
    if not (flags.AHEAD and _scales_read_early(flags.KS_TMA, flags.K_BLOCK)):
        ks = _k_scales_at_use(f + n_tiles - 1, j_last, ks, lp.ksrc, col_s, grp_layout, flags)
    kb = _key_bias(j_last, lp.kbsrc, col_s, BLOCK_N, HAS_BIAS)
    # The last tile releases the event after it (its V slot; the K slot of a visit that does not exist) but in a
    # persistent launch, whose next item's first Q·Kᵀ releases that event: the rings count on across items
    RELEASE_LAST: gl.constexpr = 1 - flags.PERSIST
    if SKIP:
        m_i, l_i, acc = _softmax_pv_skip(f + n_tiles - 1, j_last, s, ks, kb, m_i, l_i, acc, lp, p_layout, row_o, flags,
                                         True, RELEASE_LAST, 0, HAS_BIAS)
    else:
        m_i, l_i, acc = _softmax_pv(f + n_tiles - 1, j_last, s, ks, kb, m_i, l_i, acc, lp, p_layout, row_o, flags, True,
                                    RELEASE_LAST, 0, HAS_BIAS)

    return m_i, l_i, acc

