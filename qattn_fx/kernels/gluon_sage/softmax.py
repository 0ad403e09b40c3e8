"""gluon_sage's consumer steps on one S tile: its K scales (global loads or the TMA ring, :func:`_tile_k_scales`
and the ahead/at-use pair), its key bias (:func:`_key_bias`), and the online softmax in two halves
(:func:`_logits_max`: scaled logits and running max; :func:`_exp_sum`: e4m3 P, rescale factor, row sum). The
algebra's constants come from :mod:`qattn_fx.kernels._sage_common`.
"""

from ._gluon import constexpr_function, gl, jit
from .state import _SCALAR, _named
from .._sage_common import C_INT8_ACC_OFFSET, C_LOG2_448, C_LOG2E, k_scale_kind


@_named
class KeyScales:
    """Where a consumer reads its work item's K scales (:func:`_tile_k_scales`): by pointer from ``ptr`` (its head's
    scales from the item's first key, ``stride_n`` between key groups), or with ``KS_TMA`` from the ring ``smem``
    the producer fills (else an alias, unused); ``seq_kv``: the item's keys (loads past them are masked)."""
    ptr: gl.tensor
    stride_n: _SCALAR
    smem: gl.shared_memory_descriptor
    seq_kv: _SCALAR


@_named
class KeyBias:
    """Where a consumer reads its work item's key bias (:func:`_key_bias`): fp32 ``ptr`` at its batch row's first
    key of the item, ``seq_kv`` keys (``-inf`` past them)."""
    ptr: gl.tensor
    seq_kv: _SCALAR


@jit
def _cut_k_scales(ks, KIND: gl.constexpr):
    """The tile's K scales ``ks`` (:func:`~.._sage_common.k_scale_kind` ``KIND``) as the softmax applies them: scales that vary
    inside the tile (``"group"``, ``"column"``) cut to 22 significant bits (relative change < 2e-7), so that
    ``1.5·2^23 · ks`` is exact in fp32 and :func:`_scale_logits`' int8 fma rounds ``S · ks`` once (as triton_sage
    does); one scale per tile (or none) as it is."""
    if KIND == "group" or KIND == "column":
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    return ks


