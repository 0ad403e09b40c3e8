"""Read a mask the model repeated over the heads as the per-key mask it was made from.

diffusers' ``Attention.prepare_attention_mask`` (the ``AttnProcessor2_0`` family: LTX-Video's cross-attention,
PixArt, ...) turns a key-padding bias ``(B, 1, Skv)`` into ``repeat_interleave(heads, dim=0)`` and then
``view(B, heads, -1, Skv)``. Every head then holds the same row, but SDPA sees a ``(B, H, 1, Skv)`` mask, which by its
shape may vary per head, so the pass would keep the site dense. :func:`head_repeated_source` recognizes that chain
in the graph and returns the mask it started from; the site is then described with the per-key shape
``(B, 1, 1, Skv)`` (:func:`per_key_shape`), and a quantized site reads ``unsqueeze(source, 1)``: the same values
at every head, by ``repeat_interleave``'s definition (row ``b·H + h`` of the repeated mask is row ``b`` of the
source). A 4-D mask with a head axis of 1 goes through the same chain to ``(B, H, ...)``; it is read as itself. A
``(B, Skv)`` mask goes through it to ``(B, H, 1, Skv)`` (diffusers' ``AttnProcessor2_0`` given a 2-D
``encoder_attention_mask``: Latte); it is read as ``(B, 1, 1, Skv)``. Lumina-Next's processor broadcasts its
``(B, 1, 1, S)`` mask with ``expand(-1, H, Sq, -1)``: a 4-D mask tiled over the heads and queries (``expand`` or
``repeat``) is read as the mask it tiles.

Matched forms: ``Tensor.repeat_interleave`` / ``torch.repeat_interleave`` / ``aten.repeat_interleave.self_int`` with
an integer ``repeats`` and ``dim=0``, followed by ``view`` / ``reshape`` (method, function or aten op) to
``(B, repeats, *source.shape[1:])`` (or ``(B, repeats, *source.shape[2:])`` when ``source.shape[1]`` is 1, or
``(B, repeats, 1, Skv)`` for a ``(B, Skv)`` source).

Read a symmetric padding mask as its key mask and a row mask.

HunyuanVideo-1.5 builds every block's self-attention mask from a ``(B, S)`` padding mask ``m`` as ``M = R &
R.transpose(2, 3)`` with ``R = m.view(B, 1, 1, S).repeat(1, 1, S, 1)``: ``M[b, 0, i, j] = m[b, i] & m[b, j]``.
Its token refiner's processor repeats that mask over the heads (``prepare_attention_mask``): read the same way.
(HunyuanVideo's token refiner sets the mask's first column in place, which lets a masked query see key 0: it stays
dense.) A query ``i`` that is kept sees exactly the keys of the per-key mask ``m.view(B, 1, 1,
S)``; a query that is masked has every key masked, a row that SDPA's math and memory-efficient kernels give as 0
(its cuDNN kernel on the H200 gives other finite values:
``benchmarks/results/2026-12-03_h200_sdpa_fully_masked_rows.log``); those rows belong to padding tokens, which every
later attention masks as keys.
:func:`symmetric_source` recognizes that form (``&`` as ``operator.and_``, ``bitwise_and`` or ``logical_and``, either
operand order, no-op ``.bool()`` conversions around it; the tiling as ``repeat`` or ``expand`` along the query axis;
the transpose of the last two axes); a quantized site takes the per-key mask and sets the rows of masked queries to
0 (:meth:`MaskRead.finish`), as SDPA's reference (math) kernel does.

Sizes are compared only where they are known to be equal without a guard, so a symbolic size never adds one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

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
_AND_METHODS = ("__and__", "bitwise_and", "logical_and")
_AND_FUNCTIONS = (operator.and_, torch.bitwise_and, torch.logical_and, torch.ops.aten.bitwise_and.Tensor,
                  torch.ops.aten.logical_and.default)
_TILE_METHODS = ("repeat", "expand")
_TILE_FUNCTIONS = (torch.ops.aten.repeat.default, torch.ops.aten.expand.default)
_TRANSPOSE_METHODS = ("transpose", "swapaxes")
_TRANSPOSE_FUNCTIONS = (torch.transpose, torch.swapaxes, torch.ops.aten.transpose.int)


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


def _input(node: fx.Node) -> object:
    """The tensor a method or function node takes first (``args[0]``, or its ``input`` / ``self`` keyword)."""
    return node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))


def _ndim(node: fx.Node) -> int:
    value = example_value(node)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def head_repeated_source(mask: object) -> tuple[fx.Node, int] | None:
    """``(x, n)`` when ``mask`` is ``view(repeat_interleave(x, H, dim=0), (B, H, ...))`` and every head of it holds
    ``x[b]`` read with ``n`` unit axes after the batch axis: ``n = 1`` for ``x`` of shape ``(B, ...)`` viewed to
    ``(B, H, *x.shape[1:])``; ``n = 2`` for a ``(B, Skv)`` ``x`` viewed to ``(B, H, 1, Skv)``; ``n = 0`` for ``x``
    with a head axis of 1 already, viewed to ``(B, H, *x.shape[2:])`` (a 4-D mask through
    ``prepare_attention_mask``). Else ``None``. :func:`per_key_shape` is the read's shape."""
    if not _is(mask, _VIEW_METHODS, _VIEW_FUNCTIONS):
        return None
    repeated = _input(mask)
    if not _is(repeated, _REPEAT_METHODS, _REPEAT_FUNCTIONS):
        return None
    source, repeats, dim = _repeat_args(repeated)
    if not isinstance(source, fx.Node) or not isinstance(repeats, int) or dim not in (0, -_ndim(source)):
        return None
    x, out = example_value(source), example_value(mask)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() < 1:
        return None
    if not _same(out.shape[1], repeats) or not _same(out.shape[0], x.shape[0]):
        return None
    new_axes = out.dim() - x.dim()
    if new_axes not in (0, 1, 2) or (new_axes == 0 and x.dim() < 2):
        return None
    read = per_key_shape(source, new_axes)
    if not _same(read[1], 1) or not all(_same(a, b) for a, b in zip(out.shape[2:], read[2:])):
        return None
    return source, new_axes


