"""Why each attention site ended up as it did: the site table, its summary line, and debug dumps.

``Report.to_dict()`` → ``{"sites": [{"site", "module", "layer", "role", "q_shape", "kv_shape", "dtype", "mask",
"mask_shape", "rewritten", "recipe", "kernel", "reason", "deployment", "source", "skip_softmax", "sparsity",
"block_sparse", "block_sparsity", "predicted_slower", "graph", "notes"}, ...], "notes": [...]}`` (``skip_softmax``:
the site's Skip-Softmax setting, ``sparsity``: the fraction of tiles it skipped, once measured:
:meth:`Report.record_sparsity`; ``block_sparse``: its block-sparsity setting, ``block_sparsity``: the fraction of
blocks its predictor skipped, once measured: :meth:`Report.record_block_sparsity`; ``mask``: the kind of
``attn_mask`` as the pass read it, ``none``, ``key_padding`` / ``key_bias`` (per key), ``bool`` / ``float`` (per
query or head))
(report-wide notes: rules of the spec that decided no site); ``report.markdown()`` has the same full detail.
``str(report)`` is a table that fits 120 columns: module and layer first, the recipe's short name, and a reason
that does not repeat the recipe and kernel of a quantized site (the rule that chose it and, for an emulated site,
what its deployment target would run), wrapped; ``report.table(columns, width=)`` picks other columns.
``report.summary()`` is the one line logged after each compile.

Debug dumps (``debug_dir=``, else ``qattn_fx.config.debug_dir`` / ``$QATTN_FX_DEBUG``), per compiled graph ``N``:
``graph_N_before.py`` and ``graph_N_after.py`` (readable code with shapes, strides and devices, the signature one
argument a line), ``graph_N_sites.md`` / ``.json``, and ``spec.json`` (the spec as resolved, the hardware,
versions); ``Backend.record_sparsity`` adds ``sparsity.json`` (measured Skip-Softmax sparsity per site),
``Backend.record_block_sparsity`` ``block_sparsity.json`` (blocks skipped per block-sparse site). The same
payloads are emitted as structured trace artifacts (``TORCH_TRACE=dir`` + ``tlparse``) named
``qattn_fx_before_rewrite``, ``qattn_fx_after_rewrite``, ``qattn_fx_sites``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import config
from .fx.rewrite import SiteOutcome
from .site import Deployment
from .sparsity_key import SparsityKey

#: Every field of a site, as ``to_dict()`` and ``markdown()`` give them.
_COLUMNS = ("graph", "site", "module", "layer", "role", "q_shape", "kv_shape", "dtype", "mask", "mask_shape",
            "rewritten", "recipe", "kernel", "reason", "deployment", "source", "skip_softmax", "sparsity",
            "block_sparse", "block_sparsity", "predicted_slower")
#: The columns of ``str(report)`` (``graph`` is put first when the report spans several graphs). ``q/kv``: the
#: query and key lengths; ``d``: head_dim; ``recipe``: its short name; ``reason``: for a quantized site the rule
#: (or default) that chose it plus the deployment note of an emulated site, for a dense one why. Any field of
#: :data:`_COLUMNS` is a column too, e.g. ``report.table(TABLE_COLUMNS[:5] + ("mask", "recipe"))``.
TABLE_COLUMNS = ("module", "layer", "role", "q/kv", "d", "recipe", "kernel", "reason")
#: The default width of ``str(report)``.
WIDTH = 120
_MODULE_WIDTH = 40
#: A character of a symbolic size that is more than one symbol or int (an operator, a space, a parenthesis).
_EXPRESSION = re.compile(r"[^A-Za-z0-9_-]")


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


def _site_notes(site) -> tuple[str, ...]:
    """Facts of the site worth a note whatever was decided: context parallelism, how its mask was read, an LSE
    call form."""
    notes = []
    if site.context:
        notes.append(site.context)
    if site.mask_note:
        notes.append(site.mask_note)
    if site.lse:
        notes.append("an attention op that also returns the log-sum-exp (ring attention merges partial results "
                     "by it); a quantized site returns both")
    return tuple(notes)


@dataclass(frozen=True)
class SparsityRecord:
    """One sparsity setting of a site (its Skip-Softmax, its block sparsity) as the report shows it: in full
    (``describe()``), its short name (the table's recipe cell) and the fraction it skipped (of tiles, of blocks), once
    measured."""

    setting: str
    short: str
    measured: float | None = None

    @classmethod
    def of(cls, key: SparsityKey | None) -> SparsityRecord | None:
        """The record of ``key`` (a :class:`~qattn_fx.recipes.SkipSoftmax`, a :class:`~qattn_fx.recipes.BlockSparse`),
        not measured yet; ``None`` without one."""
        return None if key is None else cls(key.describe(), key.short_name)


def _part(record: str, part: str) -> property:
    """A read-only attribute of :class:`SiteRecord`: ``part`` of its :class:`SparsityRecord` ``record``, ``None``
    where the site has none."""

    def get(site: SiteRecord):
        found = getattr(site, record)
        return None if found is None else getattr(found, part)

    return property(get, doc=f"``{record}.{part}``, ``None`` without ``{record}``.")


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
    #: Emulated sites: what the deployment target would run (``Decision.deployment``; text in :meth:`to_dict`).
    deployment: Deployment | None = None
    #: The rule (``rule 2 (layers=-1)``) or ``default`` that chose the attention spec.
    source: str = "default"
    #: ``Recipe.short_name`` of a quantized site.
    recipe_short: str | None = None
    #: The site's Skip-Softmax setting, if any, and the fraction of tiles it skipped, once measured
    #: (:meth:`Report.record_sparsity`).
    skip: SparsityRecord | None = None
    #: The label of its measured sparsity (the inserted nodes' prefix, ``blocks_0_attn1``).
    label_prefix: str = ""
    #: Where the cost data predict its kernel slower than dense, the prediction (``Decision.predicted_slower``):
    #: why ``auto`` kept it dense, or, on a quantized site, that an explicit backend runs it anyway.
    predicted_slower: str | None = None
    #: The kind of its ``attn_mask`` as the pass read it (``Site.mask``) and that mask's shape.
    mask: str = "none"
    mask_shape: list | None = None
    #: The site's block-sparsity setting, if any, and the fraction of blocks its predictor skipped, once measured
    #: (:meth:`Report.record_block_sparsity`).
    blocks: SparsityRecord | None = None

    #: :attr:`skip` and :attr:`blocks` by the names of :meth:`to_dict` and the table: the setting in full
    #: (``SkipSoftmax.describe()``), its short name, the fraction measured.
    skip_softmax = _part("skip", "setting")
    skip_short = _part("skip", "short")
    sparsity = _part("skip", "measured")
    block_sparse = _part("blocks", "setting")
    block_short = _part("blocks", "short")
    block_sparsity = _part("blocks", "measured")

    @classmethod
    def from_outcome(cls, graph: int, outcome: SiteOutcome) -> "SiteRecord":
        site, decision = outcome.site, outcome.decision
        recipe = decision.recipe if decision.quantized else None
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
            recipe=recipe.name if recipe else None,
            kernel=decision.kernel,
            reason=decision.reason,
            notes=decision.notes + _site_notes(site),
            deployment=decision.deployment,
            source=decision.source,
            recipe_short=(recipe.short_name if recipe else "bf16" if decision.skip_softmax else None),
            skip=SparsityRecord.of(decision.skip_softmax) if decision.quantized else None,
            label_prefix=outcome.prefix,
            predicted_slower=decision.predicted_slower,
            mask=site.mask,
            mask_shape=None if site.mask_shape is None else _shape(site.mask_shape),
            blocks=SparsityRecord.of(decision.block_sparse) if decision.quantized else None,
        )

    @property
    def label(self) -> str:
        """How notes name the site: its module path, else its graph node."""
        return self.module or self.site

    def compact_reason(self) -> str:
        """The reason without what the recipe and kernel columns say: for a quantized site the rule that chose it
        (and the deployment note of an emulated one), for a dense one the whole reason."""
        if not self.rewritten:
            return self.reason
        skipped = "".join(f"; skipped {100 * found.measured:.1f}% of {unit}"
                          for found, unit in ((self.skip, "tiles"), (self.blocks, "blocks"))
                          if found is not None and found.measured is not None)
        return self.source + skipped + (f"; {self.deployment}" if self.deployment else "")

    def cell(self, column: str) -> str:
        """One cell of ``Report.table``."""
        if column == "module":
            return _fit_path(self.module, _MODULE_WIDTH)
        if column == "q/kv":  # a symbolic length may be an expression ("4*s0 + 10", "((s0//2))"): spaces then
            q, kv = _cell(_dim(self.q_shape, -2)), _cell(_dim(self.kv_shape, -2))  # keep the separator apart
            return f"{q} / {kv}" if _EXPRESSION.search(q + kv) else f"{q}/{kv}"
        if column == "d":
            return _cell(_dim(self.q_shape, -1))
        if column == "mask":
            return "-" if self.mask == "none" else self.mask
        if column == "recipe":
            return _cell(self.recipe_short) + "".join(f", {found.short}" for found in (self.skip, self.blocks) if found)
        if column == "reason":
            return self.compact_reason()
        if column not in _COLUMNS:
            raise ValueError(f"column={column!r} is invalid; valid: {', '.join(TABLE_COLUMNS + _COLUMNS)}")
        return _cell(getattr(self, column))

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in _COLUMNS}
        d["deployment"] = None if self.deployment is None else str(self.deployment)
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

    def record_sparsity(self, measurement) -> "Report":
        """Put the sparsity of a :func:`qattn_fx.skip_softmax.measure` block (calls of the compiled model inside
        it) into the sites it measured (by their label, the inserted nodes' prefix); returns ``self``."""
        return self._record("skip", measurement)

    def record_block_sparsity(self, measurement) -> "Report":
        """Put the block sparsity of a :func:`qattn_fx.block_sparse.measure` block (calls of the compiled model
        inside it) into the block-sparse sites it measured (by their label, the inserted nodes' prefix); returns
        ``self``."""
        return self._record("blocks", measurement)

    def _record(self, kind: str, measurement) -> "Report":
        """Put ``measurement.sparsity()`` (by label) into the ``kind`` record (``skip``, ``blocks``) of each site
        that has one and was measured."""
        measured = measurement.sparsity()
        for i, s in enumerate(self.sites):
            found = getattr(s, kind)
            if found is not None and s.label_prefix in measured:
                found = dataclasses.replace(found, measured=measured[s.label_prefix])
                self.sites[i] = dataclasses.replace(s, **{kind: found})
        return self

    def deployed(self) -> dict[str, tuple[int, int]]:
        """For the emulated sites (those with a ``deployment``): per deployment arch, how many of them the spec would
        quantize there without emulation, and of how many (``{"sm_90": (0, 4), "sm_100": (4, 4)}``), from each
        site's :class:`~qattn_fx.site.Deployment` clauses."""
        counts: dict[str, tuple[int, int]] = {}
        for s in self.sites:
            if not (s.rewritten and s.deployment):
                continue
            for clause in s.deployment.clauses:
                done, of = counts.get(clause.arch, (0, 0))
                counts[clause.arch] = (done + clause.quantized, of + 1)
        return counts

    def summary(self) -> str:
        """One line: sites quantized (and how many of them an explicit backend runs although the cost data predict
        them slower than dense; for emulated sites, how many the spec would quantize on each deployment arch where
        that is fewer: ``4/4 attention sites quantized (emulated; on sm_90 the spec would quantize 0 of 4)``), sites
        dense, and the dense sites' reasons by count."""
        total, quantized = len(self.sites), self.quantized
        dense = Counter(s.reason.removeprefix("dense: ") for s in self.sites if not s.rewritten)
        slower = sum(s.rewritten and s.predicted_slower is not None for s in self.sites)
        line = f"qattn_fx: {quantized}/{total} attention sites quantized"
        emulated = sum(s.rewritten and s.deployment is not None for s in self.sites)
        if emulated:
            fewer = [(arch, done, of) for arch, (done, of) in self.deployed().items() if done < of]
            said = ", ".join(f"on {arch} {'the spec would quantize ' if i == 0 else ''}{done} of {of}"
                             for i, (arch, done, of) in enumerate(fewer))
            line += f" ({'emulated' if emulated == quantized else f'{emulated} emulated'}"
            line += f"; {said})" if said else ")"
        if slower:
            line += f" ({slower} predicted slower than dense: auto would keep them dense)"
        line += f", {total - quantized} dense"
        if dense:
            line += ": " + "; ".join(f"{n}x {reason}" for reason, n in dense.most_common())
        return line

    def table(self, columns: tuple[str, ...] | None = None, *, width: int | None = WIDTH) -> str:
        """The site table: ``columns`` (default :data:`TABLE_COLUMNS`, led by ``graph`` when the sites come from
        several graphs) with the last column wrapped so that lines fit ``width`` characters (``None``: one line a
        site), then the notes (also wrapped). Cells: see :meth:`SiteRecord.cell`; the full text of every field is
        in :meth:`to_dict` and :meth:`markdown`."""
        if columns is None:
            columns = TABLE_COLUMNS
            if len({s.graph for s in self.sites}) > 1:
                columns = ("graph",) + columns
        rows = [[s.cell(c) for c in columns] for s in self.sites]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        if width is not None:
            fixed = sum(widths[:-1]) + 2 * (len(columns) - 1)
            widths[-1] = max(min(widths[-1], width - fixed), len(columns[-1]), 20)
        indent = sum(widths[:-1]) + 2 * (len(columns) - 1)

        def fmt(cells: list[str]) -> list[str]:
            head = "  ".join(v.ljust(w) for v, w in zip(cells[:-1], widths))
            last = textwrap.wrap(cells[-1], widths[-1], break_on_hyphens=False) or [""]
            lines = [(head + "  " + last[0] if head else last[0]).rstrip()]
            return lines + [" " * indent + part for part in last[1:]]

        lines = fmt(list(columns)) + ["  ".join("-" * w for w in widths)]
        for r in rows:
            lines += fmt(r)
        notes = [f"note ({s.label}): {n}" for s in self.sites for n in s.notes] + [f"note: {n}" for n in self.notes]
        for note in dict.fromkeys(notes):
            lines += textwrap.wrap(note, width, subsequent_indent="  ") if width else [note]
        return "\n".join(lines)

    def markdown(self, columns: tuple[str, ...] = _COLUMNS) -> str:
        """Every field of every site (full recipe names and reasons), as a markdown table."""
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(getattr(s, c)).replace("|", "\\|") for c in columns) + " |"
                  for s in self.sites]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table() + "\n" + self.summary()


