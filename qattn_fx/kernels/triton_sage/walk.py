"""triton_sage's block-sparse walk (Triton source, the ``SPARSE`` constexpr): a program visits the BLOCK_N
sub-tiles of the key tiles its query tile's list names (:mod:`qattn_fx.block_sparse`), with the steps of
:mod:`.tiles`. The walk's rules: the package docstring, "Block-sparse calls".

Loaded by :mod:`.source` once per Triton mode; :mod:`.kernel` calls :func:`sparse_tiles`.
"""

import triton
import triton.language as tl

from ... import block_sparse
from .source import sibling

_tiles = sibling("tiles")
load_kb, load_ks, load_v, plain_step, qk_tile, softmax_pv = (
    _tiles.load_kb, _tiles.load_ks, _tiles.load_v, _tiles.plain_step, _tiles.qk_tile, _tiles.softmax_pv)

#: Keys per block of the block-sparse lists (:data:`qattn_fx.block_sparse.BLOCK_KEYS`; query rows per block are
#: the same number, :data:`~qattn_fx.block_sparse.BLOCK_ROWS`).
C_BLOCK_KEYS = tl.constexpr(block_sparse.BLOCK_KEYS)
C_BLOCK_ROWS = tl.constexpr(block_sparse.BLOCK_ROWS)


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
    """:func:`plain_step` on the tile at key ``start_n`` (its bases computed, not carried). Returns ``(acc, l,
    m)``."""
    acc, l_i, m_i, _, _ = plain_step(
        acc, l_i, m_i, q, rs, start_n, _k_at(k_head, start_n, stride_ks), k_offs, 0,
        _v_at(v_head, start_n, stride_vs, PV_FP16), v_offs, 0, ks_ptr, stride_ksn, kb_ptr, SEQ_KV,
        QK_KIND, K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, MASK_KV, HAS_BIAS)
    return acc, l_i, m_i


@triton.jit
def _sparse_pipe_step(acc, l_i, m_i, s, q, rs, start_n, next_n, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs,
                      ks_ptr, stride_ksn, kb_ptr, SEQ_KV, QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr,
                      BLOCK_N: tl.constexpr, PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr,
                      INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`pipe_step` on the full tile at ``start_n`` (``S`` given) whose successor in the walk starts at
    ``next_n``: that tile's Q·Kᵀ (masked: it may be the tail) is issued before this tile's softmax and P·V.
    Returns ``(acc, l, m, S_next)``."""
    ks = load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, False)
    kb = load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, False, HAS_BIAS)
    s_next = qk_tile(q, _k_at(k_head, next_n, stride_ks), k_offs, next_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
    v = load_v(_v_at(v_head, start_n, stride_vs, PV_FP16), v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, False)
    acc, l_i, m_i = softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, HAS_BIAS)
    return acc, l_i, m_i, s_next


@triton.jit
def sparse_tiles(acc, l_i, m_i, q, rs, bi_ptr, count, k_head, k_offs, stride_ks, v_head, v_offs, stride_vs,
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
        s = qk_tile(q, _k_at(k_head, start_n, stride_ks), k_offs, start_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
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
        v = load_v(_v_at(v_head, start_n, stride_vs, PV_FP16), v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, True)
        ks = load_ks(ks_ptr, stride_ksn, tl.where(empty, 0, start_n), SEQ_KV, K_BLOCK, BLOCK_N, True)
        kb = load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N, True, HAS_BIAS)
        acc, l_i, m_i = softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
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
