"""gluon_sage's producer warp: the Q tiles once, then K (and its scales) and V tiles into the shared-memory rings."""

from ._gluon import gl, jit, mbarrier, quantizes_q, tma


@jit
def _produce_tile(j, descs, smem, bars, coords, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  KS_TMA: gl.constexpr, PERMUTED: gl.constexpr):
    """Tile ``j``'s K (with its scales) and V, each into its ring slot once the consumers have freed it.
    ``PERMUTED``: K through the permuting 5-D view (:func:`_permuted_k`), for full tiles only."""
    q_desc, k_desc, v_desc, ks_desc, kp_desc = descs
    q_smem, k_smem, v_smem, ks_smem, ones_smem = smem
    q_bar, k_ready, v_ready, kv_free = bars
    b, hk, ks_base, kp_x, kp_g, kv0 = coords
    slot = j % STAGES
    phase = (j // STAGES) & 1
    # a fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait
    mbarrier.wait(kv_free.index(slot), phase ^ 1)  # event j - STAGES: tile j - STAGES's K slot is free
    if KS_TMA:
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ks_desc, [ks_base + j * (BLOCK_N // K_BLOCK)], k_ready.index(slot),
                                        ks_smem.index(j % (2 * STAGES)))
    else:
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    if PERMUTED:
        tma.async_copy_global_to_shared(kp_desc, [kp_g + j * (BLOCK_N // 16), 0, 0, 0, kp_x], k_ready.index(slot),
                                        k_smem.index(slot).reshape(kp_desc.block_type.shape))
    else:
        tma.async_copy_global_to_shared(k_desc, [b, hk, kv0 + j * BLOCK_N, 0], k_ready.index(slot),
                                        k_smem.index(slot))
    # event j - STAGES + 1: tile j - STAGES's V slot is free (events before 0 count as passed)
    mbarrier.wait(kv_free.index((j + 1) % STAGES), (((j + 1) // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, hk, 0, kv0 + j * BLOCK_N], v_ready.index(slot), v_smem.index(slot))


@jit
def _producer(args, flags):
    """Producer warp: the Q tiles once (not when Q is bf16/fp16 with int8 K: the consumers quantize it), then K and V
    tiles into their rings (:func:`_produce_tile`); the last
    (maybe partial) tile's K always through the plain descriptor."""
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    KS_TMA: gl.constexpr = flags.KS_TMA
    PERMK: gl.constexpr = flags.PERMK
    SPLIT_TAIL: gl.constexpr = flags.SPLIT_TAIL
    descs, smem, bars, ptrs, ints, qk_scale, _ = args
    q_desc = descs[0]
    q_smem = smem[0]
    q_bar = bars[0]
    (_, _, _, stride_ksb, stride_ksh, _, _, _, _, _, _, _, _, _, SEQ_KV, b, h, hk, start_m, kp_xh, kp_gb,
     kp_gh, kv0, _, _) = ints
    # K scales' flat offset of this head (KS_TMA) and the permuted view's coordinates of this head (PERMK), both
    # at this CTA's first key kv0 (0 but in a split tail's pieces: a multiple of BLOCK_N and of K_BLOCK)
    ks_base = b * stride_ksb + hk * stride_ksh
    kp_g = b * kp_gb + hk * kp_gh
    if SPLIT_TAIL:
        if K_BLOCK > 0:
            ks_base += kv0 // K_BLOCK
        kp_g += kv0 // 16
    else:
        kv0 = 0
    coords = (b, hk, ks_base, hk * kp_xh, kp_g, kv0)
    BM: gl.constexpr = q_desc.block_type.shape[2]

    NC: gl.constexpr = q_smem.type.shape[0]  # consumer warpgroups: one Q tile each
    if not quantizes_q(q_desc.dtype, descs[1].dtype):
        mbarrier.expect(q_bar, NC * q_desc.block_type.nbytes)
        for i in gl.static_range(NC):
            tma.async_copy_global_to_shared(q_desc, [b, h, start_m + i * BM, 0], q_bar, q_smem.index(i))
    n_tiles = gl.cdiv(SEQ_KV, BLOCK_N)
    for j in range(n_tiles - 1):
        _produce_tile(j, descs, smem, bars, coords, K_BLOCK, BLOCK_N, STAGES, KS_TMA, PERMK)
    _produce_tile(n_tiles - 1, descs, smem, bars, coords, K_BLOCK, BLOCK_N, STAGES, KS_TMA, 0)
