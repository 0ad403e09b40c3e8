"""Kernel registry: the implementations behind the attention ops.

A kernel is a module with one function per attention op family it implements:

* ``scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype) -> Tensor``
  (bf16/int8/fp8 Q/K with per-block/head/tensor scales, fp8 V with per-channel/head/tensor scales), and/or
* ``block_scaled_attention(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale,
  out_dtype) -> Tensor`` (MXFP8 / NVFP4).

A kernel whose requirements say ``lse=True`` also takes ``return_lse=True`` in ``scaled_attention`` and then returns
``(out, lse)``, ``lse`` the natural-log log-sum-exp of each query row's logits, fp32 ``(B, Hq, Sq)``
(``qattn::scaled_attention_lse``, what ring attention merges partial results by).

Tensors and scales follow :mod:`qattn_fx.ops.attention`; every kernel returns the output as logical
``(B, Hq, Sq, Dv)`` stored BSHD (``torch.empty(B, Sq, Hq, Dv).transpose(1, 2)``), the layout the op's fake
kernel promises. GPU libraries are imported inside the kernel module, never at package import.

Adding a kernel: write ``qattn_fx/kernels/<name>.py`` (or a package), add a :class:`KernelInfo` below with its
:class:`~qattn_fx.requirements.Requirements`, and add or extend rows of :data:`qattn_fx.recipes.TABLE` that name
them (``kernels.requirements(name)``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..requirements import ADA_HOPPER, SM90, SM100, SM100_103, HeadDims, Requirements

_FLASHINFER_SAGE = ("flashinfer-python", "0.6.16rc1")
_SAGE_HD = HeadDims(allowed=(128,))


@dataclass(frozen=True)
class KernelInfo:
    """Where a kernel lives, which op families it implements, and what it needs.

    ``v_seq_major``: the kernel wants fp8 V stored sequence-fastest (the quantize node writes it so);
    ``quantizes_q``: the ``q_block`` values of int8 recipes for which its ``scaled`` function takes the bf16/fp16 Q
    itself (``q_scale=None``, K int8 with scales) and quantizes it inside the kernel with the numerics of
    ``qattn::quantize_per_block`` (no Q pass in the graph);
    ``requirements``: its targets (architectures, head dims, library floor, call-site capabilities), the one
    declaration of these facts: :data:`qattn_fx.recipes.TABLE` names them, the policy checks them, and the kernel
    module reads its own limits from them; ``description`` is a one-line summary (docs/kernels.md has the table).
    """

    name: str
    module: str
    scaled: str | None = None
    block_scaled: str | None = None
    v_seq_major: bool = False
    dense_skip: str | None = None
    quantizes_q: tuple[int, ...] = ()
    requirements: tuple[Requirements, ...] = ()
    description: str = ""

    @property
    def key_bias(self) -> bool:
        """Its functions take ``key_bias=`` (a per-key fp32 logit bias: how key-padding masks run)."""
        return any(r.key_bias for r in self.requirements)

    @property
    def lse(self) -> bool:
        """Its ``scaled`` function takes ``return_lse=True`` and then returns ``(out, lse)``."""
        return any(r.lse for r in self.requirements)

    @property
    def skip_softmax(self) -> bool:
        """Its functions take ``skip_threshold=`` and ``skip_label=`` (Skip-Softmax, :mod:`qattn_fx.skip_softmax`)."""
        return any(r.skip_softmax for r in self.requirements)

    @property
    def block_sparse(self) -> bool:
        """Its ``scaled`` function takes ``block_index=`` and ``block_count=`` (the blocks to visit,
        :mod:`qattn_fx.block_sparse`)."""
        return any(r.block_sparse for r in self.requirements)


KERNELS: dict[str, KernelInfo] = {
    info.name: info
    for info in (
        KernelInfo("reference", "qattn_fx.kernels.reference", "scaled_attention", "block_scaled_attention",
                   dense_skip="dense_attention",
                   requirements=(Requirements("reference", None, key_bias=True, lse=True, skip_softmax=True, block_sparse=True,
                                              dtypes=(torch.bfloat16, torch.float16, torch.float32)),),
                   description="exact numerics in torch (fp32), CPU and CUDA; the definition kernels are tested "
                               "against"),
        KernelInfo("triton_sage", "qattn_fx.kernels.triton_sage", "scaled_attention", v_seq_major=True,
                   requirements=(Requirements("triton_sage", ADA_HOPPER, HeadDims(allowed=(64, 128)),
                                              ("triton", "3.0.0"), key_bias=True, lse=True, block_sparse=True),),
                   description="qattn_fx Triton SageAttention (INT8/FP8 Q·Kᵀ per-block, FP8 P·V), sm_89/sm_90"),
        KernelInfo("gluon_sage", "qattn_fx.kernels.gluon_sage", "scaled_attention", v_seq_major=True,
                   quantizes_q=(1,),
                   requirements=(Requirements("gluon_sage", SM90, HeadDims(allowed=(64, 128)), ("triton", "3.6.0"),
                                              key_bias=True, lse=True, skip_softmax=True, block_sparse=True,
                                              note="needs 16-byte aligned Q/K/V strides (TMA); the quantize nodes "
                                                   "write them so"),),
                   description="qattn_fx warp-specialized Gluon SageAttention (TMA producer warp, two or three "
                               "consumer warpgroups; triton_sage's numerics), sm_90, triton >= 3.6"),
        KernelInfo("cudnn_fp8", "qattn_fx.kernels.cudnn", "fp8_attention",
                   requirements=(
                       Requirements("cudnn_fp8", SM100_103, HeadDims(allowed=(32, 64, 96, 128)), ("cudnn", "9.1.0"),
                                    note="bf16 output straight from cuDNN (Blackwell, cuDNN >= 9.13)"),
                       Requirements("cudnn_fp8", SM90, HeadDims(multiple_of=16, max=256), ("cudnn", "9.1.0"),
                                    note="sm_90: FP8 output with scale_o, dequantized after (qattn_fx)")),
                   description="cuDNN frontend sdpa_fp8, per-tensor FP8 Q/K/V"),
        KernelInfo("cudnn_mxfp8", "qattn_fx.kernels.cudnn", block_scaled="mxfp8_attention",
                   requirements=(Requirements("cudnn_mxfp8", SM100_103, HeadDims(allowed=(64, 128)),
                                              ("cudnn", "9.21.0")),),
                   description="cuDNN frontend sdpa_mxfp8 (Blackwell, cuDNN >= 9.21)"),
        KernelInfo("flashinfer_fa3_fp8", "qattn_fx.kernels.flashinfer", "fa3_fp8_attention",
                   requirements=(Requirements("flashinfer_fa3_fp8", SM90, HeadDims(allowed=(64, 128, 256)),
                                              ("flashinfer-python", "0.6.0")),),
                   description="FlashInfer FA3 FP8 prefill with per-head scales (sm_90)"),
        KernelInfo("flashinfer_trtllm_sage", "qattn_fx.kernels.flashinfer", "trtllm_sage_attention",
                   requirements=(
                       Requirements("flashinfer_trtllm_sage", SM100, _SAGE_HD, _FLASHINFER_SAGE, skip_softmax=True,
                                    qk_dtypes=("int8",), note="trtllm-gen cubins; INT8 Q/K compiled for sm_100 only"),
                       Requirements("flashinfer_trtllm_sage", SM100_103, _SAGE_HD, _FLASHINFER_SAGE,
                                    skip_softmax=True, qk_dtypes=("fp8",), note="trtllm-gen cubins")),
                   description="FlashInfer trtllm-gen SageAttention (sm_100/sm_103)"),
    )
}

FAMILIES = ("scaled", "block_scaled", "dense_skip")


def info(name: str) -> KernelInfo:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel={name!r} is unknown; valid: {', '.join(KERNELS)}") from None


def names_with(ability: str) -> str:
    """The kernels whose :class:`KernelInfo` has ``ability`` (``key_bias``, ``lse``, ``skip_softmax``,
    ``block_sparse``, ``quantizes_q``), comma-joined:
    the valid choices an error names when a kernel lacks it."""
    return ", ".join(n for n, i in KERNELS.items() if getattr(i, ability))


def q_quantized_in_kernel(q_dtype: torch.dtype, k_dtype: torch.dtype) -> bool:
    """The form of ``scaled_attention`` call whose Q the kernel quantizes itself (:attr:`KernelInfo.quantizes_q`): a
    bf16/fp16 Q (no scales) beside an int8 K."""
    return q_dtype in (torch.bfloat16, torch.float16) and k_dtype == torch.int8


def requirements(name: str, qk_dtype: str | None = None) -> tuple[Requirements, ...]:
    """Kernel ``name``'s targets (those that run Q/K format ``qk_dtype``, when given)."""
    return tuple(r for r in info(name).requirements if qk_dtype is None or r.qk_dtypes is None
                 or qk_dtype in r.qk_dtypes)


def load(name: str, family: str) -> Callable:
    """The function implementing op ``family`` (``scaled`` / ``block_scaled`` / ``dense_skip``: unquantized attention
    with Skip-Softmax) in kernel ``name``."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is invalid; valid: {', '.join(FAMILIES)}")
    entry = info(name)
    function = getattr(entry, family)
    if function is None:
        implemented = [f for f in FAMILIES if getattr(entry, f)]
        raise ValueError(f"kernel {name!r} does not implement {family} attention; it implements: {implemented}")
    return getattr(importlib.import_module(entry.module), function)
