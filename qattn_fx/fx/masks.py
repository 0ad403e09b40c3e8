"""Read a mask the model repeated over the heads as the per-key mask it was made from.

diffusers' ``Attention.prepare_attention_mask`` (the ``AttnProcessor2_0`` family: LTX-Video's cross-attention,
PixArt, ...) turns a key-padding bias ``(B, 1, Skv)`` into ``repeat_interleave(heads, dim=0)`` and then
``view(B, heads, -1, Skv)``. Every head then holds the same row, but SDPA sees a ``(B, H, 1, Skv)`` mask, which by its
shape may vary per head, so the pass would keep the site dense. :func:`head_repeated_source` recognizes that chain
in the graph and returns the mask it started from; the site is then described with the per-key shape
``(B, 1, 1, Skv)`` (:func:`per_key_shape`), and a quantized site reads ``unsqueeze(source, 1)``: the same values
at every head, by ``repeat_interleave``'s definition (row ``b·H + h`` of the repeated mask is row ``b`` of the
source).

Matched forms: ``Tensor.repeat_interleave`` / ``torch.repeat_interleave`` / ``aten.repeat_interleave.self_int`` with
an integer ``repeats`` and ``dim=0``, followed by ``view`` / ``reshape`` (method, function or aten op) to
``(B, repeats, *source.shape[1:])``. Sizes are compared only where they are known to be equal without a guard, so a
symbolic size never adds one.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops import canonical
from .match import SdpaCall, example_value

_REPEAT_METHODS = ("repeat_interleave",)
_REPEAT_FUNCTIONS = (torch.repeat_interleave, torch.ops.aten.repeat_interleave.self_int)
_VIEW_METHODS = ("view", "reshape")
_VIEW_FUNCTIONS = (torch.reshape, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                   torch.ops.aten._unsafe_view.default)


def _is(node: object, methods: tuple[str, ...], functions: tuple) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return ((node.op == "call_method" and node.target in methods)
            or (node.op == "call_function" and node.target in functions))


def _repeat_args(node: fx.Node) -> tuple[object, object, object]:
    """``(input, repeats, dim)`` of a repeat_interleave node (``dim`` ``None`` when not given: flattened)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    names = ("input", "repeats", "dim")
    values = {name: args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(names)}
    if values["input"] is None:
        values["input"] = kwargs.get("self")
    return values["input"], values["repeats"], values["dim"]


def _ndim(node: fx.Node) -> int:
    value = example_value(node)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def head_repeated_source(mask: object) -> fx.Node | None:
    """The node ``x`` when ``mask`` is ``view(repeat_interleave(x, H, dim=0), (B, H, *x.shape[1:]))`` (``x`` of shape
    ``(B, ...)``, so that ``mask[b, h] == x[b]`` for every head ``h``), else ``None``."""
    if not _is(mask, _VIEW_METHODS, _VIEW_FUNCTIONS):
        return None
    repeated = mask.args[0] if mask.args else mask.kwargs.get("input", mask.kwargs.get("self"))
    if not _is(repeated, _REPEAT_METHODS, _REPEAT_FUNCTIONS):
        return None
    source, repeats, dim = _repeat_args(repeated)
    if not isinstance(source, fx.Node) or not isinstance(repeats, int) or dim not in (0, -_ndim(source)):
        return None
    x, out = example_value(source), example_value(mask)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() < 1:
        return None
    if out.dim() != x.dim() + 1 or not _same(out.shape[1], repeats) or not _same(out.shape[0], x.shape[0]):
        return None
    if not all(_same(a, b) for a, b in zip(out.shape[2:], x.shape[1:])):
        return None
    return source


def per_key_shape(source: fx.Node) -> tuple:
    """The shape of ``unsqueeze(source, 1)``: the repeated mask's shape with 1 on the head axis."""
    x = example_value(source)
    return (x.shape[0], 1, *x.shape[1:])


def _per_key(shape: tuple, is_bool: bool, ndim: int) -> bool:
    return canonical.mask_kind(tuple(shape), is_bool, ndim) in ("key_padding", "key_bias")


def per_key_source(call: SdpaCall) -> fx.Node | None:
    """:func:`head_repeated_source` of the site's ``attn_mask`` where that mask is not a per-key mask of its operands
    by its shape (:func:`qattn_fx.ops.canonical.mask_kind`) but its source, read per head, is; else ``None`` (a mask
    already per key needs nothing; a source that still varies per query gains nothing)."""
    mask, ndim = call.args["attn_mask"], example_value(call.q).dim()
    value = example_value(mask)
    if not isinstance(value, torch.Tensor):
        return None
    is_bool = value.dtype == torch.bool
    if _per_key(value.shape, is_bool, ndim):
        return None
    source = head_repeated_source(mask)
    return source if source is not None and _per_key(per_key_shape(source), is_bool, ndim) else None
