"""What a calibration found: the table (per site and candidate), the plan, end-to-end errors, and the spec.

``Calibration.to_dict()`` is the JSON form (``save``/``load`` round-trip it; the plot can be drawn from a loaded
file): ``{"budget", "emulate", "hardware", "calls", "candidates", "rows": [...], "sites": [...], "e2e": {candidate:
[errors per call]}, "plan_e2e": [...], "spec", "notes"}``. Errors are ``{"cos", "rel_l1", "max_abs"}`` per call
(``null`` where the site did not run in that call or the candidate was not served).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..spec import Spec
from .budget import Budget, Errors, worst

WIDTH = 120


def _errs(items: list[Errors | None]) -> list:
    return [None if e is None else e.to_dict() for e in items]


def _unerrs(items: list) -> list[Errors | None]:
    return [None if e is None else Errors.from_dict(e) for e in items]


@dataclass
class TableRow:
    """One site and one candidate: its errors against dense per call, predicted speed, and whether the plan took it.

    ``sparsity``: a block-sparse candidate's measured fraction of blocks skipped (the predictor's real lists on the
    site's Q and K), the mean over the calls (its speed is the recipe's scaled by the mean fraction visited, plus the
    predictor's cost), ``per_call_sparsity`` each call's (None elsewhere).

    ``kernel``: what computed the measured output (``reference`` when emulated); ``deploy``: the kernel and arch
    the speed is predicted for (None where no kernel serves the site there); ``speedup``: predicted over dense
    SDPA (``speed_upper_bound``: at most that, the site is smaller than every measured call; ``speed_source``
    names the data); ``note``: why the candidate is not served at the site, or which bound it breaks.
    """

    site: str
    module: str
    layer: int | None
    role: str
    q_len: int
    kv_len: int
    head_dim: int
    candidate: str
    kernel: str | None
    deploy: str | None
    per_call: list[Errors | None]
    speedup: float | None
    speed_source: str
    served: bool
    within_budget: bool
    chosen: bool
    note: str = ""
    speed_upper_bound: bool = False
    sparsity: float | None = None
    per_call_sparsity: list = field(default_factory=list)

    @property
    def sparsity_text(self) -> str:
        """``0.45`` (a block-sparse candidate's fraction of blocks skipped) or ``-``."""
        return "-" if self.sparsity is None else f"{self.sparsity:.2f}"

    @property
    def speed_text(self) -> str:
        """``1.53x``, ``<=1.00x`` (an upper bound) or ``-`` (no prediction)."""
        return "-" if self.speedup is None else f"{'<=' if self.speed_upper_bound else ''}{self.speedup:.2f}x"

    @property
    def errors(self) -> Errors | None:
        """The worst of each metric over the calls (None if never measured)."""
        measured = [e for e in self.per_call if e is not None]
        return worst(measured) if measured else None

    @property
    def worst_call(self) -> int | None:
        measured = [(e.cos, i) for i, e in enumerate(self.per_call) if e is not None]
        return min(measured)[1] if measured else None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["per_call"] = _errs(self.per_call)
        d["errors"] = None if self.errors is None else self.errors.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "TableRow":
        data = {k: v for k, v in data.items() if k != "errors"}
        return cls(**{**data, "per_call": _unerrs(data["per_call"])})


@dataclass
class SitePlan:
    """The plan at one site: the chosen candidate (or ``dense``) and why."""

    site: str
    module: str
    layer: int | None
    role: str
    choice: str
    reason: str
    speed_source: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Table:
    """Rows per site and candidate, in site order (as the model runs them) then table order."""

    rows: list[TableRow]

    def __iter__(self) -> Iterator[TableRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> TableRow:
        return self.rows[i]

    def lookup(self, site: str, candidate: str) -> TableRow:
        for row in self.rows:
            if row.site == site and row.candidate == candidate:
                return row
        raise KeyError(f"no row for site {site!r} and candidate {candidate!r}")

    def __str__(self) -> str:
        head = ("site", "layer", "role", "q/kv", "d", "candidate", "cos", "rel_l1", "max_abs", "skipped", "speed",
                "plan")
        lines = []
        last = None
        for r in self.rows:
            e = r.errors
            first = r.site != last
            last = r.site
            cells = (_fit(r.site, 28) if first else "", _cell(r.layer) if first else "", r.role if first else "",
                     f"{r.q_len}/{r.kv_len}" if first else "", str(r.head_dim) if first else "", r.candidate,
                     "-" if e is None else f"{e.cos:.6f}", "-" if e is None else f"{e.rel_l1:.2e}",
                     "-" if e is None else f"{e.max_abs:.2e}", r.sparsity_text, r.speed_text,
                     "<- chosen" if r.chosen else ("n/a" if not r.served else ("" if r.within_budget else "over")))
            lines.append(cells)
        widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(c) for c in lines])

    def markdown(self) -> str:
        cols = ("site", "layer", "role", "q/kv", "d", "candidate", "kernel", "cos", "rel_l1", "max_abs", "skipped",
                "speed", "chosen", "note")
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            e = r.errors
            cells = (r.site, _cell(r.layer), r.role, f"{r.q_len}/{r.kv_len}", str(r.head_dim), r.candidate,
                     _cell(r.kernel), "-" if e is None else f"{e.cos:.6f}", "-" if e is None else f"{e.rel_l1:.3g}",
                     "-" if e is None else f"{e.max_abs:.3g}", r.sparsity_text, r.speed_text,
                     "yes" if r.chosen else "", r.note.replace("|", "\\|"))
            out.append("| " + " | ".join(cells) + " |")
        return "\n".join(out)

    def to_dict(self) -> list[dict]:
        return [r.to_dict() for r in self.rows]


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _fit(text: str, limit: int) -> str:
    parts = text.split(".")
    while len(parts) > 1 and len(".".join(parts)) + 3 > limit:
        parts.pop(0)
    short = ".".join(parts)
    return text if short == text else "..." + short


