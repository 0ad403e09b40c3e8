"""A recipe as a sequence of op calls: smooth K, quantize Q/K/V, call the attention op.

:func:`quantized_attention` is written once against an *emitter* so the same code runs eagerly (the default
emitter calls the ops) and builds FX nodes in the compile pass (``qattn_fx.fx.rewrite`` passes an emitter that
creates named graph nodes). That keeps the eager API, the benchmarks and the compiled graphs identical.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Protocol

import torch

from .. import kernels
from ..recipes import Recipe
from . import attention as _attention  # noqa: F401  (registers qattn::*_attention)
from . import formats
from . import quantize as _quantize  # noqa: F401  (registers qattn::quantize_*)

ops = torch.ops.qattn


class Emitter(Protocol):
    def __call__(self, target: Callable, args: tuple, name: str) -> Any: ...


def eager(target: Callable, args: tuple, name: str) -> Any:
    return target(*args)


def _unpack(emit: Emitter, value: Any, names: tuple[str, ...]) -> tuple:
    return tuple(emit(operator.getitem, (value, i), name) for i, name in enumerate(names))


def _quantize_qk(emit: Emitter, x: Any, recipe: Recipe, block: int, role: str) -> tuple[Any, Any, Any]:
    """(data, scale, tensor_scale) of Q or K for the recipe."""
    fmt = recipe.qk_dtype
    if fmt == "bf16":
        return x, None, None
    if fmt in ("int8", "fp8"):
        dtype = formats.torch_dtype(fmt)
        if block > 0:
            res = emit(ops.quantize_per_block.default, (x, block, dtype), f"{role}_quant")
        elif recipe.scale_scope == "head":
            res = emit(ops.quantize_per_head.default, (x, dtype), f"{role}_quant")
        else:
            res = emit(ops.quantize_per_tensor.default, (x, dtype), f"{role}_quant")
        return (*_unpack(emit, res, (f"{role}_data", f"{role}_scale")), None)
    if fmt == "mxfp8":
        res = emit(ops.quantize_mxfp8.default, (x, -1), f"{role}_quant")
        return (*_unpack(emit, res, (f"{role}_data", f"{role}_scale")), None)
    res = emit(ops.quantize_nvfp4.default, (x, False), f"{role}_quant")
    return _unpack(emit, res, (f"{role}_data", f"{role}_scale", f"{role}_tensor_scale"))


def _quantize_v(emit: Emitter, v: Any, recipe: Recipe, seq_major: bool) -> tuple[Any, Any, Any]:
    fmt = recipe.v_dtype
    if fmt == "fp8":
        fp8 = torch.float8_e4m3fn
        if recipe.v_block_size == 1:
            res = emit(ops.quantize_per_channel.default, (v, fp8, seq_major), "v_quant")
        elif recipe.scale_scope == "head":
            res = emit(ops.quantize_per_head.default, (v, fp8, seq_major), "v_quant")
        else:
            res = emit(ops.quantize_per_tensor.default, (v, fp8, seq_major), "v_quant")
        return (*_unpack(emit, res, ("v_data", "v_scale")), None)
    if fmt == "mxfp8":
        res = emit(ops.quantize_mxfp8.default, (v, -2), "v_quant")
        return (*_unpack(emit, res, ("v_data", "v_scale")), None)
    res = emit(ops.quantize_nvfp4.default, (v, True), "v_quant")
    return _unpack(emit, res, ("v_data", "v_scale", "v_tensor_scale"))


def quantized_attention(
    q: Any,
    k: Any,
    v: Any,
    recipe: Recipe,
    *,
    kernel: str = "reference",
    sm_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    emit: Emitter = eager,
) -> Any:
    """Non-causal attention of ``q (B,Hq,Sq,D)``, ``k``, ``v (B,Hkv,Skv,D)`` under ``recipe`` on ``kernel``.

    Eagerly (default ``emit``) ``q``, ``k``, ``v`` are tensors and the result is ``(B,Hq,Sq,Dv)`` (stored BSHD).
    With another emitter they are whatever it works on (FX nodes); pass ``out_dtype`` and ``head_dim`` then.
    ``sm_scale`` defaults to ``1/sqrt(D)`` like SDPA.
    """
    if head_dim is None:
        head_dim = q.shape[-1]
    if out_dtype is None:
        out_dtype = q.dtype
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    entry = kernels.info(kernel)
    if recipe.qk_dtype == "nvfp4" and head_dim % formats.NVFP4_BLOCK:
        raise ValueError(f"nvfp4 Q/K needs head_dim % 16 == 0; got head_dim={head_dim}")
    if recipe.smooth_k:
        k = emit(ops.smooth_k.default, (k,), "k_smooth")
    q_data, q_scale, q_gs = _quantize_qk(emit, q, recipe, recipe.q_block_size, "q")
    k_data, k_scale, k_gs = _quantize_qk(emit, k, recipe, recipe.k_block_size, "k")
    v_data, v_scale, v_gs = _quantize_v(emit, v, recipe, entry.v_seq_major)
    if recipe.family == "scaled":
        args = (q_data, q_scale, k_data, k_scale, v_data, v_scale, recipe.q_block_size, recipe.k_block_size,
                float(sm_scale), out_dtype, kernel)
        return emit(ops.scaled_attention.default, args, "attention")
    args = (q_data, q_scale, q_gs, k_data, k_scale, k_gs, v_data, v_scale, v_gs, recipe.qk_dtype, recipe.v_dtype,
            float(sm_scale), out_dtype, kernel)
    return emit(ops.block_scaled_attention.default, args, "attention")
