"""triton_sage's tile functions (Triton source): one K/V tile's loads, Q·Kᵀ, online softmax and P·V, and the two
schedules' steps (:func:`plain_step`, :func:`pipe_step`) built from them. The algorithm: the package docstring.

Loaded by :mod:`.source` once per Triton mode, as a module of its own, like every source file of the kernel;
:mod:`.walk` and :mod:`.kernel` call the public functions. Constants come from :mod:`qattn_fx.kernels._sage_common`.
"""

import triton
import triton.language as tl

from .._sage_common import C_INT8_ACC_BITS, C_INT8_ACC_OFFSET, C_LOG2_448, C_LOG2E, k_scale_kind


@triton.jit
def qk_tile(q, k_base, k_offs, start_n, SEQ_KV,
             QK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr):
    """Raw ``S = Q·Kᵀ`` of the K tile starting at key ``start_n``: int32 (int8 Q/K) or fp32.

    ``k_base + k_offs``: (D, BLOCK_N) pointers to the tile of Kᵀ (a scalar 64-bit base advanced per tile plus
    loop-invariant int32 offsets: fewer registers than carried pointer tiles). For int8 the accumulator starts at
    ``0x4B400000`` (Triton folds the add into the MMA's initial value): read as fp32 that is ``S + 1.5·2^23``.
    """
    if MASK_KV:
        n_valid = (start_n + tl.arange(0, BLOCK_N)) < SEQ_KV
        if INTERPRET:  # the interpreter zero-fills masked lanes and cannot cast `other` to fp8
            kt = tl.load(k_base + k_offs, mask=n_valid[None, :])
        else:
            kt = tl.load(k_base + k_offs, mask=n_valid[None, :], other=0.0)
    else:
        kt = tl.load(k_base + k_offs)
    if QK_KIND == 2 and INTERPRET:  # the interpreter's bf16 dot is not exact; fp32 products of bf16 are
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
    else:
        s = tl.dot(q, kt)
    if QK_KIND == 0:
        s = s + C_INT8_ACC_BITS
    return s


@triton.jit
def load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr):
    """The (BLOCK_N, Dv) V tile at key ``start_n`` (rows past ``SEQ_KV`` read as 0 when ``MASK_KV``)."""
    if MASK_KV:
        n_valid = (start_n + tl.arange(0, BLOCK_N)) < SEQ_KV
        if INTERPRET:
            v = tl.load(v_base + v_offs, mask=n_valid[:, None])
        else:
            v = tl.load(v_base + v_offs, mask=n_valid[:, None], other=0.0)
    else:
        v = tl.load(v_base + v_offs)
    return v