@dataclass
class Calibration:
    """The result of :func:`qattn_fx.calibrate`.

    ``spec``: the plan as a :class:`~qattn_fx.spec.Spec` (``backend(spec)``, ``spec.to_json()``); ``table``: per
    site and candidate, errors per call against dense, predicted speed, chosen; ``sites``: the plan per site with
    its reason; ``e2e``: per candidate, the model output's errors per call with that candidate at every site it
    serves; ``plan_e2e``: the same for the plan; ``calls``: the calls' labels; ``notes``: what the plan could not
    express (a step window) and how the speed was ranked.
    """

    budget: Budget
    spec: Spec
    table: Table
    sites: list[SitePlan]
    e2e: dict[str, list[Errors]]
    plan_e2e: list[Errors]
    calls: list[str]
    candidates: list[dict]
    emulate: bool
    hardware: str
    notes: list[str] = field(default_factory=list)

    # -- reading it -------------------------------------------------------------------------------------------
    @property
    def quantized(self) -> int:
        return sum(s.choice != "dense" for s in self.sites)

    def summary(self) -> str:
        e = worst(self.plan_e2e)
        return (f"qattn_fx calibration: {self.quantized}/{len(self.sites)} sites quantized within "
                f"{self.budget.describe()}; the plan's model output vs dense: worst cos {e.cos:.6f}, "
                f"rel_l1 {e.rel_l1:.3g} over {len(self.calls)} call(s)")

    def __str__(self, width: int = WIDTH) -> str:
        lines = [f"calibration: {len(self.sites)} sites x {len(self.candidates)} candidates x {len(self.calls)} "
                 f"calls ({', '.join(self.calls)}); budget {self.budget.describe()}", f"hardware: {self.hardware}",
                 "", str(self.table), "", "plan:"]
        for s in self.sites:
            text = f"{s.site} -> {s.choice}: {s.reason}" + (f" [{s.speed_source}]" if s.speed_source else "")
            lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
        lines += ["", "model output vs dense per call (cos / rel_l1):"]
        named = [*((f"{n} everywhere", v) for n, v in self.e2e.items()), ("plan", self.plan_e2e)]
        label_w = max(len(n) for n, _ in named)
        per_line = max(1, (width - label_w - 2) // 20)
        for start in range(0, len(self.calls), per_line):
            cols = range(start, min(start + per_line, len(self.calls)))
            lines.append((" " * label_w + "".join(f"  {self.calls[i]:<18}" for i in cols)).rstrip())
            for name, items in named:
                lines.append((name.ljust(label_w) + "".join(f"  {items[i].cos:.6f}/{items[i].rel_l1:<9.2e}"
                                                            for i in cols)).rstrip())
        for note in self.notes:
            lines += textwrap.wrap("note: " + note, width, subsequent_indent="  ")
        lines.append(self.summary())
        return "\n".join(lines)

    # -- JSON --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"budget": self.budget.to_dict(), "emulate": self.emulate, "hardware": self.hardware,
                "calls": list(self.calls), "candidates": list(self.candidates), "rows": self.table.to_dict(),
                "sites": [s.to_dict() for s in self.sites], "e2e": {k: _errs(v) for k, v in self.e2e.items()},
                "plan_e2e": _errs(self.plan_e2e), "spec": self.spec.to_dict(), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        return cls(budget=Budget.parse(data["budget"]), spec=Spec.from_dict(data["spec"]),
                   table=Table([TableRow.from_dict(r) for r in data["rows"]]),
                   sites=[SitePlan(**s) for s in data["sites"]],
                   e2e={k: _unerrs(v) for k, v in data["e2e"].items()}, plan_e2e=_unerrs(data["plan_e2e"]),
                   calls=list(data["calls"]), candidates=list(data["candidates"]), emulate=bool(data["emulate"]),
                   hardware=data["hardware"], notes=list(data.get("notes", [])))

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def plot(self, path: str | Path) -> Path:
        """A PNG of each site's error per candidate (worst over the calls; each call as a dot), the budget, and the
        plan's choice (:func:`qattn_fx.calibration.plot.plot`); needs matplotlib."""
        from .plot import plot

        return plot(self, path)


def load(path: str | Path) -> Calibration:
    """A :class:`Calibration` saved by :meth:`Calibration.save`."""
    return Calibration.from_dict(json.loads(Path(path).read_text()))