def _dim(shape: list, index: int):
    return shape[index] if len(shape) >= -index else None


def _fit_path(path: str, limit: int) -> str:
    """A module path of at most ``limit`` characters where it has more: its start, ``...``, and its last two
    components (layer and module), which together tell sites apart (``text_transformer_blo...10.self_attention``
    and ``visual_transformer_b...10.self_attention``)."""
    if not path:
        return "-"
    if len(path) <= limit:
        return path
    parts = path.split(".")
    tail = ".".join(parts[-2:])
    if len(tail) > limit - 4:
        tail = parts[-1][-(limit - 3):]
    head = path[:max(limit - 3 - len(tail), 0)].rstrip(".")
    return head + "..." + tail


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


def readable(gm: torch.fx.GraphModule, width: int = WIDTH) -> str:
    """``gm`` as readable code (shapes, strides, devices), with every ``def`` line longer than ``width`` (the
    signature, one parameter per graph input) wrapped to one parameter a line."""
    text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    return "\n".join(_wrap_def(line, width) for line in text.split("\n"))


_DEF = re.compile(r"^(\s*)def (\w+)\((.*)\)(\s*(?:->[^:]*)?):\s*$")


def _wrap_def(line: str, width: int) -> str:
    match = _DEF.match(line) if len(line) > width else None
    if match is None:
        return line
    indent, name, params, ret = match.groups()
    parts = _split_params(params)
    inner = indent + " " * 4
    return f"{indent}def {name}(\n" + "".join(f"{inner}{p},\n" for p in parts) + f"{indent}){ret}:"


def _split_params(text: str) -> list[str]:
    """Split a parameter list at its top-level commas (not inside brackets or string annotations)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


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


def write_sparsity(directory: Path, report: Report, measurement, *, blocks: bool = False) -> None:
    """``sparsity.json``: per measured site label, its module, the Skip-Softmax setting and the tiles skipped; with
    ``blocks``, ``block_sparsity.json``: the block-sparsity setting and the blocks skipped (``tiles``: all blocks,
    ``calls``: predictor calls)."""
    directory.mkdir(parents=True, exist_ok=True)
    modules = {s.label_prefix: s for s in report.sites if s.label_prefix}
    key = "block_sparse" if blocks else "skip_softmax"
    payload = {label: {"module": modules[label].module if label in modules else None,
                       key: getattr(modules[label], key) if label in modules else None,
                       "skipped": m.skipped, "tiles": m.tiles, "calls": m.calls, "sparsity": m.sparsity}
               for label, m in measurement.sites.items()}
    (directory / ("block_sparsity.json" if blocks else "sparsity.json")).write_text(json.dumps(payload, indent=1))
