"""gluon_sage's consumer partition: Q·Kᵀ, the online softmax and P·V per tile, and the epilogue.

Each consumer warpgroup owns 64 query rows (:func:`_consume`: the row scales, then :func:`_mainloop` over the key
tiles and :func:`_epilogue`, FlashAttention-3's split); the loop's steps are small functions: K scales
(:func:`_tile_k_scales` and the ahead/at-use pair), the key bias (:func:`_key_bias`), the softmax halves
(:func:`_scale_logits`, :func:`_running_max`, :func:`_exp_sum`), the MMAs (:func:`_qk`, :func:`_pv_issue`) and the
two schedules' steps (:func:`_softmax_pv`, :func:`_ahead_step`). The algebra's constants come from
:mod:`qattn_fx.kernels._sage_common`.
"""

from ._gluon import (async_copy, constexpr_function, fence_async_shared, gl, jit, mbarrier, quantizes_q,
                     warpgroup_mma, warpgroup_mma_wait)
from .._sage_common import C_INT8_ACC_BITS, C_INT8_ACC_OFFSET, C_INV_127, C_LN2, C_LOG2_448, C_LOG2E


@constexpr_function
def _mma_layout(num_warps, n, k_bits):
    """wgmma accumulator layout: ``num_warps`` warps along M, instruction ``m16 x n x (256 / bits)``."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 256 // k_bits])


# ------------------------------------------------------------------------------------------------------------------
# Consumer helpers
# ------------------------------------------------------------------------------------------------------------------


@jit
def _load_k_scales(ks_ptr, stride_ksn, start_n, SEQ_KV, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr,
                   K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """K scales of the tile at ``start_n`` from global memory (the path when they cannot come by TMA):

    * ``1 < k_block < BLOCK_N`` dividing it: ``(BLOCK_N / k_block,)`` group scales in ``GROUP_LAYOUT``;
    * other ``k_block`` not a multiple of ``BLOCK_N`` (e.g. 1): ``(BLOCK_N,)`` column scales in ``COL_LAYOUT``;
    * ``k_block`` a multiple of ``BLOCK_N``: one scalar; ``k_block == 0``: 1.0 (folded into the row scale).

    Per-column/group scales are cut to 22 significant bits so that ``1.5·2^23 · ks`` is exact (see triton_sage).
    """
    if K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N:
        offs_g = start_n // K_BLOCK + gl.arange(0, BLOCK_N // K_BLOCK, layout=GROUP_LAYOUT)
        ks = gl.load(ks_ptr + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    elif K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=COL_LAYOUT)
        ks = gl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    elif K_BLOCK > 0:
        ks = gl.load(ks_ptr + (start_n // K_BLOCK) * stride_ksn)
    else:
        ks = 1.0
    return ks


@jit
def _tile_k_scales(j, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, flags):
    """K scales of tile ``j`` (:func:`_load_k_scales`' shapes and layouts); ``ksrc``: ``(ks_ptr, stride_ksn, ks_smem,
    SEQ_KV)``; ``flags``: the kernel's :class:`~.state.KernelFlags` (``K_BLOCK``, ``BLOCK_N``, ``STAGES``,
    ``KS_TMA``). ``KS_TMA``: the producer brought them into the ``2·STAGES``-deep ring ``ks_smem`` with the K tile
    (same ``k_ready`` barrier), so the caller must have waited for tile ``j``'s K (its slot may already be
    released); a shared-memory broadcast read instead of masked global loads (zeros past the tensor; values past
    ``SEQ_KV`` only meet masked columns). Else a global load (issue it a tile ahead of use)."""
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    ks_ptr, stride_ksn, ks_smem, SEQ_KV = ksrc
    if flags.KS_TMA:
        tile = ks_smem.index(j % (2 * flags.STAGES))
        if K_BLOCK > 1 and tile.shape[0] > BLOCK_N // K_BLOCK:  # the box is padded to 128 bytes
            ks = tile.slice(0, BLOCK_N // K_BLOCK).load(GROUP_LAYOUT)
        elif K_BLOCK > 1:
            ks = tile.load(GROUP_LAYOUT)
        else:
            ks = tile.load(COL_LAYOUT)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    else:
        ks = _load_k_scales(ks_ptr, stride_ksn, j * BLOCK_N, SEQ_KV, COL_LAYOUT, GROUP_LAYOUT, K_BLOCK, BLOCK_N)
    return ks


@jit
def _k_scales_ahead(j, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, flags):
    """Issued a tile ahead of use: tile ``j``'s K scales from global memory, or (``KS_TMA``) a placeholder, the
    scales being read from the ring at use (:func:`_k_scales_at_use`); carried through the loop either way."""
    if flags.KS_TMA:
        return 0.0
    else:
        return _tile_k_scales(j, ksrc, COL_LAYOUT, GROUP_LAYOUT, flags)


@jit
def _k_scales_at_use(j, ks, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, flags):
    """Tile ``j``'s K scales where ``S_j`` is scaled: ``ks`` from :func:`_k_scales_ahead`, or read from the ring."""
    if flags.KS_TMA:
        return _tile_k_scales(j, ksrc, COL_LAYOUT, GROUP_LAYOUT, flags)
    else:
        return ks


@constexpr_function
def _scales_read_early(KS_TMA, K_BLOCK):
    """Whether the ``ahead`` schedule reads tile ``j+1``'s K scales from the TMA ring as soon as its K tile has
    arrived (one step before use) rather than at use: for group scales (``k_block > 1``: a few registers per
    thread); per-column scales (32 registers per thread) carried across a step make ptxas spill."""
    return bool(KS_TMA) and K_BLOCK > 1


