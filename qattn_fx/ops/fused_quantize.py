"""Fused quantize ops: the Sage recipes' Q, K and V quantization as Triton kernels, and which graph uses them.

The aten definitions (:mod:`qattn_fx.ops.quantize`) leave Inductor several passes over K and V (K's mean, block
amax and cast; V's amax and cast). On CUDA, the operands named by ``qattn_fx.config.triton_quantize``
(``$QATTN_TRITON_QUANTIZE``, letters of ``qkv``; default ``""``, none) are quantized instead by these opaque ops,
backed by :mod:`qattn_fx.kernels.triton_quantize` (one pass for Q, two for K and V):

=========================================================  =====================================================
op                                                         is
=========================================================  =====================================================
``fused_quantize_per_block(x, block, dtype, smooth)``      ``quantize_per_block(smooth_k(x) if smooth else x,
                                                           block, dtype)``
``fused_quantize_per_channel(x, dtype, seq_major)``        ``quantize_per_channel(x, dtype, seq_major)`` (e4m3)
=========================================================  =====================================================

Same outputs, layouts and bits as the aten ops (K's smoothing mean is an fp32 sum in another order: see
:mod:`qattn_fx.kernels.triton_quantize`); their fake implementations allocate the same layouts under symbolic
sizes. Which operand takes which path is decided once, by :func:`plan`: the setting, the device (CUDA; CPU graphs
keep the aten ops, which are also the reference) and what the kernels serve.

Why none by default: standalone the fused passes of Q and K are faster and V's level (H200, flux-1024: Q 18.5 µs
against Inductor's 37.2, K 34.2 against 40.0, V 30.8 against 28.9; BENCHMARKS.md, "Quantize nodes"), but inside a compiled Flux.1-dev step
with all three fused the step took 38.9 ms against 28.6 with Inductor's kernels, which fuse Q's and K's casts into
the RoPE and norm producers; with K and V fused (``"kv"``) 28.2 ms, within that run's spread
(docs/kernel-design.md, "Tried and rejected").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import config
from ..kernels.triton_quantize import layout

OPERANDS = "qkv"


def _fused_quantize_per_block_impl(x: torch.Tensor, block: int, dtype: torch.dtype,
                                   smooth: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton_quantize import launch  # noqa: PLC0415  (imports triton)

    return launch.quantize_per_block(x, block, dtype, smooth)


def _fused_quantize_per_channel_impl(x: torch.Tensor, dtype: torch.dtype,
                                     seq_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton_quantize import launch  # noqa: PLC0415

    return launch.quantize_per_channel(x, dtype, seq_major)


fused_quantize_per_block = torch.library.custom_op("qattn::fused_quantize_per_block", mutates_args=())(
    _fused_quantize_per_block_impl)
fused_quantize_per_channel = torch.library.custom_op("qattn::fused_quantize_per_channel", mutates_args=())(
    _fused_quantize_per_channel_impl)


@fused_quantize_per_block.register_fake
def _(x, block, dtype, smooth):
    return layout.per_block(x, block, dtype)


@fused_quantize_per_channel.register_fake
def _(x, dtype, seq_major):
    return layout.per_channel(x, dtype, seq_major)


FUSED_OPS = (torch.ops.qattn.fused_quantize_per_block.default, torch.ops.qattn.fused_quantize_per_channel.default)


def operands() -> str:
    """``config.triton_quantize``, validated: a string of distinct letters of ``qkv``."""
    value = config.triton_quantize
    if not isinstance(value, str) or any(c not in OPERANDS for c in value) or len(set(value)) != len(value):
        raise ValueError(f"qattn_fx.config.triton_quantize ($QATTN_TRITON_QUANTIZE) = {value!r} is invalid; valid: "
                         "the operands quantized by Triton kernels on CUDA, distinct letters of 'qkv' ('' for none)")
    return value


@dataclass(frozen=True)
class Plan:
    """Per operand, whether its quantization is a fused op (else the aten ops)."""

    q: bool = False
    k: bool = False
    v: bool = False


def plan(recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Plan:
    """Which of Q, K, V the graph quantizes with the fused ops, for ``recipe`` on the canonical ``(B, H, S, D)``
    operands (real or fake values: their device, dtype and head_dim): those named by ``config.triton_quantize``, on
    CUDA, in the formats the kernels serve (int8/fp8 Q/K per block of a power of two up to 128 tokens, K smoothed
    or not; fp8 V per channel)."""
    from ..kernels.triton_quantize import launch  # noqa: PLC0415  (its constants; triton itself is optional)

    names = operands()
    if not names or q.device.type != "cuda":
        return Plan()
    if launch.triton is None:
        raise RuntimeError(f"qattn_fx.config.triton_quantize = {names!r} needs triton ({launch._TRITON_ERROR}); "
                           "set it to '' ($QATTN_TRITON_QUANTIZE=) to quantize with Inductor's kernels")

    def served(t: torch.Tensor) -> bool:
        return t.dtype in launch.DTYPES and t.shape[-1] <= launch.MAX_HEAD_DIM

    qk = recipe.qk_dtype in ("int8", "fp8")
    return Plan(q="q" in names and qk and recipe.q_block_size in launch.BLOCKS and served(q),
                k="k" in names and qk and recipe.k_block_size in launch.BLOCKS and served(k),
                v="v" in names and recipe.v_dtype == "fp8" and recipe.v_block_size == 1 and served(v))
