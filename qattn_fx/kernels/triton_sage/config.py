"""triton_sage's launch configs: :class:`KernelConfig`, the autotuned :data:`CONFIGS`, and forcing one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional

from .._sage_common import ForcedConfig, LaunchConfig


@dataclass(frozen=True)
class KernelConfig(LaunchConfig):
    """One launch configuration.

    ``block_m`` query rows per program, ``block_n`` keys per tile, ``num_warps``, ``num_stages`` (cp.async
    pipeline depth of the K/V loads), ``pipe``: software pipelining across tiles — 0: none; 1: the next tile's
    Q·Kᵀ is issued (async wgmma) before this tile's softmax. ``str()``: ``BM128_BN64_w8_s3_pipe``; :meth:`parse`
    also reads ``"128,64,8,3,pipe"``.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pipe: int = 0

    NUMBERS: ClassVar = (("block_m", "BM"), ("block_n", "BN"), ("num_warps", "w"), ("num_stages", "s"))
    FLAGS: ClassVar = ("pipe",)
    KIND: ClassVar = "triton_sage"
    EXAMPLE: ClassVar = "128,64,8,3,pipe"

    def __post_init__(self) -> None:
        self._check_flags()

    @classmethod
    def usage(cls) -> str:
        return "BLOCK_M,BLOCK_N,num_warps,num_stages[,pipe]"

    @property
    def numerics(self) -> tuple[int]:
        """``(block_n,)``: what decides the output bits on given inputs (the key tile places the online softmax's
        rescaling and the e4m3 rounding of P); ``block_m``, warps, stages and ``pipe`` move only time."""
        return (self.block_n,)

    @classmethod
    def from_triton(cls, config) -> "KernelConfig":
        """The :class:`KernelConfig` of a ``triton.Config`` made by :meth:`to_triton`."""
        return cls(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages,
                   int(config.kwargs.get("PIPE", 0)))

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "PIPE": self.pipe}

    def to_triton(self):
        import triton

        return triton.Config(self.meta(), num_warps=self.num_warps, num_stages=self.num_stages)


#: The autotuned set. Hopper wgmma wants 4 warps per 64 query rows; all but the last entry compile without
#: register spills for int8/fp8 Q/K at head_dim 64/128 on sm_90 (Triton 3.6, checked offline with ptxas, see
#: compile_for). ``pipe`` entries issue the next tile's Q·Kᵀ before this tile's softmax (ptxas then interleaves
#: ~90 % of the exp2s with that wgmma).
CONFIGS: tuple[KernelConfig, ...] = (
    KernelConfig(128, 128, 8, 2),
    KernelConfig(128, 128, 8, 3),
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 64, 8, 4),
    KernelConfig(64, 64, 4, 3),
    KernelConfig(64, 64, 4, 4),
    KernelConfig(128, 64, 8, 3, pipe=1),
    KernelConfig(128, 64, 8, 4, pipe=1),
    KernelConfig(64, 64, 4, 3, pipe=1),
    KernelConfig(64, 64, 4, 4, pipe=1),
    KernelConfig(128, 128, 8, 3, pipe=1),  # at head_dim 128: 255 registers, <= 16 B spilled for some strides
)
#: Keys per tile of the configs the autotuner may pick, per compute capability: one width per device, so that the
#: output does not depend on the autotuner's choice (:attr:`KernelConfig.numerics`). 128 on sm_90 (the fastest
#: H200 configs, BENCHMARKS.md), 64 on sm_89 (mma.sync compiles only 128x64 tiles with 8 warps without spills).
BLOCK_N_BY_CAPABILITY = {(9, 0): 128, (8, 9): 64}
#: Used under the Triton interpreter (small tiles: many tiles and tails on test shapes).
INTERPRET_CONFIG = KernelConfig(32, 32, 4, 1)

#: The forced config (``qattn_fx.config.triton_sage_config``, ``$QATTN_TRITON_SAGE_CONFIG``).
FORCED = ForcedConfig(KernelConfig, "triton_sage_config")


def set_config(config: Optional[KernelConfig | str]) -> None:
    """Force one launch config for every call (``None`` restores autotuning)."""
    FORCED.set(config)


def use_config(config: Optional[KernelConfig | str]) -> Iterator[None]:
    """Context manager form of :func:`set_config`."""
    return FORCED.use(config)


def forced_config() -> Optional[KernelConfig]:
    """The config calls use instead of autotuning: ``qattn_fx.config.triton_sage_config`` (set by
    :func:`set_config` / :func:`use_config`, default ``$QATTN_TRITON_SAGE_CONFIG``), else ``None``."""
    return FORCED.get()