@jit
def _key_bias(j, kbsrc, COL_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr,
              PERMK: gl.constexpr = 0):
    """Tile ``j``'s key bias in log2 units, ``(BLOCK_N,)`` in ``COL_LAYOUT`` (``-inf`` past ``SEQ_KV``): a global
    load at use (32 registers per thread at BLOCK_N 128: carried a tile ahead, they made ptxas spill); 0.0 without
    ``HAS_BIAS``. ``kbsrc``: ``(kb_ptr, SEQ_KV)``. ``PERMK``: the tile's K rows were loaded permuted, so column
    ``16g + 8i + 2c + e`` of ``S`` holds key ``16g + 4c + 2i + e`` (:func:`_pv_issue`): the bias is loaded as
    ``(BLOCK_N / 16, 16)`` keys in order, in the layout that the inverse relabeling turns into ``COL_LAYOUT``
    (each thread's 4 keys per group contiguous: plain vector loads), then relabeled; else column ``n`` is key
    ``n``."""
    if HAS_BIAS:
        kb_ptr, SEQ_KV = kbsrc
        if PERMK:
            G: gl.constexpr = BLOCK_N // 16
            key_layout: gl.constexpr = gl.reshape(gl.permute(gl.reshape(
                gl.zeros([BLOCK_N], gl.float32, COL_LAYOUT), [G, 2, 4, 2]), [0, 2, 1, 3]), [G, 16]).type.layout
            offs = (j * BLOCK_N + gl.arange(0, G, layout=gl.SliceLayout(1, key_layout))[:, None] * 16
                    + gl.arange(0, 16, layout=gl.SliceLayout(0, key_layout))[None, :])
            kb = gl.load(kb_ptr + offs, mask=offs < SEQ_KV, other=float("-inf"))
            kb = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(kb, [G, 4, 2, 2]), [0, 2, 1, 3]), [BLOCK_N]),
                                   COL_LAYOUT, assert_trivial=True) * C_LOG2E
        else:
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=COL_LAYOUT)
            kb = gl.load(kb_ptr + offs_n, mask=offs_n < SEQ_KV, other=float("-inf")) * C_LOG2E
    else:
        kb = 0.0
    return kb


@jit
def _row_reduce(x, IS_MAX: gl.constexpr):
    """Max or sum over axis 1 of a ``(64, BLOCK_N)`` wgmma-layout tile."""
    if IS_MAX:
        return gl.max(x, axis=1)
    else:
        return gl.sum(x, axis=1)


@jit
def _scale_logits(s, ks, rs, QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """The raw ``S`` tile (int32 ``S + 1.5·2^23`` for int8 Q/K, else fp32) with the K scales applied: ``(t, rs)``,
    ``rs`` (64,) being ``q_scale · sm_scale · log2 e`` times K's scale when it is one per tile. ``ks``: the tile's
    K scales (:func:`_tile_k_scales`). Reads every register of ``S``, which the next Q·Kᵀ may then reuse."""
    s_layout: gl.constexpr = s.type.layout
    PER_COL: gl.constexpr = K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0
    GROUPED: gl.constexpr = K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N
    if QK_KIND == 0:
        t = s.to(gl.float32, bitcast=True)  # = S + 1.5·2^23 exactly (|S| < 2^22)
    else:
        t = s
    if GROUPED:
        t3 = gl.reshape(t, [t.shape[0], BLOCK_N // K_BLOCK, K_BLOCK])  # a relabeling of registers
        ks3 = ks[None, :, None]
        if QK_KIND == 0:
            t3 = gl.fma(t3, ks3, -(ks3 * C_INT8_ACC_OFFSET))  # round(S · ks) in one fma (ks has 22 significant bits)
        else:
            t3 = t3 * ks3
        t = gl.convert_layout(gl.reshape(t3, [t.shape[0], BLOCK_N]), s_layout, assert_trivial=True)
    elif PER_COL:
        if QK_KIND == 0:
            t = gl.fma(t, ks[None, :], -(ks * C_INT8_ACC_OFFSET)[None, :])
        else:
            t = t * ks[None, :]
    else:
        if QK_KIND == 0:
            t = t - C_INT8_ACC_OFFSET
        if K_BLOCK > 0:  # one K scale for the whole tile
            rs = rs * ks
    return t, rs


@jit
def _add_bias(t, rs, kb, HAS_BIAS: gl.constexpr):
    """``HAS_BIAS``: the tile's logits in log2 units with the key bias, ``z = t · rs + kb`` (``kb``:
    :func:`_key_bias`, ``-inf`` past ``SEQ_KV``), computed once in ``t``'s registers so that ``kb`` is dead before
    the row max; else ``t`` as it is."""
    if HAS_BIAS:
        return t * rs[:, None] + kb[None, :]
    else:
        return t


@jit
def _tile_max(t, rs, start_n, SEQ_KV, BLOCK_N: gl.constexpr, MASK: gl.constexpr, HAS_BIAS: gl.constexpr = 0):
    """Each row's largest logit (log2 units) in the scaled tile ``t`` (``MASK``: columns past ``SEQ_KV`` ignored).
    ``HAS_BIAS``: ``t`` is :func:`_add_bias`'s ``z``, already in log2 units and masked."""
    if HAS_BIAS:
        return _row_reduce(t, True)
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, t.type.layout))
        t_max = _row_reduce(gl.where((offs_n < SEQ_KV)[None, :], t, float("-inf")), True)
    else:
        t_max = _row_reduce(t, True)
    return t_max * rs  # scales are >= 0, so max(t · rs) = max(t) · rs


@jit
def _running_max(t, rs, m_i, start_n, SEQ_KV, BLOCK_N: gl.constexpr, MASK: gl.constexpr, HAS_BIAS: gl.constexpr = 0):
    """The new running max ``m`` (log2 units) after the scaled tile ``t``: :func:`_tile_max`'s, then the max."""
    return gl.maximum(m_i, _tile_max(t, rs, start_n, SEQ_KV, BLOCK_N, MASK, HAS_BIAS))


@jit
def _logits_max(s, ks, kb, m_i, rs, start_n, SEQ_KV, QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr,
                BLOCK_N: gl.constexpr, MASK: gl.constexpr, HAS_BIAS: gl.constexpr = 0):
    """First half of an online-softmax step: :func:`_scale_logits` (and :func:`_add_bias`) then
    :func:`_running_max`; ``(t, rs, m)``."""
    t, rs = _scale_logits(s, ks, rs, QK_KIND, K_BLOCK, BLOCK_N)
    t = _add_bias(t, rs, kb, HAS_BIAS)
    return t, rs, _running_max(t, rs, m_i, start_n, SEQ_KV, BLOCK_N, MASK, HAS_BIAS)


@jit
def _exp_sum(t, rs, m_new, m_i, l_i, start_n, SEQ_KV, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
             MMASUM: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0):
    """Second half: ``(p8, alpha, l)``: e4m3 ``448 · exp2(z - m)`` (0 past ``SEQ_KV`` when ``MASK``), the factor
    rescaling earlier tiles, row sum (``MMASUM``: ``l`` is returned as given; the P·V step's ones-MMA sums P).
    ``HAS_BIAS``: ``t`` is :func:`_add_bias`'s ``z``, and a running max of ``-inf`` (every key so far masked) is
    used as 0, so such rows get P = 0 and alpha = 0 instead of NaN."""
    if HAS_BIAS:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(t - (m_use - C_LOG2_448)[:, None])
        alpha = gl.exp2(m_i - m_use)
    else:
        p = gl.exp2(t * rs[:, None] - (m_new - C_LOG2_448)[:, None])  # 448 · exp2(z - m)
        if MASK:
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, t.type.layout))
            p = gl.where((offs_n < SEQ_KV)[None, :], p, 0.0)
        alpha = gl.exp2(m_i - m_new)
    if not MMASUM:
        l_i = l_i * alpha + _row_reduce(p, False)
    return p.to(gl.float8e4nv), alpha, l_i


