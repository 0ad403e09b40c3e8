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

from .. import config, kernels
from ..kernels import quantize_kv as fused_kv
from ..recipes import BlockSparse, Recipe, SkipSoftmax
from . import attention as _attention  # noqa: F401  (registers qattn::*_attention)
from . import predict as _predict  # noqa: F401  (registers qattn::predict_blocks, qattn::block_keep)
from .. import formats
from . import canonical
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


def _q_in_kernel(recipe: Recipe, entry: kernels.KernelInfo, q_dtype: torch.dtype) -> bool:
    """The kernel takes the bf16/fp16 Q and quantizes it itself (``KernelInfo.quantizes_q``): an int8 recipe whose
    ``q_block_size`` the kernel quantizes, no Q pass in the graph."""
    return (recipe.qk_dtype in ("int8", "fp8") and recipe.q_block_size in entry.quantizes_q
            and kernels.q_quantized_in_kernel(q_dtype, formats.torch_dtype(recipe.qk_dtype)))


def _q_scale_spans_tokens(recipe: Recipe) -> bool:
    """A Q scale of the recipe covers more than one token (per block of several, per head or tensor, NVFP4's
    tensor scale), so what one query holds moves the others' quantization."""
    if recipe.qk_dtype in ("int8", "fp8"):
        return recipe.q_block_size != 1
    return recipe.qk_dtype == "nvfp4"


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


def uses_fused_kv(recipe: Recipe, k: Any, v: Any) -> bool:
    """Whether a site quantizes K and V with ``qattn::kv_stats`` and ``qattn::quantize_kv`` (one Triton launch)
    instead of the separate ops (``smooth_k``, ``quantize_per_block``, ``mask_keys``, ``quantize_per_channel``):
    the recipe is one the fused op covers (smoothed int8/fp8 K in blocks of a power of two up to 128 tokens,
    per-channel fp8 V), ``qattn_fx.config.fused_kv_quantize`` is on, and ``k`` and ``v`` (tensors, or nodes whose
    fake values tell) are on a CUDA device the kernel compiles for, in dtypes and head dims it takes. Graphs of
    CPU tensors never change."""
    if not (recipe.smooth_k and recipe.qk_dtype in ("int8", "fp8") and recipe.k_block_size in fused_kv.K_BLOCKS
            and recipe.v_dtype == "fp8" and recipe.v_block_size == 1):
        return False
    if not config.flag("fused_kv_quantize"):
        return False
    k_value, v_value = value_of(k), value_of(v)
    if k_value is None or v_value is None or k_value.device != v_value.device:
        return False
    return fused_kv.device_supported(k_value.device) and fused_kv.unsupported(k_value, v_value) is None


def _quantize_kv(emit: Emitter, k: Any, v: Any, key_bias: Any, recipe: Recipe, seq_major: bool) -> tuple:
    """``(k_data, k_scale, v_data, v_scale)`` of a site :func:`uses_fused_kv` says the fused op covers: the
    statistics (K's mean, V's scales) as reductions Inductor fuses, then one pass over K and V."""
    stats = emit(ops.kv_stats.default, (k, v) if key_bias is None else (k, v, key_bias), "kv_stats")
    k_mean, v_scale = _unpack(emit, stats, ("k_mean", "v_scale"))
    args = (k, v, k_mean, v_scale, key_bias, recipe.k_block_size, formats.torch_dtype(recipe.qk_dtype), seq_major)
    res = emit(ops.quantize_kv.default, args, "kv_quant")
    return (*_unpack(emit, res, ("k_data", "k_scale", "v_data")), v_scale)


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


def _unit_stride(x: Any, dim: int) -> bool:
    """Whether ``dim`` of ``x`` is unit-stride (or of length 1), known without a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    value = value_of(x)
    return statically_known_true(value.shape[dim] == 1) or statically_known_true(value.stride(dim) == 1)


def contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into a contiguous (row-major) tensor, whatever its strides.

    ``aten.clone`` keeps the strides of a dense input (``preserve_format``): a transposed or permuted buffer would
    come back with the same non-unit stride on D. Under Inductor the copy is a pointwise read that fuses into the
    quantize pass reading it (no separate pass where the consumer is a quantize op).
    """
    return x.clone(memory_format=torch.contiguous_format)


