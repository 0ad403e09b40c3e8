"""gluon_sage's consumer epilogue: the normalized output, the LSE and a split tail piece's workspace rows."""

from ._gluon import gl, jit
from .._sage_common import C_LN2, C_LOG2_448


@jit
def _epilogue(m_i, l_i, acc, ptrs, prog, row0, offs_m, m_valid, flags, CID: gl.constexpr, NC: gl.constexpr,
              o_layout: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr):
    """O = acc · v_scale / l into ``Out`` (the 448s of P and l cancel), the LSE with ``RETURN_LSE``, and a split
    tail piece's O and LSE into the workspace, for consumer ``CID``'s rows ``row0 + [0, 64)`` (``offs_m``, valid
    where ``m_valid``); ``ptrs``, ``prog``: the kernel's :class:`~.state.Pointers` and :class:`~.state.Program`."""
    b = prog.b
    h = prog.h
    hk = prog.hk
    SEQ_Q = prog.SEQ_Q
    piece = prog.piece
    Out = ptrs.Out
    BM: gl.constexpr = offs_m.shape[0]
    HEAD_DIM_V: gl.constexpr = acc.shape[1]
    RETURN_LSE: gl.constexpr = flags.RETURN_LSE
    MMASUM: gl.constexpr = flags.MMASUM
    SPLIT_TAIL: gl.constexpr = flags.SPLIT_TAIL
    HAS_BIAS: gl.constexpr = flags.HAS_BIAS
    offs_dv = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
    vs = gl.load(ptrs.VS + b * prog.stride_vsb + hk * prog.stride_vsh + offs_dv * prog.stride_vsd)
    if MMASUM:  # its 8 columns hold the same sums: take one (max: exact)
        l_i = gl.convert_layout(gl.max(l_i, axis=1), row_s)
    if HAS_BIAS or flags.SPARSE:  # a row whose keys are all masked or not visited has l = 0 (and acc = 0): its
        # output is 0, as SDPA's
        inv_l = gl.convert_layout(gl.where(l_i == 0.0, 0.0, 1.0 / gl.where(l_i == 0.0, 1.0, l_i)), row_o)
    else:
        inv_l = gl.convert_layout(1.0 / l_i, row_o)
    out = acc * inv_l[:, None] * vs[None, :]
    offs_mo = row0 + gl.arange(0, BM, layout=row_o)
    o_ptrs = (Out + b.to(gl.int64) * prog.stride_ob + h.to(gl.int64) * prog.stride_oh
              + offs_mo.to(gl.int64)[:, None] * prog.stride_os + offs_dv[None, :])
    o_mask = (offs_mo < SEQ_Q)[:, None]
    if SPLIT_TAIL:
        o_mask = o_mask & (piece < 0)  # a piece of a split tail CTA (piece >= 0) writes to the workspace instead
        m_valid = m_valid & (piece < 0)
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    if RETURN_LSE or SPLIT_TAIL:
        lse = (m_i + gl.log2(l_i) - C_LOG2_448) * C_LN2
    if RETURN_LSE:
        gl.store(ptrs.Lse + (b.to(gl.int64) * prog.H + h) * SEQ_Q + offs_m, lse, mask=m_valid)
    if SPLIT_TAIL:  # the piece's normalized fp32 O and its LSE, rows CID·64 + [0, 64) of workspace row block piece
        ws_o = piece.to(gl.int64) * (NC * BM) + CID * BM + gl.arange(0, BM, layout=row_o)
        gl.store(ptrs.OutWs + ws_o[:, None] * HEAD_DIM_V + offs_dv[None, :], out, mask=(ws_o >= 0)[:, None])
        ws_s = piece.to(gl.int64) * (NC * BM) + CID * BM + gl.arange(0, BM, layout=row_s)
        gl.store(ptrs.LseWs + ws_s, lse, mask=ws_s >= 0)
