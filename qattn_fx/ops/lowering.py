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
from .. import formats
from . import canonical
from . import fused_quantize
from . import quantize as _quantize  # noqa: F401  (registers qattn::quantize_*)

ops = torch.ops.qattn


class Emitter(Protocol):
    def __call__(self, target: Callable, args: tuple, name: str) -> Any: ...


def eager(target: Callable, args: tuple, name: str) -> Any:
    return target(*args)


def _unpack(emit: Emitter, value: Any, names: tuple[str, ...]) -> tuple:
    return tuple(emit(operator.getitem, (value, i), name) for i, name in enumerate(names))


def _quantize_qk(emit: Emitter, x: Any, recipe: Recipe, block: int, role: str, fused: bool,
                 smooth: bool) -> tuple[Any, Any, Any]:
    """(data, scale, tensor_scale) of Q or K for the recipe; ``fused``: by the fused op (:func:`fused_quantize.plan`
    said it serves this operand), which smooths ``x`` first when ``smooth`` (otherwise ``x`` is already smoothed)."""
    fmt = recipe.qk_dtype
    if fused:
        res = emit(ops.fused_quantize_per_block.default, (x, block, formats.torch_dtype(fmt), smooth),
                   f"{role}_quant")
        return (*_unpack(emit, res, (f"{role}_data", f"{role}_scale")), None)
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


def _quantize_v(emit: Emitter, v: Any, recipe: Recipe, seq_major: bool, fused: bool) -> tuple[Any, Any, Any]:
    fmt = recipe.v_dtype
    if fused:
        res = emit(ops.fused_quantize_per_channel.default, (v, torch.float8_e4m3fn, seq_major), "v_quant")
        return (*_unpack(emit, res, ("v_data", "v_scale")), None)
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


def value_of(x: Any) -> Any:
    """What an emitted operand stands for: a tensor itself, or an FX node's fake value (``example_value``/``val``)."""
    meta = getattr(x, "meta", None)
    if meta is None:
        return x
    return meta.get("example_value", meta.get("val"))


def _shape(x: Any) -> tuple | None:
    value = value_of(x)
    return None if value is None else tuple(value.shape)


def _size(emit: Emitter, x: Any, dim: int) -> Any:
    """Size ``dim`` of ``x``: an int when static, else a ``sym_size`` (a graph node under the compile pass)."""
    size = value_of(x).shape[dim]
    return size if isinstance(size, int) else emit(torch.ops.aten.sym_size.int, (x, dim), f"size{dim % 8}")


