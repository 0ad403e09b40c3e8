"""Rewrite SDPA sites into quantize nodes + a qattn attention op, per the policy's decision.

For a quantized site the SDPA node is replaced by the node sequence of
:func:`qattn_fx.ops.lowering.quantized_attention` (smooth K, quantize Q/K/V, attention), inserted in place with
stable names after the site's module (``blocks_0_attn1_q_quant``; ``sdpa_...`` for a call outside any submodule,
``blocks_0_attn1_1_...`` for a second site of the same module) and meta computed under the graph's own fake mode;
each inserted node's ``meta["qattn_fx_site"]`` is that name prefix. An LSE call (the aten flash / cuDNN attention
ops, :data:`qattn_fx.fx.match.LSE_TARGETS`) is replaced the same way with the op that also returns the LSE; the
``getitem`` nodes that read its output and LSE are replaced by the new ones. Dense sites are left exactly as they
were. The caller recompiles the graph module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import guard_float, guard_int

from ..hardware import Hardware, detect
from ..ops import canonical
from ..ops.lowering import quantized_attention
from ..policy import resolve
from ..site import Decision, Site
from ..spec import Spec
from . import masks, match

_META_KEYS = ("nn_module_stack", "stack_trace")


@dataclass
class SiteOutcome:
    """What happened at one site: where it is, what the policy saw and decided, which nodes replaced it."""

    index: int
    node_name: str
    graph_name: str
    site: Site
    decision: Decision
    inserted: tuple[str, ...] = ()
    #: The inserted nodes' name prefix (``blocks_0_attn1``): also the site's label in measured Skip-Softmax sparsity.
    prefix: str = ""


class FxEmitter:
    """Creates one call_function node per op call, named ``<prefix>_<name>``, with fake-tensor meta."""

    def __init__(self, graph: fx.Graph, prefix: str, fake_mode, meta: dict):
        self.graph, self.prefix, self.fake_mode, self.meta = graph, prefix, fake_mode, meta
        self.created: list[fx.Node] = []

    def __call__(self, target: Callable, args: tuple, name: str) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, {}, name=f"{self.prefix}_{name}")
        node.meta["qattn_fx_site"] = self.prefix
        for key in _META_KEYS:
            if key in self.meta:
                node.meta[key] = self.meta[key]
        nodes: list[fx.Node] = []
        fx.node.map_arg(args, nodes.append)
        missing = any(match.example_value(n) is None for n in nodes)
        if self.fake_mode is not None and not missing:
            values = fx.node.map_arg(args, match.example_value)
            # the python dispatcher runs Python decompositions (as Dynamo does), which take symbolic sizes; no
            # grad: autograd records no quantized site (records_autograd), whatever the grad mode now
            with self.fake_mode, enable_python_dispatcher(), torch.no_grad():
                node.meta["example_value"] = target(*values)
        self.created.append(node)
        return node


def _fake_mode_of(value):
    return getattr(value, "fake_mode", None)


def _graph_value(arg: object) -> tuple[bool, float | None]:
    """(is it a value computed in the graph, its value when known) for a float argument of SDPA."""
    if not isinstance(arg, fx.Node):
        return False, None if arg is None else float(arg)
    value = match.example_value(arg)
    hint = getattr(getattr(value, "node", None), "hint", None)
    return True, float(hint) if hint is not None else None


def _specialized_dropout(arg: object) -> tuple[bool, float | None]:
    """SDPA's ``dropout_p``: a constant, or a graph value with a known value (``dynamic=True`` makes Python floats
    symbolic), which is specialized by a guard, as SDPA's own tracing would (the graph is then re-made for
    another value). Unknown at compile time (read from a tensor): a runtime value."""
    runtime, value = _graph_value(arg)
    if runtime and value is not None:
        return False, guard_float(match.example_value(arg))
    return runtime, value


def records_autograd(call: match.SdpaCall) -> bool:
    """Autograd records ``call`` (a backward would run through it): at its point of the graph grad mode was on and
    one of its inputs requires grad. Dynamo traces each node under the grad mode of its place in the code (a
    ``torch.enable_grad()`` / ``torch.no_grad()`` block inside the compiled function becomes
    ``torch._C._set_grad_enabled`` nodes around it), so the call's fake output says it: its ``requires_grad``.
    The grad mode when the graph is compiled is not the site's (a function called under ``no_grad`` may enable
    grad around its attention, and the reverse). Without a traced output (a graph made elsewhere): the grad mode
    now and the inputs' ``requires_grad``."""
    out = match.example_value(call.node)
    if isinstance(out, (tuple, list)) and out:  # the LSE ops: (output, logsumexp, ...)
        out = out[0]
    if isinstance(out, torch.Tensor):
        return out.requires_grad
    inputs = (match.example_value(n) for n in (call.q, call.k, call.v))
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def describe_site(call: match.SdpaCall, *, layers: dict[str, int], uses: dict[int, int],
                  mask_read: masks.MaskRead | None = None) -> Site:
    """The :class:`~qattn_fx.policy.Site` of ``call``; ``mask_read``: how its ``attn_mask`` is read per key
    (:func:`qattn_fx.fx.masks.per_key_read`), described in its place. ``grad_enabled``: whether autograd records
    the call (:func:`records_autograd`), per site."""
    q, k, v = (match.example_value(n) for n in (call.q, call.k, call.v))
    mask = match.example_value(call.args["attn_mask"]) if call.args["attn_mask"] is not None else None
    mask_shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
    mask_kind = match.mask_kind(mask, q.dim())
    mask_note = None
    if mask_read is not None:
        mask_note, mask_shape = mask_read.note, mask_read.shape
        mask_kind = canonical.mask_kind(mask_shape, mask.dtype == torch.bool, q.dim())
    path = match.module_path(call.node)
    container, index = match.split_layer(path)
    shared_graph = uses.get(id(call.module), 1) > 1
    scale_runtime, scale = _graph_value(call.args["scale"])
    dropout_runtime, dropout = _specialized_dropout(call.args["dropout_p"])
    runtime = tuple(name for name, flag in (("scale", scale_runtime), ("dropout_p", dropout_runtime)) if flag)
    return Site(
        name=call.node.name,
        module=path,
        layer=None if shared_graph else index,
        num_layers=None if shared_graph or container is None else layers.get(container),
        role=match.site_role(call),
        q_shape=tuple(q.shape),
        k_shape=tuple(k.shape),
        v_shape=tuple(v.shape),
        dtype=q.dtype,
        mask=mask_kind,
        mask_shape=mask_shape,
        causal=bool(call.args["is_causal"]),
        dropout=dropout if dropout is not None else (0.0 if not dropout_runtime else float("nan")),
        scale=scale,
        enable_gqa=bool(call.args["enable_gqa"]),
        grad_enabled=records_autograd(call),
        layer_shared=shared_graph or index is None,
        runtime_args=runtime,
        kv_dtypes=(k.dtype, v.dtype),
        lse=call.lse,
        other_outputs=tuple(i for i in call.outputs_used() if i > 1) if call.lse else (),
        context=match.context_parallel(call),
        mask_note=mask_note,
    )


