"""The spec a user writes: a default attention spec and ordered rules over attention call sites.

Canonical form (what :meth:`Spec.to_dict` returns)::

    {
      "default": {"backend": "auto",
                  "recipe": {"qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": 1, "k_block_size": 16,
                             "v_block_size": 1, "smooth_k": true, "scale_scope": "tensor"}},
      "rules": [
        {"match": {"role": ["cross"]}, "use": "dense"},
        {"match": {"layers": [0, "-2:"]}, "use": {"backend": "auto", "recipe": {...}}}
      ]
    }

:meth:`Spec.from_dict` also accepts, unchanged, the two seed formats:

* TensorRT-LLM VisualGen ``attention_config`` — ``{"backend": "TRTLLM", "quant_attention_config": {...},
  "sparse_attention_config": {"algorithm": "skip_softmax", "threshold_scale_factor" | "target_sparsity": x}}``
  (optionally wrapped in ``{"attention_config": ...}``); neither config means dense, a sparse config alone dense
  BF16 + Skip-Softmax (``recipe=None``).
* vLLM-Omni ``--diffusion-attention-config`` — ``{"default": {...}, "per_role": {"cross": {...}}}`` whose entries
  are a backend name or ``{"backend", "quant": {"dtype_qk", "q_block_size", "k_block_size"}, "skip_softmax"}``;
  per-role entries become role rules. Dense vLLM backends (TORCH_SDPA, FLASH_ATTN, CUDNN_ATTN, FLASHINFER_ATTN)
  and ``TRTLLM_ATTN`` without ``quant``/``skip_softmax`` mean dense. ``{"default": {"backend": "TRTLLM_ATTN"}}``
  reads both ways (canonical: the default recipe on TRTLLM_ATTN); it is read as vLLM-Omni (dense) with a
  :class:`SpecWarning` saying how to write the other meaning.

Unknown keys anywhere are errors; every recipe is validated against its backend at construction. Every malformed
spec raises ``ValueError`` naming the path of the bad value (``spec.rules[0].match.head_dim``,
``attention_config.quant_attention_config.q_block_size``, ``per_role['cross'].quant.dtype_qk``), the value and
what is valid; the dataclasses take a keyword-only ``where`` (not a field) giving that path, and their direct
construction uses a generic one (``match.role``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import KW_ONLY, InitVar, dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from . import recipes
from .recipes import ALL_BACKENDS, AUTO, REFERENCE, Recipe, SkipSoftmax
from .validate import (check_choice, check_int, check_items, check_list, check_mapping, check_str, invalid, path_at,
                       reject_unknown, show, wrong_type)

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
class AttentionSpec:
    """Which recipe to run and through which backend (``auto``: the best kernel available for the site).

    ``recipe=None`` is only meaningful with ``skip_softmax`` (vLLM-Omni TRTLLM_ATTN / TensorRT-LLM VisualGen TRTLLM:
    dense BF16 attention + Skip-Softmax; no kernel in qattn_fx runs it, the reference emulates it).
    ``skip_softmax`` (:class:`~qattn_fx.recipes.SkipSoftmax`, :mod:`qattn_fx.skip_softmax`) runs on top of the
    recipe where a kernel of the backend implements it (TRITON: gluon_sage on sm_90; TRTLLM, TRTLLM_ATTN:
    trtllm-gen on sm_100) and in emulation.
    ``kernel`` pins one implementation of the recipe (e.g. ``triton_sage`` where ``auto`` would take
    ``gluon_sage``); like an explicit backend it never falls back: a site it cannot serve raises.
    ``recipe`` and ``skip_softmax`` may be given as mappings. ``where`` (keyword only, not a field): the spec's
    place in a spec (``spec.rules[0].use``), for error messages.
    """

    backend: str = AUTO
    recipe: Recipe | None = DEFAULT_RECIPE
    skip_softmax: SkipSoftmax | None = None
    kernel: str | None = None
    _: KW_ONLY
    where: InitVar[str] = ""

    def __post_init__(self, where: str) -> None:
        backend = check_choice(path_at(where, "backend"), self.backend, ALL_BACKENDS)
        if isinstance(self.recipe, dict):
            object.__setattr__(self, "recipe", Recipe.from_dict(self.recipe, where=path_at(where, "recipe")))
        elif self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise invalid(path_at(where, "recipe"), self.recipe, "a recipe mapping, or null with skip_softmax")
        if isinstance(self.skip_softmax, dict):
            object.__setattr__(self, "skip_softmax",
                               SkipSoftmax.from_dict(self.skip_softmax, where=path_at(where, "skip_softmax")))
        elif self.skip_softmax is not None and not isinstance(self.skip_softmax, SkipSoftmax):
            raise invalid(path_at(where, "skip_softmax"), self.skip_softmax, "a skip_softmax mapping, or null")
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

        if self.kernel is not None:
            kernels, path = self.kernels(), path_at(where, "kernel")
            check_str(path, self.kernel, f"a kernel name ({', '.join(kernels) or 'none'})")
            if self.kernel not in kernels:
                raise ValueError(f"{path}={self.kernel!r} does not implement {self.describe_recipe()} via backend "
                                 f"{backend!r}; valid: {', '.join(kernels) or 'none'} (the kernels of this backend "
                                 "and recipe)")

    def describe_recipe(self) -> str:
        """The recipe's name, with the skip-softmax setting: ``int8 Q/K 1/16, ..., skip-softmax λ=0.01``."""
        what = self.recipe.name if self.recipe else "bf16"
        return what + (f", {self.skip_softmax.describe()}" if self.skip_softmax else "")

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
        extra = f", {self.skip_softmax.describe()}" if self.skip_softmax else ""
        kernel = f" (kernel {self.kernel})" if self.kernel else ""
        return f"{what}{extra} via {self.backend}{kernel}"

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"backend": self.backend, "recipe": self.recipe.to_dict() if self.recipe else None}
        if self.skip_softmax is not None:
            out["skip_softmax"] = self.skip_softmax.to_dict()
        if self.kernel is not None:
            out["kernel"] = self.kernel
        return out

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "attention spec") -> "AttentionSpec":
        reject_unknown(data, {"backend", "recipe", "skip_softmax", "kernel"}, where)
        return cls(backend=data.get("backend", AUTO), recipe=data.get("recipe", DEFAULT_RECIPE),
                   skip_softmax=data.get("skip_softmax"), kernel=data.get("kernel"), where=where)


