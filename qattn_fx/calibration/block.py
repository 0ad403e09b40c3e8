"""``target_sparsity`` for block sparsity: fit ``cdf`` (or ``top_k``) per site (or one for the model) on the user's
calls.

:func:`calibrate_block_sparse` traces the model once with a probe at each attention site
(:class:`~qattn_fx.calibration.capture.ProbedModel`, as :func:`qattn_fx.calibrate` does: sites are named as the
backend's report names them, nothing is compiled by Inductor) and runs the calls densely. At every site that the
spec quantizes and that has a target, the block predictor (:func:`qattn_fx.kernels.predict_blocks.predict`, the
rule of ``qattn::predict_blocks``) runs on the site's canonical, unquantized Q and K (and key bias), exactly as the
compiled site would compute them, once per value of a grid of ``keep`` values (:data:`CDF_GRID`,
:data:`TOP_K_GRID`); no attention runs per value, only the predictor, which is cheap. Each grid value's skipped
blocks are summed over the calls (and over the SDPA calls of one module path); per site the chosen ``keep`` is the
*highest* (the fewest blocks skipped, the closest to dense) whose skipped fraction on these calls reaches the
target. A site no grid value brings to the target (e.g. cross-attention to one key tile, which the sinks and the
diagonal always keep) gets the lowest grid value and says what it reaches.

The result is a spec whose rules give each calibrated site its ``block_sparse`` (``cdf`` or ``top_k``, with the
spec's own sinks, diagonal, similarity guard and gate), ahead of the spec's own rules, as
:func:`~qattn_fx.calibration.skip.calibrate_skip_softmax` does for Skip-Softmax's λ. The sparsity reached on other
prompts, lengths or steps can differ: calibrate on calls like those served.

:func:`qattn_fx.calibrate` uses it for candidates with ``block_sparse.target_sparsity`` (``int8-1-16-1+target0.5``):
the distinct ``cdf`` values fitted per site become candidates of their own, measured at every site, and the budget
decides among them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..block_sparse_spec import BlockSparse
from ..hardware import detect
from ..kernels import predict_blocks as predictor
from ..ops import quantized_attention
from ..policy import resolve, select
from ..spec import DENSE, Match, Rule, Spec
from .capture import ProbedModel, SiteCall, kwargs_or_pairs
from .skip import PER

#: The ``cdf`` values tried (denser near 1, where the predicted mass of local maps concentrates).
CDF_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.985, 0.99,
            0.993, 0.995, 0.997, 0.998, 0.999, 0.9995, 0.9999)
#: The ``top_k`` values tried: 0.02 to 0.98 by 0.02.
TOP_K_GRID = tuple(round(0.02 * i, 2) for i in range(1, 50))
MODES = ("cdf", "top_k")


@dataclass
class BlockCalibration:
    """What :func:`calibrate_block_sparse` found: ``spec`` (compile with it), ``keep`` (module path → the ``cdf``
    or ``top_k`` chosen), ``sparsity`` (module path → the fraction of blocks it skips on the calibration calls),
    ``target``, ``per``, ``mode`` and ``curve`` (module path → ``(keep, skipped fraction)`` per grid value)."""

    spec: Spec
    keep: dict[str, float] = field(default_factory=dict)
    sparsity: dict[str, float] = field(default_factory=dict)
    target: dict[str, float] = field(default_factory=dict)
    per: str = "site"
    mode: str = "cdf"
    curve: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form: ``{"spec", "per", "mode", "sites": {module: {"target", "keep", "sparsity", "curve"}}}``."""
        return {"spec": self.spec.to_dict(), "per": self.per, "mode": self.mode,
                "sites": {m: {"target": self.target[m], "keep": self.keep[m], "sparsity": self.sparsity[m],
                              "curve": [list(p) for p in self.curve[m]]} for m in self.keep}}

    def reached(self, module: str) -> bool:
        """Whether ``module``'s sparsity on the calls reaches its target."""
        return self.sparsity[module] >= self.target[module] - 1e-12

    def __str__(self) -> str:
        lines = [f"{'module':40s}  {'target':>6s}  {self.mode:>6s}  {'skipped':>7s}"]
        lines += [f"{m:40s}  {self.target[m]:6.3f}  {self.keep[m]:6.4g}  {self.sparsity[m]:7.3f}"
                  + ("" if self.reached(m) else "  (target not reached: the lowest keep tried)") for m in self.keep]
        return "\n".join(lines)


