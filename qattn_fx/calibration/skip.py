"""``target_sparsity`` for Skip-Softmax: fit the threshold λ per site (or one for the model) on the user's calls.

:func:`calibrate_skip_softmax` compiles the model once in emulation (the reference kernel, any device) with every
quantized site's Skip-Softmax at λ = 0, runs the calls, and has the reference record each site's *tile margins*
(:func:`qattn_fx.skip_softmax.tile_margins`: a tile is skipped exactly when its margin is below ``log2 λ``, for
every λ <= 1). One pass therefore gives every λ's sparsity; λ is the smallest value whose skipped-tile fraction on
these calls reaches the target (capped at 1: a site whose tiles cannot reach it, e.g. cross-attention to one key
tile, gets λ = 1 and says what it reaches). The result is a spec whose rules give each calibrated site its λ
(``threshold``), ahead of the spec's own rules, so the deployment compile runs the same recipes with fixed
thresholds (a site the calls never reached keeps the spec's own setting: a ``target_sparsity`` there still asks for
a calibration when compiled). The sparsity reached on other prompts, lengths or steps can differ (as vLLM-Omni says
of its calibrated curves): calibrate on calls like those served, e.g. a few denoising steps at the served
resolution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .. import recipes, skip_softmax
from ..policy import select
from ..recipes import SkipSoftmax
from ..spec import DENSE, Match, Rule, Spec
from .capture import kwargs_or_pairs

PER = ("site", "model")


@dataclass
class SkipCalibration:
    """What :func:`calibrate_skip_softmax` found: ``spec`` (compile with it), ``thresholds`` (module path → λ),
    ``sparsity`` (module path → the fraction of tiles λ skips on the calibration calls), ``target`` and ``per``."""

    spec: Spec
    thresholds: dict[str, float] = field(default_factory=dict)
    sparsity: dict[str, float] = field(default_factory=dict)
    target: dict[str, float] = field(default_factory=dict)
    per: str = "site"

    def __str__(self) -> str:
        lines = [f"{'module':40s}  {'target':>6s}  {'λ':>10s}  {'skipped':>7s}"]
        lines += [f"{m:40s}  {self.target[m]:6.3f}  {self.thresholds[m]:10.3g}  {self.sparsity[m]:7.3f}"
                  for m in self.thresholds]
        return "\n".join(lines)


def _with_skip(use: Any, skip: SkipSoftmax | None) -> Any:
    if use == DENSE or use.backend not in recipes.skip_softmax_backends():
        return use
    return dataclasses.replace(use, skip_softmax=skip)


def _probe_spec(spec: Spec) -> Spec:
    """``spec`` with the Skip-Softmax of every attention spec that may have one at λ = 0 (nothing skipped: the calls
    run as without it, and the reference records the margins of every tile)."""
    probe = SkipSoftmax(threshold=0.0)
    return Spec(default=_with_skip(spec.default, probe),
                rules=tuple(Rule(r.match, _with_skip(r.use, probe)) for r in spec.rules))


def calibrate_skip_softmax(model: Callable, calls: Iterable, target_sparsity: float | None = None, *,
                           spec: Spec | dict | str | Path | None = None, per: str = "site",
                           disabled_until_timestep: float | None = None, timestep: str = "timestep",
                           timestep_scale: float = 1000.0) -> SkipCalibration:
    """Fit Skip-Softmax's λ so that each site (``per="site"``) or the model (``per="model"``, one λ over every
    site's tiles) skips ``target_sparsity`` of its tiles on ``calls`` (kwargs dicts or ``(args, kwargs)`` pairs).

    ``spec`` (default :class:`Spec`): the recipes to calibrate under; a site's target is ``target_sparsity`` when
    given, else its spec's own ``skip_softmax.target_sparsity`` (sites with neither, and dense sites, are left as
    the spec has them). ``disabled_until_timestep`` goes into the returned thresholds (else each site's own).
    The calls run in emulation (the reference kernel: exact tile test, any device, slow for long sequences) and
    their outputs are the unskipped ones. Returns a :class:`SkipCalibration`; compile with its ``spec``.
    """
    from ..backend import Backend  # noqa: PLC0415  (the backend compiles; the package imports it first)

    if per not in PER:
        raise ValueError(f"per={per!r} is invalid; valid: {', '.join(PER)}")
    if target_sparsity is not None:
        SkipSoftmax(target_sparsity=target_sparsity, where="calibrate_skip_softmax")  # validates the range
    base = Spec.coerce(spec)
    owner = Backend(_probe_spec(base), emulate=True, compiler="eager", timestep=timestep,
                    timestep_scale=timestep_scale)
    compiled = torch.compile(model, backend=owner)
    with torch.no_grad(), skip_softmax.collect_margins() as margins:
        for args, kwargs in kwargs_or_pairs(calls):
            compiled(*args, **kwargs)
    sites = {}  # module path -> (label, its attention spec in ``base``, target)
    for record, site in zip(owner.report.sites, owner._sites):
        if not record.rewritten or record.label_prefix not in margins.sites:
            continue
        use, _, _ = select(base, site)
        own = use.skip_softmax.target_sparsity if use != DENSE and use.skip_softmax else None
        target = target_sparsity if target_sparsity is not None else own
        if target is not None:
            sites.setdefault(record.module, (record.label_prefix, use, target))
    if not sites:
        raise ValueError("no site to calibrate: no quantized attention site ran, or none has a target (give "
                         "target_sparsity, or skip_softmax.target_sparsity in the spec)")
    result = SkipCalibration(base, per=per)
    if per == "model":
        pooled = torch.cat([margins.of(label) for label, _, _ in sites.values()])
        targets = {t for _, _, t in sites.values()}
        if len(targets) > 1:
            raise ValueError(f"per='model' needs one target; the spec's sites ask for {sorted(targets)}")
        lam = skip_softmax.Margins.threshold_for(pooled, targets.pop())
    rules = []
    for module, (label, use, target) in sites.items():
        mine = margins.of(label)
        threshold = lam if per == "model" else skip_softmax.Margins.threshold_for(mine, target)
        gate = (disabled_until_timestep if disabled_until_timestep is not None
                else use.skip_softmax.disabled_until_timestep if use.skip_softmax else None)
        skip = SkipSoftmax(threshold=threshold, disabled_until_timestep=gate)
        rules.append(Rule(Match(module=module), dataclasses.replace(use, skip_softmax=skip)))
        result.thresholds[module] = threshold
        result.sparsity[module] = skip_softmax.Margins.sparsity(mine, threshold)
        result.target[module] = target
    result.spec = Spec(default=base.default, rules=tuple(rules) + base.rules)
    return result


__all__ = ["SkipCalibration", "calibrate_skip_softmax"]
