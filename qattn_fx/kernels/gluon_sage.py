"""Warp-specialized Hopper (sm_90) SageAttention kernel in Gluon: a TMA producer warp and two (or three) consumer
warpgroups.

Implements ``qattn::scaled_attention`` with the numerics of :mod:`qattn_fx.kernels.triton_sage` (see its module
docstring: exact int32→fp32 with the 1.5·2^23 magic number, K scales per column / group / tile, online exp2
softmax on ``448·P``, e4m3 P, two-level P·V accumulation, ``O = acc · v_scale / l``). What differs is the
schedule, which plain Triton 3.6 cannot express:

* one CTA owns ``2 · 64`` query rows of one (batch, head) (``trio``: ``3 · 64``; ``solo``: 64). A **producer
  warp** streams K and V tiles through
  ``STAGES``-deep shared-memory rings with TMA (``ready`` mbarriers carry the byte count; rows past the sequence
  arrive as zeros). Per-column / per-group K scales ride on the K tile's barrier as a 1-D TMA box into a
  ``2 · STAGES``-deep ring (a broadcast shared-memory read for the consumers instead of masked global loads,
  ~90 fewer instructions per tile); scales TMA cannot address (no unit stride on tokens, unaligned base, other
  ``k_block``) are loaded from global memory a tile ahead. Each **consumer warpgroup** owns 64 of the
  rows and runs Q·Kᵀ (wgmma), the softmax and P·V (wgmma, P from registers) on every tile, then frees tile
  ``j+1``'s K slot and tile ``j``'s V slot with one arrive on a ``kv_free`` mbarrier (count: the consumers).
* nothing synchronizes the two consumers with each other (no CTA-wide barrier in the loop), so one warpgroup's
  softmax runs while the other's MMAs occupy the tensor cores — the overlap FlashAttention-3 gets from its
  ping-pong schedule, and what Triton's CTA-wide ``bar.sync`` per pipelined load prevents in triton_sage.
* registers are rebalanced with ``setmaxnreg`` (Gluon ``warp_specialize``): consumers get
  :data:`CONSUMER_REGS`, the producer :data:`PRODUCER_REGS`. The kernel is latency-bound (BENCHMARKS.md, "What
  bounds the kernel"): ``trio`` trades registers (160 per consumer: the serial schedule only) for a third consumer
  warp on every SM sub-partition to hide it, which measured fastest at video lengths (BENCHMARKS.md, "Tuning").
* schedules inside a consumer (:class:`GluonConfig`): serial (Q·Kᵀ, softmax, P·V; what ``trio`` runs) or
  ``ahead`` (the next tile's Q·Kᵀ in flight during this tile's exponentials); docs/kernel-design.md describes
  them and the schedules tried and removed. Tiles are full except the last, which is handled after the loop with
  masks: a per-tile branch between a masked and an unmasked step inside the loop miscompiles with Triton 3.6's
  Gluon (wrong values and NaN on the H200), so no schedule has one. ``permk``, ``solo`` and ``tarrive`` change
  the data layout, the CTA shape and the slot release; which schedule is fastest depends on the shape, so calls
  are autotuned per problem key over :data:`TUNED_CONFIGS` (:data:`TUNER`, cached on disk).
* a grid whose last wave is partial runs that wave's CTAs as pieces over key ranges, merged by LSE
  (:mod:`._tail_split`, :func:`tail_plan`; ``$QATTN_GLUON_TAIL_SPLIT=0`` turns it off): measured on the H200 in
  one process (``python -m tools.ab_tail_split``), -8.3 % time at flux-1024 (4.36 waves of 192-row CTAs), -1.2 %
  at wan1.3b-480p (15.55 waves). A piece rounds P against its own running max: the same recipe, other e4m3 roundings.

Measured on the H200 (BENCHMARKS.md): 874 / 881 TFLOP/s at wan1.3b-480p / wan14b-720p with the INT8 1/16/1 recipe
under the autotuned ``trio,mmasum`` configs (~800 with two consumers), above cuDNN FP8 (800 / 824) in the same run
(latency-bound: see "What bounds the kernel" there); output identical to triton_sage's (same tiles, same
operation order) except under ``permk``, which sums each P·V tile's keys in another order (max|Δ| 1.5e-3 to 2.9e-3
on bf16 outputs of the benchmark shapes; both match the reference), and ``mmasum``, whose softmax denominator sums
the e4m3-rounded P (max|Δ| 4.3e-3 to 6.2e-3; closer to fp32 attention on every input tried, BENCHMARKS.md).

Inputs (validated by :func:`qattn_fx.kernels.triton_sage._validate`, plus :func:`ineligible`): int8 / e4m3 /
bf16 / fp16 Q ``(B, Hq, Sq, D)`` and K ``(B, Hkv, Skv, D)`` with unit stride on D (BSHD and BHSD views both; a Q
or K whose base or strides are not 16-byte aligned for TMA is copied); V e4m3 ``(B, Hkv, Sv, Dv)``, ``Sv >= Skv``,
sequence-major (``stride(-2) == 1``, the quantize node's layout, rows padded to 16 tokens); head_dim 64 or 128;
fp32 scales as for triton_sage. GQA through ``Hq = g · Hkv``. Optional ``key_bias`` fp32 ``(B|1, Skv)`` (masks):
each tile's bias is loaded at use and added to the logits, whose max is then taken over ``t·rs + bias`` (a row
with every key masked gives 0); such launches read K in key order (no ``permk``) and are tuned over
:data:`BIAS_TUNED_CONFIGS`. Output ``(B, Hq, Sq, Dv)`` stored BSHD; optional natural-log LSE ``(B, Hq, Sq)``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from . import _tail_split
from . import triton_sage as ts
from ._config_tuner import ConfigTuner

try:  # GPU libraries are optional at import time; attention() raises a clear error without them.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only without a Gluon-capable triton
    triton = gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = async_copy = None
    fence_async_shared = None
    _GLUON_ERROR = exc


def _jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


def _constexpr_function(fn):
    return gluon.constexpr_function(fn) if gluon is not None else fn


#: Compute capability the kernel is built for (wgmma, TMA, setmaxnreg).
CAPABILITY = (9, 0)
#: Query rows per consumer warpgroup (one wgmma M) and consumers per CTA.
ROWS_PER_CONSUMER = 64
CONSUMERS = 2
#: Registers per thread after ``setmaxnreg``: consumers / producer (4 + 4 + 1 warps → 3 warpgroups; the kernel
#: launches with ``maxnreg`` = their mean so that the 64 K registers of an SM hold one CTA).
CONSUMER_REGS = 240
PRODUCER_REGS = 24
LAUNCH_MAXNREG = 168
#: ``solo`` configs (one consumer warpgroup per CTA): Gluon pads the producer's partition to a warpgroup, so a CTA
#: is 256 threads; launched with 128 registers each, two CTAs fit an SM's 64 K registers and ``setmaxnreg`` gives
#: the consumer 232 (4·232 + 4·24 = 8·128; no spills, checked offline).
SOLO_LAUNCH_MAXNREG = 128
SOLO_CONSUMER_REGS = 232
#: ``trio`` configs (three consumer warpgroups, 192 query rows per CTA): 4 + 4 + 4 + 4 (the padded producer) warps
#: launched with 128 registers each fill an SM's 64 K registers; ``setmaxnreg`` gives consumers 1 and 2
#: :data:`TRIO_CONSUMER_REGS` and consumer 0 (Gluon's default partition) the rest, 168 (2·4·160 + 4·168 + 4·24 =
#: 16·128). Enough for the serial schedule only (offline: ``ahead`` spills ~530 bytes at 160).
TRIO_LAUNCH_MAXNREG = 128
TRIO_CONSUMER_REGS = 160


@_constexpr_function
def _mma_layout(num_warps, n, k_bits):
    """wgmma accumulator layout: ``num_warps`` warps along M, instruction ``m16 x n x (256 / bits)``."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 256 // k_bits])


# ------------------------------------------------------------------------------------------------------------------
# Consumer helpers
# ------------------------------------------------------------------------------------------------------------------


