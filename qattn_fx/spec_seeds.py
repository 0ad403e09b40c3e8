"""The two seed formats :meth:`qattn_fx.spec.Spec.from_dict` reads besides its canonical form (the module
docstring of :mod:`qattn_fx.spec` describes them): TensorRT-LLM VisualGen ``attention_config`` and vLLM-Omni
``--diffusion-attention-config``. Each parser returns the spec's ``(default, rules)``.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import recipes
from .recipes import Recipe, SkipSoftmax
from .spec_parts import DENSE, ROLES, AttentionSpec, Match, Rule, SpecWarning, Use
from .validate import check_choice, check_mapping, invalid, reject_unknown

TRTLLM_BACKENDS = ("TRTLLM", "CUDNN", "CUTEDSL", "FLASHINFER")
SPARSE_KEYS = ("algorithm", "threshold_scale_factor", "target_sparsity")
VLLM_DENSE = ("TORCH_SDPA", "FLASH_ATTN", "CUDNN_ATTN", "FLASHINFER_ATTN")
VLLM_QUANT = ("TRTLLM_ATTN",)


def sparse_attention(data: Any, where: str) -> SkipSoftmax:
    """VisualGen ``sparse_attention_config`` (``algorithm: skip_softmax``, ``threshold_scale_factor`` xor
    ``target_sparsity``; a ``{"prefill": x}`` mapping as TensorRT-LLM's LLM API allows is read as ``x``) as
    :class:`SkipSoftmax`."""
    reject_unknown(data, set(SPARSE_KEYS), where)
    check_choice(f"{where}.algorithm", data.get("algorithm"), ("skip_softmax",))
    values = {}
    for name in SPARSE_KEYS[1:]:
        value = data.get(name)
        if isinstance(value, dict):
            reject_unknown(value, {"prefill"}, f"{where}.{name}")
            value = value.get("prefill")
        if value is not None:
            values[name] = value
    return SkipSoftmax(**values, where=where)


def from_tensorrt_llm(data: dict) -> tuple[Use, tuple[Rule, ...]]:
    """TensorRT-LLM VisualGen ``attention_config`` as a spec's (default, rules)."""
    where = "attention_config"
    reject_unknown(data, {"backend", "quant_attention_config", "sparse_attention_config"}, where)
    backend = check_choice(f"{where}.backend", data.get("backend"), TRTLLM_BACKENDS)
    quant = data.get("quant_attention_config")
    sparse = data.get("sparse_attention_config")
    skip = None if sparse is None else sparse_attention(sparse, f"{where}.sparse_attention_config")
    if quant is None:
        if skip is None:
            return DENSE, ()
        return AttentionSpec(backend=backend, recipe=None, skip_softmax=skip, where=where), ()
    fields = ("qk_dtype", "v_dtype", "q_block_size", "k_block_size", "v_block_size")
    quant_where = f"{where}.quant_attention_config"
    reject_unknown(quant, set(fields), quant_where)
    recipe = Recipe(**{"qk_dtype": "bf16", "v_dtype": "fp8", **quant}, where=quant_where)
    recipes.validate(backend, recipe, where=quant_where)  # named as written, not as the canonical recipe
    return AttentionSpec(backend=backend, recipe=recipe, skip_softmax=skip, where=where), ()


def looks_like_vllm(data: dict) -> bool:
    """Whether a spec without TensorRT-LLM keys is a vLLM-Omni config (else canonical)."""
    if "per_role" in data:
        return True
    entry = data.get("default")
    if isinstance(entry, str):  # a backend name; a string but "dense" in a spec with rules is a canonical error
        return entry in VLLM_DENSE + VLLM_QUANT or (entry != DENSE and "rules" not in data)
    return isinstance(entry, dict) and ("quant" in entry or entry.get("backend") in VLLM_DENSE + VLLM_QUANT
                                        and "recipe" not in entry)


VLLM_DTYPE_QK = {"int8": "int8", "fp8_e4m3": "fp8"}


def vllm_entry(entry: Any, where: str) -> Use:
    ambiguous = isinstance(entry, dict) and "quant" not in entry  # a canonical entry could look the same
    backends = VLLM_DENSE + VLLM_QUANT
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
    if backend in VLLM_DENSE:
        if quant or skip is not None:
            raise ValueError(f"{where}: quant/skip_softmax are not accepted for {backend}; valid: TRTLLM_ATTN")
        return DENSE
    skip_softmax = SkipSoftmax.from_dict(skip, where=f"{where}.skip_softmax") if skip is not None else None
    recipe = None
    if quant and "dtype_qk" not in quant:
        raise ValueError(f"{quant_where} has block sizes but no dtype_qk (absent dtype_qk means dense); valid: add "
                         f"dtype_qk: {', '.join(VLLM_DTYPE_QK)}")
    if quant:
        dtype_qk = check_choice(f"{quant_where}.dtype_qk", quant["dtype_qk"], tuple(VLLM_DTYPE_QK))
        recipe = Recipe(VLLM_DTYPE_QK[dtype_qk], "fp8", quant.get("q_block_size", 1), quant.get("k_block_size", 16),
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


def from_vllm_omni(data: dict) -> tuple[Use, tuple[Rule, ...]]:
    """vLLM-Omni ``--diffusion-attention-config`` as a spec's (default, rules)."""
    reject_unknown(data, {"default", "per_role"}, "diffusion attention config")
    default = vllm_entry(data["default"], "default") if data.get("default") is not None else DENSE
    per_role = data.get("per_role")
    per_role = {} if per_role is None else check_mapping("per_role", per_role, "a mapping of role to entry")
    rules = []
    for role, entry in per_role.items():
        check_choice("per_role role", role, ROLES)
        rules.append(Rule(Match(role=(role,)), vllm_entry(entry, f"per_role[{role!r}]")))
    return default, tuple(rules)