@jit
def _softmax(s, ks, kb, m_i, l_i, rs, start_n, SEQ_KV,
             QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
             MMASUM: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0):
    """One online-softmax step (:func:`_logits_max` then :func:`_exp_sum`); returns ``(p8, alpha, l, m)``."""
    t, rs_t, m_new = _logits_max(s, ks, kb, m_i, rs, start_n, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, MASK, HAS_BIAS)
    p8, alpha, l_i = _exp_sum(t, rs_t, m_new, m_i, l_i, start_n, SEQ_KV, BLOCK_N, MASK, MMASUM, HAS_BIAS)
    return p8, alpha, l_i, m_new


@constexpr_function
def _sum_layout(num_warps):
    """Accumulator layout of the ones-MMA (``mmasum``): ``(64, 8)`` fp32, every column the row sum of P."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 32])


@jit
def _fill_ones(ones_smem):
    """Write e4m3 1.0 into this consumer's ``(8, BLOCK_N)`` ones buffer (the ones-MMA's B operand, K-major: 8
    "channels" of ones over the tile's keys), fence it for the async proxy and synchronize the warpgroup. Once per
    CTA. The barrier here is what Triton's barrier analysis would otherwise place inside the tile loop, before every
    ones-MMA (the store still pending on the loop's entry path): a warpgroup ``bar.sync`` per tile."""
    BN: gl.constexpr = ones_smem.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, BN // 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    ones_smem.store(gl.full([8, BN], 0x38, gl.int8, layout).to(gl.float8e4nv, bitcast=True))  # e4m3 1.0
    fence_async_shared()
    gl.thread_barrier()


@jit
def _quantize_q_rows(q_ptr, stride_b, stride_h, stride_s, b, h, row0, SEQ_Q, q_tile, ROW_LAYOUT: gl.constexpr):
    """Rows ``row0 + [0, BM)`` of head ``(b, h)`` of a bf16/fp16 Q quantized to int8 per token, exactly as
    ``qattn::quantize_per_block(q, 1, int8)`` (:mod:`qattn_fx.formats`): scale ``= max|x| · fp32(1/127)`` (one
    rounded multiply), data ``= x · (1 / scale)`` (the IEEE reciprocal per row, then one multiply per element; a
    zero scale counts as 1) rounded to nearest even and saturated to ±127; rows past ``SEQ_Q`` are zeros. The data
    goes to ``q_tile`` (this warpgroup's ``(BM, D)`` wgmma A operand in shared memory), fenced for the async proxy;
    returns the scales in ``ROW_LAYOUT``. Once per CTA, while the producer's first K/V tiles are in flight."""
    BM: gl.constexpr = q_tile.type.shape[0]
    D: gl.constexpr = q_tile.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])  # 16-byte loads, row-major
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    base = q_ptr + b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h
    x = gl.load(base + rows.to(gl.int64)[:, None] * stride_s + cols[None, :], mask=(rows < SEQ_Q)[:, None],
                other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(x), axis=1)
    scale = amax * C_INV_127
    inverse = gl.div_rn(gl.full_like(scale, 1.0), gl.where(scale == 0.0, 1.0, scale))
    y = x * inverse[:, None]
    y = gl.minimum(gl.maximum(y, -127.0), 127.0)
    # |y| <= 127 < 2^22: adding and taking away 1.5·2^23 rounds to an integer, ties to even (torch.round)
    q_tile.store(((y + C_INT8_ACC_OFFSET) - C_INT8_ACC_OFFSET).to(gl.int8))
    fence_async_shared()
    return gl.convert_layout(scale, ROW_LAYOUT)