@_jit
def _load_k_scales(ks_ptr, stride_ksn, start_n, SEQ_KV, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr,
                   K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """K scales of the tile at ``start_n`` from global memory (the path when they cannot come by TMA):

    * ``1 < k_block < BLOCK_N`` dividing it: ``(BLOCK_N / k_block,)`` group scales in ``GROUP_LAYOUT``;
    * other ``k_block`` not a multiple of ``BLOCK_N`` (e.g. 1): ``(BLOCK_N,)`` column scales in ``COL_LAYOUT``;
    * ``k_block`` a multiple of ``BLOCK_N``: one scalar; ``k_block == 0``: 1.0 (folded into the row scale).

    Per-column/group scales are cut to 22 significant bits so that ``1.5·2^23 · ks`` is exact (see triton_sage).
    """
    if K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N:
        offs_g = start_n // K_BLOCK + gl.arange(0, BLOCK_N // K_BLOCK, layout=GROUP_LAYOUT)
        ks = gl.load(ks_ptr + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    elif K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=COL_LAYOUT)
        ks = gl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    elif K_BLOCK > 0:
        ks = gl.load(ks_ptr + (start_n // K_BLOCK) * stride_ksn)
    else:
        ks = 1.0
    return ks


@_jit
def _tile_k_scales(j, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, K_BLOCK: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KS_TMA: gl.constexpr):
    """K scales of tile ``j`` (:func:`_load_k_scales`' shapes and layouts); ``ksrc``: ``(ks_ptr, stride_ksn,
    ks_smem, SEQ_KV)``. ``KS_TMA``: the producer brought them into the ``2·STAGES``-deep ring ``ks_smem`` with the
    K tile (same ``k_ready`` barrier), so the caller must have waited for tile ``j``'s K (its slot may already be
    released); a shared-memory broadcast read instead of masked global loads (zeros past the tensor; values past
    ``SEQ_KV`` only meet masked columns). Else a global load (issue it a tile ahead of use)."""
    ks_ptr, stride_ksn, ks_smem, SEQ_KV = ksrc
    if KS_TMA:
        tile = ks_smem.index(j % (2 * STAGES))
        if K_BLOCK > 1 and tile.shape[0] > BLOCK_N // K_BLOCK:  # the box is padded to 128 bytes
            ks = tile.slice(0, BLOCK_N // K_BLOCK).load(GROUP_LAYOUT)
        elif K_BLOCK > 1:
            ks = tile.load(GROUP_LAYOUT)
        else:
            ks = tile.load(COL_LAYOUT)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
    else:
        ks = _load_k_scales(ks_ptr, stride_ksn, j * BLOCK_N, SEQ_KV, COL_LAYOUT, GROUP_LAYOUT, K_BLOCK, BLOCK_N)
    return ks


@_jit
def _k_scales_ahead(j, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, K_BLOCK: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KS_TMA: gl.constexpr):
    """Issued a tile ahead of use: tile ``j``'s K scales from global memory, or (``KS_TMA``) a placeholder, the
    scales being read from the ring at use (:func:`_k_scales_at_use`); carried through the loop either way."""
    if KS_TMA:
        return 0.0
    else:
        return _tile_k_scales(j, ksrc, COL_LAYOUT, GROUP_LAYOUT, K_BLOCK, BLOCK_N, STAGES, KS_TMA)


@_jit
def _k_scales_at_use(j, ks, ksrc, COL_LAYOUT: gl.constexpr, GROUP_LAYOUT: gl.constexpr, K_BLOCK: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KS_TMA: gl.constexpr):
    """Tile ``j``'s K scales where ``S_j`` is scaled: ``ks`` from :func:`_k_scales_ahead`, or read from the ring."""
    if KS_TMA:
        return _tile_k_scales(j, ksrc, COL_LAYOUT, GROUP_LAYOUT, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
    else:
        return ks


@_constexpr_function
def _scales_read_early(KS_TMA, K_BLOCK):
    """Whether the ``ahead`` schedule reads tile ``j+1``'s K scales from the TMA ring as soon as its K tile has
    arrived (one step before use) rather than at use: for group scales (``k_block > 1``: a few registers per
    thread); per-column scales (32 registers per thread) carried across a step make ptxas spill."""
    return bool(KS_TMA) and K_BLOCK > 1


@_jit
def _key_bias(j, kbsrc, COL_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Tile ``j``'s key bias in log2 units, ``(BLOCK_N,)`` in ``COL_LAYOUT`` (``-inf`` past ``SEQ_KV``): a global
    load at use (32 registers per thread at BLOCK_N 128: carried a tile ahead, they made ptxas spill); 0.0 without
    ``HAS_BIAS``. ``kbsrc``: ``(kb_ptr, SEQ_KV)``. Key-bias launches never use ``permk`` (the host's choice), so
    column ``n`` of ``S`` is key ``n``."""
    if HAS_BIAS:
        kb_ptr, SEQ_KV = kbsrc
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=COL_LAYOUT)
        kb = gl.load(kb_ptr + offs_n, mask=offs_n < SEQ_KV, other=float("-inf")) * 1.4426950408889634
    else:
        kb = 0.0
    return kb


@_jit
def _row_reduce(x, IS_MAX: gl.constexpr):
    """Max or sum over axis 1 of a ``(64, BLOCK_N)`` wgmma-layout tile."""
    if IS_MAX:
        return gl.max(x, axis=1)
    else:
        return gl.sum(x, axis=1)


@_jit
def _scale_logits(s, ks, rs, QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    """The raw ``S`` tile (int32 ``S + 1.5·2^23`` for int8 Q/K, else fp32) with the K scales applied: ``(t, rs)``,
    ``rs`` (64,) being ``q_scale · sm_scale · log2 e`` times K's scale when it is one per tile. ``ks``: the tile's
    K scales (:func:`_tile_k_scales`). Reads every register of ``S``, which the next Q·Kᵀ may then reuse."""
    s_layout: gl.constexpr = s.type.layout
    PER_COL: gl.constexpr = K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0
    GROUPED: gl.constexpr = K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N
    if QK_KIND == 0:
        t = s.to(gl.float32, bitcast=True)  # = S + 1.5·2^23 exactly (|S| < 2^22)
    else:
        t = s
    if GROUPED:
        t3 = gl.reshape(t, [t.shape[0], BLOCK_N // K_BLOCK, K_BLOCK])  # a relabeling of registers
        ks3 = ks[None, :, None]
        if QK_KIND == 0:
            t3 = gl.fma(t3, ks3, -(ks3 * 12582912.0))  # round(S · ks) in one fma (ks has 22 significant bits)
        else:
            t3 = t3 * ks3
        t = gl.convert_layout(gl.reshape(t3, [t.shape[0], BLOCK_N]), s_layout, assert_trivial=True)
    elif PER_COL:
        if QK_KIND == 0:
            t = gl.fma(t, ks[None, :], -(ks * 12582912.0)[None, :])
        else:
            t = t * ks[None, :]
    else:
        if QK_KIND == 0:
            t = t - 12582912.0
        if K_BLOCK > 0:  # one K scale for the whole tile
            rs = rs * ks
    return t, rs


@_jit
def _running_max(t, rs, kb, m_i, start_n, SEQ_KV, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
                 HAS_BIAS: gl.constexpr = 0):
    """The new running max ``m`` (log2 units) after the scaled tile ``t`` (``MASK``: columns past ``SEQ_KV``
    ignored). ``HAS_BIAS``: the max of ``t · rs + kb`` (``kb``: :func:`_key_bias`, ``-inf`` past ``SEQ_KV``)."""
    if HAS_BIAS:
        return gl.maximum(m_i, _row_reduce(t * rs[:, None] + kb[None, :], True))
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, t.type.layout))
        t_max = _row_reduce(gl.where((offs_n < SEQ_KV)[None, :], t, float("-inf")), True)
    else:
        t_max = _row_reduce(t, True)
    return gl.maximum(m_i, t_max * rs)  # scales are >= 0, so max(t · rs) = max(t) · rs


@_jit
def _logits_max(s, ks, kb, m_i, rs, start_n, SEQ_KV, QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr,
                BLOCK_N: gl.constexpr, MASK: gl.constexpr, HAS_BIAS: gl.constexpr = 0):
    """First half of an online-softmax step: :func:`_scale_logits` then :func:`_running_max`; ``(t, rs, m)``."""
    t, rs = _scale_logits(s, ks, rs, QK_KIND, K_BLOCK, BLOCK_N)
    return t, rs, _running_max(t, rs, kb, m_i, start_n, SEQ_KV, BLOCK_N, MASK, HAS_BIAS)


@_jit
def _exp_sum(t, rs, kb, m_new, m_i, l_i, start_n, SEQ_KV, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
             MMASUM: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0):
    """Second half: ``(p8, alpha, l)``: e4m3 ``448 · exp2(z - m)`` (0 past ``SEQ_KV`` when ``MASK``), the factor
    rescaling earlier tiles, row sum (``MMASUM``: ``l`` is returned as given; the P·V step's ones-MMA sums P).
    ``HAS_BIAS``: ``z = t · rs + kb``, and a running max of ``-inf`` (every key so far masked) is used as 0, so
    such rows get P = 0 and alpha = 0 instead of NaN."""
    if HAS_BIAS:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(t * rs[:, None] + kb[None, :] - (m_use - 8.807354922057604)[:, None])
        alpha = gl.exp2(m_i - m_use)
    else:
        p = gl.exp2(t * rs[:, None] - (m_new - 8.807354922057604)[:, None])  # 448 · exp2(z - m)
        if MASK:
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, t.type.layout))
            p = gl.where((offs_n < SEQ_KV)[None, :], p, 0.0)
        alpha = gl.exp2(m_i - m_new)
    if not MMASUM:
        l_i = l_i * alpha + _row_reduce(p, False)
    return p.to(gl.float8e4nv), alpha, l_i


@_jit
def _softmax(s, ks, kb, m_i, l_i, rs, start_n, SEQ_KV,
             QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
             MMASUM: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0):
    """One online-softmax step (:func:`_logits_max` then :func:`_exp_sum`); returns ``(p8, alpha, l, m)``."""
    t, rs_t, m_new = _logits_max(s, ks, kb, m_i, rs, start_n, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, MASK, HAS_BIAS)
    p8, alpha, l_i = _exp_sum(t, rs_t, kb, m_new, m_i, l_i, start_n, SEQ_KV, BLOCK_N, MASK, MMASUM, HAS_BIAS)
    return p8, alpha, l_i, m_new


@_constexpr_function
def _sum_layout(num_warps):
    """Accumulator layout of the ones-MMA (``mmasum``): ``(64, 8)`` fp32, every column the row sum of P."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 32])


@_jit
def _fill_ones(ones_smem):
    """Write e4m3 1.0 into this consumer's ``(8, BLOCK_N)`` ones buffer (the ones-MMA's B operand, K-major: 8
    "channels" of ones over the tile's keys) and fence it for the async proxy. Once per CTA."""
    BN: gl.constexpr = ones_smem.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, BN // 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    ones_smem.store(gl.full([8, BN], 0x38, gl.int8, layout).to(gl.float8e4nv, bitcast=True))  # e4m3 1.0
    fence_async_shared()


# ------------------------------------------------------------------------------------------------------------------
# Partitions
# ------------------------------------------------------------------------------------------------------------------


@_jit
def _release(i, kv_free, STAGES: gl.constexpr, TARRIVE: gl.constexpr):
    """Release event ``i`` of this consumer: tile ``i``'s K slot and tile ``i-1``'s V slot are free (both are
    released at the same point of every schedule, so one mbarrier per slot, ``kv_free[i % STAGES]`` with count 2,
    serves both rings: one warpgroup barrier and one arrive per tile instead of two of each)."""
    if TARRIVE:
        # every thread arrives by itself (cp.async.mbarrier.arrive.noinc: with no cp.async in flight, at once), so
        # no warpgroup bar.sync precedes it as it does Gluon's one-thread mbarrier.arrive; count 128 per consumer
        async_copy.mbarrier_arrive(kv_free.index(i % STAGES), increment_count=False)
    else:
        mbarrier.arrive(kv_free.index(i % STAGES), count=1)


@_jit
def _qk(j, q, s_init, k_smem, k_ready, kv_free, QK_KIND: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, TARRIVE: gl.constexpr):
    """``S`` of tile ``j`` (wgmma from shared memory, waited), then release event ``j`` (tile ``j``'s K slot and
    tile ``j-1``'s V slot, whose P·V the caller has waited for)."""
    s = _qk_issue(j, q, s_init, k_smem, k_ready, QK_KIND, BLOCK_N, STAGES)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    _release(j, kv_free, STAGES, TARRIVE)
    return s


@_jit
def _qk_issue(j, q, s_init, k_smem, k_ready, QK_KIND: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue (async) ``S`` of tile ``j``; the caller waits for it and releases the K slot."""
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, q.type.shape[1]]).permute((1, 0)), s_init,
                         use_acc=QK_KIND == 0, is_async=True)


@_jit
def _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              PERMK: gl.constexpr = 0, ones_smem=None, l_zero=None, MMASUM: gl.constexpr = 0):
    """Issue (async) ``P8 · V8`` of tile ``j`` into a fresh fp32 accumulator, P being the register A operand
    (converted to the wgmma operand layout). ``PERMK``: the tile's K rows were loaded permuted
    (:func:`_permuted_k`), so accumulator column ``16h + 8i + 2c + e`` holds key ``16h + 4c + 2i + e``: relabeling
    P's registers puts every key at its operand position (no shuffles).

    Returns ``(pv, pl)``: ``MMASUM`` also issues ``P8 · 1`` (B: ``ones_smem``, ``(8, BLOCK_N)`` e4m3 ones) into
    a fresh ``(64, 8)`` accumulator ``pl``, every column of which is the row sum of the e4m3 P that P·V multiplies
    (accumulated over the tile as P·V's own products are); else ``pl`` is 0."""
    slot = j % STAGES
    v_tile = v_smem.index(slot).reshape([pv_zero.type.shape[1], BLOCK_N]).permute((1, 0))
    if PERMK:  # keys back in operand order (a relabeling of P's registers)
        BM: gl.constexpr = p8.type.shape[0]
        p8 = gl.reshape(gl.permute(gl.reshape(p8, [BM, BLOCK_N // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]),
                        [BM, BLOCK_N])
        p_op = gl.convert_layout(p8, p_layout, assert_trivial=True)
    else:
        p_op = gl.convert_layout(p8, p_layout)
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    pv = warpgroup_mma(p_op, v_tile, pv_zero, use_acc=False, is_async=True)
    if MMASUM:
        p_l = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=l_zero.type.layout,
                                                          k_width=4), assert_trivial=True)
        pl = warpgroup_mma(p_l, ones_smem.permute((1, 0)), l_zero, use_acc=False, is_async=True)
    else:
        pl = 0.0
    return pv, pl


@_jit
def _accumulate(acc, l_i, alpha, pv, pl, row_o: gl.constexpr, MMASUM: gl.constexpr):
    """``acc · alpha + pv`` (fp32: the two-level accumulation) and, with ``MMASUM``, ``l · alpha + pl`` (``l`` a
    ``(64, 8)`` tile, each column the running denominator)."""
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
    if MMASUM:
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + pl
    return acc, l_i


@_jit
def _softmax_pv(j, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready, kv_free,
                p_layout: gl.constexpr, row_o: gl.constexpr, QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr, LAST: gl.constexpr,
                PERMK: gl.constexpr, TARRIVE: gl.constexpr, sums=None, MMASUM: gl.constexpr = 0,
                HAS_BIAS: gl.constexpr = 0):
    """Softmax of tile ``j`` and its P·V (waited), added to ``acc`` in fp32 (two-level accumulation). ``LAST``:
    the row's last tile, whose V slot is released here (event ``j + 1``); otherwise the next Q·Kᵀ releases it.
    ``sums``: ``(ones_smem, l_zero)`` of the ``MMASUM`` row sums (:func:`_pv_issue`)."""
    p8, alpha, l_i, m_i = _softmax(s, ks, kb, m_i, l_i, rs, j * BLOCK_N, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N, MASK,
                                   MMASUM, HAS_BIAS)
    pv, pl = _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout, BLOCK_N, STAGES, PERMK, sums[0], sums[1], MMASUM)
    if MMASUM:
        pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(pv, pl))
    else:
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    if LAST:
        _release(j + 1, kv_free, STAGES, TARRIVE)
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
    return m_i, l_i, acc


@_jit
def _ahead_step(j, s, ks, m_i, l_i, acc, q, rs, s_init, pv_zero, SEQ_KV, k_smem, v_smem, k_ready, kv_free,
                v_ready, ksrc, kbsrc, p_layout: gl.constexpr, row_o: gl.constexpr, col_s: gl.constexpr,
                grp_layout: gl.constexpr, QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, KS_TMA: gl.constexpr, PERMK: gl.constexpr, TARRIVE: gl.constexpr, sums=None,
                MMASUM: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0):
    """Full tile ``j`` (``S`` given) with tile ``j+1``'s Q·Kᵀ in flight during its softmax; returns ``S_{j+1}``
    and (:func:`_k_scales_ahead`) tile ``j+1``'s K scales. ``sums``, ``MMASUM``: as :func:`_softmax_pv`'s;
    ``HAS_BIAS``: the tile's key bias (:func:`_key_bias`) is added to its logits."""
    if KS_TMA:
        EARLY: gl.constexpr = _scales_read_early(KS_TMA, K_BLOCK)
        if not EARLY:  # else ks holds tile j's scales, read from the ring in the previous step
            ks = _k_scales_at_use(j, ks, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
        t, rs_t = _scale_logits(s, ks, rs, QK_KIND, K_BLOCK, BLOCK_N)  # first: S_{j+1} then takes S_j's registers
        s_next = _qk_issue(j + 1, q, s_init, k_smem, k_ready, QK_KIND, BLOCK_N, STAGES)
        if EARLY:  # tile j+1's K and scales have arrived (waited just above): the shared load's latency then
            # passes under this tile's exponentials instead of stalling the next tile's scaling
            ks_next = _tile_k_scales(j + 1, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
        else:
            ks_next = _k_scales_ahead(j + 1, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
    else:  # the global load first, as early as possible (this order measured ~10 % faster for this path)
        ks_next = _k_scales_ahead(j + 1, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
        s_next = _qk_issue(j + 1, q, s_init, k_smem, k_ready, QK_KIND, BLOCK_N, STAGES)
        t, rs_t = _scale_logits(s, ks, rs, QK_KIND, K_BLOCK, BLOCK_N)
    kb = _key_bias(j, kbsrc, col_s, BLOCK_N, HAS_BIAS)
    m_new = _running_max(t, rs_t, kb, m_i, j * BLOCK_N, SEQ_KV, BLOCK_N, False, HAS_BIAS)
    p8, alpha, l_i = _exp_sum(t, rs_t, kb, m_new, m_i, l_i, j * BLOCK_N, SEQ_KV, BLOCK_N, False, MMASUM, HAS_BIAS)
    m_i = m_new
    pv, pl = _pv_issue(j, p8, pv_zero, v_smem, v_ready, p_layout, BLOCK_N, STAGES, PERMK, sums[0], sums[1], MMASUM)
    if MMASUM:
        s_next, pv, pl = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, pv, pl))
    else:
        s_next, pv = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, pv))
    _release(j + 1, kv_free, STAGES, TARRIVE)  # tile j+1's K slot and tile j's V slot: one barrier, one arrive
    acc, l_i = _accumulate(acc, l_i, alpha, pv, pl, row_o, MMASUM)
    return m_i, l_i, acc, s_next, ks_next


@_jit
def _consume(args, CID: gl.constexpr, QK_KIND: gl.constexpr, Q_BLOCK: gl.constexpr, K_BLOCK: gl.constexpr,
             RETURN_LSE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
             KS_TMA: gl.constexpr, PERMK: gl.constexpr, TARRIVE: gl.constexpr, MMASUM: gl.constexpr,
             SPLIT_TAIL: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Consumer warpgroup ``CID``: rows ``start_m + 64·CID + [0, 64)``; Q·Kᵀ, softmax, P·V per tile; epilogue."""
    descs, smem, bars, ptrs, ints, qk_scale = args
    q_desc, k_desc, v_desc, ks_desc, kp_desc = descs
    q_smem, k_smem, v_smem, ks_smem, ones_smem = smem
    q_bar, k_ready, v_ready, kv_free = bars
    QS, KS, VS, Out, Lse, OutWs, LseWs, KB = ptrs
    (stride_qsb, stride_qsh, stride_qsn, stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsd,
     stride_ob, stride_oh, stride_os, H, SEQ_Q, SEQ_KV, b, h, hk, start_m, kp_xh, kp_gb, kp_gh, kv0, piece,
     stride_kbb) = ints

    BM: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    HEAD_DIM_V: gl.constexpr = v_desc.block_type.shape[2]
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_N, q_desc.dtype.primitive_bitwidth)
    o_layout: gl.constexpr = _mma_layout(NW, HEAD_DIM_V, 8)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    if QK_KIND == 0:
        s_init = gl.full([BM, BLOCK_N], 0x4B400000, gl.int32, s_layout)  # S + 1.5·2^23 read as fp32
    else:
        s_init = gl.zeros([BM, BLOCK_N], gl.float32, s_layout)
    G: gl.constexpr = BLOCK_N // K_BLOCK if K_BLOCK > 0 else 1
    grp_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.reshape(
        gl.zeros([BM, BLOCK_N], gl.float32, s_layout), [BM, G, BLOCK_N // G]).type.layout))
    pv_zero = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)

    # ---- row scale: q_scale · sm_scale · log2(e) (· K's scale when it is per head/tensor) ---------------------
    row0 = start_m + CID * BM
    offs_m = row0 + gl.arange(0, BM, layout=row_s)
    m_valid = offs_m < SEQ_Q
    ks_ptr = KS + b * stride_ksb + hk * stride_ksh
    if SPLIT_TAIL and K_BLOCK > 0:  # a tail piece's keys start at kv0 (a multiple of K_BLOCK); its K scales there
        ks_ptr += (kv0 // K_BLOCK) * stride_ksn
    kb_ptr = KB + b * stride_kbb
    if SPLIT_TAIL:
        kb_ptr += kv0
    if QK_KIND == 2:
        rs = gl.full([BM], 0.0, gl.float32, row_s) + qk_scale
    else:
        qs_ptr = QS + b * stride_qsb + h * stride_qsh
        if Q_BLOCK == 0:
            rs = gl.full([BM], 0.0, gl.float32, row_s) + gl.load(qs_ptr) * qk_scale
        else:
            rs = gl.load(qs_ptr + (offs_m // Q_BLOCK) * stride_qsn, mask=m_valid, other=0.0) * qk_scale
        if K_BLOCK == 0:
            rs = rs * gl.load(ks_ptr)

    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    acc = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)
    q = q_smem.index(CID).reshape([BM, HEAD_DIM])
    if MMASUM:  # the running denominator: a (64, 8) tile of the ones-MMA's layout, every column the same
        l_zero = gl.zeros([BM, 8], gl.float32, _sum_layout(NW))
        l_i = l_zero
        ones = ones_smem.index(CID)
        _fill_ones(ones)
    else:
        l_zero = pv_zero  # unused
        l_i = gl.full([BM], 0.0, gl.float32, row_s)
        ones = ones_smem  # unused
    sums = (ones, l_zero)
    n_tiles = gl.cdiv(SEQ_KV, BLOCK_N)
    ksrc = (ks_ptr, stride_ksn, ks_smem, SEQ_KV)
    kbsrc = (kb_ptr, SEQ_KV)
    mbarrier.wait(q_bar, 0)
    # Tiles 0 .. n_tiles-2 are full; the last one is masked (a branch per tile inside the loop miscompiles in
    # Triton 3.6's Gluon: wrong values on the H200, so the tail is peeled).
    # K scales: _k_scales_ahead(j) a tile before use, _k_scales_at_use(j, ks) where S_j is scaled.
    ks = _k_scales_ahead(0, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
    if AHEAD:
        s = _qk(0, q, s_init, k_smem, k_ready, kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
        if _scales_read_early(KS_TMA, K_BLOCK):  # the ahead steps carry the scales of the tile they get S of
            ks = _tile_k_scales(0, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
        for j in range(n_tiles - 1):
            m_i, l_i, acc, s, ks = _ahead_step(j, s, ks, m_i, l_i, acc, q, rs, s_init, pv_zero, SEQ_KV, k_smem,
                                               v_smem, k_ready, kv_free, v_ready, ksrc, kbsrc, p_layout, row_o,
                                               col_s, grp_layout, QK_KIND, K_BLOCK, BLOCK_N, STAGES, KS_TMA, PERMK,
                                               TARRIVE, sums, MMASUM, HAS_BIAS)
    else:
        for j in range(n_tiles - 1):
            ks_next = _k_scales_ahead(j + 1, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
            s = _qk(j, q, s_init, k_smem, k_ready, kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
            ks = _k_scales_at_use(j, ks, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
            kb = _key_bias(j, kbsrc, col_s, BLOCK_N, HAS_BIAS)
            m_i, l_i, acc = _softmax_pv(j, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready, kv_free,
                                        p_layout, row_o, QK_KIND, K_BLOCK, BLOCK_N, STAGES, False, False, PERMK,
                                        TARRIVE, sums, MMASUM, HAS_BIAS)
            ks = ks_next
        s = _qk(n_tiles - 1, q, s_init, k_smem, k_ready, kv_free, QK_KIND, BLOCK_N, STAGES, TARRIVE)
    # the last (masked) tile
    if not (AHEAD and _scales_read_early(KS_TMA, K_BLOCK)):  # (else ks already holds the last tile's scales)
        ks = _k_scales_at_use(n_tiles - 1, ks, ksrc, col_s, grp_layout, K_BLOCK, BLOCK_N, STAGES, KS_TMA)
    kb = _key_bias(n_tiles - 1, kbsrc, col_s, BLOCK_N, HAS_BIAS)
    m_i, l_i, acc = _softmax_pv(n_tiles - 1, s, ks, kb, m_i, l_i, acc, rs, pv_zero, SEQ_KV, v_smem, v_ready,
                                kv_free, p_layout, row_o, QK_KIND, K_BLOCK, BLOCK_N, STAGES, True, True, 0, TARRIVE,
                                sums, MMASUM, HAS_BIAS)

    # ---- epilogue: O = acc · v_scale / l (the 448s of P and l cancel) ---------------------------------------
    offs_dv = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
    vs = gl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd)
    if MMASUM:  # its 8 columns hold the same sums: take one (max: exact)
        l_i = gl.convert_layout(gl.max(l_i, axis=1), row_s)
    if HAS_BIAS:  # a row whose keys are all masked has l = 0 (and acc = 0): its output is 0, as SDPA's
        inv_l = gl.convert_layout(gl.where(l_i == 0.0, 0.0, 1.0 / gl.where(l_i == 0.0, 1.0, l_i)), row_o)
    else:
        inv_l = gl.convert_layout(1.0 / l_i, row_o)
    out = acc * inv_l[:, None] * vs[None, :]
    offs_mo = row0 + gl.arange(0, BM, layout=row_o)
    o_ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + offs_mo.to(gl.int64)[:, None] * stride_os + offs_dv[None, :])
    o_mask = (offs_mo < SEQ_Q)[:, None]
    if SPLIT_TAIL:
        o_mask = o_mask & (piece < 0)  # a piece of a split tail CTA (piece >= 0) writes to the workspace instead
        m_valid = m_valid & (piece < 0)
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    if RETURN_LSE or SPLIT_TAIL:
        lse = (m_i + gl.log2(l_i) - 8.807354922057604) * 0.6931471805599453
    if RETURN_LSE:
        gl.store(Lse + (b.to(gl.int64) * H + h) * SEQ_Q + offs_m, lse, mask=m_valid)
    if SPLIT_TAIL:  # the piece's normalized fp32 O and its LSE, rows CID·64 + [0, 64) of workspace row block piece
        NC: gl.constexpr = q_smem.type.shape[0]
        ws_o = piece.to(gl.int64) * (NC * BM) + CID * BM + gl.arange(0, BM, layout=row_o)
        gl.store(OutWs + ws_o[:, None] * HEAD_DIM_V + offs_dv[None, :], out, mask=(ws_o >= 0)[:, None])
        ws_s = piece.to(gl.int64) * (NC * BM) + CID * BM + gl.arange(0, BM, layout=row_s)
        gl.store(LseWs + ws_s, lse, mask=ws_s >= 0)


@_jit
def _produce_tile(j, descs, smem, bars, coords, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  KS_TMA: gl.constexpr, PERMUTED: gl.constexpr):
    """Tile ``j``'s K (with its scales) and V, each into its ring slot once the consumers have freed it.
    ``PERMUTED``: K through the permuting 5-D view (:func:`_permuted_k`), for full tiles only."""
    q_desc, k_desc, v_desc, ks_desc, kp_desc = descs
    q_smem, k_smem, v_smem, ks_smem, ones_smem = smem
    q_bar, k_ready, v_ready, kv_free = bars
    b, hk, ks_base, kp_x, kp_g, kv0 = coords
    slot = j % STAGES
    phase = (j // STAGES) & 1
    # a fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait
    mbarrier.wait(kv_free.index(slot), phase ^ 1)  # event j - STAGES: tile j - STAGES's K slot is free
    if KS_TMA:
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ks_desc, [ks_base + j * (BLOCK_N // K_BLOCK)], k_ready.index(slot),
                                        ks_smem.index(j % (2 * STAGES)))
    else:
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    if PERMUTED:
        tma.async_copy_global_to_shared(kp_desc, [kp_g + j * (BLOCK_N // 16), 0, 0, 0, kp_x], k_ready.index(slot),
                                        k_smem.index(slot).reshape(kp_desc.block_type.shape))
    else:
        tma.async_copy_global_to_shared(k_desc, [b, hk, kv0 + j * BLOCK_N, 0], k_ready.index(slot),
                                        k_smem.index(slot))
    # event j - STAGES + 1: tile j - STAGES's V slot is free (events before 0 count as passed)
    mbarrier.wait(kv_free.index((j + 1) % STAGES), (((j + 1) // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, hk, 0, kv0 + j * BLOCK_N], v_ready.index(slot), v_smem.index(slot))


@_jit
def _producer(args, QK_KIND: gl.constexpr, Q_BLOCK: gl.constexpr, K_BLOCK: gl.constexpr,
              RETURN_LSE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
              KS_TMA: gl.constexpr, PERMK: gl.constexpr, TARRIVE: gl.constexpr, MMASUM: gl.constexpr,
              SPLIT_TAIL: gl.constexpr):
    """Producer warp: both Q tiles once, then K and V tiles into their rings (:func:`_produce_tile`); the last
    (maybe partial) tile's K always through the plain descriptor."""
    descs, smem, bars, ptrs, ints, qk_scale = args
    q_desc = descs[0]
    q_smem = smem[0]
    q_bar = bars[0]
    (_, _, _, stride_ksb, stride_ksh, _, _, _, _, _, _, _, _, _, SEQ_KV, b, h, hk, start_m, kp_xh, kp_gb,
     kp_gh, kv0, _, _) = ints
    # K scales' flat offset of this head (KS_TMA) and the permuted view's coordinates of this head (PERMK), both
    # at this CTA's first key kv0 (0 but in a split tail's pieces: a multiple of BLOCK_N and of K_BLOCK)
    ks_base = b * stride_ksb + hk * stride_ksh
    kp_g = b * kp_gb + hk * kp_gh
    if SPLIT_TAIL:
        if K_BLOCK > 0:
            ks_base += kv0 // K_BLOCK
        kp_g += kv0 // 16
    else:
        kv0 = 0
    coords = (b, hk, ks_base, hk * kp_xh, kp_g, kv0)
    BM: gl.constexpr = q_desc.block_type.shape[2]

    NC: gl.constexpr = q_smem.type.shape[0]  # consumer warpgroups: one Q tile each
    mbarrier.expect(q_bar, NC * q_desc.block_type.nbytes)
    for i in gl.static_range(NC):
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + i * BM, 0], q_bar, q_smem.index(i))
    n_tiles = gl.cdiv(SEQ_KV, BLOCK_N)
    for j in range(n_tiles - 1):
        _produce_tile(j, descs, smem, bars, coords, K_BLOCK, BLOCK_N, STAGES, KS_TMA, PERMK)
    _produce_tile(n_tiles - 1, descs, smem, bars, coords, K_BLOCK, BLOCK_N, STAGES, KS_TMA, 0)


@_jit
def _sage_fwd_ws(
    q_desc, k_desc, v_desc, ks_desc, kp_desc, QS, KS, VS, KB, Out, Lse,
    qk_scale,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsd,
    stride_kbb,
    stride_ob, stride_oh, stride_os,
    H, GROUP, SEQ_Q, SEQ_KV, kp_xh, kp_gb, kp_gh,
    N_M, MAIN_CTAS, SPLITS, KV_SPLIT, OutWs, LseWs,
    QK_KIND: gl.constexpr, Q_BLOCK: gl.constexpr, K_BLOCK: gl.constexpr, RETURN_LSE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_NREG: gl.constexpr, PRODUCER_NREG: gl.constexpr,
    AHEAD: gl.constexpr = 0, KS_TMA: gl.constexpr = 0, PERMK: gl.constexpr = 0, CONSUMERS: gl.constexpr = 2,
    TARRIVE: gl.constexpr = 0, MMASUM: gl.constexpr = 0, SPLIT_TAIL: gl.constexpr = 0, HAS_BIAS: gl.constexpr = 0,
):
    """Grid ``(N_M, B · Hq)``: CTA ``(m, bh)`` owns query rows ``m · R + [0, R)`` of (batch, head) ``bh``, ``R`` =
    64 · ``CONSUMERS`` (:attr:`GluonConfig.rows`): 128 rows (``num_warps=4``: consumer 0, + 4: consumer 1, + 1: the
    producer); ``CONSUMERS=3`` (``trio``): 192 rows and a third consumer; ``CONSUMERS=1`` (``solo``): 64 rows,
    consumer 0 and the producer only, two CTAs per SM (each consumer then has a K/V ring of its own instead of
    sharing one with the other consumer).

    ``SPLIT_TAIL`` (:mod:`._tail_split`): a 1-D grid of the same CTAs in the same order (CTA ``g`` is ``(g % N_M,
    g // N_M)``): ``MAIN_CTAS`` whole ones, then ``SPLITS`` pieces for each remaining CTA ``g`` (the last, partial
    wave), piece ``s`` over keys ``[s · KV_SPLIT, (s + 1) · KV_SPLIT)``;
    pieces write their normalized fp32 O and natural-log LSE to ``OutWs (pieces, R, Dv)`` / ``LseWs (pieces, R)``,
    which :func:`._tail_split.merge` combines into ``Out`` (and ``Lse``).

    Descriptors: Q ``(B, Hq, Sq, D)`` block ``(1, 1, 64, D)``, K ``(B, Hkv, Skv, D)`` block ``(1, 1, BLOCK_N, D)``,
    V ``(B, Hkv, Dv, Skv)`` (the sequence-major storage) block ``(1, 1, Dv, BLOCK_N)``; with ``KS_TMA`` the K
    scales flattened to 1-D (unit stride on tokens), block ``BLOCK_N / k_block`` (at least 32: 128 bytes), else
    ``None`` (scales by pointer ``KS``).
    """
    BM: gl.constexpr = q_desc.block_type.shape[2]
    if SPLIT_TAIL:  # CTAs past MAIN_CTAS are pieces: SPLITS per tail CTA, each over KV_SPLIT keys from kv0
        cta = gl.program_id(0)
        tail = (cta >= MAIN_CTAS).to(gl.int32)
        t = gl.maximum(cta - MAIN_CTAS, 0)
        g = cta + tail * (MAIN_CTAS + t // SPLITS - cta)
        kv0 = tail * (t % SPLITS) * KV_SPLIT
        kv_len = SEQ_KV + tail * (gl.minimum(SEQ_KV - kv0, KV_SPLIT) - SEQ_KV)
        piece = tail * (t + 1) - 1
        pid_m = g % N_M
        pid_bh = g // N_M
    else:  # (the same CTA order as a 2-D grid (N_M, B·Hq))
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        kv0 = pid_m * 0
        kv_len = SEQ_KV
        piece = kv0 - 1
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    NC: gl.constexpr = CONSUMERS  # consumer warpgroups in this CTA (GluonConfig.consumers)
    start_m = pid_m * (NC * BM)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NC] + q_desc.block_type.shape, q_desc.layout)
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
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # every consumer (TARRIVE: every consumer thread) arrives on each release event
        mbarrier.init(kv_free.index(i), count=NC * 128 if TARRIVE else NC)

    args = ((q_desc, k_desc, v_desc, ks_desc, kp_desc), (q_smem, k_smem, v_smem, ks_smem, ones_smem),
            (q_bar, k_ready, v_ready, kv_free),
            (QS, KS, VS, Out, Lse, OutWs, LseWs, KB),
            (stride_qsb, stride_qsh, stride_qsn, stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh,
             stride_vsd, stride_ob, stride_oh, stride_os, H, SEQ_Q, kv_len, b, h, hk, start_m, kp_xh, kp_gb,
             kp_gh, kv0, piece, stride_kbb),
            qk_scale)
    # the argument lists are written out per partition: passed inside a tuple, Triton 3.6's Gluon turns the
    # constexprs into tensors (layout constructors then fail), and JIT code cannot concatenate tuples
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consume, (args, 0, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                        TARRIVE, MMASUM, SPLIT_TAIL, HAS_BIAS)),
            (_producer, (args, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                         TARRIVE, MMASUM, SPLIT_TAIL)),
        ], [1], [PRODUCER_NREG])
    elif CONSUMERS == 3:
        gl.warp_specialize([
            (_consume, (args, 0, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                        TARRIVE, MMASUM, SPLIT_TAIL, HAS_BIAS)),
            (_consume, (args, 1, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                        TARRIVE, MMASUM, SPLIT_TAIL, HAS_BIAS)),
            (_consume, (args, 2, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                        TARRIVE, MMASUM, SPLIT_TAIL, HAS_BIAS)),
            (_producer, (args, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                         TARRIVE, MMASUM, SPLIT_TAIL)),
        ], [4, 4, 1], [CONSUMER_NREG, CONSUMER_NREG, PRODUCER_NREG])
    else:
        gl.warp_specialize([
            (_consume, (args, 0, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                        TARRIVE, MMASUM, SPLIT_TAIL, HAS_BIAS)),
            (_consume, (args, 1, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                        TARRIVE, MMASUM, SPLIT_TAIL, HAS_BIAS)),
            (_producer, (args, QK_KIND, Q_BLOCK, K_BLOCK, RETURN_LSE, BLOCK_N, STAGES, AHEAD, KS_TMA, PERMK,
                         TARRIVE, MMASUM, SPLIT_TAIL)),
        ], [4, 1], [CONSUMER_NREG, PRODUCER_NREG])


# ------------------------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------------------------

ENV_CONFIG = "QATTN_GLUON_SAGE_CONFIG"


@dataclass(frozen=True)
class GluonConfig:
    """``block_n`` keys per tile (64 or 128), ``stages`` (depth of the K/V TMA rings, 2-4) and schedule flags:
    ``ahead``: each consumer issues tile ``j+1``'s Q·Kᵀ before tile ``j``'s softmax, so it runs during the
    exponentials; ``permk``: full K tiles load through a row-permuting TMA view (:func:`_permuted_k`) so that P
    reaches the P·V wgmma without shuffles, where the K layout allows it; ``solo``: one consumer
    warpgroup (64 query rows) per CTA and two CTAs per SM, so the two warpgroups on an SM no longer share one K/V
    ring (each streams K/V itself: twice the L2 reads); ``tarrive``: every consumer
    thread arrives on the slot-release barrier by itself (``cp.async.mbarrier.arrive.noinc``), instead of a
    warpgroup ``bar.sync`` and one thread's arrive; ``mmasum``: the softmax denominator comes from the tensor
    cores, a second wgmma per tile multiplying P by a shared-memory block of e4m3 ones (``P8 · 1``, fp32 tile sums
    added like P·V's), instead of ~70 fp32 adds and shuffles per thread and tile: ``l`` is then the sum of the
    e4m3-rounded P that P·V multiplies (the normalized weights sum to 1), not of fp32 P; ``trio``: three consumer
    warpgroups per CTA (192 query rows) at :data:`TRIO_CONSUMER_REGS` registers, which only the serial schedule
    fits: three warps per SM sub-partition hide more of the MMA and exponential latency than ``ahead`` does with
    two (4-5 % faster at the Wan shapes; with ``mmasum``, whose few spills at 160 registers cost less than the ~50
    instructions per tile it saves, 8-12 %). Schedules tried and removed: docs/kernel-design.md."""

    block_n: int
    stages: int
    ahead: int = 0
    permk: int = 0
    solo: int = 0
    tarrive: int = 0
    mmasum: int = 0
    trio: int = 0

    FLAGS = ("ahead", "permk", "solo", "tarrive", "mmasum", "trio")

    def __post_init__(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n={self.block_n!r} is invalid; valid: 64, 128")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"stages={self.stages!r} is invalid; valid: 2, 3, 4")
        for name in self.FLAGS:
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; valid: 0, 1")
        if self.trio and (self.ahead or self.solo):
            raise ValueError(f"trio (three consumers of {TRIO_CONSUMER_REGS} registers) runs the serial schedule "
                             f"only; got {self}; valid: 'BLOCK_N,STAGES,trio[,permk][,tarrive][,mmasum]'")

    @property
    def consumers(self) -> int:
        """Consumer warpgroups per CTA (each owns 64 query rows)."""
        return 1 if self.solo else (3 if self.trio else CONSUMERS)

    @property
    def rows(self) -> int:
        """Query rows per CTA: :data:`ROWS_PER_CONSUMER` per consumer warpgroup."""
        return self.consumers * ROWS_PER_CONSUMER

    def __str__(self) -> str:
        return f"WS_BN{self.block_n}_s{self.stages}" + "".join(f"_{f}" for f in self.FLAGS if getattr(self, f))

    @classmethod
    def parse(cls, text: str) -> "GluonConfig":
        """``"BLOCK_N,STAGES"`` and any of :attr:`FLAGS` (``"128,2,ahead,permk"``), or ``str()`` of a config
        (``WS_BN128_s2_ahead``)."""
        fields = [f.strip() for f in text.replace("_", ",").split(",") if f.strip() and f.strip().upper() != "WS"]
        flags = {f: 1 for f in fields if f in cls.FLAGS}
        rest = [f for f in fields if f not in cls.FLAGS]
        try:
            numbers = [int(f.lstrip("BNSbns")) for f in rest]
        except ValueError:
            numbers = []
        if len(numbers) != 2:
            optional = "".join(f"[,{f}]" for f in cls.FLAGS)
            raise ValueError(f"gluon_sage config {text!r} is invalid; valid: 'BLOCK_N,STAGES{optional}' such as "
                             "'128,2,ahead'")
        return cls(*numbers, **flags)


#: Config per head_dim where none is tuned (graph capture before any tuning, ``$QATTN_AUTOTUNE=0``): the fastest of
#: the H200 tuning sweep (BENCHMARKS.md, "Tuning: gluon_sage's default config"), ``128,3,trio,permk,tarrive,mmasum``
#: at both head dims (892.6 TFLOP/s at wan1.3b-480p, 866.5 at wan14b-720p, 537.7 at d64; the best two-consumer
#: config, ``128,3,ahead,permk``, 801.2 / 791.2 / 496.5 in the same run).
DEFAULT_CONFIGS = {128: GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1),
                   64: GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1)}
#: What the autotuner times per problem key (:data:`TUNER`). Fastest in the H200 sweeps: ``trio,permk,mmasum``
#: (with or without ``tarrive``) at the Wan shapes and d64; ``ahead,solo`` / ``ahead,permk(,solo,tarrive)`` at
#: flux-1024, whose 4608 rows make 4.4 waves of 192-row CTAs against 6.5 of 128-row ones; ``ahead`` stays for
#: inputs whose K layout ``permk`` cannot view (it then runs the plain schedule, and ``trio`` spills in its loop).
TUNED_CONFIGS = (GluonConfig(128, 3, ahead=1), GluonConfig(128, 3, ahead=1, permk=1),
                 GluonConfig(128, 3, ahead=1, solo=1),
                 GluonConfig(128, 3, ahead=1, permk=1, solo=1, tarrive=1),
                 GluonConfig(128, 3, ahead=1, permk=1, solo=1, tarrive=1, mmasum=1),
                 GluonConfig(128, 3, permk=1, tarrive=1, trio=1),
                 GluonConfig(128, 3, permk=1, mmasum=1, trio=1),
                 GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1))
#: Every config the GPU tests run (and ``python -m benchmarks.tune --kernel gluon_sage`` sweeps by default).
CONFIGS = (GluonConfig(128, 3, ahead=1), GluonConfig(128, 2, ahead=1),
           GluonConfig(128, 2),
           GluonConfig(64, 3, ahead=1),
           GluonConfig(128, 3, ahead=1, permk=1), GluonConfig(128, 2, ahead=1, permk=1),
           GluonConfig(128, 3, ahead=1, solo=1), GluonConfig(128, 3, ahead=1, tarrive=1),
           GluonConfig(128, 3, ahead=1, permk=1, solo=1),
           GluonConfig(128, 3, ahead=1, permk=1, solo=1, tarrive=1),
           GluonConfig(128, 3, ahead=1, permk=1, mmasum=1), GluonConfig(128, 2, ahead=1, permk=1, mmasum=1),
           GluonConfig(128, 3, ahead=1, mmasum=1), GluonConfig(128, 2, mmasum=1),
           GluonConfig(64, 3, ahead=1, mmasum=1),
           GluonConfig(128, 3, ahead=1, permk=1, solo=1, tarrive=1, mmasum=1),
           GluonConfig(128, 2, trio=1), GluonConfig(128, 3, trio=1, permk=1),
           GluonConfig(128, 3, trio=1, permk=1, tarrive=1), GluonConfig(128, 3, permk=1, mmasum=1, trio=1),
           GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1))

_forced: Optional[GluonConfig] = None


@contextlib.contextmanager
def use_config(config: Optional[GluonConfig | str]) -> Iterator[None]:
    """Force one config inside the block (``None``: ``$QATTN_GLUON_SAGE_CONFIG``, else autotuning)."""
    global _forced
    previous = _forced
    _forced = GluonConfig.parse(config) if isinstance(config, str) else config
    try:
        yield
    finally:
        _forced = previous


@functools.lru_cache(maxsize=None)
def _config_named(name: str) -> GluonConfig:
    return GluonConfig.parse(name)


def forced_config() -> Optional[GluonConfig]:
    """The config every call uses instead of autotuning: :func:`use_config`'s, else ``$QATTN_GLUON_SAGE_CONFIG``,
    else ``None``."""
    if _forced is not None:
        return _forced
    text = os.environ.get(ENV_CONFIG)
    return _config_named(text) if text else None


def current_config(head_dim: int = 128) -> GluonConfig:
    """The forced config (:func:`forced_config`), else the untuned default of this head_dim
    (:data:`DEFAULT_CONFIGS`)."""
    return forced_config() or DEFAULT_CONFIGS[head_dim]


_last_config: Optional[GluonConfig] = None
_last_tail: Optional[_tail_split.TailPlan] = None


def last_config() -> Optional[GluonConfig]:
    """The config of this process's latest launch (forced, tuned or default), for reports; ``None`` before any."""
    return _last_config


def last_tail_plan() -> Optional[_tail_split.TailPlan]:
    """The tail split of this process's latest launch (:func:`tail_plan`), for reports; ``None``: none."""
    return _last_tail


def _tuning_key(q: torch.Tensor, k: torch.Tensor, q_block: int, k_block: int, return_lse: bool,
                key_bias: bool = False) -> tuple:
    """``(head_dim, Q dtype, q_block, k_block, lse, Sq bucket, Skv bucket, B·Hq bucket[, "bias"])``: lengths in
    powers of 4 from 256 (as triton_sage's autotune key), ``B·Hq`` rounded up to a power of 2; key-bias calls
    (masks) are tuned apart."""
    bsz, hq, sq, d = q.shape
    key = (d, str(q.dtype).removeprefix("torch."), q_block, k_block, bool(return_lse), ts._seq_bucket(sq),
           ts._seq_bucket(k.shape[2]), 1 << max(bsz * hq - 1, 0).bit_length())
    return key + ("bias",) if key_bias else key


#: The autotuner: one timing of :data:`TUNED_CONFIGS` per :func:`_tuning_key`, cached in memory and on disk
#: (:mod:`._config_tuner`); under graph capture before any tuning it uses :data:`DEFAULT_CONFIGS`.
TUNER = ConfigTuner("gluon_sage", [str(c) for c in TUNED_CONFIGS], default=lambda key: str(DEFAULT_CONFIGS[key[0]]))
#: Key-bias launches (masks) load K in key order (no ``permk`` view), where ``trio`` spills in its loop (offline,
#: d128: over 1 KB): they are tuned over the other configs, by a tuner of their own.
BIAS_TUNED_CONFIGS = tuple(c for c in TUNED_CONFIGS if not c.trio)
BIAS_DEFAULT_CONFIG = GluonConfig(128, 3, ahead=1)
BIAS_TUNER = ConfigTuner("gluon_sage_key_bias", [str(c) for c in BIAS_TUNED_CONFIGS],
                         default=lambda key: str(BIAS_DEFAULT_CONFIG))


def ineligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why this kernel cannot take these (already validated) inputs, or ``None``."""
    if _GLUON_ERROR is not None:
        return f"triton with Gluon (Hopper) is not importable: {_GLUON_ERROR}"
    if q.device.type != "cuda" or tuple(torch.cuda.get_device_capability(q.device)) != CAPABILITY:
        return f"needs an sm_90 (Hopper) GPU; got {q.device}"
    if not ts._seq_major(v):
        return f"needs sequence-major fp8 V (stride(-2) == 1); got strides {tuple(v.stride())}"
    for name, x, dims in (("q", q, (0, 1, 2)), ("k", k, (0, 1, 2)), ("v", v, (0, 1, 3))):
        if not _tma_aligned(x, dims):
            return (f"{name} needs a 16-byte aligned base and strides for TMA; got strides {tuple(x.stride())} "
                    f"of {x.dtype}")
    return None


def _tma_aligned(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """TMA's addressing rule: a 16-byte aligned base and 16-byte multiple strides on ``dims`` (the non-unit ones)."""
    size = x.element_size()
    return x.data_ptr() % 16 == 0 and all((x.stride(d) * size) % 16 == 0 for d in dims)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA box (computed once per box and dtype: part of the launch cost)."""
    gl_dtype = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
                torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _descriptor(x: torch.Tensor, block: list[int]):
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, _shared_layout(tuple(block), x.dtype))


def _k_scale_box(k_scale: Optional[torch.Tensor], k_block: int, block_n: int) -> Optional[int]:
    """Elements per K tile of the K scales when they can ride on the K tile's TMA (one scale per column or per
    group dividing the tile, at least 4 groups; unit stride on tokens; 16-byte aligned base and batch/head strides,
    e.g. ``Skv`` a multiple of ``64 · k_block / 16``), padded to 128 bytes (TMA writes shared
    memory at 128-byte aligned addresses: each slot of the ring is one box); else ``None``."""
    if k_scale is None or not (k_block == 1 or (1 < k_block < block_n and block_n % k_block == 0)):
        return None
    if (k_scale.shape[-1] > 1 and k_scale.stride(-1) != 1) or k_scale.data_ptr() % 16:
        return None
    # every box starts at b·s_b + h·s_h + j·G elements, which TMA needs 16-byte aligned (4 fp32)
    if any(st % 4 for st in ts._scale_strides(k_scale)[:2]) or (block_n // k_block) % 4:
        return None
    return max(block_n // k_block, 32)


def _k_scale_descriptor(k_scale: torch.Tensor, box: int):
    """1-D TMA descriptor over every element a (broadcast-aware) offset ``b·s_b + h·s_h + n`` can reach."""
    extent = 1 + sum((n - 1) * st for n, st in zip(k_scale.shape, ts._scale_strides(k_scale)))
    return _descriptor(k_scale.as_strided((extent,), (1,)), [box])


def _permuted_k(k: torch.Tensor, k_block: int, block_n: int):
    """A 5-D view of K for TMA whose box, read in order, is a ``(block_n, D)`` tile with row ``16g + 8i + 2c + e``
    holding key ``16g + 4c + 2i + e``: the wgmma accumulator then holds P in the FP8 A-operand order, with V as
    stored. Returns ``(descriptor, x_per_head, g_per_batch, g_per_head)`` (the producer's box coordinates are
    ``x = hk·x_per_head`` on the innermost dim, ``g = b·g_per_batch + hk·g_per_head`` on the 16-key groups), or
    ``None`` where the view cannot be built: K not 8-bit; K scales per 1 or 4 keys (the permutation crosses them;
    per 16, 32, ... keys, per head or per tensor are kept); heads neither interleaved (BSHD) nor stacked (BHSD)
    with contiguous batches; several batches or heads folded into the groups but ``Skv`` not a multiple of 16."""
    if k.element_size() != 1 or k_block % 16:
        return None
    bsz, hkv, skv, d = k.shape
    sb, sh, ss, _ = k.stride()
    if (ss % 16) or (ss == 0):
        return None
    if sh == d and (hkv == 1 or ss == hkv * d):  # BSHD: the heads side by side in one token row
        inner, x_per_head, g_per_head = hkv * d, d, 0
        if bsz > 1 and (skv % 16 or sb != skv * ss):
            return None
        g_per_batch = skv // 16 if bsz > 1 else 0
        groups = (bsz * skv) // 16 if bsz > 1 else skv // 16
    elif ss == d and (hkv == 1 or sh == skv * d) and (bsz == 1 or sb == hkv * skv * d):  # BHSD, contiguous
        if (bsz * hkv > 1) and skv % 16:
            return None
        inner, x_per_head, g_per_head, g_per_batch = d, 0, skv // 16, hkv * skv // 16
        groups = (bsz * hkv * skv) // 16
    else:
        return None
    if groups == 0:
        return None
    view = k.as_strided((groups, 2, 4, 2, inner), (16 * ss, 2 * ss, 4 * ss, ss, 1))
    return _descriptor(view, [block_n // 16, 2, 4, 2, d]), x_per_head, g_per_batch, g_per_head


def _launch_args(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out, lse, return_lse,
                 config: GluonConfig, tail: Optional[_tail_split.TailPlan] = None, workspace=None, key_bias=None):
    """(grid, positional args, keyword args) of one launch; shared by :func:`attention` and the offline compile.
    ``tail``: split the last wave (:mod:`._tail_split`), its pieces writing to ``workspace = (o_ws, lse_ws)``.
    ``key_bias``: fp32 ``(B|1, Skv)``; such launches load K in key order (no ``permk`` view)."""
    bsz, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    qs = q_scale if q_scale is not None else v_scale  # dummies for bf16/fp16 Q/K (never read)
    ks = k_scale if k_scale is not None else v_scale
    ks_box = _k_scale_box(k_scale, k_block, config.block_n)
    permuted = (_permuted_k(k, k_block if k_scale is not None else 0, config.block_n)
                if config.permk and key_bias is None else None)
    kp_desc, kp_xh, kp_gb, kp_gh = permuted if permuted else (None, 0, 0, 0)
    args = [
        _descriptor(q, [1, 1, ROWS_PER_CONSUMER, d]), _descriptor(k, [1, 1, config.block_n, d]),
        _descriptor(v.transpose(2, 3), [1, 1, dv, config.block_n]),
        _k_scale_descriptor(k_scale, ks_box) if ks_box else None, kp_desc,
        qs, ks, v_scale, key_bias if key_bias is not None else v_scale, out, lse, float(sm_scale) * ts.LOG2E,
        *ts._scale_strides(q_scale), *ts._scale_strides(k_scale), *ts._scale_strides(v_scale),
        0 if key_bias is None or key_bias.shape[0] == 1 else key_bias.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, sq, skv, kp_xh, kp_gb, kp_gh,
        _q_blocks(sq, config), tail.main if tail else 0, tail.splits if tail else 1, tail.kv_split if tail else 0,
        *(workspace if tail else (out, lse)),
    ]
    meta = dict(QK_KIND=ts._QK_KIND[q.dtype], Q_BLOCK=q_block if q_scale is not None else 0,
                K_BLOCK=k_block if k_scale is not None else 0, RETURN_LSE=return_lse,
                BLOCK_N=config.block_n, STAGES=config.stages,
                CONSUMER_NREG=TRIO_CONSUMER_REGS if config.trio else CONSUMER_REGS,
                PRODUCER_NREG=PRODUCER_REGS,
                AHEAD=config.ahead, KS_TMA=int(ks_box is not None),
                PERMK=int(permuted is not None), CONSUMERS=config.consumers, TARRIVE=config.tarrive,
                MMASUM=config.mmasum, SPLIT_TAIL=int(tail is not None), HAS_BIAS=int(key_bias is not None))
    grid = (tail.grid,) if tail else (_q_blocks(sq, config), bsz * hq)
    return grid, args, meta


def _q_blocks(sq: int, config: GluonConfig) -> int:
    """CTAs per (batch, head): query rows in blocks of :attr:`GluonConfig.rows`."""
    return -(-sq // config.rows)


#: ``0`` turns the tail split off (every CTA whole; for A/B timing and debugging).
ENV_TAIL_SPLIT = "QATTN_GLUON_TAIL_SPLIT"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tail_plan(q: torch.Tensor, k: torch.Tensor, k_block: int, config: GluonConfig) -> Optional[_tail_split.TailPlan]:
    """The split of this call's last partial wave (:func:`._tail_split.plan`; ``None``: none, or turned off by
    ``$QATTN_GLUON_TAIL_SPLIT=0``). Slots: the device's SMs, two CTAs each under ``solo``. ``k_block``: 0 when K
    has no per-block scales."""
    if os.environ.get(ENV_TAIL_SPLIT, "1") == "0":
        return None
    bsz, hq, sq, _ = q.shape
    slots = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return _tail_split.plan(bsz * hq * _q_blocks(sq, config), slots * (2 if config.solo else 1), k.shape[2],
                            config.block_n, k_block)


def _launch_maxnreg(meta: dict) -> int:
    return {1: SOLO_LAUNCH_MAXNREG, 3: TRIO_LAUNCH_MAXNREG}.get(meta["CONSUMERS"], LAUNCH_MAXNREG)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when TMA can address it (:func:`_tma_aligned` on its batch, head and token strides), else a
    contiguous copy (a bf16 Q/K straight from the model at an odd offset; the quantize nodes' outputs always are)."""
    return x if _tma_aligned(x, (0, 1, 2)) else x.clone(memory_format=torch.contiguous_format)


