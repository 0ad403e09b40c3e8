"""gluon_sage's configuration: the CTA's register budget, :class:`GluonConfig` (schedule and layout flags), the
config lists the GPU tests, the tuner and the untuned defaults use, and forcing one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional

from .. import requirements as kernel_requirements
from .._sage_common import ForcedConfig, LaunchConfig

#: Compute capability the kernel is built for (wgmma, TMA, setmaxnreg): the registry's declaration.
((CAPABILITY,),) = (r.capabilities for r in kernel_requirements("gluon_sage"))
#: Query rows per consumer warpgroup (one wgmma M) and consumers per CTA.
ROWS_PER_CONSUMER = 64
CONSUMERS = 2
#: Registers per thread after ``setmaxnreg``: consumers / producer (4 + 4 + 1 warps → 3 warpgroups; the kernel
#: launches with ``maxnreg`` = their mean so that the 64 K registers of an SM hold one CTA).
CONSUMER_REGS = 240
PRODUCER_REGS = 24
LAUNCH_MAXNREG = 168
#: ``trio`` configs (three consumer warpgroups, 192 query rows per CTA): 4 + 4 + 4 + 4 (the padded producer) warps
#: launched with 128 registers each fill an SM's 64 K registers; ``setmaxnreg`` gives consumers 1 and 2
#: :data:`TRIO_CONSUMER_REGS` and consumer 0 (Gluon's default partition) the rest, 168 (2·4·160 + 4·168 + 4·24 =
#: 16·128). Enough for the serial schedule only (offline: ``ahead`` spills ~530 bytes at 160).
TRIO_LAUNCH_MAXNREG = 128
TRIO_CONSUMER_REGS = 160
#: ``quad`` configs (four consumer warpgroups, 256 query rows per CTA): 4 · 4 + 4 (the padded producer) warps
#: launched with 96 registers each (20 · 128 · 96 ≤ 64 K); ``setmaxnreg`` gives consumers 1-3
#: :data:`QUAD_CONSUMER_REGS` and consumer 0 the rest, 120 (3·4·112 + 4·120 + 4·24 = 20·96). Enough for head_dim
#: :data:`QUAD_HEAD_DIM` without a key bias or Skip-Softmax (offline, ``128,4,quad,permk,tarrive,mmasum``: ~200 bytes
#: spilled; with a key bias 1.8 KB, with Skip-Softmax's test 576 bytes, at head_dim 128 3.2 KB).
QUAD_LAUNCH_MAXNREG = 96
QUAD_CONSUMER_REGS = 112
QUAD_HEAD_DIM = 64
#: Per CTA shape (consumer warpgroups): ``(registers per thread at launch, setmaxnreg of the consumer partitions
#: after the first)``.
REGISTERS = {CONSUMERS: (LAUNCH_MAXNREG, CONSUMER_REGS),
             3: (TRIO_LAUNCH_MAXNREG, TRIO_CONSUMER_REGS), 4: (QUAD_LAUNCH_MAXNREG, QUAD_CONSUMER_REGS)}


@dataclass(frozen=True)
class GluonConfig(LaunchConfig):
    """``block_n`` keys per tile (64 or 128), ``stages`` (depth of the K/V TMA rings, 2-4) and schedule flags:
    ``ahead``: each consumer issues tile ``j+1``'s Q·Kᵀ before tile ``j``'s softmax, so it runs during the exponentials;
    ``permk``: full K tiles load through a row-permuting TMA view (:func:`_permuted_k`) so that P reaches the P·V wgmma
    without shuffles, where the K layout allows it; ``tarrive``: every consumer thread arrives on the slot-release
    barrier by itself (``cp.async.mbarrier.arrive.noinc``), instead of a warpgroup ``bar.sync`` and one thread's arrive;
    ``mmasum``: the softmax denominator comes from the tensor cores, a second wgmma per tile multiplying P by a
    shared-memory block of e4m3 ones (``P8 · 1``, fp32 tile sums added like P·V's), instead of ~70 fp32 adds and
    shuffles per thread and tile: ``l`` is then the sum of the e4m3-rounded P that P·V multiplies (the normalized
    weights sum to 1), not of fp32 P; ``trio``: three consumer warpgroups per CTA (192 query rows) at
    :data:`TRIO_CONSUMER_REGS` registers, which only the serial schedule fits: three warps per SM sub-partition hide
    more of the MMA and exponential latency than ``ahead`` does with two (with ``mmasum``, whose few spills at 160
    registers cost less than the ~50 instructions per tile it saves); ``quad``: four consumer warpgroups (256 query
    rows) at :data:`QUAD_CONSUMER_REGS` registers, serial, for head_dim :data:`QUAD_HEAD_DIM` only (its running output
    takes half the registers of head_dim 128's; :func:`check_quad_config`). ``persist``: one CTA per SM runs the
    launch's work items in turn (:mod:`.schedule`), loading the next item's Q and first K/V tiles during the current
    one's last tiles and epilogue; the same numerics. ``pair``: two key tiles per online-softmax step on the serial
    two-consumer schedule (one running max and one rescale of the output per pair, both P·V and both ones-MMAs into one
    fp32 accumulator; :func:`check_pair_config`): numerics of their own, :attr:`softmax_keys` keys per step. Their
    speed: see docs/kernel-profile.md ("Tuning") and BENCHMARKS.md ("head_dim 64"). Schedules tried and removed:
    docs/kernel-design.md."""

    block_n: int
    stages: int
    ahead: int = 0
    permk: int = 0
    tarrive: int = 0
    mmasum: int = 0
    trio: int = 0
    quad: int = 0
    persist: int = 0
    pair: int = 0

    NUMBERS: ClassVar = (("block_n", "BN"), ("stages", "s"))
    FLAGS: ClassVar = ("ahead", "permk", "tarrive", "mmasum", "trio", "quad", "persist", "pair")
    #: The flags the kernel takes as they are, as constexprs of their upper-case names (:func:`.plan.kernel_meta`);
    #: the others shape other constexprs: ``permk`` (``PERMK``, where K's layout takes the view),
    #: ``trio`` and ``quad`` (``CONSUMERS``).
    KERNEL_FLAGS: ClassVar = ("ahead", "tarrive", "mmasum", "persist", "pair")
    PREFIX: ClassVar = "WS"
    KIND: ClassVar = "gluon_sage"
    EXAMPLE: ClassVar = "128,2,ahead"

    def __post_init__(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n={self.block_n!r} is invalid; valid: 64, 128")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"stages={self.stages!r} is invalid; valid: 2, 3, 4")
        self._check_flags()
        if self.trio and (self.ahead or self.quad):
            raise ValueError(f"trio (three consumers of {TRIO_CONSUMER_REGS} registers) runs the serial schedule "
                             f"only; got {self}; valid: 'BLOCK_N,STAGES,trio[,permk][,tarrive][,mmasum]'")
        if self.quad and self.ahead:
            raise ValueError(f"quad (four consumers of {QUAD_CONSUMER_REGS} registers) runs the serial schedule "
                             f"only; got {self}; valid: 'BLOCK_N,STAGES,quad[,permk][,tarrive][,mmasum]'")
        if self.pair and (self.ahead or self.trio or self.quad or not self.mmasum or self.block_n != 128):
            raise ValueError(f"pair (two S tiles in a consumer's registers, one ones-MMA sum) runs the serial "
                             f"two-consumer schedule with mmasum and 128-key tiles; got {self}; valid: "
                             "'128,STAGES,mmasum,pair[,permk][,tarrive][,persist]'")

    def without_persist(self) -> "GluonConfig":
        """This config, not persistent."""
        return dataclasses.replace(self, persist=0)

    @property
    def consumers(self) -> int:
        """Consumer warpgroups per CTA (each owns 64 query rows)."""
        return 3 if self.trio else (4 if self.quad else CONSUMERS)

    @property
    def registers(self) -> tuple[int, int]:
        """``(launch maxnreg, consumer setmaxnreg)`` of this CTA shape (:data:`REGISTERS`)."""
        return REGISTERS[self.consumers]

    @property
    def rows(self) -> int:
        """Query rows per CTA: :data:`ROWS_PER_CONSUMER` per consumer warpgroup."""
        return self.consumers * ROWS_PER_CONSUMER

    @property
    def softmax_keys(self) -> int:
        """Keys per online-softmax step (where the running max rescales the output and P is rounded against it):
        ``block_n``, twice that with ``pair`` (two consecutive visited tiles)."""
        return self.block_n * (2 if self.pair else 1)

    @property
    def numerics(self) -> tuple[int, int, int, int]:
        """``(softmax_keys, permk, mmasum, rows)``: what decides the output bits on given inputs. ``softmax_keys``
        places the online softmax's rescaling and the e4m3 rounding of P; ``permk`` orders each P·V tile's sum;
        ``mmasum`` sums the denominator over e4m3 P; ``rows`` decides which rows the tail split runs in pieces. Configs
        with equal ``numerics`` give bitwise-identical outputs (``stages``, ``ahead`` and ``tarrive`` move only time;
        tests/gpu/test_gluon_sage.py checks every tuned class)."""
        return (self.softmax_keys, self.permk, self.mmasum, self.rows)


# The autotuner's candidates, one class per way of loading K. Every candidate of a class has the same
# GluonConfig.numerics, and the class follows from the inputs alone (launch.tuner_for), so a call's output does not
# depend on which candidate the timing picks, on the tuning cache, or on whether the call was tuned at all.

#: Launches that view K through ``permk`` (8-bit K with scales per 16 keys or coarser, per head or per tensor; with
#: or without a key bias): ``trio,permk,mmasum`` with and without ``tarrive``, within the run-to-run spread of each
#: other and the fastest at the Wan shapes and d64 (docs/kernel-profile.md, "Tuning: gluon_sage's default config"), at
#: flux-1024 (the autotuner's pick there over two-consumer and one-consumer configs, BENCHMARKS.md, "Attention op") and
#: with HunyuanVideo's key-padding mask (docs/kernel-profile.md, "Key-padding masks").
TUNED_CONFIGS = (GluonConfig(128, 3, permk=1, mmasum=1, trio=1),
                 GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1),
                 GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1, persist=1))
#: Launches of that class at head_dim :data:`QUAD_HEAD_DIM` without a key bias: ``quad`` with 2 stages and with 4
#: and ``tarrive``, faster than ``trio`` at d64 with Q quantized in the kernel and on a pre-quantized Q (see
#: BENCHMARKS.md, "head_dim 64").
QUAD_TUNED_CONFIGS = (GluonConfig(128, 2, permk=1, mmasum=1, quad=1),
                      GluonConfig(128, 4, permk=1, tarrive=1, mmasum=1, quad=1))
#: The untuned config (graph capture before any tuning, ``qattn_fx.config.autotune`` off) of a ``permk`` launch
#: per head_dim (with a key bias or Skip-Softmax at head_dim 64: :data:`TRIO_DEFAULT_CONFIG`):
#: ``128,3,trio,permk,tarrive,mmasum`` (faster than the best two-consumer config, ``128,3,ahead,permk``, at the Wan
#: shapes: see BENCHMARKS.md) and ``128,2,quad,permk,mmasum``.
TRIO_DEFAULT_CONFIG = TUNED_CONFIGS[1]
DEFAULT_CONFIGS = {128: TRIO_DEFAULT_CONFIG, 64: QUAD_TUNED_CONFIGS[0]}
#: Launches that load K in key order: bf16/fp16 K, K scales per 1 or 4 keys, layouts the ``permk`` view cannot take.
#: ``trio`` spills in that loop (P reaches the P·V operand through shuffles), so two consumer warpgroups with the
#: ``ahead`` schedule, and ``mmasum`` as in the other class.
KEY_ORDER_TUNED_CONFIGS = (GluonConfig(128, 3, ahead=1, mmasum=1), GluonConfig(128, 3, ahead=1, tarrive=1, mmasum=1),
                           GluonConfig(128, 3, ahead=1, mmasum=1, persist=1))
#: The persistent candidates (``persist``, :mod:`.schedule`): the numerics of the same configs without ``persist``,
#: faster at flux-1024 and d64 and slower at the Wan lengths (BENCHMARKS.md, "Persistent schedule"), so the timing
#: decides per key. Block-sparse launches run two-consumer ones by name only (:data:`SPARSE_PERSIST_CONFIGS`).
PERSIST_CONFIGS = tuple(c for c in TUNED_CONFIGS + KEY_ORDER_TUNED_CONFIGS if c.persist)
#: Untuned key-order launches.
KEY_ORDER_DEFAULT_CONFIG = KEY_ORDER_TUNED_CONFIGS[0]
#: Skip-Softmax launches run serial schedules (the skip test branches around P·V, which ``ahead`` overlaps with the
#: next Q·Kᵀ) without the tail split. Those that view K through ``permk``: :data:`TUNED_CONFIGS`, serial already. The
#: two-consumer serial ``128,3,permk,mmasum`` (no spills with the test, where ``trio`` gains some) measured slower
#: than ``trio,permk,tarrive,mmasum`` at every sparsity at wan14b-720p (see BENCHMARKS.md, "Skip-Softmax").
SKIP_TUNED_CONFIGS = TUNED_CONFIGS
#: Skip-Softmax launches that load K in key order: the serial two-consumer configs with the numerics of
#: :data:`KEY_ORDER_TUNED_CONFIGS`.
SKIP_KEY_ORDER_TUNED_CONFIGS = (GluonConfig(128, 3, mmasum=1), GluonConfig(128, 3, tarrive=1, mmasum=1))


def check_skip_config(config: GluonConfig) -> None:
    """Skip-Softmax runs serial schedules (``trio`` or two/one consumers without ``ahead``; not ``quad``, whose 112
    registers do not hold the test) with 128-key tiles (the contract's tile,
    :data:`qattn_fx.skip_softmax.TILE_KEYS`); ``ValueError`` naming the config otherwise."""
    if config.ahead or config.quad or config.block_n != 128:
        raise ValueError(f"gluon_sage config {config} cannot run Skip-Softmax; valid: serial schedules with 128-key "
                         "tiles, e.g. '128,3,trio,permk,mmasum' or '128,3,mmasum' (no 'ahead', no 'quad')")


#: Block-sparse launches (:mod:`qattn_fx.block_sparse`): a CTA must be one 128-row query tile of the lists, so two
#: consumer warpgroups (no ``trio``, no ``quad``). Where K can be viewed through ``permk``: the ``ahead`` schedule
#: with ``permk`` and ``mmasum`` (the two-consumer configs of that class, with :data:`TUNED_CONFIGS`' numerics but
#: for the CTA's rows); Skip-Softmax: serial configs of that class. Where K loads in key order:
#: :data:`SPARSE_KEY_ORDER_TUNED_CONFIGS` and :data:`SKIP_KEY_ORDER_TUNED_CONFIGS` (two consumers already).
SPARSE_TUNED_CONFIGS = (GluonConfig(128, 3, ahead=1, permk=1, mmasum=1),
                        GluonConfig(128, 2, ahead=1, permk=1, mmasum=1))
SPARSE_SKIP_TUNED_CONFIGS = (GluonConfig(128, 3, permk=1, mmasum=1), GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1))
#: Block-sparse launches that load K in key order: :data:`KEY_ORDER_TUNED_CONFIGS` without the persistent one.
SPARSE_KEY_ORDER_TUNED_CONFIGS = tuple(c for c in KEY_ORDER_TUNED_CONFIGS if not c.persist)
#: Persistent block-sparse configs (:mod:`.schedule`: each work item finds its own lists), the numerics of the
#: sparse tuners' configs without ``persist``. Run when forced by name (:func:`use_config`); no tuner times them
#: until their GPU tests have run (docs/kernel-design.md, "Persistent block-sparse launches").
SPARSE_PERSIST_CONFIGS = (GluonConfig(128, 3, ahead=1, permk=1, mmasum=1, persist=1),
                          GluonConfig(128, 2, ahead=1, permk=1, mmasum=1, persist=1),
                          GluonConfig(128, 3, ahead=1, mmasum=1, persist=1))


def check_sparse_config(config: GluonConfig) -> None:
    """Block-sparse launches run two consumer warpgroups per CTA (128 query rows: one query tile of the lists; with
    ``persist``, of each work item) with 128-key tiles (one listed key tile per ring slot; 64-key tiles under a split
    tail do not match the emulation, so they are not served); ``ValueError`` naming the config and the valid ones
    otherwise."""
    if config.consumers != CONSUMERS or config.block_n != 128:
        valid = ", ".join(f"'{c}'" for c in dict.fromkeys(SPARSE_TUNED_CONFIGS + SPARSE_SKIP_TUNED_CONFIGS
                                                          + SPARSE_KEY_ORDER_TUNED_CONFIGS))
        raise ValueError(f"gluon_sage config {config} ({config.consumers} consumers, {config.rows} query rows per "
                         f"CTA, {config.block_n}-key tiles) cannot run block-sparse calls, whose CTA is one "
                         f"{CONSUMERS * ROWS_PER_CONSUMER}-row query tile of the lists visiting 128-key tiles; "
                         f"valid: two-consumer configs with block_n 128 (no 'trio', no 'quad'), e.g. {valid}")


def check_pair_config(config: GluonConfig, key_bias: bool, skip: bool) -> None:
    """``pair`` launches run without a key bias and without Skip-Softmax (its loop adds neither); ``ValueError``
    naming the config and the launch otherwise."""
    if config.pair and (key_bias or skip):
        raise ValueError(f"gluon_sage config {config} (pair) runs launches without a key bias and without "
                         f"Skip-Softmax; got one with {'a key bias' if key_bias else 'Skip-Softmax'}; valid there: "
                         f"the same config without 'pair', e.g. '{dataclasses.replace(config, pair=0)}'")


def quad_serves(head_dim: int, key_bias: bool) -> bool:
    """Whether a launch fits ``quad``: head_dim :data:`QUAD_HEAD_DIM` without a key bias (:data:`QUAD_CONSUMER_REGS`
    registers hold nothing more)."""
    return head_dim == QUAD_HEAD_DIM and not key_bias


def check_quad_config(config: GluonConfig, head_dim: int, key_bias: bool) -> None:
    """``quad`` runs only where :func:`quad_serves`; ``ValueError`` naming the config and the launch otherwise."""
    if config.quad and not quad_serves(head_dim, key_bias):
        raise ValueError(f"gluon_sage config {config} (four consumers of {QUAD_CONSUMER_REGS} registers) runs "
                         f"head_dim {QUAD_HEAD_DIM} without a key bias; got head_dim {head_dim}"
                         f"{' with a key bias' if key_bias else ''}; valid there: e.g. '{TRIO_DEFAULT_CONFIG}'")


#: Every config the GPU tests run (and ``python -m benchmarks.tune --kernel gluon_sage`` sweeps by default).
CONFIGS = (GluonConfig(128, 3, ahead=1), GluonConfig(128, 2, ahead=1),
           GluonConfig(128, 2),
           GluonConfig(64, 3, ahead=1),
           GluonConfig(128, 3, ahead=1, permk=1), GluonConfig(128, 2, ahead=1, permk=1),
           GluonConfig(128, 3, ahead=1, tarrive=1),
           GluonConfig(128, 3, ahead=1, permk=1, mmasum=1), GluonConfig(128, 2, ahead=1, permk=1, mmasum=1),
           GluonConfig(128, 3, ahead=1, mmasum=1), GluonConfig(128, 3, ahead=1, tarrive=1, mmasum=1),
           GluonConfig(128, 2, mmasum=1),
           GluonConfig(64, 3, ahead=1, mmasum=1),
           GluonConfig(128, 2, trio=1), GluonConfig(128, 3, trio=1, permk=1),
           GluonConfig(128, 3, trio=1, permk=1, tarrive=1), GluonConfig(128, 3, permk=1, mmasum=1, trio=1),
           GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1),
           *PERSIST_CONFIGS)

#: The forced config (``qattn_fx.config.gluon_sage_config``, ``$QATTN_GLUON_SAGE_CONFIG``).
FORCED = ForcedConfig(GluonConfig, "gluon_sage_config")


def use_config(config: Optional[GluonConfig | str]) -> Iterator[None]:
    """Force ``config`` for every call inside the block (``None``: autotune)."""
    return FORCED.use(config)


def forced_config() -> Optional[GluonConfig]:
    """The config every call uses instead of autotuning: ``qattn_fx.config.gluon_sage_config`` (set by
    :func:`use_config`, default ``$QATTN_GLUON_SAGE_CONFIG``), else ``None``."""
    return FORCED.get()


def current_config(head_dim: int = 128) -> GluonConfig:
    """The forced config (:func:`forced_config`), else the untuned default of this head_dim
    (:data:`DEFAULT_CONFIGS`)."""
    return forced_config() or DEFAULT_CONFIGS[head_dim]