# ------------------------------------------------------------------------------------------------------------------
# Partitions
# ------------------------------------------------------------------------------------------------------------------


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
              PERMK: gl.constexpr = 0, ones_smem=None, l_zero=None, MMASUM: gl.constexpr = 0):
    """Issue (async) ``P8 · V8`` of tile ``j`` into a fresh fp32 accumulator, P being the register A operand
    (converted to the wgmma operand layout). ``PERMK``: the tile's K rows were loaded permuted
    (:func:`_permuted_k`), so accumulator column ``16h + 8i + 2c + e`` holds key ``16h + 4c + 2i + e``: relabeling
    P's registers puts every key at its operand position (no shuffles).

    Returns ``(pv, pl)``: ``MMASUM`` also issues ``P8 · 1`` (B: ``ones_smem``, ``(8, BLOCK_N)`` e4m3 ones) into
    a fresh ``(64, 8)`` accumulator ``pl``, every column of which is the row sum of the e4m3 P that P·V multiplies
    (accumulated over the tile as P·V's own products are); else ``pl`` is 0."""
    slot = j % STAGES
    v_tile = v_smem.index(slot).reshape([pv_zero.type.shape[1], BLOCK_N]).permute((1, 0))
    if PERMK:  # keys back in operand order (a relabeling of P's registers)
        BM: gl.constexpr = p8.type.shape[0]
        p8 = gl.reshape(gl.permute(gl.reshape(p8, [BM, BLOCK_N // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]),
                        [BM, BLOCK_N])
        p_op = gl.convert_layout(p8, p_layout, assert_trivial=True)
    else:
        p_op = gl.convert_layout(p8, p_layout)
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    pv = warpgroup_mma(p_op, v_tile, pv_zero, use_acc=False, is_async=True)
    if MMASUM:
        p_l = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=l_zero.type.layout,
                                                          k_width=4), assert_trivial=True)
        pl = warpgroup_mma(p_l, ones_smem.permute((1, 0)), l_zero, use_acc=False, is_async=True)
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
def _softmax_pv(j, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready, kv_free,
                p_layout: gl.constexpr, row_o: gl.constexpr, flags, MASK: gl.constexpr, LAST: gl.constexpr,
                PERMK: gl.constexpr, sums, BIAS: gl.constexpr):
    """Softmax of tile ``j`` and its P·V (waited), added to ``acc`` in fp32 (two-level accumulation). ``LAST``:
    the row's last tile, whose V slot is released here (event ``j + 1``); otherwise the next Q·Kᵀ releases it.
    ``flags``: the kernel's :class:`~.state.KernelFlags` (``PERMK`` apart: the last tile is loaded in key order;
    ``BIAS`` apart: whether this tile adds the key bias ``kb``); ``sums``: ``(ones_smem, l_zero)`` of the
    ``MMASUM`` row sums (:func:`_pv_issue`)."""
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    MMASUM: gl.constexpr = flags.MMASUM
    p8, alpha, l_i, m_i = _softmax(s, ks, kb, m_i, l_i, rs, j * BLOCK_N, SEQ_KV, flags.QK_KIND, flags.K_BLOCK,
                                   BLOCK_N, MASK, MMASUM, BIAS)
    pv, pl = _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout, BLOCK_N, flags.STAGES, PERMK, sums[0], sums[1],
                       MMASUM)
    if MMASUM:
        pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pl))
    else:
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    if LAST:
        _release(j + 1, kv_free, flags.STAGES, flags.TARRIVE)
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
    return m_i, l_i, acc


@jit
def _softmax_pv_skip(j, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready, kv_free, skip,
                     p_layout: gl.constexpr, row_o: gl.constexpr, flags, MASK: gl.constexpr, LAST: gl.constexpr,
                     PERMK: gl.constexpr, sums, BIAS: gl.constexpr):
    """:func:`_softmax_pv` behind Skip-Softmax's tile test (:mod:`qattn_fx.skip_softmax`): when every valid row of
    this warpgroup has ``max z - m < log2 λ`` (``m``: the running max before the tile), the exponentials and P·V
    are not run and ``m``, ``l``, ``acc`` stay as they were; only V's ready barrier is waited (the ring's protocol:
    a slot is released once its load has landed). ``skip``: ``(log2 λ, row_out, count_ptrs, count_mask)``:
    ``row_out`` marks rows past ``SEQ_Q`` (they do not vote); ``flags.SKIP == 2`` also adds 1 per skipped tile at
    ``count_ptrs`` (one lane: ``count_mask``). The test is one compare per row and a warpgroup-wide min."""
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    MMASUM: gl.constexpr = flags.MMASUM
    log2_thr, row_out, count_ptrs, count_mask = skip
    t, rs_t = _scale_logits(s, ks, rs, flags.QK_KIND, flags.K_BLOCK, BLOCK_N)
    t = _add_bias(t, rs_t, kb, BIAS)
    tile_max = _tile_max(t, rs_t, j * BLOCK_N, SEQ_KV, BLOCK_N, MASK, BIAS)
    vote = ((tile_max - m_i) < log2_thr) | row_out  # NaN (a row with every key so far masked) votes no
    if gl.min(vote.to(gl.int32), axis=0) == 0:  # some row needs the tile
        m_new = gl.maximum(m_i, tile_max)
        p8, alpha, l_i = _exp_sum(t, rs_t, m_new, m_i, l_i, j * BLOCK_N, SEQ_KV, BLOCK_N, MASK, MMASUM, BIAS)
        pv, pl = _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout, BLOCK_N, STAGES, PERMK, sums[0], sums[1],
                           MMASUM)
        if MMASUM:
            pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pl))
        else:
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
        m_i = m_new
    else:
        mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
        if flags.SKIP == 2:
            gl.atomic_add(count_ptrs, gl.full(count_ptrs.type.shape, 1, gl.int32, count_mask.type.layout),
                          mask=count_mask)
    if LAST:
        _release(j + 1, kv_free, STAGES, flags.TARRIVE)
    return m_i, l_i, acc


