"""Find every ``scaled_dot_product_attention`` call in a Dynamo FX graph and read its facts.

Matching is explicit: a node is an attention site when its target is the SDPA builtin (however the user wrote the
call: positional or keyword arguments, diffusers' permuted views, inside ``sdpa_kernel`` context nodes) or the aten
op, or one of the aten ops that also return the log-sum-exp (:data:`LSE_TARGETS`: the flash and cuDNN forms that
diffusers' ring attention calls to merge partial results). Graphs nested in higher-order-op subgraphs (activation
checkpointing, ``invoke_subgraph``) are searched too. Calls of other attention ops (flex attention's higher-order
op, another library's ``torch.library`` op, ``nn.MultiheadAttention``'s function, which Dynamo keeps whole) are not
sites; :func:`find_other_attention` names them for the report.

Facts come from the node's fake tensors (``meta["example_value"]``) and ``nn_module_stack``:

* module path (``blocks.3.attn1``), layer index (the last integer in the path) and the layer count (distinct
  indices under the same container among the graph's sites);
* role: ``cross`` when K is projected from none of the activations Q is, or has another length than Q and is not
  projected from Q's activations; ``joint`` when Q's data flow (or, for keys of another length, K's) joins two token
  streams along the sequence axis (text and image tokens, MM-DiT): a concatenation (padding with zeros joins none,
  nor do pieces of one stream put back together) or slice assignments into one buffer (Lumina2); else ``self``;
* mask kind (:mod:`qattn_fx.ops.canonical`): none / key_padding (bool) and key_bias (float) when the mask only
  varies per key / bool / float;
* context parallelism (:func:`context_parallel`): the collectives that bring Q or K/V to this rank (Ulysses'
  all-to-all, ring attention's all-gather), so the report can say that its shapes are this rank's.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

from ..ops import canonical
from ..ops.attention import ATTENTION_OPS

#: SDPA as a graph records it: the torch function (Dynamo), the aten overload (AOT autograd, ``make_fx``) and the
#: overload packet (a model calling ``torch.ops.aten.scaled_dot_product_attention(...)`` itself, as Dynamo keeps it).
SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
                torch.ops.aten.scaled_dot_product_attention)
#: Attention ops that return ``(out, logsumexp, ...)``: outputs 0 and 1 are served, the others (backward
#: bookkeeping: cumulative lengths, RNG state, debug mask) are not. LSE ``(B, H, Sq)`` fp32 (flash) or
#: ``(B, H, Sq, 1)`` (cuDNN). Dynamo records the overload packet (``aten._scaled_dot_product_flash_attention``),
#: AOT autograd the overload: both are listed.
LSE_TARGETS = (torch.ops.aten._scaled_dot_product_flash_attention.default,
               torch.ops.aten._scaled_dot_product_cudnn_attention.default,
               torch.ops.aten._scaled_dot_product_flash_attention,
               torch.ops.aten._scaled_dot_product_cudnn_attention)
_COLLECTIVES = {
    "all_to_all_single": "Ulysses all-to-all",
    "all_gather_into_tensor": "all-gather (ring attention)",
    "permute_tensor": "ring send/receive",
}
_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.ops.aten.linear.default)
_CAT_TARGETS = (torch.cat, torch.concat, torch.ops.aten.cat.default)
#: Tensor factories of one constant value: a concatenation with one of them pads a sequence (WanVACE pads its
#: control tokens to the video's length with ``new_zeros``); it joins no second stream of tokens.
_FILL_FUNCTIONS = (torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like, torch.ones_like,
                   torch.full_like, torch.empty_like, torch.ops.aten.zeros.default, torch.ops.aten.ones.default,
                   torch.ops.aten.full.default, torch.ops.aten.empty.memory_format,
                   torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default,
                   torch.ops.aten.new_full.default, torch.ops.aten.new_empty.default)
_FILL_METHODS = ("new_zeros", "new_ones", "new_full", "new_empty")
#: Methods whose result holds the values of their first argument (casts, views, broadcasts).
_SAME_VALUES_METHODS = ("to", "type", "type_as", "view", "reshape", "expand", "expand_as", "repeat", "contiguous")
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: How many ancestor nodes the role analysis visits per site (bounds the cost on very large graphs).
_ANCESTRY_LIMIT = 20000


def is_sdpa(node: fx.Node) -> bool:
    """An attention site: the SDPA builtin or aten op, or an LSE-returning attention op (:data:`LSE_TARGETS`)."""
    return node.op == "call_function" and (node.target in SDPA_TARGETS or node.target in LSE_TARGETS)


def is_attention(node: fx.Node) -> bool:
    """An attention call in the graph: a site (:func:`is_sdpa`) or the qattn op that a rewritten site became. Walks
    that describe a site stop at both, so a site's description does not depend on whether the sites before it were
    rewritten (:func:`qattn_fx.fx.rewrite.rewrite` describes each site after rewriting the earlier ones)."""
    return is_sdpa(node) or (node.op == "call_function" and node.target in ATTENTION_OPS)


#: Words that name an attention op in an operator's name (``flex_attention``, ``_flash_attn_forward``, ...).
_ATTENTION_WORDS = re.compile(r"attention|attn")


def other_attention(node: fx.Node) -> str | None:
    """The name of an attention op that is not a site (flex attention's higher-order op, another library's
    attention op, an aten attention op without a served form, a torch function that Dynamo records as one call:
    ``nn.MultiheadAttention``'s, :mod:`.tracing`), else ``None``: its calls run as the model wrote them, and the
    report says so. qattn_fx's own ops are not counted."""
    if node.op != "call_function" or is_sdpa(node):
        return None
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        name = target.name()
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
        name = packet._qualified_op_name.replace("::", ".")
    elif str(getattr(target, "__module__", None)).startswith("torch"):  # a torch function kept as one call
        short = getattr(target, "__name__", "")  # its own name decides, not its module's (torch.nn.attention...)
        name = f"{target.__module__}.{short}" if _ATTENTION_WORDS.search(short) else ""
    else:
        return None
    if name.startswith("qattn.") or not _ATTENTION_WORDS.search(name):
        return None
    return name


def find_other_attention(root: fx.GraphModule) -> list[str]:
    """:func:`other_attention` of every node under ``root`` (nested subgraphs included), one name per call."""
    return [name for _, gm in graphs_in(root) for node in gm.graph.nodes
            if (name := other_attention(node)) is not None]


def returns_lse(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in LSE_TARGETS


def example_value(node: object):
    """The fake tensor (or value) a node produces, from Dynamo's ``example_value`` or AOT's ``val``."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


@dataclass
class SdpaCall:
    """One SDPA node with its arguments normalised to SDPA's names (defaults filled in)."""

    node: fx.Node
    module: fx.GraphModule
    graph_name: str
    args: dict

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    @property
    def q(self) -> fx.Node:
        return self.args["query"]

    @property
    def k(self) -> fx.Node:
        return self.args["key"]

    @property
    def v(self) -> fx.Node:
        return self.args["value"]

    @property
    def lse(self) -> bool:
        """The call returns ``(out, logsumexp, ...)`` (:data:`LSE_TARGETS`) rather than the output alone."""
        return returns_lse(self.node)

    def outputs_used(self) -> tuple[int, ...]:
        """Which outputs of an LSE call the graph reads (``getitem`` users; any other use counts as all)."""
        used: set[int] = set()
        for user in self.node.users:
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                used.add(user.args[1])
            else:
                used.update(range(9))
        return tuple(sorted(used))


def normalize_sdpa_args(node: fx.Node) -> dict:
    """All eight SDPA arguments by name, whichever way the call was written. An LSE call's arguments are mapped
    onto them (cuDNN's ``attn_bias`` is the mask; its other flags say nothing about the output's values)."""
    if returns_lse(node):
        return _normalize_lse_args(node)
    normalized = normalize_function(
        torch._C._nn.scaled_dot_product_attention, tuple(node.args), dict(node.kwargs),
        normalize_to_only_use_kwargs=True,
    )
    kwargs = dict(normalized.kwargs) if normalized is not None else {}
    if not kwargs:  # fall back to SDPA's documented order
        kwargs = dict(zip(_SDPA_ARGS, node.args))
        kwargs.update(node.kwargs)
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return {**defaults, **kwargs}


def _normalize_lse_args(node: fx.Node) -> dict:
    target = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target
    normalized = normalize_function(target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    if normalized is None:
        raise ValueError(f"cannot read the arguments of {node.target} at node {node.name}")
    kwargs = dict(normalized.kwargs)
    return {"query": kwargs["query"], "key": kwargs["key"], "value": kwargs["value"],
            "attn_mask": kwargs.get("attn_bias"), "dropout_p": kwargs.get("dropout_p", 0.0),
            "is_causal": kwargs.get("is_causal", False), "scale": kwargs.get("scale"), "enable_gqa": False}


def graphs_in(root: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """The root graph module and every nested GraphModule (HOP subgraphs), each once."""
    seen: set[int] = set()
    out = []
    for name, module in root.named_modules():
        if isinstance(module, fx.GraphModule) and id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


def find_sdpa(root: fx.GraphModule) -> list[SdpaCall]:
    calls = []
    for name, gm in graphs_in(root):
        for node in gm.graph.nodes:
            if is_sdpa(node):
                calls.append(SdpaCall(node, gm, name, normalize_sdpa_args(node)))
    return calls


def subgraph_uses(root: fx.GraphModule) -> dict[int, int]:
    """How many times each graph module under ``root`` runs per call of ``root``, keyed by ``id(module)``.

    Uses multiply through nesting and add over every parent that references the same module object: three
    checkpointed layers whose bodies all ``invoke_subgraph`` one shared block graph give that graph 3.
    """
    modules = {id(gm): gm for _, gm in graphs_in(root)}
    parents: dict[int, list[tuple[int, int]]] = {}
    for gm in modules.values():
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            child = gm
            for part in str(node.target).split("."):
                child = getattr(child, part, None)
            if isinstance(child, fx.GraphModule):
                parents.setdefault(id(child), []).append((id(gm), max(1, len(node.users))))
    memo: dict[int, int] = {id(root): 1}

    def uses(key: int) -> int:
        if key not in memo:
            memo[key] = 0  # guards against cycles, which FX graphs do not have
            memo[key] = sum(uses(p) * n for p, n in parents.get(key, ())) or 1
        return memo[key]

    return {key: uses(key) for key in modules}


# ------------------------------------------------------------------------------------------------------------------
# Module paths and layers
# ------------------------------------------------------------------------------------------------------------------

_PREFIX = re.compile(r"^L\['[^']*'\]")
_DICT_MODULES = re.compile(r"\.?__dict__\['_modules'\]\['([^']*)'\]")
_MODULES = re.compile(r"\._modules\['([^']*)'\]")
_ITEM = re.compile(r"\['([^']*)'\]")
# attribute hops through wrapped forwards (diffusers' hooks: a functools.partial over the module's bound forward),
# which lead back to the same module: ``blocks.0.forward.func.__closure__[0].cell_contents.forward.__self__.attn1``
_CLOSURE_HOP = re.compile(r"\.forward(?:\.func)?\.__closure__\[\d+\]\.cell_contents")
_SELF_HOP = re.compile(r"\.(?:fn_ref\.)?(?:original_)?forward\.__self__|\.__wrapped__")


def clean_module_path(raw: str) -> str:
    """``L['self'].__dict__['_modules']['blocks'].0.attn1`` → ``blocks.0.attn1``; hops through hooked forwards
    (``...forward.__self__...``, ``...forward.func.__closure__[0].cell_contents...``, and diffusers' hook registry
    ``fn_ref.original_forward.__self__``, its cache hooks' frames) are dropped."""
    path = _PREFIX.sub("", raw)
    path = _DICT_MODULES.sub(r".\1", path)
    path = _MODULES.sub(r".\1", path)
    path = _ITEM.sub(r".\1", path)
    path = _SELF_HOP.sub("", _CLOSURE_HOP.sub("", "." + path))
    return path.strip(".")


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1]
    raw = raw[0] if isinstance(raw, tuple) else str(raw)
    return clean_module_path(raw)


def split_layer(path: str) -> tuple[str | None, int | None]:
    """(container, index) of the last integer component: ``blocks.3.attn1`` → ``("blocks", 3)``."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i])
    return None, None


# ------------------------------------------------------------------------------------------------------------------
# Role and mask
# ------------------------------------------------------------------------------------------------------------------


def _ancestors(start: fx.Node, stop) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    order = []
    frontier = [start]
    while frontier and len(seen) < _ANCESTRY_LIMIT:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        if node is not start and stop(node):
            continue
        frontier.extend(node.all_input_nodes)
    return order


def _projection_inputs(start: fx.Node) -> set[fx.Node]:
    """The activations that feed the nearest linear/matmul on each path above ``start`` (Q/K/V projections: one for
    self- and cross-attention, one per stream where joint attention concatenates projected streams)."""
    frontier, seen, found = [start], set(), set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target in _LINEAR_TARGETS and node.args:
            if isinstance(node.args[0], fx.Node):
                found.add(node.args[0])
            continue
        if node.op == "call_module":
            if node.args and isinstance(node.args[0], fx.Node):
                found.add(node.args[0])
            continue
        if is_attention(node) or node.op == "placeholder":
            continue
        frontier.extend(node.all_input_nodes)
    return found


def _is_fill(node: object) -> bool:
    """``node`` is a tensor of one constant value: a factory (:data:`_FILL_FUNCTIONS`, ``x.new_zeros(...)``),
    possibly cast, viewed or broadcast."""
    while isinstance(node, fx.Node):
        if node.op == "call_function" and node.target in _FILL_FUNCTIONS:
            return True
        if node.op != "call_method":
            return False
        if node.target in _FILL_METHODS:
            return True
        if node.target not in _SAME_VALUES_METHODS or not node.args:
            return False
        node = node.args[0]
    return False


def _is_sequence_cat(node: fx.Node) -> bool:
    """A concatenation of two or more token streams along a sequence axis (not the batch or channel axis) of 3-D
    or higher tensors; operands that are constant fills (padding) do not count as streams, nor do pieces of one
    stream (:func:`_stream`)."""
    if node.op != "call_function" or node.target not in _CAT_TARGETS:
        return False
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    values = [example_value(t) for t in (tensors or ())]
    if len(values) < 2 or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if len({_stream(t) for t in tensors if not _is_fill(t)}) < 2:
        return False
    ndim = values[0].dim()
    if ndim < 3 or not isinstance(dim, int):
        return False
    dim = dim % ndim
    return dim not in (0, ndim - 1)


def _source(node: object) -> object:
    """The tensor that ``node`` indexes, views or casts (:data:`_SAME_VALUES_METHODS`), followed to its end."""
    while isinstance(node, fx.Node) and node.args and (
            (node.op == "call_function" and node.target is operator.getitem)
            or (node.op == "call_method" and node.target in _SAME_VALUES_METHODS)):
        node = node.args[0]
    return node


def _is_qattn_op(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "qattn"


def _stream(node: object) -> object:
    """The tensor whose tokens ``node`` carries: :func:`_source`, followed also through attention calls to their
    query (an output row is its query's token) and through qattn's quantize ops, so that pieces of one stream put
    back together (QwenImage21 attends per segment of its sequence and concatenates the outputs) are one stream
    whether or not the calls that made them were rewritten."""
    while True:
        node = _source(node)
        if not isinstance(node, fx.Node) or not (is_attention(node) or _is_qattn_op(node)):
            return node
        node = node.args[0] if node.args else node.kwargs.get("query")


def _sequence_slice(index: object, ndim: int) -> bool:
    """``index`` (a ``buffer[index] = value`` subscript) narrows only axes between the batch and channel axes of an
    ``ndim``-D buffer: it writes a range of tokens."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index or len(index) > ndim:
        return False
    narrowed = [axis for axis, item in enumerate(index) if isinstance(item, slice) and item != slice(None)]
    return bool(narrowed) and all(0 < axis < ndim - 1 for axis in narrowed)


def _is_stream_assembly(node: fx.Node) -> bool:
    """A constant-filled buffer into which slice assignments write token ranges of two or more tensors (Lumina2
    assembles its text and image tokens so, per sample, instead of concatenating them)."""
    value = example_value(node)
    if not _is_fill(node) or not isinstance(value, torch.Tensor) or value.dim() < 3:
        return False
    writes = [user.args for user in node.users if user.op == "call_function" and user.target is operator.setitem
              and len(user.args) == 3]
    sources = {_source(new) for _, index, new in writes
               if isinstance(new, fx.Node) and not _is_fill(new) and _sequence_slice(index, value.dim())}
    return len(sources) >= 2


def _joins_streams(node: fx.Node) -> bool:
    return any(_is_sequence_cat(n) or _is_stream_assembly(n) for n in _ancestors(node, is_attention))


def site_role(call: SdpaCall) -> str:
    """``cross``, ``joint`` or ``self`` (module docstring). Lengths are compared without a guard: symbolic lengths
    that are not the same expression are different lengths (the graph serves calls where they differ), so a later
    call whose lengths happen to be equal does not recompile. Keys of another length that are projected from Q's
    activations too hold Q's tokens and others (PRX's image queries over text and image keys: ``joint``; a query
    segment over its whole sequence: ``self``); of another length and provenance unknown, ``cross``."""
    q, k = example_value(call.q), example_value(call.k)
    q_in, k_in = _projection_inputs(call.q), _projection_inputs(call.k)
    if q_in and k_in and not q_in & k_in:  # K projected from none of the activations Q is projected from
        return "cross"
    if not statically_known_true(q.shape[-2] == k.shape[-2]):
        if not q_in & k_in:
            return "cross"
        return "joint" if _joins_streams(call.q) or _joins_streams(call.k) else "self"
    return "joint" if _joins_streams(call.q) else "self"


def mask_kind(mask: object, ndim: int) -> str:
    """The kind of SDPA's ``attn_mask`` value (a fake tensor or ``None``) for ``ndim``-D operands
    (:func:`qattn_fx.ops.canonical.mask_kind`)."""
    if mask is None:
        return "none"
    if not isinstance(mask, torch.Tensor):
        return "float"
    return canonical.mask_kind(tuple(mask.shape), mask.dtype == torch.bool, ndim)


# ------------------------------------------------------------------------------------------------------------------
# Context parallelism
# ------------------------------------------------------------------------------------------------------------------


def _collective(node: fx.Node) -> str | None:
    """The ``_c10d_functional`` collective a node calls (``all_to_all_single``), else None."""
    if node.op != "call_function":
        return None
    name = str(node.target)  # "_c10d_functional.all_to_all_single" (packet) or "....default" (overload)
    return name.split(".")[1] if name.startswith("_c10d_functional.") else None


def _stop_at_projection(node: fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in _LINEAR_TARGETS) or node.op == "call_module"
            or is_attention(node))


def context_parallel(call: SdpaCall) -> str | None:
    """How the site's operands reached this rank under context parallelism, as a note, or None.

    Walks up from Q and K to their projections: an all-to-all (``_c10d_functional.all_to_all_single``, diffusers'
    Ulysses attention) or an all-gather (ring attention) on the way means the shapes the site sees are this
    rank's: all tokens and a share of the heads (Ulysses), or this rank's queries against one chunk of keys (ring).
    """
    found: dict[str, list[str]] = {}
    for operand, node in (("Q", call.q), ("K/V", call.k)):
        for ancestor in _ancestors(node, _stop_at_projection):
            name = _collective(ancestor)
            if name in _COLLECTIVES:
                found.setdefault(_COLLECTIVES[name], [])
                if operand not in found[_COLLECTIVES[name]]:
                    found[_COLLECTIVES[name]].append(operand)
    if not found:
        return None
    how = "; ".join(f"{', '.join(ops)} through the {what}" for what, ops in found.items())
    return f"context parallel: {how}; shapes are this rank's"
