"""Block-sparse candidates in a calibration: ``target_sparsity`` fitted to ``cdf`` candidates (:func:`fit_targets`)
and step windows (:func:`step_windows`: a sparse candidate that breaks the per-site budget only at the early, high-t
calls competes gated by ``disabled_until_timestep``, its records derived from those measured). ``sites``: the
calibration's measurements (``run._Sites``: ``order``, the site keys; ``records``, a :class:`Record` per (site,
candidate name))."""

from __future__ import annotations

import dataclasses

import torch

from ..spec import Spec
from .budget import Budget, worst
from .candidates import Candidate, candidate_name, make_candidates
from .capture import SiteKey
from .records import Record, Unit, unit_of


def normalized_t(kwargs: dict, scale: float) -> float | None:
    """A call's normalized timestep (its ``timestep`` argument's max over ``scale``, as ``qattn::block_keep``
    reads it), or None without one."""
    t = timestep_of(kwargs)
    return None if t is None else float(t.float().reshape(-1).max()) / scale


def step_windows(sites, cands, times: list, budget: Budget) -> tuple[list[Candidate], list[str]]:
    """Gated block-sparse candidates where a sparse candidate breaks the per-site budget only at the early (high
    t) calls: the module docstring of :func:`calibrate`. Their records are derived from those measured (no run)."""
    if len(times) < 2 or any(t is None for t in times) or not budget.site_bounds:
        return [], []
    units: dict[Unit, list[SiteKey]] = {}
    for key in sites.order:
        units.setdefault(unit_of(key), []).append(key)
    names = {c.name for c in cands}
    added: dict[str, Candidate] = {}
    found: list[str] = []
    for c in cands:
        blocks = c.use.block_sparse
        if blocks is None or blocks.gated:
            continue
        base = next((b for b in cands if b.use == dataclasses.replace(c.use, block_sparse=None)), None)
        if base is None:
            continue
        for unit, keys in units.items():
            recs = [sites.records[(k, c.name)] for k in keys]
            if not all(r.served for r in recs):
                continue
            holds: dict[float, bool] = {}
            for i, t in enumerate(times):
                measured = [r.per_call[i] for r in recs if r.per_call[i] is not None]
                if measured:
                    holds[t] = holds.get(t, True) and budget.site_violation(worst(measured)) is None
            until = None
            for t in sorted(holds):  # the largest t up to which every call keeps the budget
                if not holds[t]:
                    break
                until = t
            if until is None or until <= 0 or until >= max(holds) or until > 1:
                continue  # it never holds, holds at every call, or the gate cannot say it
            use = dataclasses.replace(c.use, block_sparse=dataclasses.replace(blocks, disabled_until_timestep=until))
            name = candidate_name(use)
            if name not in names and name not in added:
                added[name] = Candidate(name, use, c.table_rank)
                _derive(sites, added[name], c, base, times, until)
            found.append(f"{unit[0] or 'sdpa'}: {name}")
    notes = [] if not found else [
        "step windows (block-sparse candidates that break the per-site budget only at early calls, dense while t is "
        "above the gate): " + ", ".join(found)]
    return list(added.values()), notes


def _derive(sites, gated: Candidate, sparse: Candidate, base: Candidate, times: list, until: float) -> None:
    """``gated``'s records at every site: ``sparse``'s at the calls with t <= ``until``, ``base``'s (every block
    visited: the same output) at the others, where no block is skipped."""
    for key in sites.order:
        s, b = sites.records[(key, sparse.name)], sites.records[(key, base.name)]
        late = [t <= until for t in times]
        sites.records[(key, gated.name)] = Record(
            per_call=[se if ok else be for se, be, ok in zip(s.per_call, b.per_call, late)],
            served=s.served and b.served, why=s.why or b.why, kernel=s.kernel, deploy=s.deploy, speedup=s.speedup,
            speed_known=s.speed_known, upper_bound=s.upper_bound, speed_data=s.speed_data, deploy_note=s.deploy_note,
            blocks=[sb if ok or sb is None else (0, sb[1]) for sb, ok in zip(s.blocks, late)],
            sparse_time=s.sparse_time)


def fit_targets(model, call_list, cands, say) -> tuple[tuple[Candidate, ...], list[str]]:
    """Candidates with ``block_sparse.target_sparsity`` replaced by what
    :func:`~qattn_fx.calibration.block.calibrate_block_sparse` fits per site: each distinct ``cdf`` becomes a
    candidate of its own (measured at every site; the budget picks). Also the notes saying what was fitted."""
    from .block import calibrate_block_sparse  # noqa: PLC0415

    targets = [c for c in cands if c.use.block_sparse is not None and c.use.block_sparse.target_sparsity is not None]
    if not targets:
        return cands, []
    uses, notes = [c.use for c in cands if c not in targets], []
    for c in targets:
        blocks = c.use.block_sparse
        fit = calibrate_block_sparse(model, call_list, spec=Spec(default=c.use))
        for keep in sorted(set(fit.keep.values())):
            uses.append(dataclasses.replace(c.use, block_sparse=dataclasses.replace(blocks, cdf=keep,
                                                                                   target_sparsity=None)))
        fitted = ", ".join(f"{m} cdf {fit.keep[m]:g} (skips {fit.sparsity[m]:.2f})" for m in fit.keep)
        notes.append(f"{c.name}: target_sparsity {blocks.target_sparsity:g} fitted per site (calibrate_block_sparse) "
                     f"to {fitted}; each distinct cdf is a candidate")
        say(notes[-1])
    return make_candidates(list(dict.fromkeys(uses))), notes


def timestep_of(kwargs: dict) -> torch.Tensor | None:
    """A call's ``timestep`` keyword argument as a tensor (what a gated site reads), or None."""
    t = kwargs.get("timestep")
    if t is None or torch.is_tensor(t):
        return t
    return torch.tensor([float(t)])
