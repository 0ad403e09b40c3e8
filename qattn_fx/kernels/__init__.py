"""Kernel registry: the implementations behind the attention ops.

A kernel is a module with one function per attention op family it implements:

* ``scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype) -> Tensor``
  (bf16/int8/fp8 Q/K with per-block/head/tensor scales, fp8 V with per-channel/head/tensor scales), and/or
* ``block_scaled_attention(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale,
  out_dtype) -> Tensor`` (MXFP8 / NVFP4).

Tensors and scales follow :mod:`qattn_fx.ops.attention`; every kernel returns the output as logical
``(B, Hq, Sq, Dv)`` stored BSHD (``torch.empty(B, Sq, Hq, Dv).transpose(1, 2)``), the layout the op's fake
kernel promises. GPU libraries are imported inside the kernel module, never at package import.

Adding a kernel: write ``qattn_fx/kernels/<name>.py``, add a :class:`KernelInfo` below, and add or extend rows
of :data:`qattn_fx.recipes.TABLE` whose :class:`~qattn_fx.recipes.Requirements` name it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelInfo:
    """Where a kernel lives and which op families it implements.

    ``v_seq_major``: the kernel wants fp8 V stored sequence-fastest (the quantize node writes it so);
    ``key_bias``: its functions take ``key_bias=`` (a per-key fp32 logit bias, how key-padding masks run);
    ``description`` is shown in reports and the README.
    """

    name: str
    module: str
    scaled: str | None = None
    block_scaled: str | None = None
    v_seq_major: bool = False
    key_bias: bool = False
    description: str = ""


KERNELS: dict[str, KernelInfo] = {
    info.name: info
    for info in (
        KernelInfo("reference", "qattn_fx.kernels.reference", "scaled_attention", "block_scaled_attention",
                   key_bias=True, description="exact numerics in torch (fp32), CPU and CUDA; the definition kernels are tested against"),
        KernelInfo("triton_sage", "qattn_fx.kernels.triton_sage", "scaled_attention", v_seq_major=True, key_bias=True,
                   description="qattn_fx Triton SageAttention (INT8/FP8 Q·Kᵀ per-block, FP8 P·V), sm_89/sm_90"),
        KernelInfo("gluon_sage", "qattn_fx.kernels.gluon_sage", "scaled_attention", v_seq_major=True, key_bias=True,
                   description="qattn_fx warp-specialized Gluon SageAttention (TMA producer warp, two consumer "
                               "warpgroups; triton_sage's numerics), sm_90, triton >= 3.6"),
        KernelInfo("cudnn_fp8", "qattn_fx.kernels.cudnn", "fp8_attention",
                   description="cuDNN frontend sdpa_fp8, per-tensor FP8 Q/K/V"),
        KernelInfo("cudnn_mxfp8", "qattn_fx.kernels.cudnn", block_scaled="mxfp8_attention",
                   description="cuDNN frontend sdpa_mxfp8 (Blackwell, cuDNN >= 9.21)"),
        KernelInfo("flashinfer_fa3_fp8", "qattn_fx.kernels.flashinfer", "fa3_fp8_attention",
                   description="FlashInfer FA3 FP8 prefill with per-head scales (sm_90)"),
        KernelInfo("flashinfer_trtllm_sage", "qattn_fx.kernels.flashinfer", "trtllm_sage_attention",
                   description="FlashInfer trtllm-gen SageAttention (sm_100/sm_103)"),
    )
}

FAMILIES = ("scaled", "block_scaled")


def info(name: str) -> KernelInfo:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel={name!r} is unknown; valid: {', '.join(KERNELS)}") from None


def load(name: str, family: str) -> Callable:
    """The function implementing op ``family`` (``scaled`` / ``block_scaled``) in kernel ``name``."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is invalid; valid: {', '.join(FAMILIES)}")
    entry = info(name)
    function = getattr(entry, family)
    if function is None:
        implemented = [f for f in FAMILIES if getattr(entry, f)]
        raise ValueError(f"kernel {name!r} does not implement {family} attention; it implements: {implemented}")
    return getattr(importlib.import_module(entry.module), function)