@triton.jit
def cut_ks(ks, KIND: tl.constexpr):
    """The tile's K scales ``ks`` (:func:`~.._sage_common.k_scale_kind` ``KIND``) as :func:`_softmax` applies them: scales that vary
    inside the tile (``"group"``, ``"column"``) cut to 22 significant bits (relative change < 2e-7), so that the
    constant ``1.5·2^23·ks = 3·2^22·ks`` of the int8 logits' fma is exact in fp32 and the fma rounds ``S·ks`` once;
    one scale per tile (or none) as it is."""
    if KIND == "group" or KIND == "column":
        ks = (ks.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
    return ks


@triton.jit
def load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_KV: tl.constexpr):
    """K scales of the tile at ``start_n`` by their :func:`~.._sage_common.k_scale_kind`, cut by :func:`cut_ks`: ``"group"``: a
    (BLOCK_N // K_BLOCK,) vector; ``"column"``: a (BLOCK_N,) vector; ``"tile"``: one scalar; ``"none"``: 1.

    Loaded before the tile's Q·Kᵀ is issued so that, when Q·Kᵀ runs ahead (``PIPE``), nothing the softmax
    needs waits behind the asynchronous MMA.
    """
    KIND: tl.constexpr = k_scale_kind(K_BLOCK, BLOCK_N)
    if KIND == "group":
        offs_g = start_n // K_BLOCK + tl.arange(0, BLOCK_N // K_BLOCK)
        if MASK_KV:
            ks = tl.load(ks_ptr + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
        else:
            ks = tl.load(ks_ptr + offs_g * stride_ksn)
    elif KIND == "column":
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASK_KV:
            ks = tl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
        else:
            ks = tl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn)
    elif KIND == "tile":
        ks = tl.load(ks_ptr + (start_n // K_BLOCK) * stride_ksn)
    else:
        ks = 1.0
    return cut_ks(ks, KIND)


@triton.jit
def load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N: tl.constexpr, MASK_KV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The key bias of the tile at ``start_n`` in log2 units, ``(BLOCK_N,)`` (``-inf`` past ``SEQ_KV``); 0 without
    ``HAS_BIAS``."""
    if HAS_BIAS:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASK_KV:
            kb = tl.load(kb_ptr + offs_n, mask=offs_n < SEQ_KV, other=float("-inf"))
        else:
            kb = tl.load(kb_ptr + offs_n)
        kb = kb * C_LOG2E
    else:
        kb = 0.0
    return kb


@triton.jit
def _softmax(l_i, m_i, s, ks, rs, kb, start_n, SEQ_KV,
             QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
             MASK_KV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Online-softmax step for the tile at ``start_n`` given its ``S`` (from :func:`qk_tile`).

    ``ks``: the tile's K scales (:func:`load_ks`); ``rs`` (BLOCK_M,) row scale; ``kb``: with ``HAS_BIAS`` the
    tile's key bias in log2 units (:func:`load_kb`, ``-inf`` for masked keys and past ``SEQ_KV``), added to the
    logits ``z = t·rs + kb`` whose max is then taken directly (a running max of ``-inf``, every key so far masked,
    is used as 0: the tile's P are 0, not NaN); ``MASK_KV``: the tile may run past ``SEQ_KV``. Returns ``(p8,
    alpha, l, m)``: the e4m3 ``P448`` tile, the factor rescaling earlier accumulations, and the updated row sum / max.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_KV:
        n_valid = offs_n < SEQ_KV

    # ---- t = S with per-column K scales applied (exact int32 → fp32 for int8) ------------------------------
    KIND: tl.constexpr = k_scale_kind(K_BLOCK, BLOCK_N)
    if KIND == "group":
        # S viewed as (BLOCK_M, groups, K_BLOCK): the split of the key axis is a pure relabeling of registers
        t3 = tl.reshape(s.to(tl.float32, bitcast=True) if QK_KIND == 0 else s,
                        (s.shape[0], BLOCK_N // K_BLOCK, K_BLOCK))
        if QK_KIND == 0:
            if INTERPRET:
                t3 = (t3 - C_INT8_ACC_OFFSET) * ks[None, :, None]
            else:
                t3 = tl.fma(t3, tl.broadcast_to(ks[None, :, None], t3.shape),
                            tl.broadcast_to(-(ks * C_INT8_ACC_OFFSET)[None, :, None], t3.shape))
        else:
            t3 = t3 * ks[None, :, None]
        t = tl.reshape(t3, (s.shape[0], BLOCK_N))
    elif QK_KIND == 0:
        t = s.to(tl.float32, bitcast=True)  # = S + 1.5·2^23 exactly (|S| < 2^22)
        if KIND == "column":
            # t = round(S · ks) in one fma: fma(S + 1.5·2^23, ks, -1.5·2^23·ks), its constant exact (cut_ks),
            # rounds the exact product S·ks once; the interpreter (no fma) gets the same bits from (t - 1.5·2^23)·ks.
            if INTERPRET:
                t = (t - C_INT8_ACC_OFFSET) * ks[None, :]
            else:
                t = tl.fma(t, tl.broadcast_to(ks[None, :], t.shape),
                           tl.broadcast_to(-(ks * C_INT8_ACC_OFFSET)[None, :], t.shape))
        else:
            t = t - C_INT8_ACC_OFFSET
    else:
        t = s
        if KIND == "column":
            t = t * ks[None, :]
    if KIND == "tile":  # one K scale for the whole tile
        rs = rs * ks

    # ---- online softmax (log2 units, scales >= 0 so max(t·rs) = max(t)·rs) --------------------------------------
    if HAS_BIAS:  # z = t·rs + kb; kb is -inf past SEQ_KV, so no column mask is needed
        z = t * rs[:, None] + kb[None, :]
        if INTERPRET:
            z_max = tl.reduce(z, 1, tl.standard._elementwise_max)
        else:
            z_max = tl.max(z, 1)
        m_new = tl.maximum(m_i, z_max)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(z - (m_use - C_LOG2_448)[:, None])  # 448 · exp2(z - m)
        alpha = tl.math.exp2(m_i - m_use)
    else:
        if MASK_KV:
            t_for_max = tl.where(n_valid[None, :], t, float("-inf"))
        else:
            t_for_max = t
        if INTERPRET:  # tl.max/tl.sum are @jit functions, compiled-mode objects if triton was imported before
            t_max = tl.reduce(t_for_max, 1, tl.standard._elementwise_max)  # TRITON_INTERPRET=1; the interpreter
        else:  # runs tl.reduce with these combine functions natively
            t_max = tl.max(t_for_max, 1)
        m_new = tl.maximum(m_i, t_max * rs)
        p = tl.math.exp2(t * rs[:, None] - (m_new - C_LOG2_448)[:, None])  # 448 · exp2(z - m)
        if MASK_KV:
            p = tl.where(n_valid[None, :], p, 0.0)
        alpha = tl.math.exp2(m_i - m_new)
    if INTERPRET:
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)

    # ---- P448 in e4m3 (RNE, saturating) --------------------------------------------------------------------
    if INTERPRET:
        # Round P448 ∈ [0, 448] onto the e4m3 grid with RNE in fp32 (exact); the interpreter's own cast is not.
        e = tl.maximum((p.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # biased exponent, floor 2^-6
        ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
        inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)
        p = ((p * inv_ulp + 8388608.0) - 8388608.0) * ulp
    return p.to(tl.float8e4nv), alpha, l_i, m_new


@triton.jit
def _pv(acc, alpha, p8, v, BLOCK_N: tl.constexpr, PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr):
    """Two-level accumulation: ``acc · alpha + P8·V8``, the product in a fresh fp32 MMA accumulator."""
    if PV_FP16:  # D-major V: exact fp16 MMA (e4m3 values and their products are exact in fp16/fp32)
        pv = tl.dot(p8.to(tl.float16), v.to(tl.float16))
    elif PV_SPLIT:
        pv = tl.dot(p8, v, max_num_imprecise_acc=BLOCK_N)
    else:
        pv = tl.dot(p8, v)
    return acc * alpha[:, None] + pv


@triton.jit
def softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV,
                QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """:func:`_softmax` then :func:`_pv` for one tile; returns the updated ``(acc, l, m)``."""
    p8, alpha, l_i, m_i = _softmax(l_i, m_i, s, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N,
                                       INTERPRET, MASK_KV, HAS_BIAS)
    acc = _pv(acc, alpha, p8, v, BLOCK_N, PV_FP16, PV_SPLIT)
    return acc, l_i, m_i


@triton.jit
def pipe_step(acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
               kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
               PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Full tile ``start_n`` of the pipelined loop (``S`` given): tile ``start_n + BLOCK_N``'s Q·Kᵀ issued before
    this tile's softmax and P·V; ``HAS_BIAS``: the tile adds the key bias. Returns ``(acc, l, m, S_next, k_base,
    v_base)`` with the bases advanced by a tile."""
    ks = load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, False)
    kb = load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, False, HAS_BIAS)
    k_base += k_step
    s_next = qk_tile(q, k_base, k_offs, start_n + BLOCK_N, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
    v = load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, False)
    acc, l_i, m_i = softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, HAS_BIAS)
    return acc, l_i, m_i, s_next, k_base, v_base + v_step


@triton.jit
def plain_step(acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Tile ``start_n`` of the plain schedule: its Q·Kᵀ, softmax and P·V (``MASK_KV``: the tail tile, which may
    run past ``SEQ_KV``; ``HAS_BIAS``: with the key bias). Returns ``(acc, l, m, k_base, v_base)`` with the bases
    advanced by a tile."""
    v = load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, MASK_KV)
    ks = load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, MASK_KV)
    kb = load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, MASK_KV, HAS_BIAS)
    s = qk_tile(q, k_base, k_offs, start_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, MASK_KV)
    acc, l_i, m_i = softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, MASK_KV, HAS_BIAS)
    return acc, l_i, m_i, k_base + k_step, v_base + v_step
