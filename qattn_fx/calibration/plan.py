"""From measured per-site errors to a plan (one choice per site) and a :class:`~qattn_fx.spec.Spec` that encodes it.

A *unit* is what a spec rule can tell apart: the sites of one module path and layer (a module that calls SDPA
twice is one unit; its choice must keep the budget at both). Per unit, :func:`choose` takes the fastest candidate
inside the budget at every call, by predicted speed where every candidate has cost data, else the first in
recipe-table order; dense when no candidate is inside the budget or when the fastest one is predicted no faster
than :data:`qattn_fx.cost_rule.MIN_PREDICTED_SPEEDUP` (:func:`qattn_fx.cost.no_gain`: ``auto``'s cost rule, on the same
data).

:func:`spec_for` writes the plan as rules that mean the same under whole-model and regional compilation. Units are
grouped by their module path with the layer index replaced by ``*`` (``blocks.*.attn1``). Each group gets a rule
with that glob and no layers, using the group's *safe* choice (the fastest candidate inside the budget at every
layer of the group, else dense), preceded by ``layers`` rules for the layers whose own choice differs. Under
regional compilation a block's graph serves every layer, per-layer rules cannot be honoured (the report says
so), and the safe choice applies: it keeps the budget at every layer. The default is dense: sites the calibration
did not see stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import cost
from ..cost_rule import MIN_PREDICTED_SPEEDUP
from ..fx.match import split_layer
from ..policy import select
from ..site import Site
from ..spec import DENSE, Match, Rule, Spec
from .budget import Budget, Errors, worst
from .candidates import Candidate
from .speed import NO_COST_DATA

#: A plan: per unit ``(module, layer)``, the chosen candidate's name or ``"dense"``.
Plan = dict


@dataclass(frozen=True)
class Option:
    """One candidate at one unit: served at every site and call?, worst errors, predicted speed (None: no data;
    the slowest site and call; ``upper_bound``: a length below the measured ones, so at most that fast)."""

    candidate: Candidate
    served: bool
    errors: Errors | None
    speedup: float | None
    why_not_served: str = ""
    #: Index of the call with the lowest cosine (where it is worst).
    worst_call: int | None = None
    upper_bound: bool = False
    #: Block-sparse candidates: the measured fraction of blocks skipped (mean over the calls; the lowest site).
    sparsity: float | None = None

    @property
    def speed_text(self) -> str:
        text = "-" if self.speedup is None else f"{'at most ' if self.upper_bound else ''}{self.speedup:.2f}x"
        return text + ("" if self.sparsity is None else f" (skipping {self.sparsity:.0%} of blocks)")


@dataclass(frozen=True)
class Choice:
    name: str  # a candidate's name or "dense"
    reason: str
    speed_source: str


def site_error(key: str, e: Errors) -> float:
    """The error a budget key tightens on, lower is better: ``1 - cos`` for cosine keys, else the metric."""
    return 1.0 - e.cos if key.endswith("cos") else e.value(key)


def choose(options: Sequence[Option], budget: Budget, *, limit: tuple[str, float] | None = None,
           labels: Sequence[str] | None = None) -> Choice:
    """The plan for one unit from its options (in table order). ``limit``: ``(budget key, error)`` — an extra
    per-site bound (:func:`site_error` at most ``error``) that an end-to-end bound imposed; ``labels``: the calls'
    names, for the reason."""
    at = lambda o: "" if o.worst_call is None else f" at {labels[o.worst_call] if labels else o.worst_call}"  # noqa
    inside, outside = [], []
    for o in options:
        if not o.served:
            outside.append(f"{o.candidate.name}: {o.why_not_served}")
            continue
        why = violation(o, budget, limit)
        if why is not None:
            outside.append(f"{o.candidate.name}: {why}{at(o)}")
        else:
            inside.append(o)
    if not inside:
        return Choice(DENSE, "no candidate inside the budget (" + "; ".join(outside) + ")", "")
    if all(o.speedup is not None for o in inside):
        best = max(inside, key=lambda o: o.speedup)
        if cost.no_gain(best.speedup, best.upper_bound, MIN_PREDICTED_SPEEDUP):
            verdict = "dense is faster" if best.speedup < MIN_PREDICTED_SPEEDUP else "no gain is predicted"
            return Choice(DENSE, f"{verdict}: the fastest candidate inside the budget, {best.candidate.name}, is "
                                 f"predicted {best.speed_text} of dense (auto's cost rule keeps it dense too)",
                          "cost data")
        tied = [o.candidate.name for o in inside if o is not best and o.speedup == best.speedup]
        tie = f" (tied with {', '.join(tied)}: first in table order)" if tied else ""
        return Choice(best.candidate.name, f"fastest inside the budget, predicted {best.speed_text}{tie}; worst "
                                           f"{_errors_text(best, at(best))}", "cost data")
    best = min(inside, key=_table_rank)
    return Choice(best.candidate.name, f"first inside the budget in table order{_skipping(best)}; worst "
                                       f"{_errors_text(best, at(best))}", NO_COST_DATA)


def _table_rank(o: Option) -> tuple:
    """The order without cost data: the recipe table's; within a row, block-sparse candidates that skip blocks
    (the most skipped first), then the recipe without block sparsity, then block-sparse ones that skip nothing (they
    would only add the predictor's cost)."""
    blocks = o.candidate.use.block_sparse
    if blocks is None:
        return (o.candidate.table_rank, 1, 0.0)
    return (o.candidate.table_rank, 0, -o.sparsity) if o.sparsity else (o.candidate.table_rank, 2, 0.0)


def _skipping(o: Option) -> str:
    return "" if o.sparsity is None else f" (skipping {o.sparsity:.0%} of blocks)"


def violation(o: Option, budget: Budget, limit: tuple[str, float] | None) -> str | None:
    """Why a served option is outside the budget (or the end-to-end ``limit``), or None."""
    why = budget.site_violation(o.errors)
    if why is None and limit is not None and site_error(limit[0], o.errors) > limit[1]:
        why = f"{_limit_text(limit)} (set by the end-to-end bound), has {site_error(limit[0], o.errors):.3g}"
    return why


def _errors_text(o: Option, at: str) -> str:
    return f"cos {o.errors.cos:.6f}{at}, rel_l1 {o.errors.rel_l1:.3g}"


def _limit_text(limit: tuple[str, float]) -> str:
    key, value = limit
    return f"site 1-cos <= {value:.3g}" if key.endswith("cos") else f"site {key.removeprefix('e2e_')} <= {value:.3g}"


def merge_options(per_site: Sequence[Sequence[Option]]) -> list[Option]:
    """One unit's options from its sites' (same candidates, same order): served where every site is, worst errors,
    the lowest speed."""
    out = []
    for column in zip(*per_site):
        served = all(o.served for o in column)
        speeds = [o.speedup for o in column]
        errs = [o.errors for o in column if o.errors is not None]
        why = next((o.why_not_served for o in column if not o.served), "")
        worst_o = min((o for o in column if o.errors is not None), key=lambda o: o.errors.cos, default=None)
        slowest = None if any(s is None for s in speeds) else min(column, key=lambda o: o.speedup)
        sparsity = [o.sparsity for o in column if o.sparsity is not None]
        out.append(Option(column[0].candidate, served, worst(errs) if errs and served else None,
                          None if slowest is None else slowest.speedup, why,
                          worst_o.worst_call if worst_o is not None else None,
                          slowest is not None and slowest.upper_bound, min(sparsity) if sparsity else None))
    return out


# ------------------------------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------------------------------


def group_glob(module: str, layer: int | None) -> str:
    """``blocks.3.attn1`` (layer 3) → ``blocks.*.attn1``; a path without a layer stays as it is."""
    if layer is None:
        return module
    parts = module.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i] + ["*"] + parts[i + 1:])
    return module