class _Captured(Exception):
    """Raised by :func:`_capture` with the arguments the lowering passes ``qattn::predict_blocks``."""

    def __init__(self, args: tuple):
        super().__init__("predict_blocks")
        self.op_args = args


def _capture(target: Callable, args: tuple, name: str) -> Any:
    """An eager emitter for :func:`qattn_fx.ops.quantized_attention` that stops at the predictor node."""
    if name == "predict_blocks":
        raise _Captured(args)
    return target(*args)


def predictor_inputs(sc: SiteCall, use, blocks: BlockSparse) -> tuple:
    """``(q, k, key_bias, sm_scale)`` as the compiled site passes them to the predictor: canonical, unquantized,
    with the mask as a key bias (the lowering itself computes them, stopped before any quantize node)."""
    try:
        quantized_attention(sc.q, sc.k, sc.v, use.recipe, sm_scale=sc.scale, out_dtype=sc.q.dtype,
                            attn_mask=sc.attn_mask, enable_gqa=sc.enable_gqa, emit=_capture, block_sparse=blocks)
    except _Captured as c:
        q, k, key_bias, sm_scale, runtime_scale = c.op_args[:5]
        return q, k, key_bias, sm_scale if runtime_scale is None else float(runtime_scale)
    raise AssertionError("the lowering emitted no predict_blocks node")


def _probe(use, mode: str) -> BlockSparse:
    """The site's block sparsity with every block kept, its own sinks, diagonal and guard (no gate)."""
    own = use.block_sparse or BlockSparse(cdf=1.0)
    return BlockSparse(**{mode: 1.0}, sink_tiles=own.sink_tiles, diagonal=own.diagonal, similarity=own.similarity)


