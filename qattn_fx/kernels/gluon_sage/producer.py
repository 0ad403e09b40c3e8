"""gluon_sage's producer warp: per work item its Q tiles, then K (and its scales) and V tiles into the shared-memory
rings."""

from ._gluon import gl, jit, mbarrier, quantizes_q, tma
from .schedule import _q_bar, _run_items
from .sparse import Visits, _key_tile, _visits
from .state import _SCALAR, _named


@_named
class TileCoords:
    """Where the producer loads a work item's key tiles from: batch ``b`` and K/V head ``hk`` (K's and Vᵀ's
    descriptors, from key ``kv0``: a split piece's first key, else 0), the K scales' flat offset ``ks_base`` of the
    head at ``kv0`` (``KS_TMA``) and K's permuting view's coordinates ``kp_x`` / ``kp_g`` there (``PERMK``,
    :func:`.descriptors.permuted_k`)."""
    b: _SCALAR
    hk: _SCALAR
    ks_base: _SCALAR
    kp_x: _SCALAR
    kp_g: _SCALAR
    kv0: _SCALAR


@jit
def _produce_tile(i, j, bufs, coords, flags, PERMUTED: gl.constexpr):
    """Key tile ``j``'s K (with its scales) and V, the ``i``-th tile the CTA visits (``j == i`` but in block-sparse
    launches), each into its ring slot once the consumers have freed it (``bufs``: :class:`~.state.Buffers`;
    ``coords``: the item's :class:`TileCoords`). ``PERMUTED``: K through the permuting 5-D view
    (:func:`.descriptors.permuted_k`), for full tiles only."""
    BLOCK_N: gl.constexpr = flags.BLOCK_N
    STAGES: gl.constexpr = flags.STAGES
    k_desc = bufs.k_desc
    k_ready = bufs.k_ready
    b = coords.b
    hk = coords.hk
    kv0 = coords.kv0
    slot = i % STAGES
    phase = (i // STAGES) & 1
    # a fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait
    mbarrier.wait(bufs.kv_free.index(slot), phase ^ 1)  # event i - STAGES: visit i - STAGES's K slot is free
    if flags.KS_TMA:
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes + bufs.ks_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(bufs.ks_desc, [coords.ks_base + j * (BLOCK_N // flags.K_BLOCK)],
                                        k_ready.index(slot), bufs.ks_smem.index(i % (2 * STAGES)))
    else:
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    if PERMUTED:
        tma.async_copy_global_to_shared(bufs.kp_desc, [coords.kp_g + j * (BLOCK_N // 16), 0, 0, 0, coords.kp_x],
                                        k_ready.index(slot),
                                        bufs.k_smem.index(slot).reshape(bufs.kp_desc.block_type.shape))
    else:
        tma.async_copy_global_to_shared(k_desc, [b, hk, kv0 + j * BLOCK_N, 0], k_ready.index(slot),
                                        bufs.k_smem.index(slot))
    # event i - STAGES + 1: visit i - STAGES's V slot is free (events before 0 count as passed)
    mbarrier.wait(bufs.kv_free.index((i + 1) % STAGES), (((i + 1) // STAGES) & 1) ^ 1)
    mbarrier.expect(bufs.v_ready.index(slot), bufs.v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(bufs.v_desc, [b, hk, 0, kv0 + j * BLOCK_N], bufs.v_ready.index(slot),
                                    bufs.v_smem.index(slot))


@jit
def _producer(st):
    """Producer warp: the CTA's work item (:func:`_produce_item`), or with ``PERSIST`` each of its items in turn
    (:func:`.schedule._run_items`), the rings' positions counted across them."""
    _run_items(st, _produce_item, 0)


@jit
def _produce_item(st, CID: gl.constexpr, n, first):
    """One work item (``st``: its :class:`~.state.KernelState`, ``st.prog`` its :class:`~.state.Program`; ``CID``:
    unused, :func:`.schedule._run_items`'s signature; ``n``: the CTA's items before it, ``first``: the key tiles they
    visited, its first ring position): its Q tiles (not when Q is bf16/fp16 with int8 K: the consumers quantize it;
    in Q buffer ``n % 2`` once the consumers have freed it), then K and V tiles into their rings
    (:func:`_produce_tile`); the last (maybe partial) tile's K always through the plain descriptor. ``SPARSE``: the
    listed tiles only (:func:`.sparse._visits`), the last listed one through the plain descriptor; none when nothing
    is listed. Returns the key tiles it visited."""
    flags = st.flags
    prog = st.prog
    bufs = st.bufs
    K_BLOCK: gl.constexpr = flags.K_BLOCK
    q_desc = bufs.q_desc
    b = prog.b
    hk = prog.hk
    kv0 = prog.kv0
    # K scales' flat offset of this head (KS_TMA) and the permuted view's coordinates of this head (PERMK), both
    # at this item's first key kv0 (0 but in a split tail's pieces: a multiple of BLOCK_N and of K_BLOCK)
    ks_base = b * prog.stride_ksb + hk * prog.stride_ksh
    kp_g = b * prog.kp_gb + hk * prog.kp_gh
    if flags.SPLIT_TAIL and not flags.SPARSE:  # (block-sparse: key tiles from key 0, see below)
        if K_BLOCK > 0:
            ks_base += kv0 // K_BLOCK
        kp_g += kv0 // 16
    else:
        kv0 = 0
    coords = TileCoords(b=b, hk=hk, ks_base=ks_base, kp_x=hk * prog.kp_xh, kp_g=kp_g, kv0=kv0)
    BM: gl.constexpr = q_desc.block_type.shape[2]

    NC: gl.constexpr = bufs.q_smem.type.shape[0] // (2 if flags.PERSIST else 1)  # consumer warpgroups: a Q tile each
    if not quantizes_q(q_desc.dtype, bufs.k_desc.dtype):
        qb = n % 2
        q_bar = _q_bar(bufs, n, flags)
        if flags.PERSIST:  # (a fresh barrier has completed the phase before 0: items 0 and 1 do not wait)
            mbarrier.wait(bufs.q_free.index(qb), ((n // 2) & 1) ^ 1)
        mbarrier.expect(q_bar, NC * q_desc.block_type.nbytes)
        for i in gl.static_range(NC):
            tma.async_copy_global_to_shared(q_desc, [b, prog.h, prog.start_m + i * BM, 0], q_bar,
                                            bufs.q_smem.index(qb * NC + i))
    if flags.SPARSE:  # the listed tiles as the lists number them, from key 0 (a split piece's too: fewer registers)
        visits, n_tiles, _ = _visits(st.ptrs, prog, flags)
        visits = Visits(entries=visits.entries, off=0)
        for i in range(n_tiles - 1):
            _produce_tile(first + i, _key_tile(i, visits, flags), bufs, coords, flags, flags.PERMK)
        if n_tiles > 0:
            _produce_tile(first + n_tiles - 1, _key_tile(n_tiles - 1, visits, flags), bufs, coords, flags, 0)
    else:
        n_tiles = gl.cdiv(prog.kv_len, flags.BLOCK_N)
        for j in range(n_tiles - 1):
            _produce_tile(first + j, j, bufs, coords, flags, flags.PERMK)
        _produce_tile(first + n_tiles - 1, n_tiles - 1, bufs, coords, flags, 0)
    return n_tiles
