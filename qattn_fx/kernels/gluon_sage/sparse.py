"""gluon_sage's block-sparse visits (``SPARSE``, :mod:`qattn_fx.block_sparse`): which key tiles a CTA runs.

A block-sparse launch runs two consumer warpgroups per CTA, so a CTA's 128 query rows are one query tile of the
lists; the kernel points :attr:`~.state.Pointers.BI` / :attr:`~.state.Pointers.BC` at its tile's list and count.
The producer and the consumers both walk the *visited* tiles: position ``i`` (``0 .. n - 1``) is what the rings'
slots and phases count, and :func:`_key_tile` gives the key tile ``j`` it holds (``BLOCK_N`` = 64: both halves of a
listed 128-key tile, in order). A split tail piece (``SPLIT_TAIL``, keys ``[kv0, kv0 + kv_len)``, ``kv0`` a
multiple of 128: :func:`.launch.tail_plan`) visits the listed tiles inside its range (:func:`_visits`).

Outside block-sparse launches :func:`_key_tile` is the position itself, so the dense kernel is unchanged.
"""

from ._gluon import gl, jit
from ... import block_sparse

#: Keys per block of the lists (:data:`qattn_fx.block_sparse.BLOCK_KEYS`).
C_BLOCK_KEYS = gl.constexpr(block_sparse.BLOCK_KEYS) if gl is not None else block_sparse.BLOCK_KEYS


@jit
def _entries_below(lst, n, limit):
    """How many of the first ``n`` entries of the ascending list at ``lst`` are below ``limit`` (the position of
    the first entry ``>= limit``): a binary search of scalar loads (no cross-warp reduction, few registers)."""
    lo = n * 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        below = gl.load(lst + mid) < limit
        lo = gl.where(below, mid + 1, lo)
        hi = gl.where(below, hi, mid)
    return lo


@jit
def _visits(ptrs, prog, flags):
    """``(vis, n)``: the CTA's visits, ``vis = (entries, off)`` for :func:`_key_tile` (a pointer to its first list
    entry, key tiles counted from ``off`` = ``kv0 / BLOCK_N``) and ``n`` the ``BLOCK_N`` tiles it runs. A whole CTA
    runs its ``count`` listed tiles; a split tail piece the entries inside its key range."""
    R: gl.constexpr = C_BLOCK_KEYS // flags.BLOCK_N
    count = gl.load(ptrs.BC)
    if flags.SPLIT_TAIL:
        e0 = _entries_below(ptrs.BI, count, prog.kv0 // C_BLOCK_KEYS)
        e1 = _entries_below(ptrs.BI, count, gl.cdiv(prog.kv0 + prog.kv_len, C_BLOCK_KEYS))
        off = prog.kv0 // flags.BLOCK_N
    else:
        e0 = count * 0
        e1 = count
        off = 0
    return (ptrs.BI + e0, off), (e1 - e0) * R


@jit
def _key_tile(i, vis, flags):
    """The key tile (of ``BLOCK_N`` keys, from the CTA's first key) at visit position ``i``: ``i`` itself in a dense
    launch; with ``SPARSE`` read from the list (``vis``: :func:`_visits`)."""
    if flags.SPARSE:
        entries, off = vis
        R: gl.constexpr = C_BLOCK_KEYS // flags.BLOCK_N
        if R == 1:
            j = gl.load(entries + i) - off
        else:
            j = gl.load(entries + i // R) * R + i % R - off
    else:
        j = i
    return j


@jit
def _visit_bias_tiles(ptrs, prog, n_tiles, flags):
    """``(b0, b1)`` for :func:`.mainloop._mainloop` in visit positions: the visited tiles ``[b0, b1)`` cover every
    visited 128-key block that meets the keys whose bias is not 0 (``KBR``'s span for this batch's bias row,
    :func:`.._sage_common.bias_range`); bounded by ``n_tiles - 1`` (the last visited tile adds the bias anyway)."""
    R: gl.constexpr = C_BLOCK_KEYS // flags.BLOCK_N
    count = gl.load(ptrs.BC)
    if flags.SPLIT_TAIL:  # (the piece's first entry)
        e0 = _entries_below(ptrs.BI, count, prog.kv0 // C_BLOCK_KEYS)
    else:
        e0 = 0
    kbr = ptrs.KBR + 2 * gl.where(prog.stride_kbb != 0, prog.b, 0)
    i0 = (_entries_below(ptrs.BI, count, gl.load(kbr) // C_BLOCK_KEYS) - e0) * R
    i1 = (_entries_below(ptrs.BI, count, gl.cdiv(gl.load(kbr + 1), C_BLOCK_KEYS)) - e0) * R
    b0 = gl.minimum(gl.maximum(i0, 0), n_tiles - 1)
    b1 = gl.minimum(gl.maximum(i1, b0), n_tiles - 1)
    return b0, b1
