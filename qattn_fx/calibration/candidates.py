"""The attention specs a calibration tries at every site, their names, and their order in the recipe table.

A candidate is an :class:`~qattn_fx.spec.AttentionSpec` (backend, usually ``auto``, and recipe), possibly with
block sparsity (``block_sparse`` with ``cdf`` or ``top_k``; ids ``int8-1-16-1+cdf0.9``, ``int8-1-16-1+top_k0.5``;
``+target0.5``, a ``target_sparsity``, is turned into ``cdf`` candidates by :func:`qattn_fx.calibrate` through
:func:`~qattn_fx.calibration.block.calibrate_block_sparse`). Without cost data, candidates are ranked by
:func:`table_order`: the position of the first row of :data:`qattn_fx.recipes.TABLE` that accepts them, the order
``auto`` prefers (faster rows first); within a row, block-sparse candidates come first, the smallest ``keep``
(the sparsest) first.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Iterable

from .. import recipes
from ..block_sparse_spec import BlockSparse
from ..recipes import Recipe
from ..spec import DEFAULT_RECIPE, AttentionSpec
from ..validate import show

#: The default candidates, in table order: SageAttention INT8 Q/K (the default recipe), Sage FP8 Q/K, and
#: unquantized Q/K with FP8 P·V (QK16PV8: slower, more accurate).
DEFAULT_CANDIDATES: tuple[AttentionSpec, ...] = (
    AttentionSpec(recipe=DEFAULT_RECIPE),
    AttentionSpec(recipe=Recipe("fp8", "fp8", 1, 16, 1, smooth_k=True)),
    AttentionSpec(recipe=Recipe("bf16", "fp8", 0, 0, 1)),
)

_ID = re.compile(r"^(bf16|int8|fp8)-(\d+)-(\d+)-(\d+)$|^(mxfp8|nvfp4)-(fp8|mxfp8|nvfp4)$")
_SPARSE = re.compile(r"^(.*?)\+(cdf|top_k|target)([0-9.eE+-]+)$")
ID_FORMS = ("QK-Q-K-V with fp8 V (int8-1-16-1, fp8-1-16-1, bf16-0-0-1) or QK-V for block-scaled formats (mxfp8-fp8), "
            "optionally +cdfM, +top_kF or +targetS for block sparsity (int8-1-16-1+cdf0.9)")


@dataclass(frozen=True)
class Candidate:
    """One attention spec to try, with its name in tables and plots and its rank without cost data."""

    name: str
    use: AttentionSpec
    table_rank: int

    def to_dict(self) -> dict:
        return {"name": self.name, "use": self.use.to_dict(), "table_rank": self.table_rank}


def recipe_id(recipe: Recipe) -> str:
    """The short id of a recipe, as :func:`parse_id` reads it: ``int8-1-16-1``, ``bf16-0-0-1``, ``mxfp8-fp8``
    (plus ``-nosmooth`` / ``-head`` where those differ from the default)."""
    if recipe.family == "block_scaled":
        base = f"{recipe.qk_dtype}-{recipe.v_dtype}"
    else:
        base = f"{recipe.qk_dtype}-{recipe.q_block_size}-{recipe.k_block_size}-{recipe.v_block_size}"
    if recipe.smooth_k != (recipe.qk_dtype != "bf16"):
        base += "-nosmooth" if not recipe.smooth_k else "-smooth"
    if recipe.scale_scope != "tensor":
        base += f"-{recipe.scale_scope}"
    return base


def sparse_id(blocks: BlockSparse | None) -> str:
    """The suffix of a candidate with block sparsity, as :func:`parse_id` reads it: ``+cdf0.9``, ``+top_k0.5``,
    ``+target0.5``; settings other than the defaults follow (``/sinks0``, ``/nodiag``, ``/sim0.5``, ``/t<=0.5``)."""
    if blocks is None:
        return ""
    default = BlockSparse(cdf=1.0)
    value = blocks.keep if blocks.keep is not None else blocks.target_sparsity
    text = f"+{blocks.mode.replace('target_sparsity', 'target')}{value:g}"
    if blocks.sink_tiles != default.sink_tiles:
        text += f"/sinks{blocks.sink_tiles}"
    if blocks.diagonal != default.diagonal:
        text += "/nodiag"
    if blocks.similarity != default.similarity:
        text += f"/sim{blocks.similarity:g}"
    if blocks.gated:
        text += f"/t<={blocks.disabled_until_timestep:g}"
    return text


def parse_id(text: str) -> AttentionSpec:
    """An ``auto`` attention spec from a recipe id (:data:`ID_FORMS`); smoothed K for quantized Q/K; a ``+cdfM``,
    ``+top_kF`` or ``+targetS`` suffix adds ``block_sparse`` (default sinks, diagonal and similarity guard)."""
    sparse = _SPARSE.match(text.strip())
    blocks = None
    if sparse is not None:
        mode, value = sparse.group(2), sparse.group(3)
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"candidate {text!r} is invalid; valid: {ID_FORMS}") from None
        key = {"cdf": "cdf", "top_k": "top_k", "target": "target_sparsity"}[mode]
        blocks = BlockSparse(**{key: number}, where=f"candidate {text!r}: block_sparse")
        use = parse_id(sparse.group(1))
        return dataclasses.replace(use, block_sparse=blocks)
    m = _ID.match(text.strip())
    if m is None:
        raise ValueError(f"candidate {text!r} is invalid; valid: {ID_FORMS}")
    if m.group(1):
        recipe = Recipe(m.group(1), "fp8", int(m.group(2)), int(m.group(3)), int(m.group(4)), where=text)
    else:
        recipe = Recipe(m.group(5), m.group(6), where=text)
    return AttentionSpec(recipe=recipe, where=f"candidate {text!r}")


def table_order(use: AttentionSpec) -> int:
    """Index of the first row of the recipe table that accepts ``use``'s recipe for its backend (``auto``: any)."""
    for i, row in enumerate(recipes.TABLE):
        if use.recipe is not None and row.accepts(use.recipe) and use.backend in (row.backend, recipes.AUTO,
                                                                                 recipes.REFERENCE):
            return i
    return len(recipes.TABLE)


