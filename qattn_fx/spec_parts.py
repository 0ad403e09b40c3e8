"""The parts of a spec (:mod:`qattn_fx.spec`): :class:`AttentionSpec` (what to run), :class:`Match` (which call
sites) and :class:`Rule` (a match and what to use there, an attention spec or ``"dense"``), with their checks.

Each dataclass takes a keyword-only ``where`` (not a field, :class:`~qattn_fx.validate.Checked`): its path in a spec,
for error messages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Union

from . import kernels, recipes
from .recipes import ALL_BACKENDS, AUTO, REFERENCE, BlockSparse, Recipe, SkipSoftmax
from .validate import (Checked, check_choice, check_int, check_items, check_str, invalid, path_at, reject_unknown,
                       show)

ROLES = ("self", "cross", "joint")
DENSE = "dense"
#: Backends that take ``recipe=None`` with ``skip_softmax`` (dense BF16 attention + Skip-Softmax: trtllm-gen's, or
#: the reference's emulation).
DENSE_SKIP_BACKENDS = ("TRTLLM_ATTN", "TRTLLM", AUTO, REFERENCE)


class SpecWarning(UserWarning):
    """A spec was read in one of two plausible ways; the message says which and how to write the other."""


#: SageAttention INT8 Q/K (1 token per Q scale, 16 per K scale), per-channel FP8 V, smoothed K: the VisualGen default.
DEFAULT_RECIPE = Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)


@dataclass(frozen=True)
class AttentionSpec(Checked):
    """Which recipe to run and through which backend (``auto``: the best kernel available for the site).

    ``recipe=None`` is only meaningful with ``skip_softmax`` (vLLM-Omni TRTLLM_ATTN / TensorRT-LLM VisualGen TRTLLM:
    dense BF16 attention + Skip-Softmax; no kernel in qattn_fx runs it, the reference emulates it).
    ``skip_softmax`` (:class:`~qattn_fx.recipes.SkipSoftmax`, :mod:`qattn_fx.skip_softmax`) runs on top of the
    recipe where a kernel of the backend implements it (TRITON: gluon_sage on sm_90; TRTLLM, TRTLLM_ATTN:
    trtllm-gen on sm_100) and in emulation.
    ``block_sparse`` (:class:`~qattn_fx.recipes.BlockSparse`, :mod:`qattn_fx.block_sparse`): visit only the blocks
    of 128 query rows x 128 keys a predictor picks before Q·Kᵀ, on top of a recipe of the ``scaled`` family
    (int8/fp8/bf16 Q/K, fp8 V), where a kernel of the backend implements it (``Requirements.block_sparse``) and in
    emulation; it composes with ``skip_softmax`` (which tests the visited blocks).
    ``kernel`` pins one implementation of the recipe (e.g. ``triton_sage`` where ``auto`` would take
    ``gluon_sage``); like an explicit backend it never falls back: a site it cannot serve raises.
    ``recipe``, ``skip_softmax`` and ``block_sparse`` may be given as mappings. ``where`` (keyword only, not a
    field): the spec's place in a spec (``spec.rules[0].use``), for error messages.
    """

    backend: str = AUTO
    recipe: Recipe | None = DEFAULT_RECIPE
    skip_softmax: SkipSoftmax | None = None
    kernel: str | None = None
    block_sparse: BlockSparse | None = None

    def _check(self, where: str) -> None:
        backend = check_choice(path_at(where, "backend"), self.backend, ALL_BACKENDS)
        self._read_part(where, "recipe", Recipe, "a recipe mapping, or null with skip_softmax")
        self._read_part(where, "skip_softmax", SkipSoftmax, "a skip_softmax mapping, or null")
        self._read_part(where, "block_sparse", BlockSparse, "a block_sparse mapping, or null")
        if self.recipe is None:
            if self.skip_softmax is None:
                raise ValueError(f"{path_at(where, 'recipe')}=None is invalid without skip_softmax; valid: a recipe, or "
                                 "null with skip_softmax on TRTLLM_ATTN (use \"dense\" for dense attention)")
            if backend not in DENSE_SKIP_BACKENDS:
                raise ValueError(f"{path_at(where, 'backend')}={show(backend)} is invalid with "
                                 f"{path_at(where, 'recipe')}=None; valid: {', '.join(DENSE_SKIP_BACKENDS)} (the "
                                 "backends running bf16 + skip_softmax without a recipe)")
        else:
            recipes.validate(backend, self.recipe, where=path_at(where, "recipe"))
        if self.skip_softmax is not None:
            valid = recipes.skip_softmax_backends()
            if backend not in valid:
                raise ValueError(f"{path_at(where, 'skip_softmax')} is not accepted for backend={backend!r}; "
                                 f"valid: {', '.join(valid)}")
        if self.block_sparse is not None:
            self._check_block_sparse(backend, where)

        if self.kernel is not None:
            kernels, path = self.kernels(), path_at(where, "kernel")
            check_str(path, self.kernel, f"a kernel name ({', '.join(kernels) or 'none'})")
            if self.kernel not in kernels:
                raise ValueError(f"{path}={self.kernel!r} does not implement {self.describe_recipe()} via backend "
                                 f"{backend!r}; valid: {', '.join(kernels) or 'none'} (the kernels of this backend "
                                 "and recipe)")

    def _read_part(self, where: str, name: str, cls: type[Checked], valid: str) -> None:
        """The field ``name``: ``None``, a ``cls``, or a mapping read as one (its errors under ``where.name``);
        anything else is invalid (``valid`` says what is)."""
        path, value = path_at(where, name), getattr(self, name)
        if isinstance(value, dict):
            object.__setattr__(self, name, cls.from_dict(value, where=path))
        elif value is not None and not isinstance(value, cls):
            raise invalid(path, value, valid)

    def _check_block_sparse(self, backend: str, where: str) -> None:
        """``block_sparse`` needs a recipe of the scaled family and a backend with a kernel that visits block
        lists (or ``auto`` / ``REFERENCE``)."""
        path = path_at(where, "block_sparse")
        if self.recipe is None:
            raise ValueError(f"{path} is invalid with {path_at(where, 'recipe')}=None (bf16 attention with "
                             "skip_softmax has no block lists); valid: a recipe of the scaled family (int8/fp8/bf16 "
                             "Q/K, fp8 V), e.g. {qk_dtype: bf16, v_dtype: fp8}")
        if self.recipe.family != "scaled":
            raise ValueError(f"{path} is not accepted with recipe {self.recipe.name!r} ({self.recipe.family} family); "
                             "valid: recipes of the scaled family (int8/fp8/bf16 Q/K, fp8 V)")
        valid = recipes.block_sparse_backends()
        if backend not in valid:
            raise ValueError(f"{path} is not accepted for backend={backend!r}; valid: {', '.join(valid)} (backends "
                             f"with a kernel that visits block lists: {kernels_with_block_sparsity()})")

    def sparsity(self) -> str:
        """The sparsity settings after a recipe's name: ``, skip-softmax λ=0.01, block-sparse cdf 0.9, ...``."""
        return (f", {self.skip_softmax.describe()}" if self.skip_softmax else "") + (
            f", {self.block_sparse.describe()}" if self.block_sparse else "")

    def describe_recipe(self) -> str:
        """The recipe's name, with the sparsity settings: ``int8 Q/K 1/16, ..., skip-softmax λ=0.01``."""
        what = self.recipe.name if self.recipe else "bf16"
        return what + self.sparsity()

    def kernels(self) -> tuple[str, ...]:
        """The kernels implementing this backend and recipe (what ``kernel`` may name; whether one runs
        ``skip_softmax`` is the policy's question, per site). No kernel in qattn_fx runs bf16 + skip-softmax
        (``recipe=None``)."""
        if self.backend == REFERENCE:
            return ("reference",)
        if self.recipe is None:
            return ()
        return tuple(dict.fromkeys(req.kernel for row in recipes.matching_rows(self.backend, self.recipe)
                                   for req in row.implementations if req.kernel))

    def describe(self) -> str:
        what = self.recipe.name if self.recipe else "bf16"
        kernel = f" (kernel {self.kernel})" if self.kernel else ""
        return f"{what}{self.sparsity()} via {self.backend}{kernel}"

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"backend": self.backend, "recipe": self.recipe.to_dict() if self.recipe else None}
        if self.skip_softmax is not None:
            out["skip_softmax"] = self.skip_softmax.to_dict()
        if self.block_sparse is not None:
            out["block_sparse"] = self.block_sparse.to_dict()
        if self.kernel is not None:
            out["kernel"] = self.kernel
        return out

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "attention spec") -> "AttentionSpec":
        reject_unknown(data, {"backend", "recipe", "skip_softmax", "block_sparse", "kernel"}, where)
        return cls(backend=data.get("backend", AUTO), recipe=data.get("recipe", DEFAULT_RECIPE),
                   skip_softmax=data.get("skip_softmax"), kernel=data.get("kernel"),
                   block_sparse=data.get("block_sparse"), where=where)