def attention(q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int, sm_scale: float,
              out_dtype: torch.dtype, *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None):
    """``qattn::scaled_attention`` on the warp-specialized sm_90 kernel (layouts/dtypes: the module docstring).

    Raises ``ValueError`` for bad inputs (triton_sage's checks) and ``RuntimeError`` naming what
    :func:`ineligible` found (a Q or K whose base or strides TMA cannot address is copied instead). Launches on the
    current stream; the config is the forced one (:func:`forced_config`), else :data:`TUNER`'s choice for this
    problem key. The first call of a key not in the tuning cache times every :data:`TUNED_CONFIGS` entry on these
    inputs (and synchronizes to do so); later calls never synchronize. Where the grid's last wave is partial
    (:func:`tail_plan`), that wave runs split over the keys into an fp32 workspace and a second, small kernel
    merges it (:mod:`._tail_split`). ``key_bias``: fp32 ``(B|1, Skv)`` added to the logits (masked keys
    ``-inf``; a row with every key masked gives 0 and LSE ``-inf``). Calls of more than 65,535 (batch, head) pairs
    run in batch chunks (the grid limit).
    """
    ts._validate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    q, k = _aligned(q), _aligned(k)
    reason = ineligible(q, k, v)
    if reason is not None:
        raise RuntimeError(f"gluon_sage: {reason}")
    bsz, hq, sq, _ = q.shape
    dv = v.shape[-1]
    out = torch.empty(bsz, sq, hq, dv, dtype=out_dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    if sq == 0 or bsz == 0 or hq == 0:
        return (out, lse) if return_lse else out
    per_chunk = max(1, ts.MAX_GRID_Y // hq)
    chunks = [(lo, min(bsz, lo + per_chunk)) for lo in range(0, bsz, per_chunk)]

    def launch(config: GluonConfig) -> None:
        for lo, hi in chunks:
            part = [ts._batch_chunk(t, lo, hi) for t in (q, q_scale, k, k_scale, v, v_scale, key_bias)]
            o, ls = out[lo:hi], lse[lo:hi] if return_lse else out[lo:hi]
            tail = tail_plan(part[0], part[2], k_block if k_scale is not None else 0, config)
            ws = _tail_split.workspace(tail, config.rows, dv, q.device) if tail else None
            grid, args, meta = _launch_args(*part[:6], q_block, k_block, sm_scale, o, ls, return_lse, config, tail,
                                            ws, part[6])
            _sage_fwd_ws[grid](*args, **meta, num_warps=4, maxnreg=_launch_maxnreg(meta))
            if tail:
                _tail_split.merge(tail, *ws, o, ls if return_lse else None, _q_blocks(sq, config))
        global _last_tail
        _last_tail = tail

    with torch.cuda.device(q.device):
        config = forced_config()
        if config is None:
            tuner = TUNER if key_bias is None else BIAS_TUNER
            name = tuner.choose(_tuning_key(q, k, q_block, k_block, return_lse, key_bias is not None),
                                lambda text: launch(_config_named(text)))
            config = _config_named(name)
        launch(config)
    global _last_config
    _last_config = config
    return (out, lse) if return_lse else out


def scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, *, key_bias=None):
    """Kernel entry for ``qattn::scaled_attention``."""
    return attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, key_bias=key_bias)


def compile_for(config: GluonConfig, q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int,
                sm_scale: float = 0.125, out_dtype: torch.dtype = torch.bfloat16, *, return_lse: bool = False,
                tail: Optional[_tail_split.TailPlan] = None, key_bias: Optional[torch.Tensor] = None):
    """Compile (not run) the kernel for sm_90 with these inputs' dtypes, shapes and strides (``meta`` tensors are
    fine: data pointers are taken as 16-byte aligned), with the tail split ``tail`` if given. Returns Triton's
    compiled kernel (``.asm["ptx"|"cubin"]``); needs only Triton's bundled ptxas, no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ._offline import launch_signature

    ts._validate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    bsz, hq, sq, _ = q.shape
    out = torch.empty(bsz, sq, hq, v.shape[-1], dtype=out_dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    ws = _tail_split.workspace(tail, config.rows, v.shape[-1], q.device) if tail else None
    _, args, meta = _launch_args(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out, lse,
                                 return_lse, config, tail, ws, key_bias)
    kernel = _sage_fwd_ws
    signature, constexprs, attrs = launch_signature(kernel, args, meta)
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": _launch_maxnreg(meta)})