def _as_attention_spec(item: Any, i: int) -> AttentionSpec:
    where = f"candidates[{i}]"
    if isinstance(item, AttentionSpec):
        use = item
    elif isinstance(item, Recipe):
        use = AttentionSpec(recipe=item, where=where)
    elif isinstance(item, dict):
        use = AttentionSpec.from_dict(item, where=where)
    elif isinstance(item, str):
        use = parse_id(item)
    else:
        raise ValueError(f"{where}={show(item)} is invalid; valid: an AttentionSpec, a Recipe, an attention spec "
                         f"mapping, or a recipe id ({ID_FORMS})")
    if use.recipe is None:
        raise ValueError(f"{where}: a candidate needs a recipe (skip-softmax alone has no emulation to measure)")
    return use


def make_candidates(items: Iterable[Any] | None) -> tuple[Candidate, ...]:
    """Candidates from ``items`` (default :data:`DEFAULT_CANDIDATES`), sorted by table order (ties keep their
    order). Names are recipe ids, with the backend and kernel where they are not ``auto``."""
    specs = [_as_attention_spec(item, i) for i, item in enumerate(DEFAULT_CANDIDATES if items is None else items)]
    if not specs:
        raise ValueError("candidates is empty; valid: None (the defaults) or at least one attention spec")
    out, names = [], set()
    for use in specs:
        name = candidate_name(use)
        if name in names:
            raise ValueError(f"candidate {name!r} is given twice; valid: distinct attention specs")
        names.add(name)
        out.append(Candidate(name, use, table_order(use)))
    return tuple(sorted(out, key=_rank))


def candidate_name(use: AttentionSpec) -> str:
    """A candidate's name: its recipe id and block sparsity, with the backend and kernel where not ``auto``."""
    name = recipe_id(use.recipe) + sparse_id(use.block_sparse)
    if use.backend != recipes.AUTO:
        name += f"@{use.backend}"
    if use.kernel is not None:
        name += f"/{use.kernel}"
    return name


def rank(c: Candidate) -> tuple:
    """The sort key of :func:`make_candidates`."""
    return _rank(c)


def _rank(c: Candidate) -> tuple:
    """Table order; within a row, block-sparse candidates first, the sparsest (smallest keep) first."""
    blocks = c.use.block_sparse
    return (c.table_rank, 1, 0.0) if blocks is None else (c.table_rank, 0, blocks.keep or 0.0)
