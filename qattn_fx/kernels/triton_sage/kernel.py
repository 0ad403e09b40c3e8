"""triton_sage's kernel (Triton source): ``_sage_fwd``, one program's Q tile, its key-tile loop (dense, with the
steps of :mod:`.tiles`, or block-sparse, :mod:`.walk`) and the epilogue. The algorithm: the package docstring.

The host side (:mod:`.launch`) loads this file once per Triton mode through :mod:`.source`, as a module of its own,
with ``triton.knobs.runtime.interpret`` set as wanted (``@triton.jit`` picks compiled or interpreted functions when
the module runs; :func:`.source.sibling` loads :mod:`.tiles` and :mod:`.walk` in the same mode): the interpreter
tests can turn ``TRITON_INTERPRET`` on after the package was imported, and an offline compile still gets compiled
functions. Constants come from :mod:`qattn_fx.kernels._sage_common`.
"""

import triton
import triton.language as tl

from .._sage_common import C_LN2, C_LOG2_448
from .source import sibling

_tiles, _walk = sibling("tiles"), sibling("walk")
load_kb, load_ks, load_v, pipe_step, plain_step, qk_tile, softmax_pv = (
    _tiles.load_kb, _tiles.load_ks, _tiles.load_v, _tiles.pipe_step, _tiles.plain_step, _tiles.qk_tile,
    _tiles.softmax_pv)
sparse_tiles, C_BLOCK_KEYS, C_BLOCK_ROWS = _walk.sparse_tiles, _walk.C_BLOCK_KEYS, _walk.C_BLOCK_ROWS