@jit
def _load_k_scales(ks_ptr, stride_ksn, start_n, SEQ_KV, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr,
                   K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """K scales of the tile at ``start_n`` from global memory (the path when they cannot come by TMA), as stored, by
    their :func:`~.._sage_common.k_scale_kind`: ``"group"``: ``(BLOCK_N / K_BLOCK,)`` in ``GROUP_LAYOUT``; ``"column"``:
    ``(BLOCK_N,)`` in ``COL_LAYOUT``; ``"tile"``: one scalar; ``"none"``: 1.0."""
    KIND: gl.constexpr = k_scale_kind(K_BLOCK, BLOCK_N)
    if KIND == "group":
        offs_g = start_n // K_BLOCK + gl.arange(0, BLOCK_N // K_BLOCK, layout=GROUP_LAYOUT)
        ks = gl.load(ks_ptr + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
    elif KIND == "column":
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=COL_LAYOUT)
        ks = gl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
    elif KIND == "tile":
        ks = gl.load(ks_ptr + (start_n // K_BLOCK) * stride_ksn)
    else:
        ks = 1.0
    return ks


@jit
def _tile_k_scales(i, j, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, flags):
    """K scales of key tile ``j``, the ``i``-th tile the CTA visits (its ring position; ``j == i`` but in block-sparse
    launches), cut by :func:`_cut_k_scales` (:func:`_load_k_scales`' shapes and layouts); ``ksrc``:
    :class:`KeyScales`; ``flags``: the kernel's :class:`~.state.KernelFlags` (``K_BLOCK``, ``BLOCK_N``,
    ``STAGES``, ``KS_TMA``). ``KS_TMA``: the producer brought them into the ``2·STAGES``-deep ring ``ksrc.smem`` with
    the K tile (same ``k_ready`` barrier), so the caller must have waited for tile ``j``'s K (its slot may already
    be released); a shared-memory broadcast read instead of masked global loads (zeros past the tensor; values past
    ``SEQ_KV`` only meet masked columns). Else a global load (issue it a tile ahead of use)."""
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    KIND: gl.constexpr = k_scale_kind(K_BLOCK, BLOCK_N)
    if flags.KS_TMA:  # group or column scales
        tile = ksrc.smem.index(i % (2 * flags.STAGES))
        if KIND == "group" and tile.shape[0] > BLOCK_N // K_BLOCK:  # the box is padded to 128 bytes
            ks = tile.slice(0, BLOCK_N // K_BLOCK).load(GROUP_LAYOUT)
        elif KIND == "group":
            ks = tile.load(GROUP_LAYOUT)
        else:
            ks = tile.load(COL_LAYOUT)
    else:
        ks = _load_k_scales(ksrc.ptr, ksrc.stride_n, j * BLOCK_N, ksrc.seq_kv, COL_LAYOUT, GROUP_LAYOUT, K_BLOCK,
                            BLOCK_N)
    return _cut_k_scales(ks, KIND)


@jit
def _k_scales_ahead(i, j, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, flags):
    """Issued a tile ahead of use: tile ``j``'s K scales from global memory, or (``KS_TMA``) a placeholder, the
    scales being read from the ring at use (:func:`_k_scales_at_use`); carried through the loop either way. ``i``:
    its ring position (:func:`_tile_k_scales`)."""
    if flags.KS_TMA:
        return 0.0
    else:
        return _tile_k_scales(i, j, ksrc, COL_LAYOUT, GROUP_LAYOUT, flags)


@jit
def _k_scales_at_use(i, j, ks, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, flags):
    """Tile ``j``'s K scales where ``S_j`` is scaled: ``ks`` from :func:`_k_scales_ahead`, or read from the ring
    (position ``i``)."""
    if flags.KS_TMA:
        return _tile_k_scales(i, j, ksrc, COL_LAYOUT, GROUP_LAYOUT, flags)
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
    ``HAS_BIAS``. ``kbsrc``: :class:`KeyBias`. ``PERMK``: the tile's K rows were loaded permuted, so column
    ``16g + 8i + 2c + e`` of ``S`` holds key ``16g + 4c + 2i + e`` (:func:`_pv_issue`): the bias is loaded as
    ``(BLOCK_N / 16, 16)`` keys in order, in the layout that the inverse relabeling turns into ``COL_LAYOUT``
    (each thread's 4 keys per group contiguous: plain vector loads), then relabeled; else column ``n`` is key
    ``n``."""
    if HAS_BIAS:
        kb_ptr = kbsrc.ptr
        SEQ_KV = kbsrc.seq_kv
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
    KIND: gl.constexpr = k_scale_kind(K_BLOCK, BLOCK_N)
    if QK_KIND == 0:
        t = s.to(gl.float32, bitcast=True)  # = S + 1.5·2^23 exactly (|S| < 2^22)
    else:
        t = s
    if KIND == "group":
        t3 = gl.reshape(t, [t.shape[0], BLOCK_N // K_BLOCK, K_BLOCK])  # a relabeling of registers
        ks3 = ks[None, :, None]
        if QK_KIND == 0:
            t3 = gl.fma(t3, ks3, -(ks3 * C_INT8_ACC_OFFSET))  # round(S · ks) in one fma (:func:`_cut_k_scales`)
        else:
            t3 = t3 * ks3
        t = gl.convert_layout(gl.reshape(t3, [t.shape[0], BLOCK_N]), s_layout, assert_trivial=True)
    elif KIND == "column":
        if QK_KIND == 0:
            t = gl.fma(t, ks[None, :], -(ks * C_INT8_ACC_OFFSET)[None, :])
        else:
            t = t * ks[None, :]
    else:
        if QK_KIND == 0:
            t = t - C_INT8_ACC_OFFSET
        if KIND == "tile":  # one K scale for the whole tile
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
