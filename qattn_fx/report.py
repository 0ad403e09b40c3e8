"""Why each attention site ended up as it did: the site table, its summary line, and debug dumps.

``Report.to_dict()`` → ``{"sites": [{"site", "module", "layer", "role", "q_shape", "kv_shape", "dtype",
"rewritten", "recipe", "kernel", "reason", "graph", "notes"}, ...], "notes": [...]}`` (report-wide notes: rules
of the spec that decided no site); ``str(report)`` is a readable table;
``report.summary()`` is the one line logged after each compile.

Debug dumps (``debug_dir=``, else ``qattn_fx.config.debug_dir`` / ``$QATTN_FX_DEBUG``), per compiled graph ``N``: ``graph_N_before.py`` and
``graph_N_after.py`` (readable code with shapes, strides and devices), ``graph_N_sites.md`` / ``.json``, and
``spec.json`` (the spec as resolved, the hardware, versions). The same payloads are emitted as structured trace
artifacts (``TORCH_TRACE=dir`` + ``tlparse``) named ``qattn_fx_before_rewrite``, ``qattn_fx_after_rewrite``,
``qattn_fx_sites``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import config
from .fx.rewrite import SiteOutcome

_COLUMNS = ("graph", "site", "module", "layer", "role", "q_shape", "kv_shape", "dtype", "rewritten", "recipe",
            "kernel", "reason")


def _shape(shape: tuple) -> list:
    """Ints, with a symbolic size (dynamic shapes) as its symbol's name (``"s0"``); a size the compile specialized
    (head_dim) as its int."""
    out = []
    for d in shape:
        if not isinstance(d, int):
            known = d.node.maybe_as_int() if hasattr(d, "node") else None
            d = known if known is not None else str(d)
        out.append(d)
    return out


@dataclass(frozen=True)
class SiteRecord:
    graph: int
    site: str
    module: str
    layer: int | None
    role: str
    q_shape: list
    kv_shape: list
    dtype: str
    rewritten: bool
    recipe: str | None
    kernel: str | None
    reason: str
    notes: tuple[str, ...] = ()

    @classmethod
    def from_outcome(cls, graph: int, outcome: SiteOutcome) -> "SiteRecord":
        site, decision = outcome.site, outcome.decision
        return cls(
            graph=graph,
            site=outcome.node_name if not outcome.graph_name else f"{outcome.graph_name}.{outcome.node_name}",
            module=site.module,
            layer=site.layer,
            role=site.role,
            q_shape=_shape(site.q_shape),
            kv_shape=_shape(site.k_shape),
            dtype=str(site.dtype).replace("torch.", ""),
            rewritten=decision.quantized,
            recipe=decision.recipe.name if decision.quantized and decision.recipe else None,
            kernel=decision.kernel,
            reason=decision.reason,
            notes=decision.notes,
        )

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in _COLUMNS}
        d["notes"] = list(self.notes)
        return d


@dataclass
class Report:
    """Every SDPA site of every graph a backend compiled, in compile order."""

    sites: list[SiteRecord] = field(default_factory=list)
    #: Notes on the whole compile rather than one site (e.g. a rule of the spec that decided no site).
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"sites": [s.to_dict() for s in self.sites], "notes": list(self.notes)}

    @property
    def quantized(self) -> int:
        return sum(s.rewritten for s in self.sites)

    def summary(self) -> str:
        total, quantized = len(self.sites), self.quantized
        dense = Counter(s.reason.removeprefix("dense: ") for s in self.sites if not s.rewritten)
        line = f"qattn_fx: {quantized}/{total} attention sites quantized, {total - quantized} dense"
        if dense:
            line += ": " + "; ".join(f"{n}x {reason}" for reason, n in dense.most_common())
        return line

    def table(self, columns: tuple[str, ...] = _COLUMNS) -> str:
        rows = [[_cell(getattr(s, c)) for c in columns] for s in self.sites]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        fmt = lambda cells: "  ".join(v.ljust(w) for v, w in zip(cells, widths)).rstrip()  # noqa: E731
        lines = [fmt(columns), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        notes = [f"note ({s.site}): {n}" for s in self.sites for n in s.notes] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines + list(dict.fromkeys(notes)))

    def markdown(self, columns: tuple[str, ...] = _COLUMNS) -> str:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(getattr(s, c)).replace("|", "\\|") for c in columns) + " |"
                  for s in self.sites]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table() + "\n" + self.summary()


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "(" + ",".join(str(v) for v in value) + ")"
    return str(value)


# ------------------------------------------------------------------------------------------------------------------
# Debug dumps and trace artifacts
# ------------------------------------------------------------------------------------------------------------------


def debug_dir(explicit: str | os.PathLike | None) -> Path | None:
    chosen = explicit if explicit is not None else config.debug_dir
    return Path(chosen) if chosen else None


def readable(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def emit_trace_artifacts(before: str, after: str, sites: Report) -> None:
    """Structured-trace artifacts so ``tlparse`` shows the rewrite next to Dynamo's own graphs."""
    from torch._logging import trace_structured

    for name, payload, encoding in (("qattn_fx_before_rewrite", before, "string"),
                                    ("qattn_fx_after_rewrite", after, "string"),
                                    ("qattn_fx_sites", sites.to_dict(), "json")):
        trace_structured("artifact", metadata_fn=lambda n=name, e=encoding: {"name": n, "encoding": e},
                         payload_fn=lambda p=payload: p)


def write_dump(directory: Path, graph: int, before: str, after: str, sites: Report, context: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"graph_{graph}_before.py").write_text(before)
    (directory / f"graph_{graph}_after.py").write_text(after)
    (directory / f"graph_{graph}_sites.md").write_text(sites.markdown() + "\n\n" + sites.summary() + "\n")
    (directory / f"graph_{graph}_sites.json").write_text(json.dumps(sites.to_dict(), indent=1))
    (directory / "spec.json").write_text(json.dumps(context, indent=1, default=str))