def _to_canonical(emit: Emitter, q: Any, k: Any, v: Any, mask: Any, plan: canonical.Plan,
                  v_seq_major: bool = False) -> tuple:
    """``q, k, v, mask`` in the ops' canonical form: views, except a contiguous copy (:func:`contiguous_copy`) of a
    Q or K whose last dim is not unit-stride, and of a V that has a unit stride neither on D nor, for a kernel that
    wants it sequence-major (``v_seq_major``: its quantize node writes that layout from either), on S. Every other
    layout SDPA takes (views with gaps in any dim, broadcast (stride 0) batch or heads, storage offsets) the ops
    take as it is."""
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
    q, k = (x if _unit_stride(x, -1) else emit(contiguous_copy, (x,), f"{n}_contiguous") for n, x in zip("qk", (q, k)))
    if not (_unit_stride(v, -1) or (v_seq_major and _unit_stride(v, -2))):
        v = emit(contiguous_copy, (v,), "v_contiguous")
    return q, k, v, mask


def _from_canonical(emit: Emitter, out: Any, q: Any, plan: canonical.Plan) -> Any:
    """The op's ``(B, H, Sq, Dv)`` output in the call's own form (``q``: the call's query)."""
    if plan.add_head_dim:
        return emit(torch.ops.aten.squeeze.dim, (out, -3), "out")
    if plan.flatten_batch:
        sizes = [_size(emit, q, d) for d in range(plan.ndim - 3)]
        return emit(torch.ops.aten.unflatten.int, (out, 0, sizes), "out")
    return out


def _check_lse(recipe: Recipe, kernel: str, entry: kernels.KernelInfo, plan: canonical.Plan) -> None:
    """Raise ``ValueError`` unless the call can return its LSE (see :func:`quantized_attention`)."""
    if recipe.family != "scaled":
        raise ValueError(f"return_lse=True needs a recipe of the scaled family (int8/fp8/bf16 Q/K, fp8 V); "
                         f"got {recipe.name}")
    if not entry.lse:
        raise ValueError(f"kernel {kernel!r} returns no LSE; kernels that do: "
                         f"{kernels.names_with('lse')}")
    if plan.add_head_dim or plan.flatten_batch:
        raise ValueError(f"return_lse=True needs 4-D (B, H, S, D) operands; got {plan.ndim}-D")


def _skip_threshold(emit: Emitter, k: Any, skip: SkipSoftmax | None, timestep: Any, timestep_scale: float) -> Any:
    """The ``qattn::skip_threshold`` node of a site (None without Skip-Softmax)."""
    if skip is None:
        return None
    if skip.target_sparsity is not None:
        raise ValueError(f"skip_softmax.target_sparsity={skip.target_sparsity:g} needs a calibration "
                         "(qattn_fx.calibrate_skip_softmax) that turns it into thresholds; valid here: threshold, "
                         "threshold_scale_factor")
    if skip.gated and timestep is None:
        raise ValueError(f"skip_softmax.disabled_until_timestep={skip.disabled_until_timestep:g} needs the denoising "
                         "timestep (timestep=): the model's timestep tensor, or its graph input")
    args = (k, float(skip.threshold or 0.0), float(skip.threshold_scale_factor or 0.0),
            timestep if skip.gated else None, float(skip.disabled_until_timestep or 0.0), float(timestep_scale))
    return emit(ops.skip_threshold.default, args, "skip_threshold")


def _check_block_sparse(blocks: BlockSparse | None, recipe: Recipe | None, kernel: str,
                        entry: kernels.KernelInfo, return_lse: bool, timestep: Any) -> None:
    """Raise ``ValueError`` unless the call can run ``blocks`` (see :func:`quantized_attention`)."""
    if blocks is None:
        return
    if recipe is None or recipe.family != "scaled":
        raise ValueError("block_sparse needs a recipe of the scaled family (int8/fp8/bf16 Q/K, fp8 V); got "
                         + (recipe.name if recipe is not None else "recipe=None"))
    if return_lse:
        raise ValueError("return_lse=True with block_sparse is not served (ring attention merges LSEs of whole "
                         "key chunks); give one of them")
    if not entry.block_sparse:
        raise ValueError(f"kernel {kernel!r} takes no block lists (block_sparse); kernels that do: "
                         f"{kernels.names_with('block_sparse')}")
    if blocks.keep is None:
        raise ValueError(f"block_sparse.target_sparsity={blocks.target_sparsity:g} needs a calibration that turns it "
                         "into a cdf or top_k per site; valid here: cdf, top_k")
    if blocks.gated and timestep is None:
        raise ValueError(f"block_sparse.disabled_until_timestep={blocks.disabled_until_timestep:g} needs the "
                         "denoising timestep (timestep=): the model's timestep tensor, or its graph input")