def per_key_shape(source: fx.Node, new_axes: int) -> tuple:
    """The shape of the per-key read of a mask repeated over the heads: ``source``'s with ``new_axes`` unit axes
    after the batch axis (:func:`head_repeated_source`)."""
    x = example_value(source)
    return (x.shape[0], *(1,) * new_axes, *x.shape[1:])


def _per_key(shape: tuple, is_bool: bool, ndim: int) -> bool:
    return canonical.mask_kind(tuple(shape), is_bool, ndim) in ("key_padding", "key_bias")


def _bool_value(node: object) -> bool:
    value = example_value(node) if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _without_bool_casts(node: object) -> object:
    """``node`` with the ``.bool()`` conversions of a boolean tensor (no-ops) around it taken off."""
    while (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "bool" and not node.kwargs
           and len(node.args) == 1 and _bool_value(node.args[0])):
        node = node.args[0]
    return node


def _transposed(node: object) -> object:
    """``x`` when ``node`` is ``x.transpose(-2, -1)`` of a 4-D ``x`` (either order, either sign), else None."""
    if not _is(node, _TRANSPOSE_METHODS, _TRANSPOSE_FUNCTIONS) or len(node.args) != 3 or node.kwargs:
        return None
    x, a, b = node.args
    if not isinstance(x, fx.Node) or _ndim(x) != 4 or not all(isinstance(d, int) for d in (a, b)):
        return None
    return x if {a % 4, b % 4} == {2, 3} else None


def _tiled(node: object, *, over_heads: bool) -> fx.Node | None:
    """``x`` of shape ``(B, 1, 1, S)`` when ``node`` is ``x`` repeated or expanded along the query axis (and, with
    ``over_heads``, the head axis) only, to ``(B, 1 | H, Sq, S)``, else None: ``node[b, h, i, j] == x[b, 0, 0, j]``."""
    if not _is(node, _TILE_METHODS, _TILE_FUNCTIONS):
        return None
    x = _input(node)
    xv, out = example_value(x) if isinstance(x, fx.Node) else None, example_value(node)
    if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or xv.dim() != 4 or out.dim() != 4:
        return None
    if not (_same(xv.shape[1], 1) and _same(xv.shape[2], 1) and (over_heads or _same(out.shape[1], 1))):
        return None
    return x if _same(out.shape[0], xv.shape[0]) and _same(out.shape[3], xv.shape[3]) else None


_CAST_METHODS = ("to", "type", "float", "half", "bfloat16", "double")