def layer_counts(calls: list[match.SdpaCall]) -> dict[str, int]:
    """The number of layers of each layer container (``blocks``) among the calls' module paths: one more than the
    highest layer index a call is in (what negative layer indices of a spec count from)."""
    counts: dict[str, int] = {}
    for call in calls:
        container, index = match.split_layer(match.module_path(call.node))
        if container is not None:
            counts[container] = max(counts.get(container, 0), index + 1)
    return counts


@dataclass(frozen=True)
class TimestepSource:
    """Where a step schedule (``disabled_until_timestep``) reads the denoising timestep: the graph input of the
    model's forward argument ``argument`` (diffusers transformers: ``timestep``), divided by ``scale`` to the
    normalized ``t`` in [0, 1] (1000: diffusers' ``num_train_timesteps`` as Wan, HunyuanVideo, CogVideoX and SD3
    pipelines pass it; 1: pipelines that pass ``t`` itself, as Flux's does)."""

    argument: str = "timestep"
    scale: float = 1000.0

    def __post_init__(self) -> None:
        if not isinstance(self.argument, str) or not self.argument.isidentifier():
            raise ValueError(f"timestep={self.argument!r} is invalid; valid: the name of the model's forward argument "
                             "holding the denoising timestep (e.g. 'timestep')")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not self.scale > 0:
            raise ValueError(f"timestep_scale={self.scale!r} is invalid; valid: a number > 0 (1000 for diffusers' "
                             "num_train_timesteps, 1 when the pipeline passes t in [0, 1])")

    def find(self, graph: fx.Graph) -> fx.Node | None:
        """The graph input holding the argument (Dynamo's source ``L['timestep']`` or ``L['kwargs']['timestep']``),
        or None."""
        for node in graph.nodes:
            if node.op != "placeholder":
                continue
            source = getattr(node.meta.get("grapharg"), "source", None)
            name = source.name if isinstance(getattr(source, "name", None), str) else str(node.target)
            if name in (f"L['{self.argument}']", f"L['kwargs']['{self.argument}']") or node.target in (
                    f"L_{self.argument}_", f"L_kwargs_{self.argument}_"):
                return node
        return None


