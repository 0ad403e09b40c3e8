"""Warp-specialized Hopper (sm_90) SageAttention kernel in Gluon: a TMA producer warp and two (or three) consumer
warpgroups.

Implements ``qattn::scaled_attention`` with the numerics of :mod:`qattn_fx.kernels.triton_sage` (see its module
docstring: exact int32→fp32 with the 1.5·2^23 magic number, K scales per column / group / tile, online exp2
softmax on ``448·P``, e4m3 P, two-level P·V accumulation, ``O = acc · v_scale / l``). What differs is the
schedule, which plain Triton 3.6 cannot express:

* one CTA owns ``2 · 64`` query rows of one (batch, head) (``trio``: ``3 · 64``; ``quad``: ``4 · 64``). A
  **producer warp** streams K and V tiles through
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
  :data:`CONSUMER_REGS`, the producer :data:`PRODUCER_REGS`. The kernel is latency-bound
  (docs/kernel-profile.md, "What bounds the kernel"): ``trio`` trades registers (160 per consumer: the serial schedule only) for a third consumer
  warp on every SM sub-partition to hide it (the fastest at video lengths: docs/kernel-profile.md, "Tuning");
  at head_dim 64, whose running output takes half the registers, ``quad`` runs a fourth (112 registers each).
* schedules inside a consumer (:class:`GluonConfig`): serial (Q·Kᵀ, softmax, P·V; what ``trio`` runs) or
  ``ahead`` (the next tile's Q·Kᵀ in flight during this tile's exponentials); docs/kernel-design.md describes
  them and the schedules tried and removed. Tiles are full except the last, which is handled after the loop with
  masks: a per-tile branch between a masked and an unmasked step inside the loop miscompiles with Triton 3.6's
  Gluon (wrong values and NaN on the H200), so no schedule has one. ``permk`` and ``tarrive`` change the data
  layout and the slot release. Calls are autotuned per problem key (cached on disk) over
  the candidates of their class, decided by the inputs (:func:`tuner_for`): :data:`TUNED_CONFIGS` where K can be
  viewed through ``permk`` (:data:`QUAD_TUNED_CONFIGS` at head_dim 64 without a key bias),
  :data:`KEY_ORDER_TUNED_CONFIGS` otherwise. The candidates of a class share their
  numerics (:attr:`GluonConfig.numerics`), so the output never depends on the timing or on the tuning cache.
* a grid whose last wave is partial runs that wave's CTAs as pieces over key ranges, merged by LSE
  (:mod:`.tail_split`, :func:`tail_plan`; ``qattn_fx.config.gluon_tail_split`` / ``$QATTN_GLUON_TAIL_SPLIT=0``
  turns it off; its A/B: ``python -m tools.ab_tail_split``, figures in docs/kernel-profile.md, "Tail split
  A/B"). A piece rounds P against its own running max: the same recipe, other e4m3 roundings.
* ``persist`` (:mod:`.schedule`): one CTA per SM runs the work items of the grid above (query blocks and tail
  pieces) in turn, the next item's Q and first K/V tiles loading during the current one's last tiles and epilogue;
  the numerics of the same config without it, so :data:`PERSIST_CONFIGS` are candidates of their dense classes'
  tuners (the timing picks per key). Block-sparse launches run :data:`SPARSE_PERSIST_CONFIGS` when forced by name,
  each work item pointing at its own lists; no tuner times them until their GPU tests have run.
* ``pair`` (two consumers, serial, ``mmasum``; no key bias, no Skip-Softmax): a work item's visited key tiles in
  online-softmax steps of two, numerics of its own (``emulation.emulate(..., pair=True)``); for the block-sparse
  launches, which run two consumers; forced by name only until its GPU tests have run.
* block sparsity (:mod:`qattn_fx.block_sparse`, ``block_index`` / ``block_count``; :mod:`.sparse`): a CTA of two
  consumers is one 128-row query tile of the lists; the producer loads and the consumers run only its listed key
  tiles, in list order (the rings count visited tiles), the last listed one handled as the last tile; a tile that
  lists nothing gives 0 and LSE ``-inf``. Such launches take two-consumer configs only
  (:func:`check_sparse_config`); their tail split cuts the keys at multiples of 128, each piece visiting the
  listed tiles of its range (``qattn_fx.kernels.emulation.emulate_launched``).

Speed: see BENCHMARKS.md, "Attention op" (the autotuned ``trio,permk,mmasum`` configs against cuDNN FP8), and
docs/kernel-profile.md, "What bounds the kernel". Per-tile numerics identical to triton_sage's (same tiles, same
operation order) except under ``permk``, which sums each P·V tile's keys in another order, and ``mmasum``, whose softmax denominator sums the e4m3-rounded P
(the differences on the benchmark shapes and against fp32 attention: BENCHMARKS.md).

Inputs (validated by :func:`qattn_fx.kernels._sage_common.validate`, plus :func:`ineligible`): int8 / e4m3 /
bf16 / fp16 Q ``(B, Hq, Sq, D)`` and K ``(B, Hkv, Skv, D)`` with unit stride on D (BSHD and BHSD views both; a Q
or K whose base or strides are not 16-byte aligned for TMA is copied); V e4m3 ``(B, Hkv, Sv, Dv)``, ``Sv >= Skv``,
sequence-major (``stride(-2) == 1``, the quantize node's layout, rows padded to 16 tokens); head_dim 64 or 128;
fp32 scales as for triton_sage; or a bf16/fp16 Q (``q_scale=None``, ``q_block`` 1) beside an int8 K, which the
consumers quantize per token themselves (``KernelInfo.quantizes_q``: the lowering passes Q so for int8 recipes and
the graph has no Q pass; bit-identical to ``qattn::quantize_per_block``). GQA through ``Hq = g · Hkv``. Optional
``key_bias`` fp32 ``(B|1, Skv)`` (masks): each tile's bias is loaded at use and added to the logits, whose max is
then taken over ``t·rs + bias`` (a row with every key masked gives 0), in the key tiles that meet the span of
keys whose bias is not 0 (:func:`~qattn_fx.kernels._sage_common.bias_range`: a key-padding mask touches a few
tiles at the end) and the last tile; the other tiles run without it. Such launches are in the class their K gives
(``permk``: the bias is loaded in the permuted key order), but Skip-Softmax launches with a bias load K in key
order. Output ``(B, Hq, Sq, Dv)`` stored BSHD; optional natural-log LSE ``(B, Hq, Sq)``.

Layout: :mod:`.config` (register budget, :class:`GluonConfig`, config lists, forcing); the kernel:
:mod:`.kernel` (``_sage_fwd_ws``: program coordinates, shared memory, barriers, warp specialization), :mod:`.state`
(the named aggregates every partition gets: ``KernelFlags``, ``Buffers``, ``Pointers``, ``Program``), :mod:`.schedule`
(work items, the persistent tile scheduler),
:mod:`.producer`, and the consumer in :mod:`.consumer` (row scales, Q quantization), :mod:`.mainloop` (MMAs,
schedules, key-tile loops), :mod:`.softmax` (K scales, key bias, online softmax), :mod:`.epilogue` and
:mod:`.sparse` (the visited tiles of block-sparse launches);
:mod:`._gluon` (Gluon imports, shared layouts); the host: :mod:`.descriptors` (TMA descriptors, the ``permk``
view), :mod:`.plan` (:class:`LaunchPlan`, :func:`kernel_meta`), :mod:`.launch` (tuning, launching, offline
compiles), :mod:`.tail_split` (planning and merging the split last wave); constants, input checks and helpers shared
with triton_sage are in :mod:`.._sage_common`, the tile loop's emulation in :mod:`..emulation`.
"""

