"""triton_sage's kernel source: the tile functions and ``_sage_fwd`` (the algorithm: the package docstring).

The host side (:mod:`.launch`) loads this file once per Triton mode, as a module of its own, with
``triton.knobs.runtime.interpret`` set as wanted (``@triton.jit`` picks compiled or interpreted functions when the
module runs): the interpreter tests can turn ``TRITON_INTERPRET`` on after the package was imported, and an offline
compile still gets compiled functions. Constants come from :mod:`qattn_fx.kernels._sage_common`.
"""

import triton
import triton.language as tl

from ... import block_sparse
from .._sage_common import C_INT8_ACC_BITS, C_INT8_ACC_OFFSET, C_LN2, C_LOG2_448, C_LOG2E

#: Keys per block of the block-sparse lists (:data:`qattn_fx.block_sparse.BLOCK_KEYS`; query rows per block are
#: the same number, :data:`~qattn_fx.block_sparse.BLOCK_ROWS`).
C_BLOCK_KEYS = tl.constexpr(block_sparse.BLOCK_KEYS)
C_BLOCK_ROWS = tl.constexpr(block_sparse.BLOCK_ROWS)


@triton.jit
def _qk_tile(q, k_base, k_offs, start_n, SEQ_KV,
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
def _load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr):
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
def _load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_KV: tl.constexpr):
    """K scales of the tile at ``start_n``: a (BLOCK_N,) column vector when ``k_block`` splits the tile, else one
    scalar (``k_block`` a multiple of BLOCK_N), else 1 (``k_block == 0``: already folded into the row scale).

    Loaded before the tile's Q·Kᵀ is issued so that, when Q·Kᵀ runs ahead (``PIPE``), nothing the softmax
    needs waits behind the asynchronous MMA.
    """
    if K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N:
        # grouped: one scale per K_BLOCK columns, (BLOCK_N // K_BLOCK,) values (applied through a 3-D view of S)
        offs_g = start_n // K_BLOCK + tl.arange(0, BLOCK_N // K_BLOCK)
        if MASK_KV:
            ks = tl.load(ks_ptr + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
        else:
            ks = tl.load(ks_ptr + offs_g * stride_ksn)
        ks = (ks.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
    elif K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASK_KV:
            ks = tl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
        else:
            ks = tl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn)
        # cut to 22 significant bits (relative change < 2e-7): then 1.5·2^23·ks is exact in fp32 (see _softmax_pv)
        ks = (ks.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
    elif K_BLOCK > 0:
        ks = tl.load(ks_ptr + (start_n // K_BLOCK) * stride_ksn)
    else:
        ks = 1.0
    return ks


@triton.jit
def _load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N: tl.constexpr, MASK_KV: tl.constexpr, HAS_BIAS: tl.constexpr):
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
    """Online-softmax step for the tile at ``start_n`` given its ``S`` (from :func:`_qk_tile`).

    ``ks``: the tile's K scales (:func:`_load_ks`); ``rs`` (BLOCK_M,) row scale; ``kb``: with ``HAS_BIAS`` the
    tile's key bias in log2 units (:func:`_load_kb`, ``-inf`` for masked keys and past ``SEQ_KV``), added to the
    logits ``z = t·rs + kb`` whose max is then taken directly (a running max of ``-inf``, every key so far masked,
    is used as 0: the tile's P are 0, not NaN); ``MASK_KV``: the tile may run past ``SEQ_KV``. Returns ``(p8,
    alpha, l, m)``: the e4m3 ``P448`` tile, the factor rescaling earlier accumulations, and the updated row sum / max.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_KV:
        n_valid = offs_n < SEQ_KV

    # ---- t = S with per-column K scales applied (exact int32 → fp32 for int8) ------------------------------
    PER_COL: tl.constexpr = K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0
    GROUPED: tl.constexpr = K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N
    if GROUPED:
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
        if PER_COL:
            # t = round(S · ks) in one fma: ks has 22 significant bits, so the constant 1.5·2^23·ks = 3·2^22·ks
            # is exact in fp32 and fma(S + 1.5·2^23, ks, -1.5·2^23·ks) rounds the exact product S·ks once; the
            # interpreter (no fma) gets the same bits from (t - 1.5·2^23)·ks.
            if INTERPRET:
                t = (t - C_INT8_ACC_OFFSET) * ks[None, :]
            else:
                t = tl.fma(t, tl.broadcast_to(ks[None, :], t.shape),
                           tl.broadcast_to(-(ks * C_INT8_ACC_OFFSET)[None, :], t.shape))
        else:
            t = t - C_INT8_ACC_OFFSET
    else:
        t = s
        if PER_COL:
            t = t * ks[None, :]
    if K_BLOCK > 0 and not PER_COL:  # one K scale for the whole tile
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
def _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV,
                QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """:func:`_softmax` then :func:`_pv` for one tile; returns the updated ``(acc, l, m)``."""
    p8, alpha, l_i, m_i = _softmax(l_i, m_i, s, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N,
                                       INTERPRET, MASK_KV, HAS_BIAS)
    acc = _pv(acc, alpha, p8, v, BLOCK_N, PV_FP16, PV_SPLIT)
    return acc, l_i, m_i


@triton.jit
def _pipe_step(acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
               kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
               PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Full tile ``start_n`` of the pipelined loop (``S`` given): tile ``start_n + BLOCK_N``'s Q·Kᵀ issued before
    this tile's softmax and P·V; ``HAS_BIAS``: the tile adds the key bias. Returns ``(acc, l, m, S_next, k_base,
    v_base)`` with the bases advanced by a tile."""
    ks = _load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, False)
    kb = _load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, False, HAS_BIAS)
    k_base += k_step
    s_next = _qk_tile(q, k_base, k_offs, start_n + BLOCK_N, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
    v = _load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, False)
    acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, HAS_BIAS)
    return acc, l_i, m_i, s_next, k_base, v_base + v_step