def _gate(decision: Decision) -> str | None:
    """The spec key of the site's first timestep gate (``skip_softmax.disabled_until_timestep=0.5``), or None."""
    for key, setting in (("skip_softmax", decision.skip_softmax), ("block_sparse", decision.block_sparse)):
        if setting is not None and setting.gated:
            return f"{key}.disabled_until_timestep={setting.disabled_until_timestep:g}"
    return None


def _timestep_node(call: match.SdpaCall, decision: Decision, root: fx.GraphModule, source: TimestepSource):
    """The timestep graph input a gated site reads (None when neither its skip-softmax nor its block sparsity is
    gated)."""
    gate = _gate(decision)
    if gate is None:
        return None
    node = source.find(root.graph)
    inputs = [str(n.target) for n in root.graph.nodes if n.op == "placeholder"]
    if node is None:
        shown = ", ".join(i for i in inputs if "parameters" not in i and "buffers" not in i) or "none"
        raise ValueError(
            f"{gate} at {call.node.name} needs the denoising timestep in the compiled graph, but no graph input is "
            f"the model's {source.argument!r} "
            f"argument (inputs: {shown}; an argument the forward never reads is none); compile the transformer whose "
            "forward takes and uses it (not its blocks alone), or name the argument with backend(..., timestep=...)")
    if call.graph is not root.graph:
        raise ValueError(f"{gate.split('=')[0]} at {call.node.name}: the site is in a nested "
                         "subgraph, which cannot read the timestep input; compile without the wrapper that nests it")
    return node


def rewrite_site(call: match.SdpaCall, decision: Decision, prefix: str, timestep=None,
                 timestep_scale: float = 1000.0, mask_read: masks.MaskRead | None = None) -> tuple[str, ...]:
    """Replace ``call`` by the quantized attention of ``decision``; ``mask_read``: read the mask per key as it says
    (:class:`qattn_fx.fx.masks.MaskRead`: a ``<prefix>_mask_per_key`` node, rows of masked queries zeroed)."""
    q = match.example_value(call.q)
    # kernels are specialised per head_dim: a symbolic one (dynamic=True) is fixed here by a guard on the graph
    head_dim = guard_int(q.shape[-1])
    scale = call.args["scale"]
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    emit = FxEmitter(call.graph, prefix, _fake_mode_of(q), call.node.meta)
    with call.graph.inserting_before(call.node):
        mask = call.args["attn_mask"] if mask_read is None else mask_read.key_mask(emit)
        rows = None if mask_read is None else mask_read.query_rows(emit)
        out = quantized_attention(call.q, call.k, call.v, decision.recipe, kernel=decision.kernel, sm_scale=sm_scale,
                                  out_dtype=q.dtype, head_dim=head_dim, attn_mask=mask,
                                  enable_gqa=bool(call.args["enable_gqa"]), return_lse=call.lse, emit=emit,
                                  skip_softmax=decision.skip_softmax, timestep=timestep,
                                  timestep_scale=timestep_scale, skip_label=prefix, query_mask=rows,
                                  block_sparse=decision.block_sparse)
        if call.lse:
            _replace_lse_outputs(call, *out, emit)
        else:
            call.node.replace_all_uses_with(out if mask_read is None else mask_read.finish(out, emit, rows))
    call.graph.erase_node(call.node)
    return tuple(n.name for n in emit.created)