from . import tail_split
from ._gluon import GLUON_ERROR
from .config import (CAPABILITY, CONFIGS, CONSUMER_REGS, CONSUMERS, DEFAULT_CONFIGS, FORCED,
                     KEY_ORDER_DEFAULT_CONFIG, KEY_ORDER_TUNED_CONFIGS, LAUNCH_MAXNREG, PERSIST_CONFIGS, PRODUCER_REGS,
                     QUAD_CONSUMER_REGS, QUAD_HEAD_DIM, QUAD_LAUNCH_MAXNREG, QUAD_TUNED_CONFIGS, REGISTERS,
                     ROWS_PER_CONSUMER,
                     SKIP_KEY_ORDER_TUNED_CONFIGS, SKIP_TUNED_CONFIGS, SPARSE_KEY_ORDER_TUNED_CONFIGS,
                     SPARSE_PERSIST_CONFIGS,
                     SPARSE_SKIP_TUNED_CONFIGS, SPARSE_TUNED_CONFIGS,
                     TRIO_CONSUMER_REGS, TRIO_DEFAULT_CONFIG, TRIO_LAUNCH_MAXNREG, TUNED_CONFIGS, GluonConfig,
                     check_pair_config, check_quad_config, check_skip_config, check_sparse_config, current_config,
                     forced_config,
                     use_config)