def spec_for(plan: Plan, options: dict[tuple[str, int | None], list[Option]], candidates: Sequence[Candidate],
             budget: Budget, sites: dict[tuple[str, int | None], Site], *,
             limit: tuple[str, float] | None = None) -> Spec:
    """The spec that gives every unit of ``plan`` its choice (see the module docstring); verified against the
    policy's rule selection for every unit's site."""
    by_name = {c.name: c for c in candidates}
    groups: dict[str, list[tuple[str, int | None]]] = {}
    for unit in plan:
        groups.setdefault(group_glob(*unit), []).append(unit)
    rules: list[Rule] = []
    # a site of a graph shared by several blocks first: it knows only its path inside the block (``attn``), which a
    # deeper glob would also match by its tail (context_embedder.*.attn), while its own glob matches no other path;
    # then deeper paths first: a glob's "*" also spans dots, so blocks.*.attn1 would match blocks.3.cross.attn1
    shared = {group_glob(*unit) for unit, site in sites.items() if site.layer is None and site.layer_shared}
    for glob in sorted(groups, key=lambda g: (g not in shared, -g.count("."))):
        units = groups[glob]
        safe = _safe_choice(units, plan, options, budget, limit)
        layered = [u for u in units if u[1] is not None and split_layer(u[0])[1] == u[1]]
        for name in dict.fromkeys(plan[u] for u in layered if plan[u] != safe):
            layers = sorted(u[1] for u in layered if plan[u] == name)
            rules.append(Rule(Match(module=glob, layers=tuple(layers)), _use(name, by_name)))
        rules.append(Rule(Match(module=glob), _use(safe, by_name)))
    spec = Spec(default=DENSE, rules=tuple(rules))
    for unit, site in sites.items():
        use, source, _ = select(spec, site)
        want = _use(plan[unit], by_name)
        if use != want:
            raise AssertionError(f"the plan's spec gives {unit} {use!r} by {source}, the plan says {plan[unit]!r}")
    return spec


def _use(name: str, by_name: dict[str, Candidate]):
    return DENSE if name == DENSE else by_name[name].use


def _safe_choice(units, plan: Plan, options, budget: Budget, limit) -> str:
    """The choice for every layer of a group at once: a unit's own choice if all units agree, else the best-ranked
    candidate that every unit's plan allows at that unit (inside the budget), else dense."""
    names = {plan[u] for u in units}
    if len(names) == 1:
        return names.pop()
    if DENSE in names:
        return DENSE
    common = None
    for unit in units:
        ok = {o.candidate.name for o in options[unit] if o.served and violation(o, budget, limit) is None}
        common = ok if common is None else common & ok
    ranked = [o for o in options[units[0]] if o.candidate.name in (common or ())]
    if not ranked:
        return DENSE
    if all(o.speedup is not None for u in units for o in options[u]):
        speed = {o.candidate.name: min(p.speedup for u in units for p in options[u]
                                       if p.candidate.name == o.candidate.name) for o in ranked}
        return max(ranked, key=lambda o: speed[o.candidate.name]).candidate.name
    return min(ranked, key=_table_rank).candidate.name