@jit
def _ahead_step(j, s, ks, m_i, l_i, acc, q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem, k_ready, kv_free,
                v_ready, ksrc, kbsrc, p_layout: gl.constexpr, row_o: gl.constexpr, col_s: gl.constexpr,
                grp_layout: gl.constexpr, flags, sums, BIAS: gl.constexpr):
    """Full tile ``j`` (``S`` given) with tile ``j+1``'s Q·Kᵀ in flight during its softmax; returns ``S_{j+1}``
    and (:func:`_k_scales_ahead`) tile ``j+1``'s K scales. ``flags``, ``sums``: as :func:`_softmax_pv`'s; with
    ``BIAS`` the tile's key bias (:func:`_key_bias`) is added to its logits."""
    QK_KIND: gl.constexpr = flags.QK_KIND
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    KS_TMA: gl.constexpr = flags.KS_TMA
    MMASUM: gl.constexpr = flags.MMASUM
    if KS_TMA:
        EARLY: gl.constexpr = _scales_read_early(KS_TMA, K_BLOCK)
        if not EARLY:  # else ks holds tile j's scales, read from the ring in the previous step
            ks = _k_scales_at_use(j, ks, ksrc, col_s, grp_layout, flags)
        t, rs_t = _scale_logits(s, ks, rs, QK_KIND, K_BLOCK, BLOCK_N)  # first: S_{j+1} then takes S_j's registers
        s_next = _qk_issue(j + 1, q, s_init, k_smem, k_ready, QK_KIND, BLOCK_N, STAGES)
        if EARLY:  # tile j+1's K and scales have arrived (waited just above): the shared load's latency then
            # passes under this tile's exponentials instead of stalling the next tile's scaling
            ks_next = _tile_k_scales(j + 1, ksrc, col_s, grp_layout, flags)
        else:
            ks_next = _k_scales_ahead(j + 1, ksrc, col_s, grp_layout, flags)
    else:  # the global load first, as early as possible (this order measured ~10 % faster for this path)
        ks_next = _k_scales_ahead(j + 1, ksrc, col_s, grp_layout, flags)
        s_next = _qk_issue(j + 1, q, s_init, k_smem, k_ready, QK_KIND, BLOCK_N, STAGES)
        t, rs_t = _scale_logits(s, ks, rs, QK_KIND, K_BLOCK, BLOCK_N)
    t = _add_bias(t, rs_t, _key_bias(j, kbsrc, col_s, BLOCK_N, BIAS, flags.PERMK), BIAS)
    m_new = _running_max(t, rs_t, m_i, j * BLOCK_N, SEQ_KV, BLOCK_N, False, BIAS)
    p8, alpha, l_i = _exp_sum(t, rs_t, m_new, m_i, l_i, j * BLOCK_N, SEQ_KV, BLOCK_N, False, MMASUM, BIAS)
    m_i = m_new
    pv, pl = _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout, BLOCK_N, STAGES, flags.PERMK, sums[0], sums[1],
                       MMASUM)
    if MMASUM:
        s_next, pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, pv, pl))
    else:
        s_next, pv = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, pv))
    _release(j + 1, kv_free, STAGES, flags.TARRIVE)  # tile j+1's K slot and tile j's V slot: one barrier, one arrive
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
    return m_i, l_i, acc, s_next, ks_next


@jit
def _serial_tiles(j0, j1, ks, m_i, l_i, acc, loop_args, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
                  col_s: gl.constexpr, grp_layout: gl.constexpr, SKIP: gl.constexpr, BIAS: gl.constexpr):
    """Full tiles ``[j0, j1)`` of the serial schedule (``SKIP``: behind Skip-Softmax's test; ``BIAS``: adding the
    key bias); ``ks``: tile ``j0``'s K scales as :func:`_k_scales_ahead` gives them; returns ``(ks, m, l, acc)``,
    ``ks`` being tile ``j1``'s."""
    q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem, k_ready, kv_free, v_ready, ksrc, kbsrc, skip, sums = loop_args
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    for j in range(j0, j1):
        ks_next = _k_scales_ahead(j + 1, ksrc, col_s, grp_layout, flags)
        s = _qk(j, q, s_init, k_smem, k_ready, kv_free, flags.QK_KIND, BLOCK_N, flags.STAGES, flags.TARRIVE)
        ks = _k_scales_at_use(j, ks, ksrc, col_s, grp_layout, flags)
        kb = _key_bias(j, kbsrc, col_s, BLOCK_N, BIAS, flags.PERMK)
        if SKIP:
            m_i, l_i, acc = _softmax_pv_skip(j, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready,
                                             kv_free, skip, p_layout, row_o, flags, False, False, flags.PERMK, sums,
                                             BIAS)
        else:
            m_i, l_i, acc = _softmax_pv(j, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready, kv_free,
                                        p_layout, row_o, flags, False, False, flags.PERMK, sums, BIAS)
        ks = ks_next
    return ks, m_i, l_i, acc