@triton.jit
def _sage_fwd(
    Q, K, V, QS, KS, VS, KB, KBR, BI, BC, Out, Lse,
    qk_scale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsd,
    stride_kbb,
    stride_ob, stride_oh, stride_os,
    H, GROUP, SEQ_Q, SEQ_KV,
    SQ_BUCKET, SKV_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, QK_KIND: tl.constexpr,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, V_SEQ_MAJOR: tl.constexpr,
    RETURN_LSE: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    V_ALIGN: tl.constexpr, HAS_BIAS: tl.constexpr, SPARSE: tl.constexpr,
    INTERP_LOOP_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr,
):
    """Grid ``(cdiv(Sq, BLOCK_M), B · Hq)``. Unit strides on D (Q, K, Out) and on S or D (V) are implicit.

    ``HAS_BIAS``: the key bias ``KB`` (fp32 ``(B|1, Skv)``, batch stride ``stride_kbb``) and ``KBR`` (int32
    ``(B|1, 2)``, :func:`~qattn_fx.kernels._sage_common.bias_range`): only the full key tiles that meet that span
    (and the last tile) add the bias; the others run the loop without it. Under the interpreter every tile adds it.

    ``SPARSE``: block lists ``BI`` (int32 ``(B, H, ceil(SEQ_Q/128), ceil(SEQ_KV/128))``) and ``BC`` (int32
    ``(B, H, ceil(SEQ_Q/128))``), contiguous (:mod:`qattn_fx.block_sparse`): the program walks only the key tiles
    its query tile's list names (:func:`sparse_tiles`; every one adds the key bias when ``HAS_BIAS``).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_ml = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_ml
    m_valid = offs_m < SEQ_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)

    # ---- Q tile (loaded once) and its row scale ---------------------------------------------------------------
    q_ptrs = (Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qs
              + offs_ml[:, None] * stride_qs + offs_d[None, :])
    if INTERPRET:
        q = tl.load(q_ptrs, mask=m_valid[:, None])
    else:
        q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    ks_ptr = KS + b * stride_ksb + hk * stride_ksh
    kb_ptr = KB + b * stride_kbb
    if QK_KIND == 2:
        rs = tl.full([BLOCK_M], 0.0, tl.float32) + qk_scale
    else:
        qs_ptr = QS + b * stride_qsb + h * stride_qsh
        if Q_BLOCK == 0:
            rs = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(qs_ptr) * qk_scale
        else:
            rs = tl.load(qs_ptr + (offs_m // Q_BLOCK) * stride_qsn, mask=m_valid, other=0.0) * qk_scale
        if K_BLOCK == 0:
            rs = rs * tl.load(ks_ptr)

    # ---- K/V tiles ------------------------------------------------------------------------------------------
    k_base = K + b * stride_kb + hk * stride_kh
    k_offs = offs_d[:, None] + offs_n[None, :] * stride_ks
    v_base = V + b * stride_vb + hk * stride_vh
    if V_SEQ_MAJOR:
        # V rows (one per channel) start stride_vd bytes apart; tell Triton how aligned they are (the host passes
        # the largest power of two <= 16 dividing stride_vd) so the copies stay vectorized and asynchronous.
        v_offs = offs_n[:, None] + tl.multiple_of(offs_dv * stride_vd, V_ALIGN)[None, :]
        v_step = BLOCK_N
    else:
        v_offs = offs_n[:, None] * stride_vs + offs_dv[None, :]
        v_step = BLOCK_N * stride_vs
    k_step = BLOCK_N * stride_ks

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_V], 0.0, tl.float32)
    PV_FP16: tl.constexpr = not V_SEQ_MAJOR
    if SPARSE:  # the key tiles this query tile's list names (BLOCK_M divides 128: one query tile per program)
        n_q = (SEQ_Q + C_BLOCK_ROWS - 1) // C_BLOCK_ROWS
        lists = (b * H + h) * n_q + start_m // C_BLOCK_ROWS
        n_k = (SEQ_KV + C_BLOCK_KEYS - 1) // C_BLOCK_KEYS
        acc, l_i, m_i = sparse_tiles(
            acc, l_i, m_i, q, rs, BI + lists * n_k, tl.load(BC + lists), k_base, k_offs, stride_ks, v_base, v_offs,
            stride_vs, ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET,
            HAS_BIAS, INTERP_LOOP_END, PIPE)
    else:
        # Loop bounds: under the interpreter every assigned scalar is a 1-element numpy array, which numpy >= 2.4
        # refuses to turn into a Python int for range(), so there the host passes the bound as a constexpr and every
        # full tile takes the loop with the bias.
        if PIPE == 1:  # the last tile (full or tail) is finished after the loop, masked
            end = ((SEQ_KV - 1) // BLOCK_N) * BLOCK_N
        else:  # full tiles, then the tail tile (if any)
            end = (SEQ_KV // BLOCK_N) * BLOCK_N
        if HAS_BIAS:  # the full tiles that meet the keys with a nonzero bias
            kbr = KBR + 2 * tl.where(stride_kbb != 0, b, 0)
            lo = tl.minimum((tl.load(kbr) // BLOCK_N) * BLOCK_N, end)
            hi = tl.minimum(tl.maximum(((tl.load(kbr + 1) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), end)
        else:
            lo = end
            hi = end
        if PIPE == 1:
            # Software-pipelined: S of tile j+1 is issued (async wgmma) before tile j's softmax, so the tensor cores
            # work while the exp2s of tile j run.
            s = qk_tile(q, k_base, k_offs, 0, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
            for start_n in range(0, (0 if HAS_BIAS else INTERP_LOOP_END) if INTERPRET else lo, BLOCK_N):
                acc, l_i, m_i, s, k_base, v_base = pipe_step(
                    acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                    stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False)
            if HAS_BIAS:
                for start_n in range(0 if INTERPRET else lo, INTERP_LOOP_END if INTERPRET else hi, BLOCK_N):
                    acc, l_i, m_i, s, k_base, v_base = pipe_step(
                        acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                        stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True)
            for start_n in range(INTERP_LOOP_END if INTERPRET else hi, INTERP_LOOP_END if INTERPRET else end, BLOCK_N):
                acc, l_i, m_i, s, k_base, v_base = pipe_step(
                    acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                    stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False)
            v = load_v(v_base, v_offs, end, SEQ_KV, BLOCK_N, INTERPRET, True)  # the last tile (full or tail), masked
            ks = load_ks(ks_ptr, stride_ksn, end, SEQ_KV, K_BLOCK, BLOCK_N, True)
            kb = load_kb(kb_ptr, end, SEQ_KV, BLOCK_N, True, HAS_BIAS)
            acc, l_i, m_i = softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, end, SEQ_KV, QK_KIND,
                                            K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)
        else:
            for start_n in range(0, (0 if HAS_BIAS else INTERP_LOOP_END) if INTERPRET else lo, BLOCK_N):
                acc, l_i, m_i, k_base, v_base = plain_step(
                    acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                    kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, False)
            if HAS_BIAS:
                for start_n in range(0 if INTERPRET else lo, INTERP_LOOP_END if INTERPRET else hi, BLOCK_N):
                    acc, l_i, m_i, k_base, v_base = plain_step(
                        acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                        stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False,
                        True)
            for start_n in range(INTERP_LOOP_END if INTERPRET else hi, INTERP_LOOP_END if INTERPRET else end, BLOCK_N):
                acc, l_i, m_i, k_base, v_base = plain_step(
                    acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                    kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, False)
            if end < SEQ_KV:  # the tail tile, masked
                acc, l_i, m_i, _, _ = plain_step(
                    acc, l_i, m_i, q, rs, end, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                    kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)

    # ---- epilogue: O = acc · v_scale / l  (the 448s of P and l cancel) ---------------------------------------
    vs = tl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd)
    if HAS_BIAS or SPARSE:  # a row whose keys are all masked or that visits no block has l = 0 (and acc = 0): its
        # output is 0, as SDPA's for masked rows
        inv_l = tl.where(l_i == 0.0, 0.0, 1.0 / tl.where(l_i == 0.0, 1.0, l_i))
    else:
        inv_l = 1.0 / l_i
    out = acc * inv_l[:, None] * vs[None, :]
    o_ptrs = (Out + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_os
              + offs_ml[:, None] * stride_os + offs_dv[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_valid[:, None])
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_i) - C_LOG2_448) * C_LN2
        tl.store(Lse + (b * H + h) * SEQ_Q + offs_m, lse, mask=m_valid)