from ._gluon import mma_layout
from .descriptors import descriptor, k_scale_box, permuted_k, tma_aligned
from .launch import (KEY_ORDER_TUNER, LAST, QUAD_TUNER, SKIP_KEY_ORDER_TUNER, SKIP_TUNER, SPARSE_KEY_ORDER_TUNER,
                     SPARSE_SKIP_TUNER,
                     SPARSE_TUNER, TUNER, TUNERS, attention,
                     compile_for, ineligible, last_config, last_tail_plan, scaled_attention, sm_count, tail_plan,
                     tuner_for, tuning_key)
from .plan import LaunchPlan, kernel_meta, plan_launch, q_blocks

__all__ = ["CAPABILITY", "CONFIGS", "CONSUMER_REGS", "CONSUMERS", "DEFAULT_CONFIGS", "FORCED", "GLUON_ERROR",
           "GluonConfig", "KEY_ORDER_DEFAULT_CONFIG", "KEY_ORDER_TUNED_CONFIGS", "KEY_ORDER_TUNER", "LAST",
           "LAUNCH_MAXNREG", "LaunchPlan", "PERSIST_CONFIGS", "PRODUCER_REGS", "QUAD_CONSUMER_REGS", "QUAD_HEAD_DIM",
           "QUAD_LAUNCH_MAXNREG", "QUAD_TUNED_CONFIGS", "QUAD_TUNER", "REGISTERS", "ROWS_PER_CONSUMER",
           "SKIP_KEY_ORDER_TUNED_CONFIGS", "SKIP_KEY_ORDER_TUNER", "SKIP_TUNED_CONFIGS", "SKIP_TUNER",
           "SPARSE_KEY_ORDER_TUNED_CONFIGS", "SPARSE_KEY_ORDER_TUNER", "SPARSE_PERSIST_CONFIGS",
           "SPARSE_SKIP_TUNED_CONFIGS", "SPARSE_SKIP_TUNER", "SPARSE_TUNED_CONFIGS", "SPARSE_TUNER",
           "TRIO_CONSUMER_REGS", "TRIO_DEFAULT_CONFIG",
           "TRIO_LAUNCH_MAXNREG", "TUNED_CONFIGS", "TUNER", "TUNERS", "attention", "check_pair_config",
           "check_quad_config",
           "check_skip_config", "check_sparse_config", "compile_for", "current_config", "descriptor", "forced_config",
           "ineligible",
           "k_scale_box", "kernel_meta", "last_config", "last_tail_plan", "mma_layout", "permuted_k", "plan_launch",
           "q_blocks",
           "scaled_attention", "sm_count", "tail_plan", "tail_split", "tma_aligned", "tuner_for", "tuning_key",
           "use_config"]
