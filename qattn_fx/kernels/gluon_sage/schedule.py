"""gluon_sage's tile scheduler (FlashAttention-3's split: mainloop, epilogue, tile scheduler): the work items of a
launch and which CTA runs each.

A **work item** is one CTA's worth of work of the non-persistent grid: the ``R`` query rows ``m · R + [0, R)`` of
one (batch, head) (``R`` = :attr:`~.config.GluonConfig.rows`), over all its keys, or, under a split tail
(:mod:`.tail_split`), one piece of such rows over a key range. Item ``w`` of ``N_M · B · Hq`` whole items is
``(m, bh) = (w % N_M, w // N_M)``; with a split tail the first ``main`` items are whole and each later one is piece
``t % splits`` of whole item ``main + t // splits`` (:func:`_item`).

A non-persistent launch runs one item per CTA (its program id). A **persistent** launch (``PERSIST``,
:attr:`~.config.GluonConfig.persist`) starts one CTA per SM and each CTA runs items ``pid, pid + G, pid + 2G, ...``
(``G``: the grid), in that order in every partition: the producer loads the next item's Q and first K/V tiles
while the consumers finish the current one (its last tiles, its epilogue), so there is no per-CTA prologue or
epilogue on the critical path. Consecutive CTAs run consecutive items, the query tiles of one head: its K and V stay
in L2. The partitions count their rings across items: an item's first visit position is the number of key tiles
the CTA visited before it (the producer and every consumer reach the same count), and the Q tiles alternate
between two shared-memory buffers (``q_bar`` / ``q_free`` per buffer, :class:`~.state.Buffers`). In a block-sparse
launch each item points at its own query tile's lists (:func:`_state_at`, :func:`.sparse._lists_at`) and visits
its listed tiles only, maybe none: the count of visited tiles still orders the rings. Each item's computation is the
non-persistent CTA's, so the numerics are the same (:attr:`~.config.GluonConfig.numerics`).
"""

from ._gluon import gl, jit
from .sparse import _lists_at
from .state import _SCALAR, KernelState, Program, _named


@_named
class Schedule:
    """What maps a work item's number to its coordinates: ``n_m`` (query blocks per (batch, head)), ``group``
    (query heads per K/V head), the split tail's ``main`` whole items, ``splits`` pieces per tail item and
    ``kv_split`` keys per piece (``main`` 0, ``splits`` 1 without it), ``seq_kv`` (all keys) and ``items`` (every
    work item of the launch)."""
    n_m: _SCALAR
    group: _SCALAR
    main: _SCALAR
    splits: _SCALAR
    kv_split: _SCALAR
    seq_kv: _SCALAR
    items: _SCALAR


@_named
class WorkItem:
    """One work item's coordinates (:func:`_item`): query block ``pid_m`` of (batch, head) ``pid_bh``, its keys
    ``[kv0, kv0 + kv_len)``, its workspace row block ``piece`` (-1: a whole item) and piece number ``split`` (0 for
    a whole item)."""
    pid_m: _SCALAR
    pid_bh: _SCALAR
    kv0: _SCALAR
    kv_len: _SCALAR
    piece: _SCALAR
    split: _SCALAR


@jit
def _item(w, sched, SPLIT_TAIL: gl.constexpr):
    """Work item ``w``'s :class:`WorkItem`."""
    if SPLIT_TAIL:  # items past main are pieces: splits per tail item, each over kv_split keys from kv0
        tail = (w >= sched.main).to(gl.int32)
        t = gl.maximum(w - sched.main, 0)
        g = w + tail * (sched.main + t // sched.splits - w)
        split = t % sched.splits
        kv0 = tail * split * sched.kv_split
        kv_len = sched.seq_kv + tail * (gl.minimum(sched.seq_kv - kv0, sched.kv_split) - sched.seq_kv)
        piece = tail * (t + 1) - 1
    else:
        g = w
        split = w * 0
        kv0 = split
        kv_len = sched.seq_kv
        piece = split - 1
    return WorkItem(pid_m=g % sched.n_m, pid_bh=g // sched.n_m, kv0=kv0, kv_len=kv_len, piece=piece, split=split)


@jit
def _q_bar(bufs, n, flags):
    """Item ``n``'s Q barrier: ``q_bar[n % 2]`` in a persistent launch, else the CTA's one (``n`` is 0)."""
    if flags.PERSIST:
        bar = bufs.q_bar.index(n % 2)
    else:
        bar = bufs.q_bar
    return bar


@jit
def _state_at(st, w, ROWS: gl.constexpr):
    """The :class:`~.state.KernelState` of work item ``w`` (:func:`_item`) of a persistent launch: its
    :class:`~.state.Program` (coordinates and key range of a query block of ``ROWS`` rows) and, in a block-sparse
    launch, its block-list pointers (:func:`.sparse._lists_at`: ``st.ptrs`` holds the lists' whole arrays)."""
    base = st.prog  # (the CTA's first item's: its strides and scalars serve every item)
    sched = st.sched
    flags = st.flags
    item = _item(w, sched, flags.SPLIT_TAIL)
    h = item.pid_bh % base.H
    prog = Program(base.stride_qsb, base.stride_qsh, base.stride_qsn, base.stride_ksb, base.stride_ksh,
                   base.stride_ksn, base.stride_vsb, base.stride_vsh, base.stride_vsd, base.stride_ob, base.stride_oh,
                   base.stride_os, base.H, base.SEQ_Q, item.kv_len, item.pid_bh // base.H, h, h // sched.group,
                   item.pid_m * ROWS, base.kp_xh, base.kp_gb, base.kp_gh, item.kv0, item.piece, base.stride_kbb,
                   base.qk_scale, base.skip_thr, base.skip_count)
    ptrs = _lists_at(st.ptrs, item, sched.n_m, sched.seq_kv, sched.splits, flags)
    return KernelState(flags=flags, bufs=st.bufs, ptrs=ptrs, prog=prog, sched=sched)


@jit
def _run_items(st, item: gl.constexpr, CID: gl.constexpr):
    """Run one partition's work, ``item(st, CID, n, first)`` (``st``: the item's :class:`~.state.KernelState`, its
    ``prog`` the item's :class:`~.state.Program`; ``n``: the items this CTA ran before it; ``first``: the key tiles
    they visited, its first ring position; the item returns the key tiles it visited): on the CTA's item, or with
    ``PERSIST`` on each of its items in turn (:func:`_state_at`)."""
    if st.flags.PERSIST:
        BM: gl.constexpr = st.bufs.q_desc.block_type.shape[2]
        ROWS: gl.constexpr = st.bufs.q_smem.type.shape[0] // 2 * BM  # (two Q buffers of the CTA's rows)
        first = gl.program_id(0) * 0  # (loop-carried int32s)
        n = first
        for w in range(gl.program_id(0), st.sched.items, gl.num_programs(0)):
            first += item(_state_at(st, w, ROWS), CID, n, first)
            n += 1
    else:
        item(st, CID, 0, 0)