@jit
def _ahead_tiles(j0, j1, s, ks, m_i, l_i, acc, loop_args, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
                 col_s: gl.constexpr, grp_layout: gl.constexpr, BIAS: gl.constexpr):
    """Full tiles ``[j0, j1)`` of the ``ahead`` schedule (:func:`_ahead_step`; ``BIAS``: adding the key bias),
    ``s`` and ``ks`` being tile ``j0``'s; returns ``(m, l, acc, s, ks)`` with tile ``j1``'s ``s`` and ``ks``."""
    q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem, k_ready, kv_free, v_ready, ksrc, kbsrc, skip, sums = loop_args
    for j in range(j0, j1):
        m_i, l_i, acc, s, ks = _ahead_step(j, s, ks, m_i, l_i, acc, q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem,
                                           k_ready, kv_free, v_ready, ksrc, kbsrc, p_layout, row_o, col_s,
                                           grp_layout, flags, sums, BIAS)
    return m_i, l_i, acc, s, ks


@jit
def _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, loop_args, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
              col_s: gl.constexpr, grp_layout: gl.constexpr, SKIP: gl.constexpr):
    """Every key tile of this warpgroup's rows, Q·Kᵀ through P·V: the ``ahead`` or the serial schedule (``SKIP``:
    the serial one with Skip-Softmax's test, :func:`_softmax_pv_skip`; 0 even in a Skip-Softmax kernel: the loop
    without it); ``flags``: the kernel's :class:`~.state.KernelFlags`; returns ``(m, l, acc)`` for the epilogue.
    ``n_tiles``: ``cdiv(SEQ_KV, BLOCK_N)``; ``bias_tiles``: ``(b0, b1)``, with ``HAS_BIAS`` the full tiles
    ``[b0, b1)`` add the key bias and the others run without it (their bias is 0);
    ``loop_args``: ``(q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem, k_ready, kv_free, v_ready, ksrc, kbsrc,
    skip, sums)``, ``ksrc``, ``kbsrc``, ``skip`` and ``sums`` being the sources of the K scales, the key bias, the
    test and the ``MMASUM`` sums."""
    q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem, k_ready, kv_free, v_ready, ksrc, kbsrc, skip, sums = loop_args
    QK_KIND: gl.constexpr = flags.QK_KIND
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    KS_TMA: gl.constexpr = flags.KS_TMA
    TARRIVE: gl.constexpr = flags.TARRIVE
    HAS_BIAS: gl.constexpr = flags.HAS_BIAS
    # Tiles 0 .. n_tiles-2 are full; the last one is masked (a branch per tile inside the loop miscompiles in
    # Triton 3.6's Gluon: wrong values on the H200, so the tail is peeled, and the biased tiles run in a loop of
    # their own). K scales: _k_scales_ahead(j) a tile before use, _k_scales_at_use(j, ks) where S_j is scaled.
    ks = _k_scales_ahead(0, ksrc, col_s, grp_layout, flags)
    if flags.AHEAD:
        s = _qk(0, q, s_init, k_smem, k_ready, kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
        if _scales_read_early(KS_TMA, K_BLOCK):  # the ahead steps carry the scales of the tile they get S of
            ks = _tile_k_scales(0, ksrc, col_s, grp_layout, flags)
        if HAS_BIAS:
            b0, b1 = bias_tiles
            m_i, l_i, acc, s, ks = _ahead_tiles(0, b0, s, ks, m_i, l_i, acc, loop_args, flags, p_layout, row_o,
                                                col_s, grp_layout, 0)
            m_i, l_i, acc, s, ks = _ahead_tiles(b0, b1, s, ks, m_i, l_i, acc, loop_args, flags, p_layout, row_o,
                                                col_s, grp_layout, 1)
            m_i, l_i, acc, s, ks = _ahead_tiles(b1, n_tiles - 1, s, ks, m_i, l_i, acc, loop_args, flags, p_layout,
                                                row_o, col_s, grp_layout, 0)
        else:
            m_i, l_i, acc, s, ks = _ahead_tiles(0, n_tiles - 1, s, ks, m_i, l_i, acc, loop_args, flags, p_layout,
                                                row_o, col_s, grp_layout, 0)
    else:
        if HAS_BIAS:
            b0, b1 = bias_tiles
            ks, m_i, l_i, acc = _serial_tiles(0, b0, ks, m_i, l_i, acc, loop_args, flags, p_layout, row_o, col_s,
                                              grp_layout, SKIP, 0)
            ks, m_i, l_i, acc = _serial_tiles(b0, b1, ks, m_i, l_i, acc, loop_args, flags, p_layout, row_o, col_s,
                                              grp_layout, SKIP, 1)
            ks, m_i, l_i, acc = _serial_tiles(b1, n_tiles - 1, ks, m_i, l_i, acc, loop_args, flags, p_layout,
                                              row_o, col_s, grp_layout, SKIP, 0)
        else:
            ks, m_i, l_i, acc = _serial_tiles(0, n_tiles - 1, ks, m_i, l_i, acc, loop_args, flags, p_layout, row_o,
                                              col_s, grp_layout, SKIP, 0)
        s = _qk(n_tiles - 1, q, s_init, k_smem, k_ready, kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
    # the last (masked) tile
    if not (flags.AHEAD and _scales_read_early(KS_TMA, K_BLOCK)):  # (else ks already holds the last tile's scales)
        ks = _k_scales_at_use(n_tiles - 1, ks, ksrc, col_s, grp_layout, flags)
    kb = _key_bias(n_tiles - 1, kbsrc, col_s, BLOCK_N, HAS_BIAS)
    if SKIP:
        m_i, l_i, acc = _softmax_pv_skip(n_tiles - 1, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem,
                                         v_ready, kv_free, skip, p_layout, row_o, flags, True, True, 0, sums,
                                         HAS_BIAS)
    else:
        m_i, l_i, acc = _softmax_pv(n_tiles - 1, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready,
                                    kv_free, p_layout, row_o, flags, True, True, 0, sums, HAS_BIAS)

    return m_i, l_i, acc


@jit
def _epilogue(m_i, l_i, acc, epi_args, flags, CID: gl.constexpr, NC: gl.constexpr, o_layout: gl.constexpr,
              row_s: gl.constexpr, row_o: gl.constexpr):
    """O = acc · v_scale / l into ``Out`` (the 448s of P and l cancel), the LSE with ``RETURN_LSE``, and a split
    tail piece's O and LSE into the workspace. ``epi_args``: ``(VS, Out, Lse, OutWs, LseWs, stride_vsb,
    stride_vsh, stride_vsd, stride_ob, stride_oh, stride_os, H, SEQ_Q, b, h, hk, row0, offs_m, m_valid, piece)``."""
    (VS, Out, Lse, OutWs, LseWs, stride_vsb, stride_vsh, stride_vsd, stride_ob, stride_oh, stride_os, H, SEQ_Q, b, h,
     hk, row0, offs_m, m_valid, piece) = epi_args
    BM: gl.constexpr = offs_m.shape[0]
    HEAD_DIM_V: gl.constexpr = acc.shape[1]
    RETURN_LSE: gl.constexpr = flags.RETURN_LSE
    MMASUM: gl.constexpr = flags.MMASUM
    SPLIT_TAIL: gl.constexpr = flags.SPLIT_TAIL
    HAS_BIAS: gl.constexpr = flags.HAS_BIAS
    offs_dv = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
    vs = gl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd)
    if MMASUM:  # its 8 columns hold the same sums: take one (max: exact)
        l_i = gl.convert_layout(gl.max(l_i, axis=1), row_s)
    if HAS_BIAS:  # a row whose keys are all masked has l = 0 (and acc = 0): its output is 0, as SDPA's
        inv_l = gl.convert_layout(gl.where(l_i == 0.0, 0.0, 1.0 / gl.where(l_i == 0.0, 1.0, l_i)), row_o)
    else:
        inv_l = gl.convert_layout(1.0 / l_i, row_o)
    out = acc * inv_l[:, None] * vs[None, :]
    offs_mo = row0 + gl.arange(0, BM, layout=row_o)
    o_ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + offs_mo.to(gl.int64)[:, None] * stride_os + offs_dv[None, :])
    o_mask = (offs_mo < SEQ_Q)[:, None]
    if SPLIT_TAIL:
        o_mask = o_mask & (piece < 0)  # a piece of a split tail CTA (piece >= 0) writes to the workspace instead
        m_valid = m_valid & (piece < 0)
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    if RETURN_LSE or SPLIT_TAIL:
        lse = (m_i + gl.log2(l_i) - C_LOG2_448) * C_LN2
    if RETURN_LSE:
        gl.store(Lse + (b.to(gl.int64) * H + h) * SEQ_Q + offs_m, lse, mask=m_valid)
    if SPLIT_TAIL:  # the piece's normalized fp32 O and its LSE, rows CID·64 + [0, 64) of workspace row block piece
        ws_o = piece.to(gl.int64) * (NC * BM) + CID * BM + gl.arange(0, BM, layout=row_o)
        gl.store(OutWs + ws_o[:, None] * HEAD_DIM_V + offs_dv[None, :], out, mask=(ws_o >= 0)[:, None])
        ws_s = piece.to(gl.int64) * (NC * BM) + CID * BM + gl.arange(0, BM, layout=row_s)
        gl.store(LseWs + ws_s, lse, mask=ws_s >= 0)