def _replace_lse_outputs(call: match.SdpaCall, out: fx.Node, lse: fx.Node, emit: FxEmitter) -> None:
    """Point the ``getitem`` users of an LSE call's output 0 and 1 at ``out`` and ``lse`` (the op's ``(B, H, Sq)``
    LSE given the call's own LSE shape, ``(B, H, Sq, 1)`` for cuDNN), and erase those ``getitem`` nodes."""
    for user in list(call.node.users):
        index = user.args[1]
        if index == 0:
            user.replace_all_uses_with(out)
        else:  # the policy kept sites that read other outputs dense
            want = match.example_value(user)
            value = lse
            if want is not None and want.dim() == 4:
                value = emit(torch.ops.aten.unsqueeze.default, (lse, -1), "lse_4d")
            user.replace_all_uses_with(value)
        call.graph.erase_node(user)


def node_prefix(module_path: str, taken: dict[str, int]) -> str:
    """The name prefix of a site's inserted nodes: its module path as an identifier (``blocks.0.attn1`` →
    ``blocks_0_attn1``, ``sdpa`` without one), with ``_1``, ``_2``... for later sites of the same module
    (``taken`` counts prefixes already given out in this graph)."""
    base = re.sub(r"\W+", "_", module_path).strip("_") or "sdpa"
    if base[0].isdigit():
        base = f"m{base}"
    n = taken.get(base, 0)
    taken[base] = n + 1
    return base if n == 0 else f"{base}_{n}"


def rewrite(root: fx.GraphModule, spec: Spec, *, hardware: Hardware | None = None, emulate: bool = False,
            first_index: int = 0, target=None,
            timestep: TimestepSource | None = None) -> list[SiteOutcome]:
    """Resolve and rewrite every SDPA site under ``root`` (nested subgraphs included); returns one outcome per site.

    ``hardware`` defaults to the machine the site's tensors live on; ``target`` (with ``emulate``) is where the
    emulated sites are meant to deploy (:func:`qattn_fx.deployment.deployment`); ``timestep``: where gated sites
    (``disabled_until_timestep``) read the timestep (default :class:`TimestepSource`). Graph modules are
    recompiled. A site that autograd records (:func:`records_autograd`, decided per site from the graph, not from
    the grad mode now) stays dense: the quantized ops have no backward.
    """
    timestep = timestep or TimestepSource()
    calls = match.find_sdpa(root)
    layers = layer_counts(calls)
    uses = match.subgraph_uses(root)
    outcomes = []
    touched: dict[int, fx.GraphModule] = {}
    taken: dict[str, int] = {}
    for i, call in enumerate(calls, start=first_index):
        # an earlier site's output may feed this one (chained attention): read the arguments after its rewrite
        call.args = match.normalize_sdpa_args(call.node)
        read = masks.per_key_read(call)
        site = describe_site(call, layers=layers, uses=uses, mask_read=read)
        hw = hardware if hardware is not None else detect(match.example_value(call.q).device)
        decision = resolve(site, hw, spec, emulate=emulate, target=target)
        inserted: tuple[str, ...] = ()
        prefix = ""
        if decision.quantized:
            prefix = node_prefix(site.module, taken)
            inserted = rewrite_site(call, decision, prefix, _timestep_node(call, decision, root, timestep),
                                    timestep.scale, read)
            touched[id(call.module)] = call.module
        outcomes.append(SiteOutcome(i, call.node.name, call.graph_name, site, decision, inserted, prefix))
    for gm in touched.values():
        gm.graph.lint()
        gm.recompile()
    return outcomes

