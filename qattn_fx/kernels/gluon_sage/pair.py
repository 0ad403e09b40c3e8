"""gluon_sage's ``pair`` schedule (``PAIR``): a consumer's key-tile loop in online-softmax steps of two consecutive
visits, the two-consumer launch's alternative to :func:`.mainloop._mainloop` (block-sparse launches run two
consumers). Its steps reuse the mainloop's MMAs, releases and single-tile step; its numerics are
``qattn_fx.kernels.emulation.emulate(..., pair=True)``.
"""

from ._gluon import gl, jit, warpgroup_mma_wait
from .mainloop import _accumulate, _pv_issue, _qk, _qk_issue, _release, _softmax_pv
from .softmax import _exp_sum, _running_max, _scale_logits, _tile_k_scales, _tile_max
from .sparse import _key_tile


@jit
def _pair_step(i, j0, j1, m_i, l_i, acc, lp, p_layout: gl.constexpr, row_o: gl.constexpr, col_s: gl.constexpr,
               grp_layout: gl.constexpr, flags, MASK: gl.constexpr, PERMK1: gl.constexpr,
               RELEASE_LAST: gl.constexpr):
    """Visits ``i`` and ``i + 1`` (key tiles ``j0``, ``j1``) as one online-softmax step of two tiles (``PAIR``):
    both Q·Kᵀ issued, then waited (event ``i`` released: ``j0``'s K slot, the previous visit's V slot); one running
    max over both tiles and one factor rescaling ``acc`` and ``l``; both P·V and both ones-MMAs into one fp32
    accumulator each (``MMASUM``), then event ``i + 1`` released. ``MASK``: visit ``i + 1`` is the item's last
    (masked past ``SEQ_KV``, loaded in key order: ``PERMK1`` 0), whose V slot's event ``i + 2`` is released too
    when ``RELEASE_LAST`` (not in a persistent launch: :func:`.mainloop._mainloop`)."""
    QK_KIND: gl.constexpr = flags.QK_KIND
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    s0 = _qk_issue(i, lp.q, lp.s_init, lp.k_smem, lp.k_ready, QK_KIND, BLOCK_N, STAGES)
    s1 = _qk_issue(i + 1, lp.q, lp.s_init, lp.k_smem, lp.k_ready, QK_KIND, BLOCK_N, STAGES)
    s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1))
    _release(i, lp.kv_free, STAGES, flags.TARRIVE)
    t0, rs0 = _scale_logits(s0, _tile_k_scales(i, j0, lp.ksrc, col_s, grp_layout, flags), lp.rs, QK_KIND, K_BLOCK,
                            BLOCK_N)
    t1, rs1 = _scale_logits(s1, _tile_k_scales(i + 1, j1, lp.ksrc, col_s, grp_layout, flags), lp.rs, QK_KIND,
                            K_BLOCK, BLOCK_N)
    m_new = gl.maximum(_running_max(t0, rs0, m_i, j0 * BLOCK_N, lp.SEQ_KV, BLOCK_N, False),
                       _tile_max(t1, rs1, j1 * BLOCK_N, lp.SEQ_KV, BLOCK_N, MASK))
    p0, alpha, l_i = _exp_sum(t0, rs0, m_new, m_i, l_i, j0 * BLOCK_N, lp.SEQ_KV, BLOCK_N, False, 1)
    p1, _, l_i = _exp_sum(t1, rs1, m_new, m_i, l_i, j1 * BLOCK_N, lp.SEQ_KV, BLOCK_N, MASK, 1)
    pv, pl = _pv_issue(i, p0, lp.pv_zero, lp.v_smem, lp.v_ready, p_layout, BLOCK_N, STAGES, flags.PERMK,
                       lp.sums.ones, lp.sums.l_zero, 1)
    pv, pl = _pv_issue(i + 1, p1, pv, lp.v_smem, lp.v_ready, p_layout, BLOCK_N, STAGES, PERMK1, lp.sums.ones, pl, 1,
                       1)
    pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pl))
    _release(i + 1, lp.kv_free, STAGES, flags.TARRIVE)
    if MASK and RELEASE_LAST:
        _release(i + 2, lp.kv_free, STAGES, flags.TARRIVE)
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, 1)
    return m_new, l_i, acc


@jit
def _pair_mainloop(m_i, acc, l_i, n_tiles, lp, flags, p_layout: gl.constexpr, row_o: gl.constexpr,
                   col_s: gl.constexpr, grp_layout: gl.constexpr):
    """``PAIR``: :func:`.mainloop._mainloop` in online-softmax steps of two consecutive visits (:func:`_pair_step`) from
    the work item's first; when the full tiles are odd in number the last step pairs the last full tile with the last
    (masked) one, else the last tile is a step alone. ``n_tiles``: the visits, at least one. No key bias, no
    Skip-Softmax (:func:`~.config.check_pair_config`)."""
    f = lp.first
    n_full = n_tiles - 1
    RELEASE_LAST: gl.constexpr = 1 - flags.PERSIST
    for k in range(n_full // 2):
        m_i, l_i, acc = _pair_step(f + 2 * k, _key_tile(2 * k, lp.visits, flags),
                                   _key_tile(2 * k + 1, lp.visits, flags), m_i, l_i, acc, lp, p_layout, row_o, col_s,
                                   grp_layout, flags, 0, flags.PERMK, 0)
    if n_full % 2 == 1:  # (a branch around whole steps: fine in Triton 3.6's Gluon, unlike one per tile)
        m_i, l_i, acc = _pair_step(f + n_tiles - 2, _key_tile(n_tiles - 2, lp.visits, flags),
                                   _key_tile(n_tiles - 1, lp.visits, flags), m_i, l_i, acc, lp, p_layout, row_o,
                                   col_s, grp_layout, flags, 1, 0, RELEASE_LAST)
    else:
        j_last = _key_tile(n_tiles - 1, lp.visits, flags)
        s = _qk(f + n_tiles - 1, lp.q, lp.s_init, lp.k_smem, lp.k_ready, lp.kv_free, flags.QK_KIND, flags.BLOCK_N,
                flags.STAGES, flags.TARRIVE)
        ks = _tile_k_scales(f + n_tiles - 1, j_last, lp.ksrc, col_s, grp_layout, flags)
        m_i, l_i, acc = _softmax_pv(f + n_tiles - 1, j_last, s, ks, 0.0, m_i, l_i, acc, lp, p_layout, row_o, flags,
                                    True, RELEASE_LAST, 0, 0)
    return m_i, l_i, acc
