"""gluon_sage's kernel state as named aggregates (the Gluon attention tutorial's ``AttentionConfig`` /
``AttentionProgram`` pattern): what :func:`.kernel._sage_fwd_ws` hands to every partition through
``gl.warp_specialize``, read by field name in :mod:`.producer` and :mod:`.consumer`.

* :class:`KernelFlags`: the compile-time choices (constexprs only);
* :class:`Buffers`: the TMA descriptors, the shared-memory rings and the mbarriers of the CTA;
* :class:`Pointers`: the global tensors read or written by pointer;
* :class:`Program`: the coordinates, key range, strides and scalars of the work item a partition runs;
* :class:`~.schedule.Schedule`: what maps a work item's number to its coordinates (persistent launches);
* :class:`KernelState`: these together, the one argument of each partition.

An aggregate of runtime values goes through ``gl.warp_specialize`` as its fields, flattened in declaration order (the
order the partitions' captures take); ``tools/ptx_compare.py`` checks that a change keeps the PTX.
"""

from ._gluon import aggregate, constexpr_function, gl, tma

#: A kernel scalar: Triton specializes an int argument equal to 1 into a constexpr.
_SCALAR = gl.tensor | gl.constexpr


def _named(cls):
    """An aggregate built with every field, in declaration order then by keyword (``Cls(a, b, name=value, ...)``),
    from values as the kernel has them (tensors, descriptors, constexprs)."""
    names = tuple(cls.__annotations__)

    def __init__(self, *values, **fields):
        fields.update(zip(names, values))
        if len(values) > len(names) or set(fields) != set(names):
            raise TypeError(f"{cls.__name__} takes the fields {names}; got {len(values)} values and {tuple(fields)}")
        for name in names:  # (a constexpr function gets constexprs unwrapped: wrap them again)
            value = fields[name]
            setattr(self, name, value if isinstance(value, gl.base_value) else gl.constexpr(value))

    cls.__init__ = constexpr_function(__init__)
    named = aggregate(cls)
    named.FIELDS = names  # (the aggregate class keeps no annotations of its own)
    return named


@_named
class KernelFlags:
    """The kernel's compile-time choices, one object handed to every partition (``gl.warp_specialize`` takes
    constexprs inside an aggregate but turns them into tensors inside a plain tuple). The fields are
    :func:`.kernel._sage_fwd_ws`'s constexpr parameters of the same names, in its order; the host builds them with
    the rest of the launch's constexprs in :func:`.plan.kernel_meta`."""
    QK_KIND: gl.constexpr
    Q_BLOCK: gl.constexpr
    K_BLOCK: gl.constexpr
    RETURN_LSE: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    AHEAD: gl.constexpr
    KS_TMA: gl.constexpr
    PERMK: gl.constexpr
    TARRIVE: gl.constexpr
    MMASUM: gl.constexpr
    SPLIT_TAIL: gl.constexpr
    HAS_BIAS: gl.constexpr
    SKIP: gl.constexpr
    SPARSE: gl.constexpr
    PERSIST: gl.constexpr
    PAIR: gl.constexpr


@_named
class Buffers:
    """The CTA's TMA descriptors (``ks_desc``: the K scales' 1-D view with ``KS_TMA``, else ``None``; ``kp_desc``:
    K's permuting view with ``PERMK``, else ``None``), shared-memory buffers (a Q tile per consumer, the K, V and K
    scale rings, the ones of ``MMASUM``; buffers a launch does not use alias ``k_smem``) and mbarriers (``q_bar``:
    the Q tiles, ``q_free``: the consumers done with them, one of each per Q buffer (two in a persistent launch,
    :mod:`.schedule`; else one, and ``q_free`` aliases ``q_bar``, unused); per ring slot ``k_ready``, ``v_ready``
    and ``kv_free``, the consumers' release)."""
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    ks_desc: tma.tensor_descriptor | gl.constexpr
    kp_desc: tma.tensor_descriptor | gl.constexpr
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    ks_smem: gl.shared_memory_descriptor
    ones_smem: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    q_free: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    kv_free: gl.shared_memory_descriptor