def _predict_blocks(emit: Emitter, q: Any, k: Any, key_bias: Any, sm_scale: float, runtime_scale: Any,
                    blocks: BlockSparse | None, timestep: Any, timestep_scale: float, label: str) -> tuple:
    """The ``qattn::block_keep`` and ``qattn::predict_blocks`` nodes of a site (from its canonical, unquantized Q
    and K): ``(block_index, block_count)``, or ``()`` without block sparsity."""
    if blocks is None:
        return ()
    keep_args = (k, float(blocks.keep), timestep if blocks.gated else None,
                 float(blocks.disabled_until_timestep or 0.0), float(timestep_scale))
    keep = emit(ops.block_keep.default, keep_args, "block_keep")
    args = (q, k, key_bias, float(sm_scale), runtime_scale, keep, blocks.mode, int(blocks.sink_tiles),
            bool(blocks.diagonal), float(blocks.similarity), label)
    return _unpack(emit, emit(ops.predict_blocks.default, args, "predict_blocks"), ("block_index", "block_count"))


def quantized_attention(
    q: Any,
    k: Any,
    v: Any,
    recipe: Recipe | None,
    *,
    kernel: str = "reference",
    sm_scale: Any = None,
    out_dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    attn_mask: Any = None,
    enable_gqa: bool = True,
    return_lse: bool = False,
    emit: Emitter = eager,
    skip_softmax: SkipSoftmax | None = None,
    timestep: Any = None,
    timestep_scale: float = 1000.0,
    skip_label: str = "",
    query_mask: Any = None,
    block_sparse: BlockSparse | None = None,
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

    ``return_lse``: return ``(out, lse)``, ``lse`` the natural-log log-sum-exp of each query row's logits, fp32
    ``(B, Hq, Sq)`` (``qattn::scaled_attention_lse``; with ``smooth_k`` the shift smoothing takes off is added back
    by ``qattn::lse_shift``), for 4-D operands and recipes of the ``scaled`` family on kernels that return it
    (``KernelInfo.lse``); anything else raises ``ValueError``.
    ``skip_softmax`` (:class:`~qattn_fx.recipes.SkipSoftmax` with ``threshold`` or ``threshold_scale_factor``):
    Skip-Softmax on top of the recipe (:mod:`qattn_fx.skip_softmax`); λ reaches the op as a tensor computed by a
    ``skip_threshold`` node, gated by ``timestep`` (a tensor or node: the model's timestep, divided by
    ``timestep_scale`` to the normalized ``t``) when ``disabled_until_timestep`` is set; ``skip_label`` names the
    site in measured sparsity. ``recipe=None`` (with ``skip_softmax``): unquantized attention with Skip-Softmax
    (``qattn::skip_softmax_attention``, the reference kernel).
    ``query_mask``: the kept queries, boolean, broadcastable to ``(B, 1, Sq, 1)`` of the canonical form (4-D calls),
    for a mask that masks queries too (:class:`qattn_fx.fx.masks.MaskRead`, whose caller sets their output rows to
    0): masked queries' Q rows are zeroed before a Q scale that spans several tokens reads them.
    ``block_sparse`` (:class:`~qattn_fx.recipes.BlockSparse` with ``cdf`` or ``top_k``; recipes of the ``scaled``
    family on kernels whose ``KernelInfo.block_sparse``): a ``qattn::predict_blocks`` node picks the blocks to visit
    from the canonical, unquantized Q and K (and the key bias of a mask; GQA: K's own heads) before any quantize
    node, and the attention op visits only those; its ``keep`` is a ``qattn::block_keep`` node (1, every block,
    while the normalized ``timestep`` is above ``disabled_until_timestep``); ``skip_label`` also names the site in
    measured block sparsity (:func:`qattn_fx.block_sparse.measure`).
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
    if recipe is None and skip_softmax is None:
        raise ValueError("recipe=None is only valid with skip_softmax (unquantized attention with Skip-Softmax)")
    if recipe is not None and recipe.qk_dtype == "nvfp4" and head_dim % formats.NVFP4_BLOCK:
        raise ValueError(f"nvfp4 Q/K needs head_dim % 16 == 0; got head_dim={head_dim}")
    mask_shape = _shape(attn_mask) if attn_mask is not None else None
    plan = canonical.plan(q_shape, _shape(k), _shape(v), mask_shape, enable_gqa)
    if return_lse:
        if skip_softmax is not None:
            raise ValueError("return_lse=True with skip_softmax is not served (the LSE op runs no tile test); "
                             "give one of them")
        _check_lse(recipe, kernel, entry, plan)
    _check_block_sparse(block_sparse, recipe, kernel, entry, return_lse, timestep)
    if mask_shape is not None:
        kind = canonical.mask_kind(mask_shape, value_of(attn_mask).dtype == torch.bool, len(q_shape))
        if kind not in canonical.KEY_MASKS:
            raise ValueError(f"attn_mask of shape {mask_shape} is a {kind} mask; the ops serve per-key masks "
                             f"({', '.join(canonical.KEY_MASKS)})")
        if not entry.key_bias:
            raise ValueError(f"kernel {kernel!r} takes no masks; kernels that do: "
                             f"{kernels.names_with('key_bias')}")
    q_call = q
    v_seq_major = entry.v_seq_major and recipe is not None and recipe.v_dtype == "fp8"
    q, k, v, attn_mask = _to_canonical(emit, q, k, v, attn_mask, plan, v_seq_major)
    key_bias = emit(ops.key_bias.default, (attn_mask, k), "key_bias") if attn_mask is not None else None
    k_call = k
    skip = _skip_threshold(emit, k, skip_softmax, timestep, timestep_scale)
    # masked queries' Q reaches no Q scale spanning tokens and no pooled query tile: kept queries' quantization and
    # block lists never depend on it
    spans = recipe is not None and _q_scale_spans_tokens(recipe)
    if query_mask is not None and (block_sparse is not None or spans):
        q = emit(torch.where, (query_mask, q, 0.0), "q_masked")
    blocks = _predict_blocks(emit, q, k, key_bias, sm_scale, runtime_scale, block_sparse, timestep, timestep_scale,
                             skip_label)
    if recipe is None:
        args = (q, k, v, float(sm_scale), out_dtype, kernel, key_bias, runtime_scale, skip, skip_label)
        return _from_canonical(emit, emit(ops.skip_softmax_attention.default, args, "attention"), q_call, plan)
    # masked keys (key_bias -inf) reach no scale and no mean: their rows of K and V are zeroed first (smooth_k does
    # it for K while taking the mean of the kept keys; bf16 K has no scale), whatever they hold; the fused K/V
    # quantize does all of it in one pass
    fused = uses_fused_kv(recipe, k, v)
    if key_bias is not None and recipe.qk_dtype != "bf16" and not recipe.smooth_k:
        k = emit(ops.mask_keys.default, (k, key_bias), "k_masked")
    if recipe.smooth_k and not fused:
        k = emit(ops.smooth_k.default, (k,) if key_bias is None else (k, key_bias), "k_smooth")
    if _q_in_kernel(recipe, entry, value_of(q).dtype):
        q_data, q_scale, q_gs = q, None, None  # the kernel quantizes Q itself, with quantize_per_block's numerics
    else:
        q_data, q_scale, q_gs = _quantize_qk(emit, q, recipe, recipe.q_block_size, "q")
    if fused:
        k_data, k_scale, v_data, v_scale = _quantize_kv(emit, k, v, key_bias, recipe, entry.v_seq_major)
        k_gs = v_gs = None
    else:
        k_data, k_scale, k_gs = _quantize_qk(emit, k, recipe, recipe.k_block_size, "k")
        if key_bias is not None:
            v = emit(ops.mask_keys.default, (v, key_bias), "v_masked")
        v_data, v_scale, v_gs = _quantize_v(emit, v, recipe, entry.v_seq_major)
    extra = (() if key_bias is None and runtime_scale is None and skip is None and not blocks else
             (key_bias, runtime_scale)) + (() if skip is None and not blocks else (skip, skip_label)) + blocks
    if return_lse:
        args = (q_data, q_scale, k_data, k_scale, v_data, v_scale, recipe.q_block_size, recipe.k_block_size,
                float(sm_scale), out_dtype, kernel, *extra)
        res = emit(ops.scaled_attention_lse.default, args, "attention")
        out, lse = _unpack(emit, res, ("out", "lse"))
        if recipe.smooth_k:
            shift_args = (q, k_call, float(sm_scale), runtime_scale) + (() if key_bias is None else (key_bias,))
            shift = emit(ops.lse_shift.default, shift_args, "lse_shift")
            lse = emit(torch.ops.aten.add.Tensor, (lse, shift), "lse_full")
        return out, lse
    if recipe.family == "scaled":
        args = (q_data, q_scale, k_data, k_scale, v_data, v_scale, recipe.q_block_size, recipe.k_block_size,
                float(sm_scale), out_dtype, kernel, *extra)
        out = emit(ops.scaled_attention.default, args, "attention")
    else:
        args = (q_data, q_scale, q_gs, k_data, k_scale, k_gs, v_data, v_scale, v_gs, recipe.qk_dtype,
                recipe.v_dtype, float(sm_scale), out_dtype, kernel, *extra)
        out = emit(ops.block_scaled_attention.default, args, "attention")
    return _from_canonical(emit, out, q_call, plan)