def _unit_stride_last(x: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    value = value_of(x)
    return value.shape[-1] == 1 or statically_known_true(value.stride(-1) == 1)


def _to_canonical(emit: Emitter, q: Any, k: Any, v: Any, mask: Any, plan: canonical.Plan) -> tuple:
    """``q, k, v, mask`` in the ops' canonical form (views, except a contiguous copy of an operand whose last dim
    is not unit-stride, which every kernel needs)."""
    if plan.add_head_dim:
        q, k, v = (emit(torch.ops.aten.unsqueeze.default, (x, -3), f"{n}_4d") for n, x in zip("qkv", (q, k, v)))
        if mask is not None and len(_shape(mask)) == 3:
            mask = emit(torch.ops.aten.unsqueeze.default, (mask, -3), "mask_4d")
    if plan.flatten_batch:
        q, k, v = (emit(torch.ops.aten.flatten.using_ints, (x, 0, plan.ndim - 4), f"{n}_4d")
                   for n, x in zip("qkv", (q, k, v)))
    if any(plan.expand_batch):
        full = [x for x, e in zip((q, k, v, mask), (*plan.expand_batch, False))
                if x is not None and not e and len(_shape(x)) == 4 and value_of(x).shape[0] != 1]
        batch = _size(emit, full[0], 0)
        q, k, v = (emit(torch.ops.aten.expand.default, (x, [batch, -1, -1, -1]), f"{n}_batch") if e else x
                   for n, x, e in zip("qkv", (q, k, v), plan.expand_batch))
    q, k, v = (x if _unit_stride_last(x) else emit(torch.ops.aten.clone.default, (x,), f"{n}_contiguous")
               for n, x in zip("qkv", (q, k, v)))
    return q, k, v, mask


def _from_canonical(emit: Emitter, out: Any, q: Any, plan: canonical.Plan) -> Any:
    """The op's ``(B, H, Sq, Dv)`` output in the call's own form (``q``: the call's query)."""
    if plan.add_head_dim:
        return emit(torch.ops.aten.squeeze.dim, (out, -3), "out")
    if plan.flatten_batch:
        sizes = [_size(emit, q, d) for d in range(plan.ndim - 3)]
        return emit(torch.ops.aten.unflatten.int, (out, 0, sizes), "out")
    return out


def quantized_attention(
    q: Any,
    k: Any,
    v: Any,
    recipe: Recipe,
    *,
    kernel: str = "reference",
    sm_scale: Any = None,
    out_dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    attn_mask: Any = None,
    enable_gqa: bool = True,
    emit: Emitter = eager,
) -> Any:
    """Non-causal attention of ``q``, ``k``, ``v`` under ``recipe`` on ``kernel``, as ``F.scaled_dot_product_attention``
    computes it (same shapes, broadcasting, masks).

    Operands are ``(B, Hq, Sq, D)`` / ``(B, Hkv, Skv, D)`` or any other form :mod:`qattn_fx.ops.canonical` serves
    (``(N, S, E)``, leading batch dims, broadcast batch); ``attn_mask`` may be a per-key mask (boolean
    key-padding or additive float bias, e.g. ``(B, 1, 1, Skv)``). Eagerly (default ``emit``) they are tensors and
    the result has SDPA's shape, ``(B, Hq, Sq, Dv)`` stored BSHD for 4-D operands. With another emitter they are
    whatever it works on (FX nodes with fake values in ``meta``). ``sm_scale`` defaults to ``1/sqrt(D)`` like SDPA;
    it may also be a graph value (a node producing a SymFloat), passed to the op as a CPU scalar tensor.
    ``enable_gqa`` (SDPA's flag) defaults to on here: ``Hq`` may be any multiple of ``Hkv``; the compile pass passes
    each call's own flag.
    """
    q_shape = _shape(q)
    if head_dim is None:
        head_dim = q_shape[-1]
    if out_dtype is None:
        out_dtype = value_of(q).dtype
    runtime_scale = None
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(sm_scale, (int, float)):
        runtime_scale = emit(ops.as_scalar_tensor.default, (sm_scale,), "scale")
        sm_scale = 1.0  # unused: the op takes runtime_scale
    entry = kernels.info(kernel)
    if recipe.qk_dtype == "nvfp4" and head_dim % formats.NVFP4_BLOCK:
        raise ValueError(f"nvfp4 Q/K needs head_dim % 16 == 0; got head_dim={head_dim}")
    mask_shape = _shape(attn_mask) if attn_mask is not None else None
    plan = canonical.plan(q_shape, _shape(k), _shape(v), mask_shape, enable_gqa)
    if mask_shape is not None:
        kind = canonical.mask_kind(mask_shape, value_of(attn_mask).dtype == torch.bool, len(q_shape))
        if kind not in canonical.KEY_MASKS:
            raise ValueError(f"attn_mask of shape {mask_shape} is a {kind} mask; the ops serve per-key masks "
                             f"({', '.join(canonical.KEY_MASKS)})")
        if not entry.key_bias:
            raise ValueError(f"kernel {kernel!r} takes no masks; kernels that do: "
                             f"{', '.join(n for n, i in kernels.KERNELS.items() if i.key_bias)}")
    q_call = q
    q, k, v, attn_mask = _to_canonical(emit, q, k, v, attn_mask, plan)
    key_bias = emit(ops.key_bias.default, (attn_mask, k), "key_bias") if attn_mask is not None else None
    fused = fused_quantize.plan(recipe, *(value_of(x) for x in (q, k, v)))
    if recipe.smooth_k and not fused.k:
        k = emit(ops.smooth_k.default, (k,), "k_smooth")
    q_data, q_scale, q_gs = _quantize_qk(emit, q, recipe, recipe.q_block_size, "q", fused.q, False)
    k_data, k_scale, k_gs = _quantize_qk(emit, k, recipe, recipe.k_block_size, "k", fused.k, recipe.smooth_k)
    v_data, v_scale, v_gs = _quantize_v(emit, v, recipe, entry.v_seq_major, fused.v)
    extra = () if key_bias is None and runtime_scale is None else (key_bias, runtime_scale)
    if recipe.family == "scaled":
        args = (q_data, q_scale, k_data, k_scale, v_data, v_scale, recipe.q_block_size, recipe.k_block_size,
                float(sm_scale), out_dtype, kernel, *extra)
        out = emit(ops.scaled_attention.default, args, "attention")
    else:
        args = (q_data, q_scale, q_gs, k_data, k_scale, k_gs, v_data, v_scale, v_gs, recipe.qk_dtype,
                recipe.v_dtype, float(sm_scale), out_dtype, kernel, *extra)
        out = emit(ops.block_scaled_attention.default, args, "attention")
    return _from_canonical(emit, out, q_call, plan)
