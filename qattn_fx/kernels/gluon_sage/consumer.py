"""gluon_sage's consumer partition (:func:`_consume`): each consumer warpgroup owns 64 query rows: their row scales
(quantizing Q when the kernel does, :func:`_quantize_q_rows`), then :func:`.mainloop._mainloop` over the key tiles
and :func:`.epilogue._epilogue` (FlashAttention-3's split). The steps on one tile: :mod:`.softmax`; the MMAs, the
schedules and the loops: :mod:`.mainloop`.
"""

from ._gluon import fence_async_shared, gl, jit, mbarrier, mma_layout, quantizes_q, sum_layout
from .._sage_common import C_INT8_ACC_BITS, C_INT8_ACC_OFFSET, C_INV_127
from .epilogue import _epilogue
from .mainloop import RowSums, SkipTest, TileLoop, _mainloop
from .pair import _pair_mainloop
from .schedule import _q_bar, _run_items
from .softmax import KeyBias, KeyScales
from .sparse import Visits, _visit_bias_tiles, _visits


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


@jit
def _row_scales(q, ks_ptr, ptrs, prog, flags, row0, offs_m, m_valid, ROW_LAYOUT: gl.constexpr,
                QUANT_Q: gl.constexpr):
    """This warpgroup's row scales ``q_scale · sm_scale · log2 e`` (times K's scale when it is one per head or
    tensor, ``K_BLOCK == 0``), ``(BM,)`` in ``ROW_LAYOUT``, for rows ``row0 + [0, BM)`` (``offs_m``, valid where
    ``m_valid``): ``sm_scale · log2 e`` alone for bf16/fp16 Q/K; with ``QUANT_Q`` the scales of the Q rows it
    quantizes into ``q`` itself (:func:`_quantize_q_rows`; ``QS`` is then Q, its strides in ``stride_qs*``); else
    Q's scales from ``QS`` (one per head or tensor when ``Q_BLOCK == 0``)."""
    BM: gl.constexpr = offs_m.shape[0]
    Q_BLOCK: gl.constexpr = flags.Q_BLOCK
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    b = prog.b
    h = prog.h
    qk_scale = prog.qk_scale
    if flags.QK_KIND == 2:
        rs = gl.full([BM], 0.0, gl.float32, ROW_LAYOUT) + qk_scale
    elif QUANT_Q:
        rs = _quantize_q_rows(ptrs.QS, prog.stride_qsb, prog.stride_qsh, prog.stride_qsn, b, h, row0, prog.SEQ_Q, q,
                              ROW_LAYOUT) * qk_scale
        if K_BLOCK == 0:
            rs = rs * gl.load(ks_ptr)
    else:
        qs_ptr = ptrs.QS + b * prog.stride_qsb + h * prog.stride_qsh
        if Q_BLOCK == 0:
            rs = gl.full([BM], 0.0, gl.float32, ROW_LAYOUT) + gl.load(qs_ptr) * qk_scale
        else:
            rs = gl.load(qs_ptr + (offs_m // Q_BLOCK) * prog.stride_qsn, mask=m_valid, other=0.0) * qk_scale
        if K_BLOCK == 0:
            rs = rs * gl.load(ks_ptr)
    return rs


@jit
def _bias_tiles(ptrs, prog, n_tiles, BLOCK_N: gl.constexpr):
    """``(b0, b1)``: the full key tiles ``[b0, b1)`` that meet the keys whose bias is not 0 (``KBR``'s span for this
    batch's bias row, :func:`.._sage_common.bias_range`), counted from ``kv0`` (a split piece's first key); the
    others, and the last tile, are bounded by ``n_tiles - 1``."""
    kbr = ptrs.KBR + 2 * gl.where(prog.stride_kbb != 0, prog.b, 0)
    b0 = gl.minimum(gl.maximum(gl.load(kbr) - prog.kv0, 0) // BLOCK_N, n_tiles - 1)
    b1 = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(gl.load(kbr + 1) - prog.kv0, 0), BLOCK_N), b0), n_tiles - 1)
    return b0, b1


@jit
def _consume(st, CID: gl.constexpr):
    """Consumer warpgroup ``CID``: the CTA's work item (:func:`_consume_item`), or with ``PERSIST`` each of its items
    in turn (:mod:`.schedule`), the rings' positions counted across them; a persistent one with ``MMASUM`` first fills
    its ones buffer (:func:`_fill_ones`), once per CTA."""
    flags = st.flags
    if flags.MMASUM and flags.PERSIST:  # (once per CTA; a non-persistent CTA fills it in _consume_item)
        _fill_ones(st.bufs.ones_smem.index(CID))
    _run_items(st, _consume_item, CID)