@triton.jit
def _plain_step(acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Tile ``start_n`` of the plain schedule: its Q·Kᵀ, softmax and P·V (``MASK_KV``: the tail tile, which may
    run past ``SEQ_KV``; ``HAS_BIAS``: with the key bias). Returns ``(acc, l, m, k_base, v_base)`` with the bases
    advanced by a tile."""
    v = _load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, MASK_KV)
    ks = _load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, MASK_KV)
    kb = _load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, MASK_KV, HAS_BIAS)
    s = _qk_tile(q, k_base, k_offs, start_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, MASK_KV)
    acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, MASK_KV, HAS_BIAS)
    return acc, l_i, m_i, k_base + k_step, v_base + v_step


# ------------------------------------------------------------------------------------------------------------------
# Block-sparse walk (SPARSE): a program visits the BLOCK_N sub-tiles of the key tiles its query tile's list names
# ------------------------------------------------------------------------------------------------------------------


@triton.jit
def _listed_start(bi_ptr, it, BLOCK_N: tl.constexpr):
    """First key of sub-tile ``it`` of a program's walk: list entry ``it // SUB`` (``SUB = 128 / BLOCK_N`` sub-tiles
    per listed key tile), its ``it % SUB``-th BLOCK_N keys."""
    SUB: tl.constexpr = C_BLOCK_KEYS // BLOCK_N
    it = tl.cast(it, tl.int32)  # a tensor also under the interpreter, whose loop counters are ints
    return tl.load(bi_ptr + it // SUB) * C_BLOCK_KEYS + (it % SUB) * BLOCK_N


@triton.jit
def _k_at(k_head, start_n, stride_ks):
    """The K base of the tile at key ``start_n`` (a 64-bit offset: a listed tile can lie anywhere in the head)."""
    return k_head + start_n.to(tl.int64) * stride_ks


@triton.jit
def _v_at(v_head, start_n, stride_vs, PV_FP16: tl.constexpr):
    """The V base of the tile at key ``start_n``: keys ``stride_vs`` apart (D-major, ``PV_FP16``) or adjacent."""
    if PV_FP16:
        v_base = v_head + start_n.to(tl.int64) * stride_vs
    else:
        v_base = v_head + start_n.to(tl.int64)
    return v_base


@triton.jit
def _sparse_plain_step(acc, l_i, m_i, q, rs, start_n, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs, ks_ptr,
                       stride_ksn, kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
                       BLOCK_N: tl.constexpr, PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr,
                       INTERPRET: tl.constexpr, MASK_KV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`_plain_step` on the tile at key ``start_n`` (its bases computed, not carried). Returns ``(acc, l,
    m)``."""
    acc, l_i, m_i, _, _ = _plain_step(
        acc, l_i, m_i, q, rs, start_n, _k_at(k_head, start_n, stride_ks), k_offs, 0,
        _v_at(v_head, start_n, stride_vs, PV_FP16), v_offs, 0, ks_ptr, stride_ksn, kb_ptr, SEQ_KV,
        QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, MASK_KV, HAS_BIAS)
    return acc, l_i, m_i