@_named
class Pointers:
    """The tensors read or written by pointer: ``QS`` (Q's scales; Q itself when the consumers quantize it), ``KS``
    (K's scales), ``VS`` (V's), ``Out``, ``Lse``, the tail split's workspace ``OutWs`` / ``LseWs``, the key bias
    ``KB`` and its nonzero span ``KBR``; with ``SPARSE`` (:mod:`.sparse`) this CTA's query tile's block list ``BI``
    and its count ``BC`` (int32, :mod:`qattn_fx.block_sparse`), its split piece's first and end list positions
    ``BP`` (``SPLIT_TAIL``) and the list positions bounding the key bias's span ``BR`` (``HAS_BIAS``), else
    ``None`` (constexprs: the dense kernel has no such arguments). Other arguments a launch does not use point at
    another tensor."""
    QS: gl.tensor
    KS: gl.tensor
    VS: gl.tensor
    Out: gl.tensor
    Lse: gl.tensor
    OutWs: gl.tensor
    LseWs: gl.tensor
    KB: gl.tensor
    KBR: gl.tensor
    BI: gl.tensor | gl.constexpr
    BC: gl.tensor | gl.constexpr
    BP: gl.tensor | gl.constexpr
    BR: gl.tensor | gl.constexpr



@_named
class Program:
    """The scalars of the work item a partition runs (the CTA's own, or in a persistent launch each of its items in
    turn, :func:`.schedule._state_at`): the scale strides (``stride_qs*``: Q's own strides when the consumers
    quantize it), the output's, the key bias's batch stride; ``H`` (query heads), ``SEQ_Q``; the keys it runs,
    ``kv_len`` from ``kv0`` (a split tail's piece: a key range; else all of them from 0), and ``piece`` (its
    workspace row block, -1: a whole CTA); batch ``b``, query head ``h``, K/V head ``hk``, first query row
    ``start_m``; the permuting view's coordinates (``kp_*``, :func:`.descriptors.permuted_k`); ``qk_scale``
    (``sm_scale · log2 e``) and Skip-Softmax's ``log2 λ`` and counter pointers ``skip_thr`` / ``skip_count``."""
    stride_qsb: _SCALAR
    stride_qsh: _SCALAR
    stride_qsn: _SCALAR
    stride_ksb: _SCALAR
    stride_ksh: _SCALAR
    stride_ksn: _SCALAR
    stride_vsb: _SCALAR
    stride_vsh: _SCALAR
    stride_vsd: _SCALAR
    stride_ob: _SCALAR
    stride_oh: _SCALAR
    stride_os: _SCALAR
    H: _SCALAR
    SEQ_Q: _SCALAR
    kv_len: _SCALAR
    b: _SCALAR
    h: _SCALAR
    hk: _SCALAR
    start_m: _SCALAR
    kp_xh: _SCALAR
    kp_gb: _SCALAR
    kp_gh: _SCALAR
    kv0: _SCALAR
    piece: _SCALAR
    stride_kbb: _SCALAR
    qk_scale: _SCALAR
    skip_thr: gl.tensor
    skip_count: gl.tensor



@_named
class KernelState:
    """Everything a partition gets: ``flags`` (:class:`KernelFlags`), ``bufs`` (:class:`Buffers`), ``ptrs``
    (:class:`Pointers`), ``prog`` (:class:`Program`: the CTA's work item; a persistent launch's first) and ``sched``
    (:class:`~.schedule.Schedule` with ``PERSIST``, else the constexpr 0)."""
    flags: KernelFlags
    bufs: Buffers
    ptrs: Pointers
    prog: Program
    sched: gl.constexpr | gl.base_value