Use = Union[AttentionSpec, Literal["dense"]]


def _parse_use(value: Any, where: str) -> Use:
    if isinstance(value, str) and value == DENSE:
        return DENSE
    if isinstance(value, AttentionSpec):
        return value
    if isinstance(value, dict):
        return AttentionSpec.from_dict(value, where=where)
    raise invalid(where, value, "\"dense\" or an attention spec mapping")


def _use_to_dict(use: Use) -> Any:
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
class Match:
    """Conditions on a call site; all given ones must hold.

    ``role``: any of self/cross/joint; ``module``: an fnmatch glob on the module path (``blocks.*.attn2``);
    ``layers``: layer indices (negative count from the last layer) or ``"start:stop"`` slices;
    ``head_dim``: allowed head dims; ``min_q_len`` / ``min_kv_len``: minimum query / key lengths.
    ``role``, ``layers`` and ``head_dim`` take one item or a non-empty list (stored as a tuple); ``None``: any.
    ``where`` (keyword only, not a field): the match's place in a spec, for error messages.
    """

    role: tuple[str, ...] | None = None
    module: str | None = None
    layers: tuple[int | str, ...] | None = None
    head_dim: tuple[int, ...] | None = None
    min_q_len: int | None = None
    min_kv_len: int | None = None
    _: KW_ONLY
    where: InitVar[str] = "match"

    def __post_init__(self, where: str) -> None:
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

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "match") -> "Match":
        reject_unknown(data, {f.name for f in dataclasses.fields(cls)}, where)
        return cls(**data, where=where)