def _uncast(node: object) -> tuple[object, torch.dtype | None]:
    """``(x, dtype)`` when ``node`` is ``x`` cast to another dtype (``.to(dtype)``, ``.bfloat16()``, ..., same
    shape): a cast after a mask is repeated or broadcast over the heads, e.g. ``mask.to(query.dtype)``; else
    ``(node, None)``."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in _CAST_METHODS):
        return node, None
    x = _input(node)
    xv, out = example_value(x) if isinstance(x, fx.Node) else None, example_value(node)
    if not (isinstance(xv, torch.Tensor) and isinstance(out, torch.Tensor) and xv.dtype != out.dtype
            and len(xv.shape) == len(out.shape) and all(_same(a, b) for a, b in zip(xv.shape, out.shape))):
        return node, None
    return x, out.dtype


def symmetric_source(mask: object) -> fx.Node | None:
    """The ``(B, 1, 1, S)`` boolean node ``x`` when ``mask`` is ``R & R.transpose(-2, -1)`` with ``R`` ``x`` tiled
    along the query axis (so that ``mask[b, 0, i, j] == x[b, 0, 0, i] & x[b, 0, 0, j]``), else None."""
    mask = _without_bool_casts(mask)
    if not _is(mask, _AND_METHODS, _AND_FUNCTIONS) or len(mask.args) != 2 or mask.kwargs:
        return None
    a, b = (_without_bool_casts(x) for x in mask.args)
    for tiled, other in ((a, b), (b, a)):
        if isinstance(tiled, fx.Node) and _transposed(other) is tiled:
            source = _tiled(tiled, over_heads=False)
            if source is not None and _bool_value(source):
                return source
    return None


_ALIAS_METHODS = ("view", "view_as", "reshape", "expand", "expand_as", "transpose", "swapaxes", "permute", "movedim",
                  "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "t", "diagonal", "as_strided",
                  "contiguous", "detach", "__getitem__", "to", "type", "bool", "float", "half", "bfloat16", "int",
                  "long")
_ALIAS_FUNCTIONS = (operator.getitem, torch.reshape, torch.transpose, torch.swapaxes, torch.permute, torch.movedim,
                    torch.unsqueeze, torch.squeeze, torch.flatten, torch.narrow, torch.select, torch.t,
                    torch.diagonal, torch.as_strided, torch.detach)
_INPLACE_OPERATORS = (operator.setitem, operator.iand, operator.ior, operator.ixor, operator.iadd, operator.isub,
                      operator.imul, operator.itruediv)


def _aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s output may share memory with its first input (a view, or a cast that may return self)."""
    if node.op == "call_method":
        return node.target in _ALIAS_METHODS
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # an aten op: its schema says whether the output aliases an input
        return any(r.alias_info is not None for r in schema.returns)
    return node.target in _ALIAS_FUNCTIONS


