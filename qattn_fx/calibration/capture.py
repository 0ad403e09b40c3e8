"""Run a model densely with every attention site intercepted, identified as the backend's report identifies it.

:class:`ProbedModel` compiles the model with a torch.compile backend that finds the SDPA sites of each Dynamo graph
with the same matcher and site description as :func:`qattn_fx.backend` (:mod:`qattn_fx.fx.match`,
:func:`qattn_fx.fx.rewrite.describe_site`: module path, layer, role, mask kind) and replaces each SDPA node by a
probe; the graph then runs eagerly (nothing is compiled by Inductor). At run time each probe computes the dense
output and hands a :class:`SiteCall` (the site's real Q/K/V and SDPA arguments) to the current handler, which
returns what the site outputs: the dense output (measuring) or a quantized one (applying a plan). Nothing is kept
after a probe returns: memory is what the dense model needs plus one site's candidate outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..fx import masks, match
from ..fx.rewrite import describe_site, layer_counts
from ..site import Site


@dataclass(frozen=True, order=True)
class SiteKey:
    """A site's identity across graphs and calls: its module path, layer index (None outside a layer container)
    and which SDPA call of that module it is (0 for the first)."""

    module: str
    layer: int | None
    index: int = 0

    @property
    def label(self) -> str:
        return (self.module or "sdpa") + (f"#{self.index}" if self.index else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SiteCall:
    """One run of one site: its identity, the policy's view (real shapes), its operands and the dense output.

    ``q``/``k``/``v``/``attn_mask``/``scale``/``enable_gqa`` are SDPA's arguments as the model passed them
    (``attn_mask`` per key where a quantized site reads the mask so: :mod:`qattn_fx.fx.masks`); ``query_mask``: the
    kept queries, boolean ``(B, 1, Sq, 1)``, of a mask that also masks queries (None otherwise), whose rows the
    model's graph sets to 0 after the site, so they are 0 in ``dense`` (``F.scaled_dot_product_attention`` of the
    arguments) and in every candidate's output (:meth:`finish`), and no candidate's Q scale sees them.
    """

    key: SiteKey
    site: Site
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    scale: float | None
    enable_gqa: bool
    dense: torch.Tensor
    query_mask: torch.Tensor | None = None

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """A site output with the masked queries' rows at 0, as the model's graph has them."""
        return out if self.query_mask is None else torch.where(self.query_mask, out, 0.0)


Handler = Callable[[SiteCall], torch.Tensor]


class ProbedModel:
    """``model`` compiled with probes at its attention sites; :meth:`run` calls it under a handler.

    ``sites`` maps every site seen so far to the policy's view of it (shapes of the first call traced). Shapes are
    traced static (a new shape traces a new graph, as cheap as the first).
    """

    def __init__(self, model: Callable):
        self.sites: dict[SiteKey, Site] = {}
        self._handler: Handler | None = None
        self._compiled = torch.compile(model, backend=self._backend, dynamic=False)

    def run(self, handler: Handler, args: tuple, kwargs: dict) -> Any:
        """``model(*args, **kwargs)`` with every site's output chosen by ``handler``."""
        self._handler = handler
        try:
            return self._compiled(*args, **kwargs)
        finally:
            self._handler = None

    # -- the compile-time part -------------------------------------------------------------------------------
    def _backend(self, gm: fx.GraphModule, example_inputs, **_) -> Callable:
        calls = match.find_sdpa(gm)
        layers = layer_counts(calls)
        uses = match.subgraph_uses(gm)
        seen: dict[tuple[str, int | None], int] = {}
        touched: dict[int, fx.GraphModule] = {}
        for call in calls:
            call.args = match.normalize_sdpa_args(call.node)
            read = masks.per_key_read(call)
            site = describe_site(call, layers=layers, uses=uses, mask_read=read)
            n = seen.get((site.module, site.layer), 0)
            seen[(site.module, site.layer)] = n + 1
            key = SiteKey(site.module, site.layer, n)
            self.sites.setdefault(key, site)
            self._replace(call, key, site, read)
            touched[id(call.module)] = call.module
        for module in touched.values():
            module.graph.lint()
            module.recompile()
        return gm.forward

    def _replace(self, call: match.SdpaCall, key: SiteKey, site: Site, mask_read: masks.MaskRead | None) -> None:
        """``call`` replaced by the site's probe; ``mask_read``: the probe gets the mask per key, as a quantized
        site would (:mod:`qattn_fx.fx.masks`)."""
        probe = self._probe(key, site)
        a = call.args
        make = lambda target, args, name: call.graph.call_function(target, args)  # noqa: E731
        with call.graph.inserting_before(call.node):
            mask = a["attn_mask"] if mask_read is None else mask_read.key_mask(make)
            rows = None if mask_read is None else mask_read.query_rows(make)
            node = call.graph.call_function(probe, (a["query"], a["key"], a["value"]), {
                "attn_mask": mask, "dropout_p": a["dropout_p"], "is_causal": a["is_causal"],
                "scale": a["scale"], "enable_gqa": a["enable_gqa"], "query_mask": rows})
            node.meta.update(call.node.meta)
            out = node if mask_read is None else mask_read.finish(node, make, rows)
            out.meta.update(call.node.meta)  # the SDPA output's meta: what later sites read of their inputs
        call.node.replace_all_uses_with(out)
        call.graph.erase_node(call.node)

    def _probe(self, key: SiteKey, site: Site) -> Callable:
        owner = self

        def qattn_probe(q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                        query_mask=None):
            dense = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            if query_mask is not None:
                dense = torch.where(query_mask, dense, 0.0)
            handler = owner._handler
            if handler is None:
                return dense
            shape = lambda t: tuple(int(d) for d in t.shape)  # noqa: E731
            real = dataclasses.replace(
                site, q_shape=shape(q), k_shape=shape(k), v_shape=shape(v), dtype=q.dtype,
                kv_dtypes=(k.dtype, v.dtype), mask_shape=None if attn_mask is None else shape(attn_mask))
            return handler(SiteCall(key, real, q, k, v, attn_mask, scale, bool(enable_gqa), dense, query_mask))

        qattn_probe.__name__ = qattn_probe.__qualname__ = f"qattn_probe_{_identifier(key.label)}"
        return qattn_probe


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def kwargs_or_pairs(calls: Iterable) -> list[tuple[tuple, dict]]:
    """The sparsity calibrations' ``calls`` (kwargs dicts or ``(args, kwargs)`` pairs) as ``(args, kwargs)`` pairs;
    ``ValueError`` naming the accepted forms otherwise or when there is none."""
    out = []
    for call in calls:
        if isinstance(call, dict):
            out.append(((), call))
        elif isinstance(call, tuple) and len(call) == 2 and isinstance(call[1], dict):
            out.append((tuple(call[0]), call[1]))
        else:
            raise ValueError(f"calls must hold kwargs dicts or (args, kwargs) pairs; got {type(call).__name__}")
    if not out:
        raise ValueError("calls is empty; valid: at least one call of the model (a kwargs dict or (args, kwargs))")
    return out