@triton.jit
def _sparse_pipe_step(acc, l_i, m_i, s, q, rs, start_n, next_n, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs,
                      ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
                      BLOCK_N: tl.constexpr, PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr,
                      INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`_pipe_step` on the full tile at ``start_n`` (``S`` given) whose successor in the walk starts at
    ``next_n``: that tile's Q·Kᵀ (masked: it may be the tail) is issued before this tile's softmax and P·V.
    Returns ``(acc, l, m, S_next)``."""
    ks = _load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, False)
    kb = _load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, False, HAS_BIAS)
    s_next = _qk_tile(q, _k_at(k_head, next_n, stride_ks), k_offs, next_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
    v = _load_v(_v_at(v_head, start_n, stride_vs, PV_FP16), v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, False)
    acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, HAS_BIAS)
    return acc, l_i, m_i, s_next


@triton.jit
def _sparse_tiles(acc, l_i, m_i, q, rs, bi_ptr, count, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs,
                  ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
                  BLOCK_N: tl.constexpr, PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                  HAS_BIAS: tl.constexpr, INTERP_LOOP_END: tl.constexpr, PIPE: tl.constexpr):
    """The tile loop over the key tiles a query tile's list names (``bi_ptr``: its ``count`` ascending entries;
    entries past the count are never read). Each listed tile is walked as its ``128 / BLOCK_N`` sub-tiles of
    BLOCK_N keys, those past ``SEQ_KV`` left out: sub-tiles ``[0, n_full)`` of the walk are full (unmasked); the
    last key tile, partial when ``SEQ_KV`` is not a multiple of BLOCK_N and listed, adds one masked tail sub-tile
    (``n_total = n_full + 1``). ``HAS_BIAS``: every visited tile adds the key bias. ``PIPE``: the walk's next
    sub-tile's Q·Kᵀ is issued before this one's softmax, the last sub-tile finished after the loop (masked). A
    list of nothing leaves ``acc``, ``l`` and ``m`` at their initial 0, 0, ``-inf``. Returns ``(acc, l, m)``."""
    SUB: tl.constexpr = C_BLOCK_KEYS // BLOCK_N
    n_keys = (SEQ_KV + C_BLOCK_KEYS - 1) // C_BLOCK_KEYS  # key tiles of the head
    end = (SEQ_KV // BLOCK_N) * BLOCK_N  # the full sub-tiles end here; [end, SEQ_KV) is the tail
    last = tl.load(bi_ptr + (count - 1), mask=count > 0, other=-1)  # the ascending list's last entry
    has_last = last == n_keys - 1
    n_full = count * SUB - tl.where(has_last, SUB - (end - (n_keys - 1) * C_BLOCK_KEYS) // BLOCK_N, 0)
    has_tail = has_last & (end < SEQ_KV)
    # Under the interpreter loop bounds are constexprs (numpy scalars cannot bound range()): the host passes the
    # most sub-tiles a list can name, and iterations past the walk do nothing.
    if PIPE == 1:
        n_total = n_full + has_tail.to(tl.int32)
        # The walk's first sub-tile (none: a start past the keys, so its Q·Kᵀ loads nothing), its Q·Kᵀ issued
        start_n = tl.load(bi_ptr, mask=n_total > 0, other=n_keys) * C_BLOCK_KEYS
        s = _qk_tile(q, _k_at(k_head, start_n, stride_ks), k_offs, start_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
        for it in range(0, INTERP_LOOP_END if INTERPRET else n_total - 1):
            if INTERPRET:
                if it < n_total - 1:
                    next_n = _listed_start(bi_ptr, it + 1, BLOCK_N)
                    acc, l_i, m_i, s = _sparse_pipe_step(
                        acc, l_i, m_i, s, q, rs, start_n, next_n, k_head, k_offs, stride_ks, v_head, v_offs,
                        stride_vs, ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT,
                        INTERPRET, HAS_BIAS)
                    start_n = next_n
            else:
                next_n = _listed_start(bi_ptr, it + 1, BLOCK_N)
                acc, l_i, m_i, s = _sparse_pipe_step(
                    acc, l_i, m_i, s, q, rs, start_n, next_n, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs,
                    ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET,
                    HAS_BIAS)
                start_n = next_n
        # The last sub-tile, masked. An empty walk runs it too, without a branch (one around it keeps the loop's
        # registers apart and spills), on keys past SEQ_KV (nothing loaded; its K scales are the first ones, as
        # an unmasked scale load past the end must not run), and discards it: its state goes back to the initial
        # 0, 0, -inf (that step's arithmetic on m = -inf is NaN).
        empty = n_total == 0
        v = _load_v(_v_at(v_head, start_n, stride_vs, PV_FP16), v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, True)
        ks = _load_ks(ks_ptr, stride_ksn, tl.where(empty, 0, start_n), SEQ_KV, K_BLOCK, BLOCK_N, True)
        kb = _load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, True, HAS_BIAS)
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                    BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)
        acc = tl.where(empty, 0.0, acc)
        l_i = tl.where(empty, 0.0, l_i)
        m_i = tl.where(empty, float("-inf"), m_i)
    else:
        for it in range(0, INTERP_LOOP_END if INTERPRET else n_full):
            if INTERPRET:
                if it < n_full:
                    acc, l_i, m_i = _sparse_plain_step(
                        acc, l_i, m_i, q, rs, _listed_start(bi_ptr, it, BLOCK_N), k_head, k_offs, stride_ks, v_head,
                        v_offs, stride_vs, ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16,
                        PV_SPLIT, INTERPRET, False, HAS_BIAS)
            else:
                acc, l_i, m_i = _sparse_plain_step(
                    acc, l_i, m_i, q, rs, _listed_start(bi_ptr, it, BLOCK_N), k_head, k_offs, stride_ks, v_head,
                    v_offs, stride_vs, ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16,
                    PV_SPLIT, INTERPRET, False, HAS_BIAS)
        if has_tail:  # the last key tile's partial sub-tile, masked
            acc, l_i, m_i = _sparse_plain_step(
                acc, l_i, m_i, q, rs, end, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs, ks_ptr, stride_ksn,
                kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)
    return acc, l_i, m_i


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
    its query tile's list names (:func:`_sparse_tiles`; every one adds the key bias when ``HAS_BIAS``).
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
        acc, l_i, m_i = _sparse_tiles(
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
            s = _qk_tile(q, k_base, k_offs, 0, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
            for start_n in range(0, (0 if HAS_BIAS else INTERP_LOOP_END) if INTERPRET else lo, BLOCK_N):
                acc, l_i, m_i, s, k_base, v_base = _pipe_step(
                    acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                    stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False)
            if HAS_BIAS:
                for start_n in range(0 if INTERPRET else lo, INTERP_LOOP_END if INTERPRET else hi, BLOCK_N):
                    acc, l_i, m_i, s, k_base, v_base = _pipe_step(
                        acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                        stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True)
            for start_n in range(INTERP_LOOP_END if INTERPRET else hi, INTERP_LOOP_END if INTERPRET else end, BLOCK_N):
                acc, l_i, m_i, s, k_base, v_base = _pipe_step(
                    acc, l_i, m_i, s, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                    stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False)
            v = _load_v(v_base, v_offs, end, SEQ_KV, BLOCK_N, INTERPRET, True)  # the last tile (full or tail), masked
            ks = _load_ks(ks_ptr, stride_ksn, end, SEQ_KV, K_BLOCK, BLOCK_N, True)
            kb = _load_kb(kb_ptr, end, SEQ_KV, BLOCK_N, True, HAS_BIAS)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, end, SEQ_KV, QK_KIND,
                                            K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)
        else:
            for start_n in range(0, (0 if HAS_BIAS else INTERP_LOOP_END) if INTERPRET else lo, BLOCK_N):
                acc, l_i, m_i, k_base, v_base = _plain_step(
                    acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                    kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, False)
            if HAS_BIAS:
                for start_n in range(0 if INTERPRET else lo, INTERP_LOOP_END if INTERPRET else hi, BLOCK_N):
                    acc, l_i, m_i, k_base, v_base = _plain_step(
                        acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr,
                        stride_ksn, kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False,
                        True)
            for start_n in range(INTERP_LOOP_END if INTERPRET else hi, INTERP_LOOP_END if INTERPRET else end, BLOCK_N):
                acc, l_i, m_i, k_base, v_base = _plain_step(
                    acc, l_i, m_i, q, rs, start_n, k_base, k_offs, k_step, v_base, v_offs, v_step, ks_ptr, stride_ksn,
                    kb_ptr, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, False)
            if end < SEQ_KV:  # the tail tile, masked
                acc, l_i, m_i, _, _ = _plain_step(
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