def kernels_with_block_sparsity() -> str:
    """The kernels that visit block lists (``KernelInfo.block_sparse``), comma-joined."""
    return kernels.names_with("block_sparse")


Use = Union[AttentionSpec, Literal["dense"]]


def parse_use(value: Any, where: str) -> Use:
    if isinstance(value, str) and value == DENSE:
        return DENSE
    if isinstance(value, AttentionSpec):
        return value
    if isinstance(value, dict):
        return AttentionSpec.from_dict(value, where=where)
    raise invalid(where, value, "\"dense\" or an attention spec mapping")


def use_to_dict(use: Use) -> Any:
    return DENSE if use == DENSE else use.to_dict()


# ------------------------------------------------------------------------------------------------------------------
# Matching call sites
# ------------------------------------------------------------------------------------------------------------------


_LAYER = "an int or a slice string like '2:5' or '-4:'"


def _parse_layer_item(path: str, item: Any) -> int | str:
    if isinstance(item, int) and not isinstance(item, bool):
        return item
    if isinstance(item, str) and item.count(":") == 1:
        try:
            [int(x) for x in item.split(":") if x.strip()]
        except ValueError:
            pass
        else:
            return item.replace(" ", "")
    raise invalid(path, item, _LAYER)


def layer_selected(items: tuple[int | str, ...], layer: int, num_layers: int | None) -> bool:
    """Whether ``layer`` is among ``items`` (ints, negative from the last layer; or ``start:stop`` slices)."""
    for item in items:
        if isinstance(item, int):
            if item >= 0 and item == layer:
                return True
            if item < 0 and num_layers is not None and num_layers + item == layer:
                return True
        else:
            start, stop = (int(x) if x else None for x in item.split(":"))
            if num_layers is None and ((start or 0) < 0 or (stop or 0) < 0 or stop is None):
                continue  # a slice open at the end or negative needs the layer count
            total = num_layers if num_layers is not None else max(layer + 1, stop or 0)
            if layer in range(total)[slice(start, stop)]:
                return True
    return False