def _mutates_input(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first input in place (``x[i] = v``, ``x &= m``, ``x.masked_fill_(...)``)."""
    target = node.target
    if node.op == "call_method":
        return (target.endswith("_") and not target.startswith("__")) or target == "__setitem__" or (
            target.startswith("__i") and target.endswith("__"))
    if node.op != "call_function":
        return False
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    if target in _INPLACE_OPERATORS:
        return True
    name = getattr(target, "__name__", "")  # torch.fill_, Tensor.masked_fill_; not operator.and_ / or_
    return name.endswith("_") and not name.startswith("_") and getattr(target, "__module__", None) != "_operator"


def _root(node: object) -> object:
    """The tensor ``node`` is a view of, following view-like nodes up through their first input."""
    while isinstance(node, fx.Node) and _aliases_input(node) and isinstance(_input(node), fx.Node):
        node = _input(node)
    return node


def _written_in_place(mask: fx.Node, source: fx.Node) -> bool:
    """Whether anything in the graph writes in place into a tensor on the path from ``source`` to ``mask`` (or a
    view of one): a read of ``source`` in place of ``mask`` would then miss or see the write. HunyuanVideo's token
    refiner sets its ``m_i & m_j`` mask's first column this way. Conservative: the order of the write is not
    considered."""
    graph, reach = mask.graph, {source}
    for node in graph.nodes:
        if node is not source and any(a in reach for a in node.all_input_nodes):
            reach.add(node)
        if node is mask:
            break
    chain, stack = set(), [mask]
    while stack:  # the nodes on paths from source to mask
        node = stack.pop()
        if node in reach and node not in chain:
            chain.add(node)
            stack.extend(node.all_input_nodes)
    roots = {_root(n) for n in chain}
    return any(_mutates_input(n) and _root(_input(n)) in roots for n in graph.nodes if n.op in (
        "call_method", "call_function") and isinstance(_input(n), fx.Node))


@dataclass(frozen=True)
class MaskRead:
    """How a quantized site reads an ``attn_mask`` that is not per key by its shape.

    ``source``: the node the per-key mask is made of; ``new_axes``: the unit axes the read adds after the batch axis
    (``unsqueeze(source, 1)`` that many times: a ``(B, ...)`` mask repeated over the heads); ``masks_queries``: the
    mask also masks the query of each masked key (the symmetric form), whose rows :meth:`finish` sets to 0;
    ``shape``: the per-key mask's shape; ``note``: the report's line; ``dtype``: the dtype the model casts the
    repeated or broadcast mask to (the read is cast the same way), ``None`` without a cast.
    """

    source: fx.Node
    new_axes: int
    masks_queries: bool
    shape: tuple
    note: str
    dtype: torch.dtype | None = None

    def key_mask(self, make: Callable[[Callable, tuple, str], fx.Node]) -> fx.Node:
        """The per-key mask node; ``make(target, args, name)`` creates a node."""
        mask = self.source
        for _ in range(self.new_axes):
            mask = make(torch.unsqueeze, (mask, 1), "mask_per_key")
        if self.dtype is not None:
            mask = make(torch.Tensor.to, (mask, self.dtype), "mask_per_key_cast")
        return mask

    def query_rows(self, make: Callable[[Callable, tuple, str], fx.Node]) -> fx.Node | None:
        """The kept queries as a boolean ``(B, 1, S, 1)`` node (``None`` when the mask masks no query)."""
        if not self.masks_queries:
            return None
        return make(torch.transpose, (self.source, -2, -1), "masked_queries")

    def finish(self, out: fx.Node, make: Callable[[Callable, tuple, str], fx.Node],
               rows: fx.Node | None = None) -> fx.Node:
        """``out`` (``(B, H, S, D)``) with the rows of masked queries set to 0, as SDPA's math kernel gives a row
        whose keys are all masked; ``out`` itself when the mask masks no query. ``rows``: :meth:`query_rows`'
        node, when already made."""
        if not self.masks_queries:
            return out
        rows = rows if rows is not None else self.query_rows(make)
        return make(torch.where, (rows, out, 0.0), "zero_masked_queries")


def per_key_read(call: SdpaCall) -> MaskRead | None:
    """How the site's ``attn_mask`` is read per key where it is not a per-key mask of its operands by its shape
    (:func:`qattn_fx.ops.canonical.mask_kind`): repeated over the heads (:func:`head_repeated_source`), broadcast
    over the heads and queries (``expand`` / ``repeat`` of a ``(B, 1, 1, S)`` mask, 4-D calls) or symmetric
    (:func:`symmetric_source`, 4-D calls that return no LSE); else ``None`` (a mask already per key needs nothing; a
    source that still varies per query gains nothing)."""
    mask, ndim = call.args["attn_mask"], example_value(call.q).dim()
    value = example_value(mask)
    if not isinstance(value, torch.Tensor):
        return None
    is_bool, shape = value.dtype == torch.bool, tuple(value.shape)
    if _per_key(value.shape, is_bool, ndim):
        return None
    uncast, dtype = _uncast(mask)
    cast = "" if dtype is None else f", then cast to {dtype}"
    repeated = head_repeated_source(uncast)
    if repeated is not None:
        source, new_axes = repeated
        read = per_key_shape(source, new_axes)
        repeats = f"repeats a {tuple(example_value(source).shape)} mask over the heads (repeat_interleave + view)"
        if _written_in_place(mask, source):
            return None
        if _per_key(read, is_bool, ndim):
            return MaskRead(source, new_axes, False, read,
                            f"attn_mask {shape} {repeats}{cast}: read per key as {read}", dtype)
        mask = None if new_axes or dtype else source  # a (B, 1, S, S) mask repeated: read it as it is, per head
    broadcast = _tiled(uncast, over_heads=True) if ndim == 4 and repeated is None else None
    if broadcast is not None and not _written_in_place(mask, broadcast):
        read = tuple(example_value(broadcast).shape)
        return MaskRead(broadcast, 0, False, read, f"attn_mask {shape} broadcasts a {read} mask over the heads and "
                        f"queries (expand or repeat){cast}: read per key", dtype)
    symmetric = symmetric_source(mask) if ndim == 4 and not call.lse and mask is not None else None
    if symmetric is None or _written_in_place(call.args["attn_mask"], symmetric):
        return None
    read = tuple(example_value(symmetric).shape)  # (B, 1, 1, S): per key by symmetric_source's own shape test
    what = f"{repeats}, which " if repeated is not None else ""
    return MaskRead(symmetric, 0, True, read, f"attn_mask {shape} {what}is m_i & m_j of a {read} key mask m "
                    "(repeat + transpose): read per key, the rows of masked queries set to 0 (SDPA math's output "
                    "for them)")