@jit
def _q_done(bufs, n, flags):
    """A persistent launch's consumer is done with item ``n``'s Q buffer (after its last Q·Kᵀ): the producer may load
    item ``n + 2``'s there (:mod:`.schedule`). Nothing otherwise."""
    if flags.PERSIST:
        mbarrier.arrive(bufs.q_free.index(n % 2), count=1)


@jit
def _consume_item(st, CID: gl.constexpr, n, first):
    """Consumer warpgroup ``CID`` on one work item (``st.prog``: its :class:`~.state.Program`; ``n``: the CTA's items
    before it, ``first``: the key tiles they visited, its first ring position): rows ``start_m + 64·CID + [0,
    64)``, their row scales (quantizing Q when the kernel does), then :func:`_mainloop` (``PAIR``:
    :func:`.pair._pair_mainloop`) and :func:`_epilogue`.
    ``st``: the item's :class:`~.state.KernelState`; its flags' ``SKIP`` (serial schedules only): every tile behind
    Skip-Softmax's test (:func:`_softmax_pv_skip`; 2: counting skipped tiles) unless λ is 0. Returns the key tiles
    it visited."""
    flags = st.flags
    bufs = st.bufs
    ptrs = st.ptrs
    prog = st.prog
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    SKIP: gl.constexpr = flags.SKIP
    q_desc = bufs.q_desc
    kv0 = prog.kv0
    SEQ_Q = prog.SEQ_Q
    SEQ_KV = prog.kv_len

    BM: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    HEAD_DIM_V: gl.constexpr = bufs.v_desc.block_type.shape[2]
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NW, BLOCK_N, bufs.k_desc.dtype.primitive_bitwidth)
    QUANT_Q: gl.constexpr = quantizes_q(q_desc.dtype, bufs.k_desc.dtype)  # this warpgroup quantizes its Q rows itself
    o_layout: gl.constexpr = mma_layout(NW, HEAD_DIM_V, 8)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    if flags.QK_KIND == 0:
        s_init = gl.full([BM, BLOCK_N], C_INT8_ACC_BITS, gl.int32, s_layout)  # S + 1.5·2^23 read as fp32
    else:
        s_init = gl.zeros([BM, BLOCK_N], gl.float32, s_layout)
    G: gl.constexpr = BLOCK_N // K_BLOCK if K_BLOCK > 0 else 1
    grp_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.reshape(
        gl.zeros([BM, BLOCK_N], gl.float32, s_layout), [BM, G, BLOCK_N // G]).type.layout))
    pv_zero = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)

    # ---- row scales (and this warpgroup's Q quantized, when the kernel does), the K scales' and key bias's bases --
    row0 = prog.start_m + CID * BM
    offs_m = row0 + gl.arange(0, BM, layout=row_s)
    m_valid = offs_m < SEQ_Q
    ks_ptr = ptrs.KS + prog.b * prog.stride_ksb + prog.hk * prog.stride_ksh
    if flags.SPLIT_TAIL and K_BLOCK > 0:  # a tail piece's keys start at kv0 (a multiple of K_BLOCK); its K scales there
        ks_ptr += (kv0 // K_BLOCK) * prog.stride_ksn
    kb_ptr = ptrs.KB + prog.b * prog.stride_kbb
    if flags.SPLIT_TAIL:
        kb_ptr += kv0
    NC: gl.constexpr = bufs.q_smem.type.shape[0] // (2 if flags.PERSIST else 1)
    qb = n % 2  # this item's Q buffer (.schedule)
    q = bufs.q_smem.index(qb * NC + CID).reshape([BM, HEAD_DIM])
    rs = _row_scales(q, ks_ptr, ptrs, prog, flags, row0, offs_m, m_valid, row_s, QUANT_Q)

    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    acc = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)
    if flags.MMASUM:  # the running denominator: a (64, 8) tile of the ones-MMA's layout, every column the same
        l_zero = gl.zeros([BM, 8], gl.float32, sum_layout(NW))
        l_i = l_zero
        ones = bufs.ones_smem.index(CID)
        if not flags.PERSIST:  # (a persistent CTA fills it once, in _consume)
            _fill_ones(ones)
    else:
        l_zero = pv_zero  # unused
        l_i = gl.full([BM], 0.0, gl.float32, row_s)
        ones = bufs.ones_smem  # unused
    sums = RowSums(ones=ones, l_zero=l_zero)
    if flags.SPARSE:  # the listed key tiles only (.sparse): n_tiles of them, maybe none
        visits, n_tiles, e0 = _visits(ptrs, prog, flags)  # (e0: its first list position)
    else:
        visits = Visits(entries=0, off=0)  # unused
        n_tiles = gl.cdiv(SEQ_KV, BLOCK_N)
    ksrc = KeyScales(ptr=ks_ptr, stride_n=prog.stride_ksn, smem=bufs.ks_smem, seq_kv=SEQ_KV)
    kbsrc = KeyBias(ptr=kb_ptr, seq_kv=SEQ_KV)
    if flags.HAS_BIAS and flags.SPARSE:
        bias_tiles = _visit_bias_tiles(ptrs, e0, n_tiles, flags)
    elif flags.HAS_BIAS:
        bias_tiles = _bias_tiles(ptrs, prog, n_tiles, BLOCK_N)
    else:
        bias_tiles = (0, 0)  # unused
    if SKIP:  # (log2 λ, rows past SEQ_Q, the skip counter per lane, the one lane that counts)
        count_lane = (offs_m == row0) & (row0 < SEQ_Q)
        skip = SkipTest(log2_thr=gl.load(prog.skip_thr), row_out=offs_m >= SEQ_Q,
                        count_ptrs=prog.skip_count + offs_m * 0, count_lane=count_lane)
    else:
        skip = SkipTest(log2_thr=0.0, row_out=0.0, count_ptrs=0.0, count_lane=0.0)  # unused
    if not QUANT_Q:
        mbarrier.wait(_q_bar(bufs, n, flags), (n // 2) & 1)
    lp = TileLoop(q=q, rs=rs, s_init=s_init, pv_zero=pv_zero, SEQ_KV=SEQ_KV, k_smem=bufs.k_smem, v_smem=bufs.v_smem,
                  k_ready=bufs.k_ready, kv_free=bufs.kv_free, v_ready=bufs.v_ready, ksrc=ksrc, kbsrc=kbsrc, skip=skip,
                  sums=sums, visits=visits, first=first)
    # Skip-Softmax with λ = 0 (log2 λ = -inf: nothing can be skipped, e.g. the steps before disabled_until_timestep)
    # runs the loop without the test (its cost: docs/kernel-design.md); each branch has its own epilogue
    # (one join after both loops made ptxas spill 1516 bytes in trio's consumers, 456 with two epilogues)
    # A block-sparse CTA that visits no tile skips the loop: its rows keep l = 0 and m = -inf (output 0, LSE -inf).
    if flags.PAIR:  # steps of two visits (no Skip-Softmax, no key bias: check_pair_config); maybe none listed
        if n_tiles > 0:
            m_i, l_i, acc = _pair_mainloop(m_i, acc, l_i, n_tiles, lp, flags, p_layout, row_o, col_s, grp_layout)
        _q_done(bufs, n, flags)
        _epilogue(m_i, l_i, acc, ptrs, prog, row0, offs_m, m_valid, flags, CID, NC, o_layout, row_s, row_o)
    elif flags.SPARSE:
        if SKIP and skip.log2_thr != float("-inf") and n_tiles > 0:
            m_i, l_i, acc = _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, lp, flags, p_layout, row_o, col_s,
                                      grp_layout, SKIP)
        elif n_tiles > 0:
            m_i, l_i, acc = _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, lp, flags, p_layout, row_o, col_s,
                                      grp_layout, 0)
        _q_done(bufs, n, flags)
        _epilogue(m_i, l_i, acc, ptrs, prog, row0, offs_m, m_valid, flags, CID, NC, o_layout, row_s, row_o)
    elif SKIP and skip.log2_thr != float("-inf"):
        m_i, l_i, acc = _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, lp, flags, p_layout, row_o, col_s, grp_layout,
                                  SKIP)
        _q_done(bufs, n, flags)
        _epilogue(m_i, l_i, acc, ptrs, prog, row0, offs_m, m_valid, flags, CID, NC, o_layout, row_s, row_o)
    else:
        m_i, l_i, acc = _mainloop(m_i, acc, l_i, n_tiles, bias_tiles, lp, flags, p_layout, row_o, col_s, grp_layout,
                                  0)
        _q_done(bufs, n, flags)
        _epilogue(m_i, l_i, acc, ptrs, prog, row0, offs_m, m_valid, flags, CID, NC, o_layout, row_s, row_o)
    return n_tiles