@dataclass(frozen=True)
class Match(Checked):
    """Conditions on a call site; all given ones must hold.

    ``role``: any of self/cross/joint; ``module``: an fnmatch glob on the module path (``blocks.*.attn2``);
    ``layers``: layer indices (negative count from the last layer) or ``"start:stop"`` slices;
    ``head_dim``: allowed head dims; ``min_q_len`` / ``min_kv_len``: minimum query / key lengths.
    ``role``, ``layers`` and ``head_dim`` take one item or a non-empty list (stored as a tuple); ``None``: any.
    ``where`` (keyword only, not a field): the match's place in a spec, for error messages.
    """

    WHERE = "match"

    role: tuple[str, ...] | None = None
    module: str | None = None
    layers: tuple[int | str, ...] | None = None
    head_dim: tuple[int, ...] | None = None
    min_q_len: int | None = None
    min_kv_len: int | None = None

    def _check(self, where: str) -> None:
        if self.role is not None:
            object.__setattr__(self, "role", check_items(
                path_at(where, "role"), self.role, lambda path, r: check_choice(path, r, ROLES), ", ".join(ROLES)))
        if self.layers is not None:
            object.__setattr__(self, "layers", check_items(path_at(where, "layers"), self.layers, _parse_layer_item,
                                                            _LAYER))
        if self.head_dim is not None:
            object.__setattr__(self, "head_dim", check_items(
                path_at(where, "head_dim"), self.head_dim, lambda path, d: check_int(path, d, 1), "an int >= 1"))
        for name in ("min_q_len", "min_kv_len"):
            if getattr(self, name) is not None:
                check_int(path_at(where, name), getattr(self, name), 0)
        if self.module is not None:
            check_str(path_at(where, "module"), self.module, "a glob string like 'blocks.*.attn1'")

    def describe(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, tuple):
                value = ",".join(str(v) for v in value)
            parts.append(f"{f.name}={value}")
        return ", ".join(parts) or "any site"

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class Rule(Checked):
    """If ``match`` holds for a site, use ``use`` (an attention spec, or ``"dense"``); either may be a mapping.

    ``where`` (keyword only, not a field): the rule's place in a spec, for error messages.
    """

    WHERE = "rule"

    match: Match
    use: Use

    def _check(self, where: str) -> None:
        if not isinstance(self.match, Match):
            object.__setattr__(self, "match", Match.from_dict(self.match, where=path_at(where, "match")))
        object.__setattr__(self, "use", parse_use(self.use, path_at(where, "use")))

    def to_dict(self) -> dict:
        return {"match": self.match.to_dict(), "use": use_to_dict(self.use)}

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "rule") -> "Rule":
        reject_unknown(data, {"match", "use"}, where)
        if "use" not in data:
            raise ValueError(f"{where} needs 'use' (\"dense\" or an attention spec)")
        return cls(data.get("match", {}), data["use"], where=where)
