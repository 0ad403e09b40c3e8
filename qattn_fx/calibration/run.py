"""``calibrate``: measure every attention site under every candidate on the user's calls, plan, write the spec;
``measure``: the per-site and end-to-end errors of a given spec on the same calls (to re-check a plan).

Each call runs the model once densely with every site intercepted (:mod:`.capture`): at each site every candidate
runs on that site's real Q/K/V (the reference kernel when emulated, else the kernel the policy picks) and its output
is compared with the dense one, then dropped. Then the model runs once per candidate with that candidate at every
site it serves, for the model output's error. After the calls, :mod:`.plan` chooses per site and, with an end-to-end
bound, tightens the per-site bound until the plan's model output keeps it (each try runs the calls once more).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import block_sparse
from ..deployment import deployment_targets
from ..hardware import Hardware, detect
from ..ops import quantized_attention
from ..policy import resolve
from ..site import Decision, Site
from ..sparse_cost import sparse_time
from ..spec import DENSE, AttentionSpec, Spec
from .budget import Budget, Errors, errors, flat_output, worst
from .capture import ProbedModel, SiteCall, SiteKey
from .candidates import Candidate, make_candidates, rank
from .plan import Choice, Option, choose, merge_options, site_error, spec_for, violation
from .records import Record, Unit, unit_of
from .result import Calibration, SitePlan, Table, TableRow
from .sparse import fit_targets, normalized_t, step_windows, timestep_of
from .speed import NO_COST_DATA, SpeedSource, cost_data_on, predicted

log = logging.getLogger("qattn_fx")

Call = tuple[tuple, dict]


def _as_calls(calls: Iterable[Any]) -> list[Call]:
    out = []
    for i, item in enumerate(calls):
        if (not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], (tuple, list))
                or not isinstance(item[1], dict)):
            raise ValueError(f"calls[{i}] is {type(item).__name__}; valid: an (args, kwargs) pair such as "
                             "((latents,), {'timestep': t})")
        out.append((tuple(item[0]), dict(item[1])))
    if not out:
        raise ValueError("calls is empty; valid: at least one (args, kwargs) pair")
    return out


def _target(hardware: Hardware | str | None) -> Hardware | None:
    if hardware is None or isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        return Hardware.supported_install(hardware)
    raise ValueError(f"hardware={hardware!r} is invalid; valid: a Hardware, an arch such as 'sm_90', or None")


class _Sites:
    """Decides, runs and measures candidates at sites (shared by measuring and applying, so both decide alike)."""

    def __init__(self, emulate: bool, target: Hardware | None, speed: SpeedSource | None, calls: int):
        self.emulate, self.target, self.speed, self.calls = emulate, target, speed, calls
        self.records: dict[tuple[SiteKey, str], Record] = {}
        self.order: list[SiteKey] = []
        self.sites: dict[SiteKey, Site] = {}
        self.here = "cpu"
        #: The current call's timestep argument (for candidates whose block sparsity is gated by it), or None.
        self.timestep: torch.Tensor | None = None
        self.timestep_scale = 1000.0

    def hardware(self, sc: SiteCall) -> Hardware:
        """The machine the candidates run on: where the site's tensors are (``hardware=`` must name it without
        emulation, since the candidates then run on its kernels)."""
        here = detect(sc.q.device)
        if not self.emulate and self.target is not None and self.target.arch != here.arch:
            raise ValueError(f"hardware={self.target.arch!r} but the model runs on {sc.q.device} ({here.arch}), "
                             "where the candidates run without emulation; valid: hardware=None (this machine), "
                             f"hardware={here.arch!r}, or emulate=True to predict {self.target.arch} from the "
                             "emulation")
        return self.target if not self.emulate and self.target is not None else here

    def speed_source(self, sc: SiteCall) -> SpeedSource:
        """The calibration's speed source, else the cost data of the GPU the candidates deploy on (the points of
        that GPU first, :func:`qattn_fx.cost.predict`): the target's where it names one, else without emulation the
        GPU the site's tensors are on (its kernels run the candidates), else none (the architecture's points)."""
        return self.speed if self.speed is not None else cost_data_on(self.deploy_gpu(sc))

    def deploy_gpu(self, sc: SiteCall) -> str | None:
        """The GPU the candidates deploy on, whose measurements count first: the target's where it names one, else
        without emulation the GPU the site's tensors are on, else ``None`` (the architecture's points)."""
        gpu = self.target.gpu if self.target is not None else None
        if gpu is None and not self.emulate:
            gpu = detect(sc.q.device).gpu
        return gpu

    def decide(self, sc: SiteCall, spec: Spec) -> Decision:
        """The policy's decision for ``spec`` at this site, without ``auto``'s cost rule: every candidate a kernel
        serves is measured, and :mod:`.plan` weighs the same prediction (dense where it is below 1x)."""
        try:
            return resolve(sc.site, self.hardware(sc), spec, emulate=self.emulate, apply_cost_rule=False)
        except ValueError as e:  # an explicit backend or kernel that cannot serve this site
            return Decision(False, f"dense: {e}")

    def output(self, sc: SiteCall, decision: Decision) -> torch.Tensor:
        """The site's output under ``decision``; with block sparsity the predictor's lists are the real ones (and
        recorded under the site's label inside :func:`qattn_fx.block_sparse.measure`)."""
        blocks = decision.block_sparse
        timestep = self.timestep if blocks is not None and blocks.gated else None
        scale = self.timestep_scale
        if blocks is not None and blocks.gated and timestep is None:
            raise ValueError(f"{blocks.describe()} at {sc.key.label} needs the call's timestep: give each call a "
                             "'timestep' keyword argument")
        return sc.finish(quantized_attention(
            sc.q, sc.k, sc.v, decision.recipe, kernel=decision.kernel, sm_scale=sc.scale, out_dtype=sc.q.dtype,
            attn_mask=sc.attn_mask, enable_gqa=sc.enable_gqa, block_sparse=blocks, skip_label=sc.key.label,
            timestep=timestep, timestep_scale=scale, query_mask=sc.query_mask))

    def deployed(self, sc: SiteCall, use: AttentionSpec, decision: Decision) -> tuple[str | None, str, str, str]:
        """(kernel, arch, why not, note) of what the candidate runs where it deploys, for the speed lookup. A
        block-sparse candidate that no kernel serves there is looked up as its recipe's kernel (the note says so:
        its speed is that kernel's once it takes block lists)."""
        if use.block_sparse is not None:
            kernel, arch, why, note = self.deployed(sc, dataclasses.replace(use, block_sparse=None), decision)
            if not self.emulate or kernel is None:
                return kernel, arch, why, note
            sparse = self._deploy_one(sc, use, arch)
            if sparse[0] is not None:
                return sparse[0], arch, "", ""
            return kernel, arch, "", (f"on {arch}: no kernel takes block lists yet; speed predicted for {kernel} "
                                      "with them")
        if not self.emulate:
            return decision.kernel, self.hardware(sc).arch, "", ""
        target = self.target
        if target is None:
            archs = deployment_targets(use)
            if not archs:
                return None, "-", "no deployment target in the recipe table"
            target = Hardware.supported_install(archs[0])
        kernel, why = self._deploy_one(sc, use, target)
        return kernel, target.arch, why, ""

    @staticmethod
    def _deploy_one(sc: SiteCall, use: AttentionSpec, target: Hardware | str) -> tuple[str | None, str]:
        """(kernel, why not) of ``use`` at the site on ``target`` (emulated calibrations)."""
        site = sc.site
        if isinstance(target, str):
            target = Hardware.supported_install(target)
        if site.dtype == torch.float32:  # a CPU model: judged as bf16, as the GPU runs it
            site = _as_bf16(site)
        try:
            d = resolve(site, target, Spec(default=use), apply_cost_rule=False)
        except ValueError as e:
            return None, str(e)
        return (d.kernel, "") if d.quantized else (None, d.reason.removeprefix("dense: "))

    def measure(self, sc: SiteCall, call: int, candidates: Sequence[Candidate]) -> list[str]:
        """Run every candidate at this site; record errors; the progress cells."""
        if sc.key not in self.sites:
            self.here = self.hardware(sc).describe()
            self.sites[sc.key] = sc.site
            self.order.append(sc.key)
        cells = []
        for c in candidates:
            rec = self.records.setdefault((sc.key, c.name), Record([None] * self.calls, blocks=[None] * self.calls))
            decision = self.decide(sc, Spec(default=c.use))
            if not decision.quantized:
                rec.served, rec.why = False, decision.reason.removeprefix("dense: ")
                cells.append(f"{c.name} n/a")
                continue
            with block_sparse.measure() as measured:
                e = errors(self.output(sc, decision), sc.dense)
            old = rec.per_call[call]
            rec.per_call[call] = e if old is None else worst([old, e])
            skipped = None
            if decision.block_sparse is not None:
                found = measured.sites.get(sc.key.label)
                done = rec.blocks[call] or (0, 0)
                rec.blocks[call] = (done[0] + found.skipped, done[1] + found.tiles) if found else done
                skipped = found.skipped / found.tiles if found and found.tiles else 0.0
            rec.kernel = decision.kernel
            kernel, arch, why, note = self.deployed(sc, c.use, decision)
            rec.deploy = f"{kernel} on {arch}" if kernel else None
            rec.deploy_note = rec.deploy_note or note
            speed = None
            if kernel is not None:
                s = sc.site
                speed = predicted(self.speed_source(sc), kernel, arch, q_len=s.q_len, kv_len=s.kv_len,
                                  head_dim=s.head_dim, batch_heads=int(torch.Size(s.q_shape[:-2]).numel()))
            elif why:
                rec.deploy_note = f"on {arch}: {why.removeprefix('dense: ')}"
            rec.speed_known = rec.speed_known and speed is not None
            if not rec.speed_known:
                rec.speedup = None
            elif rec.speedup is None or speed.speedup < rec.speedup:  # the slowest call counts
                rec.speedup, rec.upper_bound, rec.speed_data = speed.speedup, speed.upper_bound, speed.data
                if decision.block_sparse is not None:
                    rec.sparse_time = sparse_time(kernel, arch, kv_len=s.kv_len, head_dim=s.head_dim,
                                                  gpu=self.deploy_gpu(sc))
            cells.append(f"{c.name} cos {e.cos:.6f} rel_l1 {e.rel_l1:.2e}"
                         + ("" if skipped is None else f" skipped {skipped:.3f}"))
        return cells


def _speed_source(rec: Record) -> str:
    """What a table row's predicted speed comes from: the cost data and, for a block-sparse candidate, the measured
    block-sparse time it was divided by."""
    sparse = f"; block-sparse: {rec.sparse_time.data}" if rec.sparse_time is not None else ""
    return f"cost data ({rec.speed_data}{sparse})"


def _as_bf16(site: Site) -> Site:
    return dataclasses.replace(site, dtype=torch.bfloat16,
                               kv_dtypes=None if site.kv_dtypes is None else (torch.bfloat16,) * 2)


def calibrate(model: Callable, calls: Iterable[Call], *, budget: Budget | dict | str,
              candidates: Iterable[Any] | None = None, emulate: bool = False, hardware: Hardware | str | None = None,
              speed: SpeedSource | None = None, labels: Sequence[str] | None = None,
              progress: Callable[[str], None] | None = None, timestep_scale: float = 1000.0) -> Calibration:
    """Measure every attention site of ``model`` under each candidate on ``calls`` and plan the fastest candidate per
    site that keeps ``budget``; the plan comes back as a spec (``result.spec``) with the table behind it.

    ``calls``: ``(args, kwargs)`` pairs, each one call of ``model`` (e.g. denoising steps at several timesteps and
    prompts); they are kept in a list and run several times. ``budget``: :class:`Budget`, a mapping or
    ``"cos=0.999,e2e_cos=0.995"`` (per-site bounds and/or bounds on the model output; each must hold at every call).
    ``candidates``: attention specs, recipes, spec mappings or recipe ids (``"int8-1-16-1"``); default
    :data:`~qattn_fx.calibration.candidates.DEFAULT_CANDIDATES`. ``emulate``: run candidates on the reference kernel
    (any device; the speed is predicted for where each recipe deploys), else on the kernel the policy picks on the
    machine of the site's tensors. ``hardware``: a :class:`Hardware` or an arch (``"sm_90"``, a supported install):
    where the plan deploys (without emulation it must be that machine; the libraries it names are the ones the
    policy assumes). ``speed``: the speed source (default
    :func:`~qattn_fx.calibration.speed.cost_data`; without data candidates rank by recipe-table order).
    ``labels``: a name per call for tables and plots (default ``call 0``, ``call 1``, ...). ``progress``: called
    with a line per site and call (default: the ``qattn_fx`` logger at INFO). ``timestep_scale``: what the calls'
    ``timestep`` is divided by for step windows (the backend's ``timestep_scale``, default 1000).

    **Block sparsity.** A candidate with ``block_sparse`` (``"int8-1-16-1+cdf0.9"``, ``"+top_k0.5"``) runs with the
    predictor's real lists at each site; the table's ``skipped`` column is the measured fraction of blocks skipped
    (:func:`qattn_fx.block_sparse.measure`), the mean over the calls. Its predicted speed is its recipe's scaled by
    the mean fraction visited by the measured time of block-sparse calls (:mod:`qattn_fx.sparse_cost`), so
    the plan takes the sparsest candidate inside the budget. A ``target_sparsity`` candidate (``"+target0.5"``) is
    first fitted per site (:func:`~qattn_fx.calibration.block.calibrate_block_sparse`); each distinct ``cdf``
    becomes a candidate.

    **Step windows.** Where the calls have a ``timestep`` keyword (normalized by ``timestep_scale``, as the backend
    does: ``t = timestep / 1000`` by default) and a block-sparse candidate without a gate breaks the per-site budget
    at a module only at its early calls, the calibration adds a gated candidate: the same with
    ``disabled_until_timestep`` = D, the largest t such that the candidate keeps the budget at every call with
    ``t <= D`` (calls with ``t > D`` then run every block). Its errors and sparsity per call are derived from the
    runs already made (the sparse candidate's at ``t <= D``, the recipe alone's at the others, which must also be
    a candidate; no block skipped there), and it competes like any candidate (one gated candidate per distinct D).

    The model runs under ``torch.no_grad()``; it is traced by Dynamo (``torch.compile`` with a probing backend,
    static shapes), not compiled by Inductor, so sites are identified as :func:`qattn_fx.backend` identifies them.
    """
    budget = Budget.parse(budget)
    cands = make_candidates(candidates)
    call_list = _as_calls(calls)
    labels = _labels(labels, len(call_list))
    say = progress or log.info
    cands, fitted = fit_targets(model, call_list, cands, say)
    sites = _Sites(emulate, _target(hardware), speed, len(call_list))
    sites.timestep_scale = float(timestep_scale)
    probed = ProbedModel(model)
    refs: list[torch.Tensor] = []
    e2e: dict[str, list[Errors]] = {c.name: [] for c in cands}
    with torch.no_grad():
        for i, (args, kwargs) in enumerate(call_list):
            def measure(sc: SiteCall, i=i) -> torch.Tensor:
                cells = sites.measure(sc, i, cands)
                s = sc.site
                say(f"{labels[i]} ({i + 1}/{len(call_list)}) {sc.key.label} (layer {_cell(s.layer)}, {s.role}, "
                    f"q/kv {s.q_len}/{s.kv_len}, d {s.head_dim}): " + "; ".join(cells))
                return sc.dense

            sites.timestep = timestep_of(kwargs)
            refs.append(flat_output(probed.run(measure, args, kwargs)))
            if i == 0:
                _check_served(sites)
            for c in cands:
                out = probed.run(_apply(sites, lambda key, c=c: c), args, kwargs)
                e2e[c.name].append(errors(flat_output(out), refs[i]))
            say(f"{labels[i]}: model output with one candidate everywhere vs dense: " + "; ".join(
                f"{n} cos {v[i].cos:.6f}" for n, v in e2e.items()))
    if not sites.order:
        raise ValueError("the model ran no scaled_dot_product_attention call on these calls: nothing to calibrate")
    times = [normalized_t(kwargs, timestep_scale) for _, kwargs in call_list]
    windows, window_notes = step_windows(sites, cands, times, budget)
    cands = tuple(sorted(cands + tuple(windows), key=rank))
    options, per_key = _options(sites, cands)
    plan = {u: choose(o, budget).name for u, o in options.items()}
    limit = None
    by_name = {c.name: c for c in cands}

    def run_plan(p: dict) -> list[Errors]:
        found = []
        with torch.no_grad():
            for i, (args, kwargs) in enumerate(call_list):
                sites.timestep = timestep_of(kwargs)
                out = probed.run(_apply(sites, lambda key: _named(p[unit_of(key)], by_name)), args, kwargs)
                found.append(errors(flat_output(out), refs[i]))
        return found

    plan_e2e = run_plan(plan)
    if budget.e2e_bounds and budget.e2e_violation(worst(plan_e2e)) is not None:
        plan, limit, plan_e2e = _tighten(options, budget, plan_e2e, run_plan, say)
    choices = {u: choose(o, budget, limit=limit, labels=labels) for u, o in options.items()}
    assert all(choices[u].name == plan[u] for u in plan)
    unit_sites = {}
    for key in sites.order:
        unit_sites.setdefault(unit_of(key), sites.sites[key])
    spec = spec_for(plan, options, cands, budget, unit_sites, limit=limit)
    table, site_plans = _table(sites, cands, per_key, choices, budget, limit)
    return Calibration(budget=budget, spec=spec, table=table, sites=site_plans, e2e=e2e, plan_e2e=plan_e2e,
                       calls=labels, candidates=[c.to_dict() for c in cands], emulate=emulate,
                       hardware=_hardware_text(sites, emulate),
                       notes=fitted + window_notes + _notes(sites, cands, per_key, budget, labels, table, limit))


def _check_served(sites: _Sites) -> None:
    """Without emulation, raise when no candidate runs at any site of the first call (a plan would be all dense for
    want of a kernel here, not for want of quality)."""
    if sites.emulate or not sites.order or any(r.served for r in sites.records.values()):
        return
    why = next(r.why for r in sites.records.values())
    raise ValueError(f"no candidate runs at any attention site on this machine ({sites.here}), e.g. {why}; valid: "
                     "emulate=True (qattn-fx calibrate --emulate) to measure the recipes on the reference kernel, "
                     "or a GPU with a kernel for them")


def _labels(labels: Sequence[str] | None, n: int) -> list[str]:
    if labels is None:
        return [f"call {i}" for i in range(n)]
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(f"labels has {len(labels)} names for {n} calls; valid: one name per call")
    return labels


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _named(name: str, by_name: dict[str, Candidate]) -> Candidate | None:
    return None if name == DENSE else by_name[name]


def _apply(sites: _Sites, pick: Callable[[SiteKey], Candidate | None]):
    """A handler that outputs, at each site, the candidate ``pick`` names there (None: dense)."""
    def handler(sc: SiteCall) -> torch.Tensor:
        c = pick(sc.key)
        if c is None:
            return sc.dense
        decision = sites.decide(sc, Spec(default=c.use))
        return sites.output(sc, decision) if decision.quantized else sc.dense
    return handler


def _options(sites: _Sites, cands) -> tuple[dict[Unit, list[Option]], dict[SiteKey, list[Option]]]:
    per_key: dict[SiteKey, list[Option]] = {}
    for key in sites.order:
        row = []
        for c in cands:
            rec = sites.records[(key, c.name)]
            measured = [(e.cos, i) for i, e in enumerate(rec.per_call) if e is not None]
            served = rec.served and bool(measured)
            row.append(Option(c, served, worst([e for e in rec.per_call if e is not None]) if served else None,
                              rec.sparse_speedup(), rec.why or ("" if measured else "never ran"),
                              min(measured)[1] if measured else None, rec.speed_upper_bound(),
                              rec.mean_sparsity() if served else None))
        per_key[key] = row
    units: dict[Unit, list[list[Option]]] = {}
    for key, row in per_key.items():
        units.setdefault(unit_of(key), []).append(row)
    return {u: merge_options(rows) for u, rows in units.items()}, per_key


def _tighten(options, budget: Budget, plan_e2e, run_plan, say):
    """The loosest extra per-site bound whose plan keeps the end-to-end bounds (bisection over the measured site
    errors; every site dense always keeps them). Returns (plan, limit, the plan's end-to-end errors)."""
    key = "e2e_rel_l1" if "e2e_rel_l1" in budget.e2e_bounds else "e2e_cos"
    values = sorted({site_error(key, o.errors) for opts in options.values() for o in opts
                     if o.served and budget.site_violation(o.errors) is None}, reverse=True)
    limits = values[1:] + [-1.0]  # the loosest value is the plan that broke the bound; -1: every site dense
    tried: dict[int, list[Errors]] = {}

    def plan_at(j: int) -> dict:
        return {u: choose(o, budget, limit=(key, limits[j])).name for u, o in options.items()}

    lo, hi = 0, len(limits) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        tried[mid] = run_plan(plan_at(mid))
        e = worst(tried[mid])
        ok = budget.e2e_violation(e) is None
        say(f"end-to-end bound: sites at {key.removeprefix('e2e_')} error <= {limits[mid]:.3g}: model output cos "
            f"{e.cos:.6f}, rel_l1 {e.rel_l1:.3g} ({'keeps' if ok else 'breaks'} {budget.describe()})")
        if ok:
            hi = mid
        else:
            lo = mid + 1
    plan = plan_at(hi)
    found = tried.get(hi) or run_plan(plan)
    return plan, (key, limits[hi]), found


def _table(sites: _Sites, cands, per_key, choices: dict[Unit, Choice], budget: Budget, limit):
    rows, plans = [], []
    units: dict[Unit, list[SiteKey]] = {}
    for key in sites.order:
        units.setdefault(unit_of(key), []).append(key)
    for key in sites.order:
        site, choice = sites.sites[key], choices[unit_of(key)]
        for c, o in zip(cands, per_key[key]):
            rec = sites.records[(key, c.name)]
            why = o.why_not_served if not o.served else (violation(o, budget, limit) or "")
            note = "; ".join(filter(None, (why, rec.deploy_note)))
            rows.append(TableRow(
                site=key.label, module=key.module, layer=key.layer, role=site.role, q_len=site.q_len,
                kv_len=site.kv_len, head_dim=site.head_dim, candidate=c.name, kernel=rec.kernel, deploy=rec.deploy,
                per_call=list(rec.per_call), speedup=o.speedup,
                speed_source=_speed_source(rec) if o.speedup is not None else NO_COST_DATA, served=o.served,
                within_budget=o.served and not why,
                chosen=choice.name == c.name, note=note, speed_upper_bound=o.upper_bound,
                sparsity=o.sparsity, per_call_sparsity=rec.sparsity() if c.use.block_sparse is not None else []))
        shared = [k.label for k in units[unit_of(key)] if k != key]
        reason = choice.reason + (f"; one rule with {', '.join(shared)} (same module and layer)" if shared else "")
        plans.append(SitePlan(key.label, key.module, key.layer, site.role, choice.name, reason, choice.speed_source))
    return Table(rows), plans


def _hardware_text(sites: _Sites, emulate: bool) -> str:
    if emulate:
        where = sites.target.arch if sites.target is not None else "each recipe's first deployment arch"
        return f"{sites.here} (emulated: reference kernel; speed predicted for {where})"
    return sites.here


def _notes(sites: _Sites, cands, per_key, budget: Budget, labels, table: Table, limit) -> list[str]:
    notes = []
    if any(r.speedup is None and r.served for r in table):
        notes.append(f"{NO_COST_DATA}: where a site's candidates lack predicted speeds (no kernel where the recipe "
                     "deploys, or no cost data for the kernel and arch in qattn_fx.cost), the first candidate inside "
                     "the budget in recipe-table order is taken")
    if any(r.speed_upper_bound and r.chosen for r in table):
        notes.append("<=: a site smaller than every call the cost data measured; its speedup is at most the one "
                     "shown (auto's cost rule reads it the same way)")
    if limit is not None:
        key, value = limit
        what = "1-cos" if key.endswith("cos") else key.removeprefix("e2e_")
        notes.append(f"the end-to-end bound tightened every site to {what} <= {value:.3g}")
    if budget.site_bounds and len(labels) > 1:
        counts = []
        for i, label in enumerate(labels):
            ok = 0
            for key, row in per_key.items():
                recs = [sites.records[(key, c.name)] for c in cands]
                ok += any(r.served and r.per_call[i] is not None and budget.site_violation(r.per_call[i]) is None
                          for r in recs)
            counts.append(f"{label}: {ok}/{len(per_key)}")
        notes.append("sites where some candidate keeps the per-site budget, per call: " + ", ".join(counts)
                     + ". A recipe has no step window, so each site's choice holds at every call and is made at "
                       "its worst call (block sparsity's only: disabled_until_timestep)")
    return notes
