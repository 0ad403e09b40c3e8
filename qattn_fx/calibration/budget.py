"""Error metrics of an attention output against dense, and the budget a calibration plan must keep.

:class:`Errors` holds three numbers comparing an output ``o`` with the dense one ``r`` (both any shape, any float
dtype, computed in fp32): ``cos`` (cosine similarity of the flattened tensors), ``rel_l1`` (``Σ|o−r| / Σ|r|``) and
``max_abs`` (``max |o−r|``). :class:`Budget` bounds them per site (``cos``, ``rel_l1``, ``max_abs``) and on the
model's whole output (``e2e_cos``, ``e2e_rel_l1``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..validate import show

#: Per-site bounds: ``cos`` is a lower bound, the others upper bounds.
SITE_KEYS = ("cos", "rel_l1", "max_abs")
#: Bounds on the model output (all floating-point tensors it returns, flattened together).
E2E_KEYS = ("e2e_cos", "e2e_rel_l1")


@dataclass(frozen=True)
class Errors:
    """How far an output is from dense: cosine (1 is exact), relative L1 and max absolute error (0 is exact)."""

    cos: float
    rel_l1: float
    max_abs: float

    def value(self, key: str) -> float:
        """The metric a budget key names: ``cos``/``e2e_cos`` → ``cos``, ``rel_l1``/``e2e_rel_l1`` → ``rel_l1``."""
        return getattr(self, key.removeprefix("e2e_"))

    def describe(self) -> str:
        return f"cos {self.cos:.6f}, rel_l1 {self.rel_l1:.2e}, max_abs {self.max_abs:.2e}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Errors":
        return cls(float(data["cos"]), float(data["rel_l1"]), float(data["max_abs"]))


EXACT = Errors(1.0, 0.0, 0.0)


def errors(out: torch.Tensor, ref: torch.Tensor) -> Errors:
    """:class:`Errors` of ``out`` against ``ref`` (same number of elements; compared flattened, in fp32).

    Two all-zero tensors have cosine 1; a zero ``ref`` with a nonzero ``out`` has cosine 0 and relative L1 ``inf``.
    """
    if out.numel() != ref.numel():
        raise ValueError(f"out has {out.numel()} elements, ref {ref.numel()}; they must match")
    o, r = out.detach().float().flatten(), ref.detach().float().flatten()
    diff = (o - r).abs()
    norms = o.norm() * r.norm()
    if norms == 0:
        cos = 1.0 if bool((o == r).all()) else 0.0
    else:
        cos = float(torch.dot(o, r) / norms)
    ref_l1 = float(r.abs().sum())
    err_l1 = float(diff.sum())
    rel = err_l1 / ref_l1 if ref_l1 > 0 else (0.0 if err_l1 == 0 else math.inf)
    return Errors(min(cos, 1.0), rel, float(diff.max()) if diff.numel() else 0.0)


def worst(items: Sequence[Errors]) -> Errors:
    """The worst of each metric over ``items`` (lowest cosine, highest errors); :data:`EXACT` for none."""
    if not items:
        return EXACT
    return Errors(min(e.cos for e in items), max(e.rel_l1 for e in items), max(e.max_abs for e in items))


def output_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a model's output (tensors, tuples/lists, dicts such as diffusers'
    ``Transformer2DModelOutput``, dataclasses), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in output_tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in output_tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in output_tensors(getattr(value, f.name))]
    return []


def flat_output(value: Any) -> torch.Tensor:
    """Every floating-point tensor of a model output, flattened and concatenated in fp32 (what end-to-end errors
    compare). Raises when the output has none."""
    tensors = output_tensors(value)
    if not tensors:
        raise ValueError(f"the model returned {type(value).__name__} without floating-point tensors; end-to-end "
                         "errors need a tensor output (a tensor, or tuples/dicts/dataclasses of them)")
    return torch.cat([t.detach().float().flatten() for t in tensors])


@dataclass(frozen=True)
class Budget:
    """The error a plan may add: per attention site and/or on the model's output.

    ``cos``: each site's output cosine to dense ≥ this; ``rel_l1`` / ``max_abs``: each site's relative L1 / max
    absolute error ≤ this; ``e2e_cos`` / ``e2e_rel_l1``: the same on the model output with the whole plan applied.
    Every bound holds at every calibration call (the worst call counts). At least one bound is needed.
    """

    cos: float | None = None
    rel_l1: float | None = None
    max_abs: float | None = None
    e2e_cos: float | None = None
    e2e_rel_l1: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"budget.{f.name}={show(value)} is invalid; valid: a finite number")
            if f.name.endswith("cos") and not -1.0 <= value <= 1.0:
                raise ValueError(f"budget.{f.name}={show(value)} is out of range; valid: a cosine in [-1, 1], "
                                 "e.g. 0.999")
            if not f.name.endswith("cos") and value < 0:
                raise ValueError(f"budget.{f.name}={show(value)} is out of range; valid: >= 0, e.g. 0.05")
            object.__setattr__(self, f.name, float(value))
        if all(getattr(self, f.name) is None for f in dataclasses.fields(self)):
            raise ValueError("budget has no bound; valid keys: " + ", ".join(SITE_KEYS + E2E_KEYS)
                             + " (e.g. {'cos': 0.999})")

    @property
    def site_bounds(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in SITE_KEYS if getattr(self, k) is not None}

    @property
    def e2e_bounds(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in E2E_KEYS if getattr(self, k) is not None}

    @staticmethod
    def holds(key: str, bound: float, e: Errors) -> bool:
        value = e.value(key)
        return value >= bound if key.endswith("cos") else value <= bound

    def site_violation(self, e: Errors) -> str | None:
        """Which per-site bound ``e`` breaks (``"cos 0.99812 < 0.999"``), or None."""
        return _violation(self.site_bounds, e)

    def e2e_violation(self, e: Errors) -> str | None:
        """Which end-to-end bound ``e`` (the model output's errors) breaks, or None."""
        return _violation(self.e2e_bounds, e)

    def describe(self) -> str:
        return ", ".join(f"{k} {'>=' if k.endswith('cos') else '<='} {v:g}"
                         for k, v in {**self.site_bounds, **self.e2e_bounds}.items())

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, value: "Budget | dict | str") -> "Budget":
        """A budget from a :class:`Budget`, a mapping (``{"cos": 0.999, "e2e_cos": 0.995}``) or the command line's
        ``"cos=0.999,e2e_rel_l1=0.02"``."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            data: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                key, sep, number = part.partition("=")
                try:
                    data[key.strip()] = float(number)
                except ValueError:
                    sep = ""
                if not sep:
                    raise ValueError(f"budget {value!r}: {part!r} is invalid; valid: KEY=NUMBER with KEY one of "
                                     + ", ".join(SITE_KEYS + E2E_KEYS))
            value = data
        if not isinstance(value, dict):
            raise ValueError(f"budget={show(value)} is invalid; valid: a Budget, a mapping such as "
                             "{'cos': 0.999}, or a string such as 'cos=0.999'")
        unknown = sorted(set(value) - set(SITE_KEYS + E2E_KEYS), key=str)
        if unknown:
            raise ValueError(f"unknown budget key(s) {unknown}; valid: {', '.join(SITE_KEYS + E2E_KEYS)}")
        return cls(**value)


def _violation(bounds: dict[str, float], e: Errors) -> str | None:
    for key, bound in bounds.items():
        if not Budget.holds(key, bound, e):
            op = "<" if key.endswith("cos") else ">"
            return f"{key} {_fmt(e.value(key), key)} {op} {bound:g}"
    return None


def _fmt(value: float, key: str) -> str:
    return f"{value:.6f}" if key.endswith("cos") else f"{value:.3g}"