@dataclass(frozen=True)
class Rule:
    """If ``match`` holds for a site, use ``use`` (an attention spec, or ``"dense"``); either may be a mapping.

    ``where`` (keyword only, not a field): the rule's place in a spec, for error messages.
    """

    match: Match
    use: Use
    _: KW_ONLY
    where: InitVar[str] = "rule"

    def __post_init__(self, where: str) -> None:
        if not isinstance(self.match, Match):
            object.__setattr__(self, "match", Match.from_dict(self.match, where=path_at(where, "match")))
        object.__setattr__(self, "use", _parse_use(self.use, path_at(where, "use")))

    def to_dict(self) -> dict:
        return {"match": self.match.to_dict(), "use": _use_to_dict(self.use)}

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "rule") -> "Rule":
        reject_unknown(data, {"match", "use"}, where)
        if "use" not in data:
            raise ValueError(f"{where} needs 'use' (\"dense\" or an attention spec)")
        return cls(data.get("match", {}), data["use"], where=where)


# ------------------------------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A default for every attention site plus ordered rules; the first matching rule wins."""

    default: Use = field(default_factory=AttentionSpec)
    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", _parse_use(self.default, "spec.default"))
        rules = check_list("spec.rules", self.rules)
        object.__setattr__(self, "rules", tuple(
            r if isinstance(r, Rule) else Rule.from_dict(r, where=f"spec.rules[{i}]") for i, r in enumerate(rules)))

    def to_dict(self) -> dict:
        return {"default": _use_to_dict(self.default), "rules": [r.to_dict() for r in self.rules]}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "Spec":
        """Canonical form, TensorRT-LLM ``attention_config``, or vLLM-Omni ``--diffusion-attention-config``."""
        check_mapping("spec", data, "a mapping (canonical, TensorRT-LLM attention_config or vLLM-Omni diffusion "
                                     "attention config)")
        if "attention_config" in data:
            reject_unknown(data, {"attention_config"}, "spec")
            return _from_tensorrt_llm(data["attention_config"])
        if "quant_attention_config" in data or ("backend" in data and "default" not in data):
            return _from_tensorrt_llm(data)
        if _looks_like_vllm(data):
            return _from_vllm_omni(data)
        reject_unknown(data, {"default", "rules"}, "spec")
        return cls(default=data.get("default", AttentionSpec()), rules=data.get("rules", []))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_file(cls, path: str | Path) -> "Spec":
        """A ``.json``, ``.yaml`` or ``.yml`` file in any accepted format (another suffix is read as JSON).

        ``ValueError`` for a path that names no readable file: ``no such spec file: 'x.json'``, a directory (``""``
        is one), a name the system refuses."""
        if not isinstance(path, (str, Path)):
            raise wrong_type("path", path, "a str or a Path naming a .json/.yaml/.yml file")
        if str(path) == "":
            raise ValueError("spec path '' is empty; valid: the path of a .json, .yaml or .yml spec file")
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ValueError(f"no such spec file: {show(str(path))}") from None
        except IsADirectoryError:
            raise ValueError(f"spec path {show(str(path))} is a directory; valid: the path of a .json, .yaml or "
                             ".yml spec file") from None
        except OSError as e:  # a name too long, no permission, ...
            raise ValueError(f"spec file {show(str(path))} cannot be read: {e.strerror or e}") from None
        if path.suffix in (".yaml", ".yml"):
            return cls.from_yaml(text)
        return cls.from_json(text)

    @classmethod
    def from_text(cls, text: str) -> "Spec":
        """A spec written as JSON or YAML text (JSON is tried first; what it cannot read is read as YAML)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return cls.from_yaml(text)
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, value: "Spec | dict | str | Path | None") -> "Spec":
        """The spec that ``qattn_fx.backend(spec)`` and the other entry points take: ``None`` (the default
        :class:`Spec`), a :class:`Spec`, a mapping (:meth:`from_dict`), a :class:`~pathlib.Path` (:meth:`from_file`)
        or a ``str``. A ``str`` is spec *text* (:meth:`from_text`, JSON or YAML) when it starts with ``{`` (leading
        whitespace aside) or holds a newline, and otherwise the path of a spec file: ``'{"default": "dense"}'``
        and ``"default: dense\\n"`` are specs, ``"spec.yaml"`` is a file.

        ``TypeError`` for another type; ``ValueError`` for a bad spec, text that does not parse, or a path that
        names no readable file (``no such spec file: 'x.json'``)."""
        if value is None:
            return cls()
        if isinstance(value, Spec):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, Path):
            return cls.from_file(value)
        if isinstance(value, str):
            if is_spec_text(value):
                return cls.from_text(value)
            try:
                return cls.from_file(value)
            except ValueError as e:
                if not str(e).startswith("no such spec file") or ":" not in value:
                    raise
                raise ValueError(f"{e} (a str is read as spec text when it starts with '{{' or holds a "
                                 "newline, else as a path)") from None
        raise wrong_type("spec", value, "a Spec, a mapping, JSON or YAML text, a path to a .json/.yaml/.yml file, or "
                                        "None")

    @classmethod
    def from_yaml(cls, text: str) -> "Spec":
        try:
            import yaml
        except ImportError as e:  # pragma: no cover - pyyaml is a dependency
            raise ImportError("reading YAML specs needs PyYAML: pip install pyyaml") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"spec YAML does not parse: {e}") from e
        return cls.from_dict(data)


def is_spec_text(value: str) -> bool:
    """Whether :meth:`Spec.coerce` reads the ``str`` ``value`` as spec text (it starts with ``{``, leading
    whitespace aside, or holds a newline) rather than as the path of a spec file."""
    return value.lstrip().startswith("{") or "\n" in value


def dense_spec() -> Spec:
    return Spec(default=DENSE)


# ------------------------------------------------------------------------------------------------------------------
# Seed formats
# ------------------------------------------------------------------------------------------------------------------

_TRTLLM_BACKENDS = ("TRTLLM", "CUDNN", "CUTEDSL", "FLASHINFER")
_SPARSE_KEYS = ("algorithm", "threshold_scale_factor", "target_sparsity")
_VLLM_DENSE = ("TORCH_SDPA", "FLASH_ATTN", "CUDNN_ATTN", "FLASHINFER_ATTN")
_VLLM_QUANT = ("TRTLLM_ATTN",)


def _sparse_attention(data: Any, where: str) -> SkipSoftmax:
    """VisualGen ``sparse_attention_config`` (``algorithm: skip_softmax``, ``threshold_scale_factor`` xor
    ``target_sparsity``; a ``{"prefill": x}`` mapping as TensorRT-LLM's LLM API allows is read as ``x``) as
    :class:`SkipSoftmax`."""
    reject_unknown(data, set(_SPARSE_KEYS), where)
    check_choice(f"{where}.algorithm", data.get("algorithm"), ("skip_softmax",))
    values = {}
    for name in _SPARSE_KEYS[1:]:
        value = data.get(name)
        if isinstance(value, dict):
            reject_unknown(value, {"prefill"}, f"{where}.{name}")
            value = value.get("prefill")
        if value is not None:
            values[name] = value
    return SkipSoftmax(**values, where=where)


def _from_tensorrt_llm(data: dict) -> Spec:
    where = "attention_config"
    reject_unknown(data, {"backend", "quant_attention_config", "sparse_attention_config"}, where)
    backend = check_choice(f"{where}.backend", data.get("backend"), _TRTLLM_BACKENDS)
    quant = data.get("quant_attention_config")
    sparse = data.get("sparse_attention_config")
    skip = None if sparse is None else _sparse_attention(sparse, f"{where}.sparse_attention_config")
    if quant is None:
        if skip is None:
            return Spec(default=DENSE)
        return Spec(default=AttentionSpec(backend=backend, recipe=None, skip_softmax=skip, where=where))
    fields = ("qk_dtype", "v_dtype", "q_block_size", "k_block_size", "v_block_size")
    quant_where = f"{where}.quant_attention_config"
    reject_unknown(quant, set(fields), quant_where)
    recipe = Recipe(**{"qk_dtype": "bf16", "v_dtype": "fp8", **quant}, where=quant_where)
    recipes.validate(backend, recipe, where=quant_where)  # named as written, not as the canonical recipe
    return Spec(default=AttentionSpec(backend=backend, recipe=recipe, skip_softmax=skip, where=where))


def _looks_like_vllm(data: dict) -> bool:
    """Whether a spec without TensorRT-LLM keys is a vLLM-Omni config (else canonical)."""
    if "per_role" in data:
        return True
    entry = data.get("default")
    if isinstance(entry, str):  # a backend name; a string but "dense" in a spec with rules is a canonical error
        return entry in _VLLM_DENSE + _VLLM_QUANT or (entry != DENSE and "rules" not in data)
    return isinstance(entry, dict) and ("quant" in entry or entry.get("backend") in _VLLM_DENSE + _VLLM_QUANT
                                        and "recipe" not in entry)


_VLLM_DTYPE_QK = {"int8": "int8", "fp8_e4m3": "fp8"}


def _vllm_entry(entry: Any, where: str) -> Use:
    ambiguous = isinstance(entry, dict) and "quant" not in entry  # a canonical entry could look the same
    backends = _VLLM_DENSE + _VLLM_QUANT
    if isinstance(entry, str):
        entry = {"backend": entry}
    elif not isinstance(entry, dict):
        raise invalid(where, entry, f"a backend name ({', '.join(backends)}) or a mapping with backend, quant, "
                                     "skip_softmax")
    reject_unknown(entry, {"backend", "quant", "skip_softmax"}, where)
    backend = check_choice(f"{where}.backend", entry.get("backend"), backends)
    quant, skip = entry.get("quant"), entry.get("skip_softmax")
    quant_where = f"{where}.quant"
    if quant is not None:
        reject_unknown(quant, {"dtype_qk", "q_block_size", "k_block_size"}, quant_where)
    if backend in _VLLM_DENSE:
        if quant or skip is not None:
            raise ValueError(f"{where}: quant/skip_softmax are not accepted for {backend}; valid: TRTLLM_ATTN")
        return DENSE
    skip_softmax = SkipSoftmax.from_dict(skip, where=f"{where}.skip_softmax") if skip is not None else None
    recipe = None
    if quant and "dtype_qk" not in quant:
        raise ValueError(f"{quant_where} has block sizes but no dtype_qk (absent dtype_qk means dense); valid: add "
                         f"dtype_qk: {', '.join(_VLLM_DTYPE_QK)}")
    if quant:
        dtype_qk = check_choice(f"{quant_where}.dtype_qk", quant["dtype_qk"], tuple(_VLLM_DTYPE_QK))
        recipe = Recipe(_VLLM_DTYPE_QK[dtype_qk], "fp8", quant.get("q_block_size", 1), quant.get("k_block_size", 16),
                        1, smooth_k=True, where=quant_where)
        recipes.validate(backend, recipe, where=quant_where)
    if recipe is None and skip_softmax is None:
        if ambiguous:
            warnings.warn(
                f"{where}: {entry!r} is read as a vLLM-Omni entry: TRTLLM_ATTN without quant is dense BF16 attention. "
                "For qattn_fx's default SageAttention recipe on that backend write "
                "{'backend': 'TRTLLM_ATTN', 'recipe': {...}} (canonical form) or add "
                "'quant': {'dtype_qk': 'int8'} (vLLM-Omni form).", SpecWarning, stacklevel=4)
        return DENSE
    return AttentionSpec(backend=backend, recipe=recipe, skip_softmax=skip_softmax, where=where)


def _from_vllm_omni(data: dict) -> Spec:
    reject_unknown(data, {"default", "per_role"}, "diffusion attention config")
    default = _vllm_entry(data["default"], "default") if data.get("default") is not None else DENSE
    per_role = data.get("per_role")
    per_role = {} if per_role is None else check_mapping("per_role", per_role, "a mapping of role to entry")
    rules = []
    for role, entry in per_role.items():
        check_choice("per_role role", role, ROLES)
        rules.append(Rule(Match(role=(role,)), _vllm_entry(entry, f"per_role[{role!r}]")))
    return Spec(default=default, rules=tuple(rules))


__all__ = ["Spec", "AttentionSpec", "Rule", "Match", "DENSE", "DEFAULT_RECIPE", "ROLES", "dense_spec",
           "is_spec_text", "layer_selected"]
