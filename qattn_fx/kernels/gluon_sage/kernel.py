"""gluon_sage's kernel: shared memory and barriers, then the consumer and producer partitions
(``gl.warp_specialize``)."""

from ._gluon import gl, jit, mbarrier, quantizes_q
from .consumer import _consume
from .producer import _producer
from .schedule import Schedule, WorkItem, _item
from .sparse import _lists_at
from .state import Buffers, KernelFlags, KernelState, Pointers, Program


@jit
def _sage_fwd_ws(
    q_desc, k_desc, v_desc, ks_desc, kp_desc, QS, KS, VS, KB, KBR, Out, Lse,
    qk_scale,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsd,
    stride_kbb,
    stride_ob, stride_oh, stride_os,
    H, GROUP, SEQ_Q, SEQ_KV, kp_xh, kp_gb, kp_gh,
    N_M, MAIN_CTAS, SPLITS, KV_SPLIT, OutWs, LseWs, SkipThr, SkipCount, ITEMS, BI, BC, BB,
    QK_KIND: gl.constexpr, Q_BLOCK: gl.constexpr, K_BLOCK: gl.constexpr, RETURN_LSE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_NREG: gl.constexpr, PRODUCER_NREG: gl.constexpr,
    AHEAD: gl.constexpr = 0, KS_TMA: gl.constexpr = 0, PERMK: gl.constexpr = 0, CONSUMERS: gl.constexpr = 2,
    TARRIVE: gl.constexpr = 0, MMASUM: gl.constexpr = 0, SPLIT_TAIL: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0,
    SKIP: gl.constexpr = 0, SPARSE: gl.constexpr = 0, PERSIST: gl.constexpr = 0, PAIR: gl.constexpr = 0,
):
    """Grid ``(N_M, B · Hq)``: CTA ``(m, bh)`` owns query rows ``m · R + [0, R)`` of (batch, head) ``bh``, ``R`` =
    64 · ``CONSUMERS`` (:attr:`GluonConfig.rows`): 128 rows (``num_warps=4``: consumer 0, + 4: consumer 1, + 1: the
    producer); ``CONSUMERS=3`` (``trio``): 192 rows and a third consumer; ``CONSUMERS=4`` (``quad``): 256 rows and
    a fourth. Each partition gets the :class:`~.state.KernelState` built here (flags, buffers, pointers, program).

    ``SPLIT_TAIL`` (:mod:`.tail_split`): a 1-D grid of the same CTAs in the same order (CTA ``g`` is ``(g % N_M,
    g // N_M)``): ``MAIN_CTAS`` whole ones, then ``SPLITS`` pieces for each remaining CTA ``g`` (the last, partial
    wave), piece ``s`` over keys ``[s · KV_SPLIT, (s + 1) · KV_SPLIT)``;
    pieces write their normalized fp32 O and natural-log LSE to ``OutWs (pieces, R, Dv)`` / ``LseWs (pieces, R)``,
    which :func:`.tail_split.merge` combines into ``Out`` (and ``Lse``).

    Descriptors: Q ``(B, Hq, Sq, D)`` block ``(1, 1, 64, D)``, K ``(B, Hkv, Skv, D)`` block ``(1, 1, BLOCK_N, D)``,
    V ``(B, Hkv, Dv, Skv)`` (the sequence-major storage) block ``(1, 1, Dv, BLOCK_N)``; with ``KS_TMA`` the K
    scales flattened to 1-D (unit stride on tokens), block ``BLOCK_N / k_block`` (at least 32: 128 bytes), else
    ``None`` (scales by pointer ``KS``).

    Q in bf16/fp16 with int8 K (``Q_BLOCK == 1``): the consumers load their Q rows by pointer from ``QS`` (then
    the Q itself, with its batch/head/token strides in ``stride_qs*``) and quantize them per token into shared
    memory (:func:`.consumer._quantize_q_rows`, the numerics of ``qattn::quantize_per_block``); the producer loads
    no Q and ``q_desc`` only gives the box.

    ``HAS_BIAS``: the key bias ``KB`` (fp32 ``(B|1, Skv)``, batch stride ``stride_kbb``) and ``KBR`` (int32
    ``(B|1, 2)``: per bias row, the first key whose bias is not 0 and one past the last;
    :func:`.._sage_common.bias_range`). Only the key tiles that range meets, and the last tile, load and add the
    bias; the others run the loop without it (a key-padding mask touches a few tiles at the end of the keys).

    ``SKIP`` (serial schedules, no tail split): Skip-Softmax's tile test (:mod:`qattn_fx.skip_softmax`) with
    ``log2 λ`` read from ``SkipThr`` (fp32, one element, on the device: a schedule may change it between calls
    without a new launch configuration); ``SKIP == 2`` also counts the skipped tiles into ``SkipCount`` (int32).

    ``SPARSE`` (two consumers: a CTA is one 128-row query tile of :mod:`qattn_fx.block_sparse`): ``BI`` int32
    ``(B, Hq, N_M, ceil(SEQ_KV / 128))`` and ``BC`` int32 ``(B, Hq, N_M)``, the key tiles each CTA visits
    (:mod:`.sparse`), and ``BB`` int32 ``(B, Hq, N_M, NB)``, the list positions that bound a split piece's keys
    (``SPLITS + 1`` with ``SPLIT_TAIL``) and the key bias's span (2 with ``HAS_BIAS``), in that order
    (:func:`.launch.visit_bounds`; ``None`` with neither); else all three ``None``.

    ``PERSIST`` (:mod:`.schedule`): a 1-D grid of at most one CTA per SM, each running the work items ``pid, pid +
    G, ...`` of the ``ITEMS`` (int) the non-persistent grid would run one per CTA (with ``SPLIT_TAIL``: the same
    whole items and pieces; with ``SPARSE`` each item points at its own lists); Q in two buffers. ``ITEMS``: ``None``
    otherwise.

    ``PAIR`` (two consumers, serial, ``MMASUM``, no key bias, no Skip-Softmax): consecutive visited key tiles in
    online-softmax steps of two (:func:`.pair._pair_mainloop`).
    """
    BM: gl.constexpr = q_desc.block_type.shape[2]
    if PERSIST or SPLIT_TAIL:  # a 1-D grid of work items (.schedule): this CTA's one (a persistent CTA's first)
        sched = Schedule(n_m=N_M, group=GROUP, main=MAIN_CTAS, splits=SPLITS, kv_split=KV_SPLIT, seq_kv=SEQ_KV,
                         items=ITEMS if PERSIST else MAIN_CTAS)  # (items: read by persistent loops only)
        item = _item(gl.program_id(0), sched, SPLIT_TAIL)
    else:  # (the same CTA order as a 2-D grid (N_M, B·Hq))
        pid_m = gl.program_id(0)
        kv0 = pid_m * 0
        item = WorkItem(pid_m=pid_m, pid_bh=gl.program_id(1), kv0=kv0, kv_len=SEQ_KV, piece=kv0 - 1, split=kv0)
    pid_bh = item.pid_bh
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    NC: gl.constexpr = CONSUMERS  # consumer warpgroups in this CTA (GluonConfig.consumers)
    start_m = item.pid_m * (NC * BM)

    QBUF: gl.constexpr = 2 if PERSIST else 1  # Q buffers: a persistent CTA loads the next item's Q during this one
    if quantizes_q(q_desc.dtype, k_desc.dtype):  # each consumer writes its Q tile quantized (the box's int8 layout)
        q_smem = gl.allocate_shared_memory(k_desc.dtype, [QBUF * NC] + q_desc.block_type.shape,
                                           gl.NVMMASharedLayout.get_default_for(q_desc.block_type.shape, k_desc.dtype))
    else:
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [QBUF * NC] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if KS_TMA:
        # twice the K ring's depth: tile j's scales stay until tile j + 2·STAGES, i.e. past the release of tile j's
        # K slot, so consumers may read them any time after its ready barrier
        ks_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES] + ks_desc.block_type.shape, ks_desc.layout)
    else:
        ks_smem = k_smem  # unused
    if MMASUM:  # each consumer's ones-MMA B operand: 8 rows of e4m3 ones over the tile's keys
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [NC, 8, BLOCK_N],
                                              gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], gl.float8e4nv))
    else:
        ones_smem = k_smem  # unused
    if PERSIST:  # a Q barrier per buffer, and the consumers' release of each (one arrive each)
        q_bar = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QBUF):
            mbarrier.init(q_free.index(i), count=NC)
        for i in gl.static_range(QBUF):
            mbarrier.init(q_bar.index(i), count=1)
    else:
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        q_free = q_bar  # unused
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # every consumer (TARRIVE: every consumer thread) arrives on each release event
        mbarrier.init(kv_free.index(i), count=NC * 128 if TARRIVE else NC)

    bufs = Buffers(q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, ks_desc=ks_desc, kp_desc=kp_desc, q_smem=q_smem,
                   k_smem=k_smem, v_smem=v_smem, ks_smem=ks_smem, ones_smem=ones_smem, q_bar=q_bar, q_free=q_free,
                   k_ready=k_ready, v_ready=v_ready, kv_free=kv_free)
    # the constexprs travel as an aggregate (in a plain tuple Gluon would turn them into tensors)
    flags = KernelFlags(QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK, TARRIVE, MMASUM,
                        SPLIT_TAIL, HAS_BIAS, SKIP, SPARSE, PERSIST, PAIR)
    ptrs = Pointers(QS=QS, KS=KS, VS=VS, Out=Out, Lse=Lse, OutWs=OutWs, LseWs=LseWs, KB=KB, KBR=KBR, BI=BI, BC=BC,
                    BP=BB, BR=BB)  # (the block lists' arrays; None: a dense launch)
    if not PERSIST:  # this CTA's query tile's list (a persistent CTA points at each item's in turn: .schedule)
        ptrs = _lists_at(ptrs, item, N_M, SEQ_KV, SPLITS, flags)
    # assigned as a plain tuple, the scalars become values (an int Triton specialized to the constexpr 1 becomes an
    # i32 constant here), so the worker partitions take them as captures, not as constants (this keeps the PTX)
    scalars = (stride_qsb, stride_qsh, stride_qsn, stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh,
               stride_vsd, stride_ob, stride_oh, stride_os, H, SEQ_Q, item.kv_len, b, h, hk, start_m, kp_xh, kp_gb,
               kp_gh, item.kv0, item.piece, stride_kbb, qk_scale, SkipThr, SkipCount)
    prog = Program(*scalars)
    st = KernelState(flags=flags, bufs=bufs, ptrs=ptrs, prog=prog, sched=sched if PERSIST else 0)
    # one literal partition list per CTA shape: Triton 3.6's Gluon cannot bind a list of (function, args) to a name
    # ("cannot convert JITFunction ... to tensor"), so the list cannot be built in a static_range loop
    if CONSUMERS == 4:
        gl.warp_specialize([(_consume, (st, 0)), (_consume, (st, 1)), (_consume, (st, 2)),
                            (_consume, (st, 3)), (_producer, (st,))], [4, 4, 4, 1],
                           [CONSUMER_NREG, CONSUMER_NREG, CONSUMER_NREG, PRODUCER_NREG])
    elif CONSUMERS == 3:
        gl.warp_specialize([(_consume, (st, 0)), (_consume, (st, 1)), (_consume, (st, 2)),
                            (_producer, (st,))], [4, 4, 1], [CONSUMER_NREG, CONSUMER_NREG, PRODUCER_NREG])
    else:
        gl.warp_specialize([(_consume, (st, 0)), (_consume, (st, 1)), (_producer, (st,))],
                           [4, 1], [CONSUMER_NREG, PRODUCER_NREG])