def calibrate_block_sparse(model: Callable, calls: Iterable, target_sparsity: float | None = None, *,
                           spec: Spec | dict | str | Path | None = None, per: str = "site", mode: str = "cdf",
                           grid: Iterable[float] | None = None,
                           disabled_until_timestep: float | None = None) -> BlockCalibration:
    """Fit block sparsity's ``cdf`` (``mode="cdf"``) or ``top_k`` so that each site (``per="site"``) or the model
    (``per="model"``, one value over every site's blocks) skips at least ``target_sparsity`` of its blocks on
    ``calls`` (kwargs dicts or ``(args, kwargs)`` pairs), with the highest such value (the module docstring).

    ``spec`` (default :class:`Spec`): the recipes to calibrate under; a site's target is ``target_sparsity`` when
    given, else its spec's own ``block_sparse.target_sparsity`` (sites with neither, dense sites, and sites whose
    recipe cannot be block-sparse are left as the spec has them). A site's sinks, diagonal and similarity guard are
    its spec's ``block_sparse`` ones (default :class:`~qattn_fx.recipes.BlockSparse`'s). ``grid``: the values to
    try (default :data:`CDF_GRID` / :data:`TOP_K_GRID`). ``disabled_until_timestep`` goes into the returned
    settings (else each site's own). Returns a :class:`BlockCalibration`; compile with its ``spec``.
    """
    if per not in PER:
        raise ValueError(f"per={per!r} is invalid; valid: {', '.join(PER)}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    if target_sparsity is not None:
        BlockSparse(target_sparsity=target_sparsity, where="calibrate_block_sparse")  # validates the range
    values = sorted(set(CDF_GRID if mode == "cdf" else TOP_K_GRID) if grid is None else {float(g) for g in grid})
    if not values or not all(0 < v <= 1 for v in values):
        raise ValueError(f"grid={values} is invalid; valid: values in (0, 1]")
    base = Spec.coerce(spec)
    call_list = kwargs_or_pairs(calls)
    counts: dict[str, list[list[int]]] = {}  # module path -> per grid value [skipped, blocks]
    sites: dict[str, tuple] = {}  # module path -> (its attention spec in ``base``, target)

    def handler(sc: SiteCall) -> torch.Tensor:
        use, _, _ = select(base, sc.site)
        if use == DENSE or use.recipe is None or use.recipe.family != "scaled":
            return sc.dense
        own = use.block_sparse.target_sparsity if use.block_sparse is not None else None
        target = target_sparsity if target_sparsity is not None else own
        if target is None:
            return sc.dense
        probe = _probe(use, mode)
        decision = resolve(sc.site, detect(sc.q.device), Spec(default=dataclasses.replace(use, block_sparse=probe)),
                           emulate=True, apply_cost_rule=False)
        if not decision.quantized:
            return sc.dense
        q, k, key_bias, scale = predictor_inputs(sc, use, probe)
        row = counts.setdefault(sc.key.module, [[0, 0] for _ in values])
        sites.setdefault(sc.key.module, (use, target))
        for cell, keep in zip(row, values):
            blocks = predictor.predict(q, k, key_bias, scale, keep, mode, probe.sink_tiles, probe.diagonal,
                                       probe.similarity)
            cell[0] += blocks.total - blocks.visited
            cell[1] += blocks.total
        return sc.dense

    probed = ProbedModel(model)
    with torch.no_grad():
        for args, kwargs in call_list:
            probed.run(handler, args, kwargs)
    if not sites:
        raise ValueError("no site to calibrate: no quantized attention site of the scaled family ran, or none has a "
                         "target (give target_sparsity, or block_sparse.target_sparsity in the spec)")
    result = BlockCalibration(base, per=per, mode=mode)
    curves = {m: [(keep, s / n if n else 0.0) for keep, (s, n) in zip(values, row)] for m, row in counts.items()}
    if per == "model":
        targets = {t for _, t in sites.values()}
        if len(targets) > 1:
            raise ValueError(f"per='model' needs one target; the spec's sites ask for {sorted(targets)}")
        pooled = [(keep, sum(counts[m][i][0] for m in counts) / max(1, sum(counts[m][i][1] for m in counts)))
                  for i, keep in enumerate(values)]
        model_keep = _highest_reaching(pooled, targets.pop())
    rules = []
    for module, (use, target) in sites.items():
        keep = model_keep if per == "model" else _highest_reaching(curves[module], target)
        own = use.block_sparse
        gate = disabled_until_timestep if disabled_until_timestep is not None else (
            own.disabled_until_timestep if own is not None else None)
        probe = _probe(use, mode)
        setting = dataclasses.replace(probe, **{mode: keep}, disabled_until_timestep=gate)
        rules.append(Rule(Match(module=module), dataclasses.replace(use, block_sparse=setting)))
        result.keep[module] = keep
        result.sparsity[module] = dict(curves[module])[keep]
        result.target[module] = target
        result.curve[module] = curves[module]
    result.spec = Spec(default=base.default, rules=tuple(rules) + base.rules)
    return result


def _highest_reaching(curve: list[tuple[float, float]], target: float) -> float:
    """The highest ``keep`` whose skipped fraction reaches ``target``; the lowest ``keep`` when none does."""
    reaching = [keep for keep, skipped in curve if skipped >= target - 1e-12]
    return max(reaching) if reaching else min(keep for keep, _ in curve)


__all__ = ["BlockCalibration", "CDF_GRID", "TOP_K_GRID", "calibrate_block_sparse"]