@jit
def _consume(st, CID: gl.constexpr):
    """Consumer warpgroup ``CID``: rows ``start_m + 64·CID + [0, 64)``: their row scales (quantizing Q when the
    kernel does), then :func:`_mainloop` and :func:`_epilogue`. ``st``: the :class:`~.state.KernelState`; its
    flags' ``SKIP`` (serial schedules only): every tile behind Skip-Softmax's test (:func:`_softmax_pv_skip`; 2:
    counting skipped tiles) unless λ is 0."""
    flags = st.flags
    bufs = st.bufs
    ptrs = st.ptrs
    prog = st.prog
    QK_KIND: gl.constexpr = flags.QK_KIND
    Q_BLOCK: gl.constexpr = flags.Q_BLOCK
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    MMASUM: gl.constexpr = flags.MMASUM
    SPLIT_TAIL: gl.constexpr = flags.SPLIT_TAIL
    SKIP: gl.constexpr = flags.SKIP
    q_desc = bufs.q_desc
    k_desc = bufs.k_desc
    b = prog.b
    h = prog.h
    hk = prog.hk
    kv0 = prog.kv0
    SEQ_Q = prog.SEQ_Q
    SEQ_KV = prog.kv_len
    stride_ksn = prog.stride_ksn
    qk_scale = prog.qk_scale

    BM: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    HEAD_DIM_V: gl.constexpr = bufs.v_desc.block_type.shape[2]
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_N, k_desc.dtype.primitive_bitwidth)
    QUANT_Q: gl.constexpr = quantizes_q(q_desc.dtype, k_desc.dtype)  # this warpgroup quantizes its Q rows itself
    o_layout: gl.constexpr = _mma_layout(NW, HEAD_DIM_V, 8)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    if QK_KIND == 0:
        s_init = gl.full([BM, BLOCK_N], C_INT8_ACC_BITS, gl.int32, s_layout)  # S + 1.5·2^23 read as fp32
    else:
        s_init = gl.zeros([BM, BLOCK_N], gl.float32, s_layout)
    G: gl.constexpr = BLOCK_N // K_BLOCK if K_BLOCK > 0 else 1
    grp_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.reshape(
        gl.zeros([BM, BLOCK_N], gl.float32, s_layout), [BM, G, BLOCK_N // G]).type.layout))
    pv_zero = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)

    # ---- row scale: q_scale · sm_scale · log2(e) (· K's scale when it is per head/tensor) ---------------------
    row0 = prog.start_m + CID * BM
    offs_m = row0 + gl.arange(0, BM, layout=row_s)
    m_valid = offs_m < SEQ_Q
    ks_ptr = ptrs.KS + b * prog.stride_ksb + hk * prog.stride_ksh
    if SPLIT_TAIL and K_BLOCK > 0:  # a tail piece's keys start at kv0 (a multiple of K_BLOCK); its K scales there
        ks_ptr += (kv0 // K_BLOCK) * stride_ksn
    kb_ptr = ptrs.KB + b * prog.stride_kbb
    if SPLIT_TAIL:
        kb_ptr += kv0
    q = bufs.q_smem.index(CID).reshape([BM, HEAD_DIM])
    if QK_KIND == 2:
        rs = gl.full([BM], 0.0, gl.float32, row_s) + qk_scale
    elif QUANT_Q:  # QS: the bf16/fp16 Q itself, its (batch, head, token) strides in stride_qs*
        rs = _quantize_q_rows(ptrs.QS, prog.stride_qsb, prog.stride_qsh, prog.stride_qsn, b, h, row0, SEQ_Q, q,
                              row_s) * qk_scale
        if K_BLOCK == 0:
            rs = rs * gl.load(ks_ptr)
    else:
        qs_ptr = ptrs.QS + b * prog.stride_qsb + h * prog.stride_qsh
        if Q_BLOCK == 0:
            rs = gl.full([BM], 0.0, gl.float32, row_s) + gl.load(qs_ptr) * qk_scale
        else:
            rs = gl.load(qs_ptr + (offs_m // Q_BLOCK) * prog.stride_qsn, mask=m_valid, other=0.0) * qk_scale
        if K_BLOCK == 0:
            rs = rs * gl.load(ks_ptr)

    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    acc = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)
    if MMASUM:  # the running denominator: a (64, 8) tile of the ones-MMA's layout, every column the same
        l_zero = gl.zeros([BM, 8], gl.float32, _sum_layout(NW))
        l_i = l_zero
        ones = bufs.ones_smem.index(CID)
        _fill_ones(ones)
    else:
        l_zero = pv_zero  # unused
        l_i = gl.full([BM], 0.0, gl.float32, row_s)
        ones = bufs.ones_smem  # unused
    sums = (ones, l_zero)
    n_tiles = gl.cdiv(SEQ_KV, BLOCK_N)
    ksrc = (ks_ptr, stride_ksn, bufs.ks_smem, SEQ_KV)
    kbsrc = (kb_ptr, SEQ_KV)
    if flags.HAS_BIAS:  # the full tiles that meet the keys with a nonzero bias (from kv0, a split piece's first key)
        kbr = ptrs.KBR + 2 * gl.where(prog.stride_kbb != 0, b, 0)
        b0 = gl.minimum(gl.maximum(gl.load(kbr) - kv0, 0) // BLOCK_N, n_tiles - 1)
        b1 = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(gl.load(kbr + 1) - kv0, 0), BLOCK_N), b0), n_tiles - 1)
        bias_tiles = (b0, b1)
    else:
        bias_tiles = (0, 0)  # unused
    if SKIP:  # (log2 λ, rows past SEQ_Q, the skip counter per lane, the one lane that counts)
        count_lane = (offs_m == row0) & (row0 < SEQ_Q)
        skip = (gl.load(prog.skip_thr), offs_m >= SEQ_Q, prog.skip_count + offs_m * 0, count_lane)
    else:
        skip = (0.0, 0.0, 0.0, 0.0)  # unused
    if not QUANT_Q:
        mbarrier.wait(bufs.q_bar, 0)
    loop_args = (q, rs, s_init, pv_zero, SEQ_KV, bufs.k_smem, bufs.v_smem, bufs.k_ready, bufs.kv_free, bufs.v_ready,
                 ksrc, kbsrc, skip, sums)
    epi_args = (ptrs.VS, ptrs.Out, ptrs.Lse, ptrs.OutWs, ptrs.LseWs, prog.stride_vsb, prog.stride_vsh,
                prog.stride_vsd, prog.stride_ob, prog.stride_oh, prog.stride_os, prog.H, SEQ_Q, b, h, hk, row0,
                offs_m, m_valid, prog.piece)
    NC: gl.constexpr = bufs.q_smem.type.shape[0]
    # Skip-Softmax with λ = 0 (log2 λ = -inf: nothing can be skipped, e.g. the steps before disabled_until_timestep)
    # runs the loop without the test, which costs 11-13 % (docs/kernel-design.md); each branch has its own epilogue
    # (one join after both loops made ptxas spill 1516 bytes in trio's consumers, 456 with two epilogues)
    if SKIP and skip[0] != float("-inf"):
        m_i, l_i, acc = _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, loop_args, flags, p_layout, row_o, col_s,
                                  grp_layout, SKIP)
        _epilogue(m_i, l_i, acc, epi_args, flags, CID, NC, o_layout, row_s, row_o)
    else:
        m_i, l_i, acc = _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, loop_args, flags, p_layout, row_o, col_s,
                                  grp_layout, 0)
        _epilogue(m_i, l_i, acc, epi_args, flags, CID, NC, o_layout, row_s, row_o)
