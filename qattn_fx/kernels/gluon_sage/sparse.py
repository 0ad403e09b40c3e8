"""gluon_sage's block-sparse visits (``SPARSE``, :mod:`qattn_fx.block_sparse`): which key tiles a CTA runs.

A block-sparse launch runs two consumer warpgroups per CTA, so a work item's 128 query rows are one query tile of
the lists; :func:`_lists_at` points :attr:`~.state.Pointers.BI` / :attr:`~.state.Pointers.BC` at its tile's list and
count (once per CTA; in a persistent launch, :mod:`.schedule`, once per work item).
The producer and the consumers both walk the *visited* tiles: position ``i`` (``0 .. n - 1``) is what the rings'
slots and phases count, and :func:`_key_tile` gives the key tile ``j`` it holds (``BLOCK_N`` = 64: both halves of a
listed 128-key tile, in order). A split tail piece (``SPLIT_TAIL``, keys ``[kv0, kv0 + kv_len)``, ``kv0`` a
multiple of 128: :func:`.launch.tail_plan`) visits the listed tiles inside its range (:func:`_visits`); the host
gives the list positions that bound each piece and the key bias's span (:func:`.launch.visit_bounds`), so the kernel
searches nothing.

Outside block-sparse launches :func:`_key_tile` is the position itself, so the dense kernel is unchanged.
"""

from ._gluon import gl, jit
from .state import _SCALAR, Pointers, _named
from ... import block_sparse

#: Keys per block of the lists (:data:`qattn_fx.block_sparse.BLOCK_KEYS`).
C_BLOCK_KEYS = gl.constexpr(block_sparse.BLOCK_KEYS) if gl is not None else block_sparse.BLOCK_KEYS


@_named
class Visits:
    """The key tiles a work item visits, as :func:`_key_tile` reads them: ``entries``, a pointer to its first list
    entry (the list position ``e0`` of :func:`_visits`), and ``off``, the key tile its keys start at (``kv0 /
    BLOCK_N``); constexpr zeros in a dense launch, where the visit position is the key tile."""
    entries: _SCALAR
    off: _SCALAR


@jit
def _lists_at(ptrs, item, n_m, seq_kv, splits, flags):
    """``ptrs`` (:class:`~.state.Pointers`) with the block-list pointers of work ``item`` (:class:`~.schedule.WorkItem`:
    its query block, (batch, head) and piece): ``BI`` at its query tile's list (int32 ``(B, Hq, n_m, cdiv(seq_kv,
    128))``), ``BC`` at its count (``(B, Hq, n_m)``), ``BP`` at its piece's first and end list positions
    (``SPLIT_TAIL``) and ``BR`` at those bounding the key bias's span (``HAS_BIAS``), in the bounds' rows of ``NB``
    positions (:func:`.launch.visit_bounds`). ``ptrs``' list fields are the launch's whole arrays (``BP`` and ``BR``
    both the bounds, ``None`` with neither); outside ``SPARSE`` it is returned as it is."""
    if flags.SPARSE:
        tile_row = item.pid_bh * n_m + item.pid_m
        blk_index = ptrs.BI + tile_row.to(gl.int64) * gl.cdiv(seq_kv, C_BLOCK_KEYS)
        blk_count = ptrs.BC + tile_row
        blk_piece = ptrs.BP
        blk_bias = ptrs.BR
        NB = flags.SPLIT_TAIL * (splits + 1) + 2 * flags.HAS_BIAS  # the bounds' positions per query tile
        if flags.SPLIT_TAIL:  # piece split's first and end list positions (a whole item reads its count instead)
            blk_piece = ptrs.BP + tile_row.to(gl.int64) * NB + item.split
        if flags.HAS_BIAS:  # the list positions bounding the key bias's span
            blk_bias = ptrs.BR + tile_row.to(gl.int64) * NB + (NB - 2)
        ptrs = Pointers(QS=ptrs.QS, KS=ptrs.KS, VS=ptrs.VS, Out=ptrs.Out, Lse=ptrs.Lse, OutWs=ptrs.OutWs,
                        LseWs=ptrs.LseWs, KB=ptrs.KB, KBR=ptrs.KBR, BI=blk_index, BC=blk_count, BP=blk_piece,
                        BR=blk_bias)
    return ptrs


@jit
def _visits(ptrs, prog, flags):
    """``(vis, n, e0)``: the work item's :class:`Visits` for :func:`_key_tile` (from list position ``e0``), and ``n``,
    the ``BLOCK_N`` tiles it runs. A whole CTA runs its ``count`` listed tiles; a split tail piece the entries inside
    its key range, whose list positions the host computed (``BP``, :func:`.launch.visit_bounds`)."""
    R: gl.constexpr = C_BLOCK_KEYS // flags.BLOCK_N
    count = gl.load(ptrs.BC)
    if flags.SPLIT_TAIL:
        whole = prog.piece < 0
        e0 = gl.where(whole, 0, gl.load(ptrs.BP))
        e1 = gl.where(whole, count, gl.load(ptrs.BP + 1))
        off = prog.kv0 // flags.BLOCK_N
    else:
        e0 = 0
        e1 = count
        off = 0
    return Visits(entries=ptrs.BI + e0, off=off), (e1 - e0) * R, e0


@jit
def _key_tile(i, vis, flags):
    """The key tile (of ``BLOCK_N`` keys, from the CTA's first key) at visit position ``i``: ``i`` itself in a dense
    launch; with ``SPARSE`` read from the list (``vis``: :class:`Visits`)."""
    if flags.SPARSE:
        R: gl.constexpr = C_BLOCK_KEYS // flags.BLOCK_N
        if R == 1:
            j = gl.load(vis.entries + i) - vis.off
        else:
            j = gl.load(vis.entries + i // R) * R + i % R - vis.off
    else:
        j = i
    return j


@jit
def _visit_bias_tiles(ptrs, e0, n_tiles, flags):
    """``(b0, b1)`` for :func:`.mainloop._mainloop` in visit positions: the visited tiles ``[b0, b1)`` cover every
    visited 128-key block that meets the keys whose bias is not 0 (``KBR``'s span for this batch's bias row,
    :func:`.._sage_common.bias_range`; the host gives its bounds as list positions, ``BR``); bounded by
    ``n_tiles - 1`` (the last visited tile adds the bias anyway). ``e0``: the CTA's first list position
    (:func:`_visits`)."""
    R: gl.constexpr = C_BLOCK_KEYS // flags.BLOCK_N
    b0 = gl.minimum(gl.maximum((gl.load(ptrs.BR) - e0) * R, 0), n_tiles - 1)
    b1 = gl.minimum(gl.maximum((gl.load(ptrs.BR + 1) - e0) * R, b0), n_tiles - 1)
    return b0, b1
