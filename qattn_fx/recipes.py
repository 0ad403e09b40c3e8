"""Quantized-attention recipes and the table of accepted (backend, recipe) combinations.

A *recipe* fixes the numerics of one attention call: the element format of Q/K (BMM1) and of V (BMM2), how many
tokens share one Q/K scale, how V is scaled, and whether K is smoothed. It says nothing about which kernel runs it;
kernels are implementations of a recipe on some hardware (see ``qattn_fx.kernels``).

Everything that decides whether a recipe is accepted, and where it can run, is *data* in :data:`TABLE`: one
:class:`Row` per (backend, recipe family) taken from the two seed documents (TensorRT-LLM VisualGen quantized
attention; vLLM-Omni ``TRTLLM_ATTN``) plus the Hopper rows served by this project's own kernels. Validation,
policy resolution and docs/spec.md's recipe table are all generated from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Literal

from . import kernels
from .block_sparse_spec import BlockSparse  # noqa: F401  (re-exported: the spec key beside SkipSoftmax)
from .requirements import SM100_103, SM120_121, ANY_HEAD_DIM, HeadDims, Requirements  # noqa: F401  (re-exported)
from .sparsity_key import SparsityKey
from .validate import (Checked, check_bool, check_choice, check_int, check_range, fmt_set, fmt_tuple, from_fields,
                       path_at, unique)

QKDType = Literal["bf16", "int8", "fp8", "mxfp8", "nvfp4"]
VDType = Literal["fp8", "mxfp8", "nvfp4"]
ScaleScope = Literal["tensor", "head"]

QK_DTYPES: tuple[str, ...] = ("bf16", "int8", "fp8", "mxfp8", "nvfp4")
V_DTYPES: tuple[str, ...] = ("fp8", "mxfp8", "nvfp4")
SCALE_SCOPES: tuple[str, ...] = ("tensor", "head")
#: Formats whose scaling is defined by the format itself (block sizes stay 0).
BLOCK_SCALED_FORMATS: tuple[str, ...] = ("mxfp8", "nvfp4")


@dataclass(frozen=True)
class Recipe(Checked):
    """The numerics of one quantized attention call.

    Fields (VisualGen's configuration surface, plus ``smooth_k`` and ``scale_scope``):

    * ``qk_dtype``: element format of Q and K for BMM1 (Q·Kᵀ). ``bf16`` leaves Q/K unquantized; ``int8`` and
      ``fp8`` (e4m3) carry one fp32 scale per block of tokens; ``mxfp8`` (e4m3, E8M0 scale per 32 channels) and
      ``nvfp4`` (e2m1, E4M3 scale per 16 channels plus an fp32 tensor scale) define their own blocks.
    * ``v_dtype``: element format of V for BMM2 (P·V). ``fp8`` uses fp32 scales (see ``v_block_size``);
      ``mxfp8`` / ``nvfp4`` are block-scaled along the sequence (the contraction axis of P·V).
    * ``q_block_size`` / ``k_block_size``: tokens per Q / K scale along the sequence, per head (SageAttention).
      0 means one scale for the whole tensor (or per head, see ``scale_scope``), or "defined by the format".
    * ``v_block_size``: for fp8 V, 0 = one tensor-wide scale (or per head), 1 = one scale per (head, channel).
    * ``smooth_k``: subtract K's per-channel mean over tokens before quantizing (exact under softmax).
    * ``scale_scope``: what a 0 block size spans for int8/fp8 operands: the whole ``tensor`` (cuDNN FP8) or one
      ``head`` (FlashInfer FA3 FP8).

    ``where`` (keyword only, not a field, :class:`~qattn_fx.validate.Checked`) is where the recipe sits in a spec,
    e.g. ``spec.default.recipe``; error messages name each bad field under it (bare field names when not given).
    """

    qk_dtype: str = "bf16"
    v_dtype: str = "fp8"
    q_block_size: int = 0
    k_block_size: int = 0
    v_block_size: int = 0
    smooth_k: bool | None = None
    scale_scope: str = "tensor"

    def _check(self, where: str) -> None:
        check_choice(path_at(where, "qk_dtype"), self.qk_dtype, QK_DTYPES)
        check_choice(path_at(where, "v_dtype"), self.v_dtype, V_DTYPES)
        check_choice(path_at(where, "scale_scope"), self.scale_scope, SCALE_SCOPES)
        for name in ("q_block_size", "k_block_size", "v_block_size"):
            check_int(path_at(where, name), getattr(self, name), 0)
        if self.smooth_k is None:
            object.__setattr__(self, "smooth_k", self.qk_dtype != "bf16")
        check_bool(path_at(where, "smooth_k"), self.smooth_k)
        if self.smooth_k and self.qk_dtype == "bf16":
            raise ValueError(f"{path_at(where, 'smooth_k')}=True is invalid with qk_dtype='bf16' (K is not quantized); "
                             "valid: false")

    # -- derived facts ------------------------------------------------------------------------------------------
    @property
    def blocks(self) -> tuple[int, int, int]:
        return (self.q_block_size, self.k_block_size, self.v_block_size)

    @property
    def family(self) -> str:
        """Which attention op implements the recipe: ``scaled`` (bf16/int8/fp8 Q/K, fp8 V) or ``block_scaled``."""
        if self.qk_dtype in BLOCK_SCALED_FORMATS or self.v_dtype in BLOCK_SCALED_FORMATS:
            return "block_scaled"
        return "scaled"

    @property
    def name(self) -> str:
        """A short human name, e.g. ``int8 Q/K 1/16, fp8 V per-channel``."""
        if self.qk_dtype == "bf16":
            qk = "bf16 Q/K"
        elif self.qk_dtype in BLOCK_SCALED_FORMATS:
            qk = f"{self.qk_dtype} Q/K"
        elif self.q_block_size or self.k_block_size:
            qk = f"{self.qk_dtype} Q/K {self.q_block_size}/{self.k_block_size}"
        else:
            qk = f"{self.qk_dtype} Q/K per-{self.scale_scope}"
        if self.v_dtype in BLOCK_SCALED_FORMATS:
            v = f"{self.v_dtype} V"
        elif self.v_block_size == 1:
            v = "fp8 V per-channel"
        else:
            v = f"fp8 V per-{self.scale_scope}"
        smooth = ", smooth K" if self.smooth_k else ""
        return f"{qk}, {v}{smooth}"

    @property
    def short_name(self) -> str:
        """The name in a table cell, Q/K then V: ``int8 1/16, fp8/ch`` (per-block Q/K scales of 1 and 16 tokens,
        per-channel V), ``fp8/tensor, fp8/tensor``, ``bf16, fp8/tensor``, ``mxfp8, mxfp8``; `` no-smooth`` when a
        quantized K is not smoothed."""
        def part(fmt: str, blocks: str | None, per_channel: bool) -> str:
            if fmt in BLOCK_SCALED_FORMATS or fmt == "bf16":
                return fmt
            if blocks:
                return f"{fmt} {blocks}"
            return f"{fmt}/ch" if per_channel else f"{fmt}/{self.scale_scope}"

        qk_blocks = f"{self.q_block_size}/{self.k_block_size}" if self.q_block_size or self.k_block_size else None
        qk = part(self.qk_dtype, qk_blocks, False)
        v = part(self.v_dtype, None, self.v_block_size == 1)
        unsmoothed = " no-smooth" if self.qk_dtype != "bf16" and not self.smooth_k else ""
        return f"{qk}, {v}{unsmoothed}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "recipe") -> "Recipe":
        return from_fields(cls, data, where)


@dataclass(frozen=True)
class BlockChoices:
    """Accepted (q, k, v) block sizes: an explicit list of tuples, or the product of per-field choices."""

    tuples: tuple[tuple[int, int, int], ...] = ()
    q: tuple[int, ...] = ()
    k: tuple[int, ...] = ()
    v: tuple[int, ...] = ()

    def all(self) -> tuple[tuple[int, int, int], ...]:
        if self.tuples:
            return self.tuples
        return tuple(itertools.product(self.q, self.k, self.v))

    def describe(self) -> str:
        if self.tuples:
            return ", ".join(fmt_tuple(t) for t in self.tuples)
        return f"q {fmt_set(self.q)}; k {fmt_set(self.k)}; v {fmt_set(self.v)}"


def _blocks(*tuples: tuple[int, int, int]) -> BlockChoices:
    return BlockChoices(tuples=tuple(tuples))


@dataclass(frozen=True)
class Row:
    """One accepted (backend, recipe family) combination, with where it runs."""

    backend: str
    qk_dtype: str
    v_dtype: str
    blocks: BlockChoices
    common_name: str
    source: str
    implementations: tuple[Requirements, ...]
    scale_scopes: tuple[str, ...] = ("tensor",)

    def accepts(self, recipe: Recipe) -> bool:
        return (
            recipe.qk_dtype == self.qk_dtype
            and recipe.v_dtype == self.v_dtype
            and recipe.blocks in self.blocks.all()
            and (recipe.scale_scope in self.scale_scopes or not _scope_matters(recipe))
        )


def _scope_matters(recipe: Recipe) -> bool:
    """``scale_scope`` only changes numerics when some int8/fp8 operand has a 0 block size."""
    qk_whole = recipe.qk_dtype in ("int8", "fp8") and (recipe.q_block_size == 0 or recipe.k_block_size == 0)
    v_whole = recipe.v_dtype == "fp8" and recipe.v_block_size == 0
    return qk_whole or v_whole


VG = "TensorRT-LLM VisualGen quantized attention"
VO = "vLLM-Omni TRTLLM_ATTN"
OURS = "qattn_fx (Hopper)"

_FI = ("flashinfer-python", "0.6.0")
_SAGE_HD = HeadDims(allowed=(128,))
#: The Hopper Sage kernels, fastest first: the warp-specialized Gluon kernel (sm_90, Triton 3.6's Gluon API), then
#: the Triton one (sm_89/sm_90, same numerics).
_HOPPER_SAGE = (*kernels.requirements("gluon_sage"), *kernels.requirements("triton_sage"))
#: The reference kernel (``emulate=True``, backend ``REFERENCE``): every recipe, any device, masks too.
(REFERENCE_REQUIREMENTS,) = kernels.requirements("reference")



#: Every accepted (backend, recipe) combination. Order matters for ``backend="auto"``: the first row whose
#: implementation runs on the hardware and serves the site wins, so faster/more accurate rows come first.
TABLE: tuple[Row, ...] = (
    # ---- our own Hopper kernels ---------------------------------------------------------------------------------
    Row("TRITON", "int8", "fp8", BlockChoices(q=(1, 4, 16, 32, 64, 128), k=(1, 4, 16, 32, 64, 128), v=(0, 1)),
        "SageAttention (INT8 QK), Triton", OURS,
        _HOPPER_SAGE, scale_scopes=("tensor",)),
    Row("TRITON", "fp8", "fp8", BlockChoices(q=(1, 4, 16, 32, 64, 128), k=(1, 4, 16, 32, 64, 128), v=(0, 1)),
        "SageAttention (FP8 QK), Triton", OURS,
        _HOPPER_SAGE, scale_scopes=("tensor",)),
    Row("TRITON", "bf16", "fp8", _blocks((0, 0, 0), (0, 0, 1)), "QK16PV8, Triton", OURS,
        _HOPPER_SAGE),
    # ---- TensorRT-LLM VisualGen table ---------------------------------------------------------------------------
    Row("TRTLLM", "int8", "fp8", _blocks((1, 1, 1), (1, 4, 1), (1, 16, 1)), "SageAttention (INT8 QK)", VG,
        kernels.requirements("flashinfer_trtllm_sage", "int8")),
    Row("TRTLLM", "fp8", "fp8", _blocks((1, 1, 1), (1, 4, 1)), "SageAttention (FP8 QK)", VG,
        kernels.requirements("flashinfer_trtllm_sage", "fp8")),
    Row("CUDNN", "fp8", "fp8", _blocks((0, 0, 0)), "cuDNN FP8", VG,
        kernels.requirements("cudnn_fp8")),
    Row("CUDNN", "mxfp8", "mxfp8", _blocks((0, 0, 0)), "cuDNN MXFP8", VG,
        kernels.requirements("cudnn_mxfp8")),
    Row("CUTEDSL", "bf16", "fp8", _blocks((0, 0, 0)), "QK16PV8", VG,
        (Requirements(None, SM100_103, _SAGE_HD, None, note="TensorRT-LLM CuTe DSL kernel; not in qattn_fx"),)),
    Row("CUTEDSL", "mxfp8", "fp8", _blocks((0, 0, 0), (0, 0, 1)), "MXFP8 Q/K", VG,
        (Requirements(None, SM100_103, _SAGE_HD, None, note="TensorRT-LLM CuTe DSL kernel; not in qattn_fx"),)),
    Row("CUTEDSL", "nvfp4", "fp8", _blocks((0, 0, 0), (0, 0, 1)), "NVFP4 Q/K", VG,
        (Requirements(None, SM100_103, _SAGE_HD, None, note="TensorRT-LLM CuTe DSL kernel; not in qattn_fx"),)),
    Row("FLASHINFER", "mxfp8", "fp8", _blocks((0, 0, 0)), "MXFP8 Q/K", VG,
        (Requirements(None, SM100_103, _SAGE_HD, _FI, note="FlashInfer cute-dsl block-scaled FMHA; not wired"),)),
    Row("FLASHINFER", "nvfp4", "fp8", _blocks((0, 0, 0)), "NVFP4 Q/K", VG,
        (Requirements(None, SM100_103, _SAGE_HD, _FI, note="FlashInfer cute-dsl block-scaled FMHA; not wired"),)),
    Row("FLASHINFER", "nvfp4", "nvfp4", _blocks((0, 0, 0)), "NVFP4 Attention", VG,
        (Requirements(None, SM120_121, HeadDims(allowed=(64, 128)), _FI, cross_attention=False, gqa=False,
                      self_attention_only_equal_shapes=True, seq_multiple_of=128,
                      note="FlashInfer nvfp4_attention_sm120; not wired"),)),
    # ---- our Hopper rows for the library backends ---------------------------------------------------------------
    Row("FLASHINFER", "fp8", "fp8", _blocks((0, 0, 0)), "FA3 FP8 per-head", OURS,
        kernels.requirements("flashinfer_fa3_fp8"),
        scale_scopes=("head",)),
    # ---- vLLM-Omni TRTLLM_ATTN ----------------------------------------------------------------------------------
    Row("TRTLLM_ATTN", "int8", "fp8", BlockChoices(q=(1, 4, 16), k=(1, 4, 16), v=(1,)), "SAGE (INT8 QK)", VO,
        kernels.requirements("flashinfer_trtllm_sage", "int8")),
    Row("TRTLLM_ATTN", "fp8", "fp8", BlockChoices(q=(1, 4, 16), k=(1, 4, 16), v=(1,)), "SAGE (FP8 QK)", VO,
        kernels.requirements("flashinfer_trtllm_sage", "fp8")),
)

#: Backend names a spec may name. ``auto`` searches the table; ``REFERENCE`` is the exact torch definition
#: (emulation), accepted for every recipe of the table.
BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(row.backend for row in TABLE))
AUTO = "auto"
REFERENCE = "REFERENCE"
ALL_BACKENDS: tuple[str, ...] = (AUTO, *BACKENDS, REFERENCE)


def skip_softmax_backends() -> tuple[str, ...]:
    """Backends with a row whose implementations run Skip-Softmax (TRITON: gluon_sage; TRTLLM, TRTLLM_ATTN:
    trtllm-gen), then ``auto`` and ``REFERENCE`` (the reference kernel runs it for every recipe)."""
    return (*dict.fromkeys(r.backend for r in TABLE if any(i.skip_softmax for i in r.implementations)), AUTO,
            REFERENCE)


def block_sparse_backends() -> tuple[str, ...]:
    """Backends with a row whose implementations visit only listed blocks (``Requirements.block_sparse``), then
    ``auto`` and ``REFERENCE`` (the reference kernel runs block lists for every recipe of the scaled family)."""
    return (*dict.fromkeys(r.backend for r in TABLE if any(i.block_sparse for i in r.implementations)), AUTO,
            REFERENCE)


def rows_for(backend: str) -> tuple[Row, ...]:
    if backend in (AUTO, REFERENCE):
        return TABLE
    return tuple(row for row in TABLE if row.backend == backend)


def matching_rows(backend: str, recipe: Recipe) -> tuple[Row, ...]:
    return tuple(row for row in rows_for(backend) if row.accepts(recipe))


def validate(backend: str, recipe: Recipe, *, where: str = "") -> None:
    """Raise ``ValueError`` unless ``recipe`` is accepted by ``backend`` (``auto``/``REFERENCE``: by any row).

    The message names the first field that no accepted combination allows, its value, and the valid choices
    for that backend, e.g. ``k_block_size=16 is not accepted for TRTLLM fp8 Q/K; valid: (1,1,1), (1,4,1)``;
    ``where`` (the recipe's place in a spec, e.g. ``spec.default.recipe``) prefixes the field's name.
    """
    check_choice("backend", backend, ALL_BACKENDS)
    if matching_rows(backend, recipe):
        return
    what = "any backend" if backend in (AUTO, REFERENCE) else backend
    rows = rows_for(backend)
    qk_choices = unique(row.qk_dtype for row in rows)
    if recipe.qk_dtype not in qk_choices:
        raise ValueError(f"{path_at(where, 'qk_dtype')}={recipe.qk_dtype!r} is not accepted for {what}; "
                         f"valid: {fmt_set(qk_choices)}")
    rows = tuple(row for row in rows if row.qk_dtype == recipe.qk_dtype)
    v_choices = unique(row.v_dtype for row in rows)
    if recipe.v_dtype not in v_choices:
        raise ValueError(
            f"{path_at(where, 'v_dtype')}={recipe.v_dtype!r} is not accepted for {what} {recipe.qk_dtype} Q/K; "
            f"valid: {fmt_set(v_choices)}"
        )
    rows = tuple(row for row in rows if row.v_dtype == recipe.v_dtype)
    what += f" {recipe.qk_dtype} Q/K" + ("" if len(v_choices) == 1 else f" with {recipe.v_dtype} V")
    block_rows = tuple(row for row in rows if recipe.blocks in row.blocks.all())
    if not block_rows:
        valid = unique(t for row in rows for t in row.blocks.all())
        for i, name in enumerate(("q_block_size", "k_block_size", "v_block_size")):
            field_choices = unique(t[i] for t in valid)
            if recipe.blocks[i] not in field_choices:
                raise ValueError(f"{path_at(where, name)}={recipe.blocks[i]} is not accepted for {what}; "
                                 f"valid: {_describe(rows)}")
        raise ValueError(
            f"{where + ': ' if where else ''}block sizes (q,k,v)={fmt_tuple(recipe.blocks)} are not accepted for "
            f"{what}; valid: {_describe(rows)}"
        )
    scopes = unique(s for row in block_rows for s in row.scale_scopes)
    raise ValueError(f"{path_at(where, 'scale_scope')}={recipe.scale_scope!r} is not accepted for {what}; "
                     f"valid: {fmt_set(scopes)}")


def _describe(rows: Iterable[Row]) -> str:
    """The block sizes ``rows`` accept: ``(1,1,1), (1,4,1)`` for one backend's rows; with several backends each is
    named before its set, ``TRITON [q 1, 4; k 1, 4; v 0, 1], TRTLLM [(1,1,1), (1,4,1)]``."""
    by_backend: dict[str, list[str]] = {}
    for row in rows:
        by_backend.setdefault(row.backend, []).append(row.blocks.describe())
    sets = {backend: "; ".join(unique(found)) for backend, found in by_backend.items()}
    if len(sets) == 1:
        return next(iter(sets.values()))
    return ", ".join(f"{backend} [{found}]" for backend, found in sets.items())


# ------------------------------------------------------------------------------------------------------------------
# Skip-Softmax (the contract: qattn_fx/skip_softmax.py)
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkipSoftmax(SparsityKey, key="skip_softmax", short="skip",
                  controls=("target_sparsity", "threshold", "threshold_scale_factor")):
    """Skip-Softmax (BLASST) on top of a recipe: exactly one of ``threshold`` (λ of the tile test
    ``exp(tile max - running max) < λ``, vLLM-Omni's meaning), ``threshold_scale_factor`` (TensorRT-LLM's
    ``SkipSoftmaxAttentionConfig``: λ = factor / Skv) or ``target_sparsity`` (the fraction of tiles to skip:
    served after a calibration on the user's calls, :func:`qattn_fx.calibrate_skip_softmax`, which turns it into
    thresholds), and optionally ``disabled_until_timestep`` D (nothing skipped while the normalized timestep is
    above D; 0: off). The test, the tile and the timestep: :mod:`qattn_fx.skip_softmax`.

    ``where`` (keyword only, not a field, :class:`~qattn_fx.validate.Checked`): its place in a spec, for error
    messages (default ``skip_softmax``).
    """

    target_sparsity: float | None = None
    threshold: float | None = None
    disabled_until_timestep: float | None = None
    threshold_scale_factor: float | None = None

    def _check(self, where: str) -> None:
        self._check_one_control(where)
        check_range(path_at(where, "target_sparsity"), self.target_sparsity, 0.0, 1.0)
        check_range(path_at(where, "threshold"), self.threshold, 0.0, math.inf)
        check_range(path_at(where, "threshold_scale_factor"), self.threshold_scale_factor, 0.0, math.inf)
        check_range(path_at(where, "disabled_until_timestep"), self.disabled_until_timestep, 0.0, 1.0)

    def _setting(self) -> tuple[str, str]:
        """``("λ=", "0.01")``, ``("λ=", "1000/Skv")`` or ``("", "target 0.5")``: what is set, and its prefix in
        :meth:`describe`."""
        if self.threshold is not None:
            return "λ=", f"{self.threshold:g}"
        if self.threshold_scale_factor is not None:
            return "λ=", f"{self.threshold_scale_factor:g}/Skv"
        return "", f"target {self.target_sparsity:g}"

    def describe(self) -> str:
        """``skip-softmax λ=0.01``, ``skip-softmax λ=1000/Skv``, ``skip-softmax target 0.5``; ``, dense while
        t > 0.9`` with a gate."""
        prefix, what = self._setting()
        return f"skip-softmax {prefix}{what}{self._gate()}"

    def _short_setting(self) -> str:
        """What :attr:`short_name` shows: ``skip 0.01``, ``skip 1000/Skv``, ``skip target 0.5``."""
        return self._setting()[1]


def recipe_table_markdown() -> str:
    """The accepted-combinations table as markdown (docs/spec.md's recipe table is this, verbatim)."""
    lines = [
        "| backend | qk_dtype | v_dtype | (q, k, v) block sizes | scale scope | name | runs on (kernel) | source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in TABLE:
        impls = "; ".join(
            f"{'/'.join(r.archs or ('any',))}, d {r.head_dims.describe()}"
            f" ({r.kernel or 'no kernel: emulation only'}{', key masks' if r.key_bias else ''})"
            for r in row.implementations
        )
        lines.append(
            f"| {row.backend} | {row.qk_dtype} | {row.v_dtype} | {row.blocks.describe()} | "
            f"{'/'.join(row.scale_scopes)} | {row.common_name} | {impls} | {row.source} |"
        )
    return "\n".join(lines)


__all__ = [
    "Recipe",
    "Row",
    "Requirements",
    "HeadDims",
    "BlockChoices",
    "SkipSoftmax",
    "BlockSparse",
    "TABLE",
    "BACKENDS",
    "ALL_BACKENDS",
    "AUTO",
    "REFERENCE",
    "validate",
    "matching_rows",
    "rows_for",
    "recipe_table_markdown",
]
