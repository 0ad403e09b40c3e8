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

:meth:`Spec.from_dict` also accepts, unchanged, the two seed formats (read by :mod:`qattn_fx.spec_seeds`; the
parts :class:`AttentionSpec`, :class:`Match`, :class:`Rule` are in :mod:`qattn_fx.spec_parts`):

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

import json
from dataclasses import dataclass, field
from pathlib import Path

from . import spec_seeds as seeds
from .spec_parts import (DEFAULT_RECIPE, DENSE, ROLES, AttentionSpec, Match, Rule, SpecWarning, Use, layer_selected,
                         parse_use, use_to_dict)
from .validate import check_list, check_mapping, reject_unknown, show, wrong_type


# ------------------------------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A default for every attention site plus ordered rules; the first matching rule wins."""

    default: Use = field(default_factory=AttentionSpec)
    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", parse_use(self.default, "spec.default"))
        rules = check_list("spec.rules", self.rules)
        object.__setattr__(self, "rules", tuple(
            r if isinstance(r, Rule) else Rule.from_dict(r, where=f"spec.rules[{i}]") for i, r in enumerate(rules)))

    def to_dict(self) -> dict:
        return {"default": use_to_dict(self.default), "rules": [r.to_dict() for r in self.rules]}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "Spec":
        """Canonical form, TensorRT-LLM ``attention_config``, or vLLM-Omni ``--diffusion-attention-config``."""
        check_mapping("spec", data, "a mapping (canonical, TensorRT-LLM attention_config or vLLM-Omni diffusion "
                                     "attention config)")
        if "attention_config" in data:
            reject_unknown(data, {"attention_config"}, "spec")
            return cls(*seeds.from_tensorrt_llm(data["attention_config"]))
        if "quant_attention_config" in data or ("backend" in data and "default" not in data):
            return cls(*seeds.from_tensorrt_llm(data))
        if seeds.looks_like_vllm(data):
            return cls(*seeds.from_vllm_omni(data))
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


__all__ = ["Spec", "AttentionSpec", "Rule", "Match", "DENSE", "DEFAULT_RECIPE", "ROLES", "dense_spec",
           "is_spec_text", "layer_selected"]
