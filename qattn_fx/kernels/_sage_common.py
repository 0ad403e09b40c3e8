"""What the two Sage kernels (:mod:`.triton_sage`, :mod:`.gluon_sage`) share: the softmax algebra's constants, the
launch-config base class, forced configs, input validation (the op boundary's checks plus these kernels' own),
and host helpers.

The kernels implement one algorithm (the triton_sage module docstring states it): logits in log2 units
``z = t · rs`` with ``rs = q_scale · sm_scale · log2 e`` and ``t`` the K-scaled Q·Kᵀ accumulator; ``448 · P =
exp2(z - m + log2 448)`` so the e4m3 P operand is ``448 · P`` rounded; the output ``O = acc · v_scale / l`` and the
natural-log LSE ``(m + log2 l - log2 448) · ln 2``. int8 accumulators start at the bits of ``1.5 · 2^23``
(``0x4B400000``): read as fp32 that is ``S + 1.5 · 2^23`` exactly for ``|S| < 2^22``, so one subtraction converts
them. The constants below are the single definition of these numbers, as Python floats for the host and as
``constexpr`` for the Triton and Gluon kernel source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from typing import ClassVar, Iterator, Optional

import torch

from .. import block_sparse, config, formats
from . import requirements as _requirements_of
from ._cuda_utils import FifoCache, layout_key
from .op_inputs import check_scaled_inputs

try:  # the kernels' source needs triton; the host side below does not
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    tl = None


def _constexpr(value):
    return tl.constexpr(value) if tl is not None else value


def _constexpr_function(fn):  # callable from the host and, as a constexpr, from Triton and Gluon kernel source
    if tl is None:
        return fn
    import triton  # noqa: PLC0415

    return triton.constexpr_function(fn)


@_constexpr_function
def k_scale_kind(K_BLOCK, BLOCK_N):
    """How K's scales (one per ``K_BLOCK`` keys) vary over a key tile of ``BLOCK_N`` keys: ``"group"`` (``1 <
    K_BLOCK < BLOCK_N`` dividing it: ``BLOCK_N / K_BLOCK`` scales, each for a group of columns), ``"column"``
    (another ``K_BLOCK`` not a multiple of ``BLOCK_N``, e.g. 1: a scale per column), ``"tile"`` (a multiple: one
    scale) or ``"none"`` (``K_BLOCK == 0``: K's scale is folded into the row scale). Scales that vary inside a tile
    (group, column) are cut to 22 significant bits by both kernels and the emulation (triton_sage's ``cut_ks``)."""
    if K_BLOCK > 1 and BLOCK_N % K_BLOCK == 0 and K_BLOCK < BLOCK_N:
        return "group"
    if K_BLOCK > 0 and K_BLOCK % BLOCK_N != 0:
        return "column"
    return "tile" if K_BLOCK > 0 else "none"


#: log2(e): natural-log logits to log2 units.
LOG2E = 1.4426950408889634
#: log2(448): the fixed e4m3 scale of P (``exp2(z - m + log2 448) = 448 · P``).
LOG2_448 = math.log2(448.0)
#: ln(2): log2 units back to natural log (the LSE).
LN2 = math.log(2.0)
#: ``1.5 · 2^23`` and its fp32 bit pattern: the int8 accumulator's starting value.
INT8_ACC_OFFSET = 12582912.0
INT8_ACC_BITS = 0x4B400000

#: fp32(1/127): the int8 scale is ``amax · fp32(1/127)`` (:func:`qattn_fx.formats.amax_to_scale`), for the kernels
#: that quantize Q themselves.
INV_127 = float(torch.tensor(formats.inv_qmax(torch.int8), dtype=torch.float32))
C_LOG2E = _constexpr(LOG2E)
C_INV_127 = _constexpr(INV_127)
C_LOG2_448 = _constexpr(LOG2_448)
C_LN2 = _constexpr(LN2)
C_INT8_ACC_OFFSET = _constexpr(INT8_ACC_OFFSET)
C_INT8_ACC_BITS = _constexpr(INT8_ACC_BITS)

#: Q/K dtype → the kernels' ``QK_KIND`` constexpr (0: int8, 1: e4m3, 2: bf16/fp16, unquantized).
QK_KIND = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2, torch.float16: 2}
#: The grid's second dimension is at most 65535 (batch · heads programs): larger calls run in batch chunks.
MAX_GRID_Y = 65535


# ------------------------------------------------------------------------------------------------------------------
# Launch configs
# ------------------------------------------------------------------------------------------------------------------


class LaunchConfig:
    """Base of a Sage kernel's launch config (a frozen dataclass): numbers, then 0/1 flags.

    Subclasses declare ``NUMBERS`` (``(field, label)`` pairs in order: ``str()`` writes ``label`` + value),
    ``FLAGS``, ``PREFIX`` (written first in ``str()``), ``KIND`` (the kernel, for messages) and ``EXAMPLE``.
    ``parse`` reads ``"128,3,ahead"`` as well as ``str()`` of a config (``WS_BN128_s3_ahead``).
    """

    NUMBERS: ClassVar[tuple[tuple[str, str], ...]] = ()
    FLAGS: ClassVar[tuple[str, ...]] = ()
    PREFIX: ClassVar[str] = ""
    KIND: ClassVar[str] = ""
    EXAMPLE: ClassVar[str] = ""

    def _check_flags(self) -> None:
        for name in self.FLAGS:
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (0, 1):
                raise ValueError(f"{name}={value!r} is invalid; valid: 0, 1")
            object.__setattr__(self, name, int(value))

    def __str__(self) -> str:
        parts = ([self.PREFIX] if self.PREFIX else []) + [f"{label}{getattr(self, field)}"
                                                          for field, label in self.NUMBERS]
        return "_".join(parts + [f for f in self.FLAGS if getattr(self, f)])

    @classmethod
    def usage(cls) -> str:
        return ",".join(f.upper() if f.startswith(("block", "stages")) else f for f, _ in cls.NUMBERS) + "".join(
            f"[,{f}]" for f in cls.FLAGS)

    @classmethod
    def parse(cls, text: str):
        words = [w.strip() for w in text.replace("_", ",").split(",") if w.strip()]
        if cls.PREFIX and words and words[0].upper() == cls.PREFIX:
            words = words[1:]
        flags = {w.lower(): 1 for w in words if w.lower() in cls.FLAGS}
        numbers = [re.fullmatch(r"[A-Za-z]*(\d+)", w) for w in words if w.lower() not in cls.FLAGS]
        if len(numbers) != len(cls.NUMBERS) or not all(numbers):
            raise ValueError(f"{cls.KIND} config {text!r} is invalid; valid: '{cls.usage()}' such as "
                             f"'{cls.EXAMPLE}'")
        return cls(*(int(m.group(1)) for m in numbers), **flags)


class ForcedConfig:
    """A kernel's forced launch config: the setting ``qattn_fx.config.<setting>`` (a config string), parsed."""

    def __init__(self, config_cls: type, setting: str):
        self.config_cls, self.setting = config_cls, setting

    def get(self):
        """The config every call uses instead of autotuning, or ``None``."""
        text = getattr(config, self.setting)
        return parse_config(self.config_cls, text) if text else None

    def set(self, value) -> None:
        setattr(config, self.setting, self._text(value))

    @contextlib.contextmanager
    def use(self, value) -> Iterator[None]:
        """Force ``value`` (a config, its string, or ``None``: autotune) inside the block."""
        with config.patch(**{self.setting: self._text(value)}):
            yield

    def _text(self, value) -> Optional[str]:
        if value is None:
            return None
        return str(parse_config(self.config_cls, value) if isinstance(value, str) else value)


@functools.lru_cache(maxsize=256)
def parse_config(config_cls: type, text: str):
    """``config_cls.parse(text)``, parsed once per text (configs are frozen: every call may share the instance)."""
    return config_cls.parse(text)


# ------------------------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------------------------


def head_dims(kernel: str) -> tuple[int, ...]:
    """The head dims ``kernel`` is compiled for (its registry requirements: the one declaration)."""
    (req,) = _requirements_of(kernel)
    return tuple(req.head_dims.allowed)


#: The input layouts :func:`validate` passed (keys of :func:`validate`): the check runs once per layout.
_VALID_LAYOUTS = FifoCache(maxsize=256)


def validate(kernel: str, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias=None, block_index=None,
             block_count=None) -> None:
    """``ValueError`` naming the argument for inputs the Sage kernels cannot take (layouts: the triton_sage module
    docstring): the op boundary's checks (:func:`qattn_fx.kernels.op_inputs.check_scaled_inputs`, their messages
    prefixed with the kernel's name) after what only these kernels add (their head dims, no fp32 Q/K), then the
    op boundary's check of the block lists (:func:`qattn_fx.block_sparse.check`, on Q's device). The kernels' direct
    entries (``attention``, ``compile_for``) run it, the one check of a call that does not come through the op; the
    policy keeps sites these kernels cannot take dense before they get here. The input checks read shapes, strides
    and dtypes only, so they run once per layout (:data:`_VALID_LAYOUTS`)."""
    key = (kernel, layout_key(q), q_scale is None, layout_key(k), k_scale is None, layout_key(v), layout_key(key_bias),
           q_block, k_block, key_bias is None or key_bias.device == k.device)
    if key not in _VALID_LAYOUTS:
        _VALID_LAYOUTS.get_or_build(key, lambda: _validate(kernel, q, q_scale, k, k_scale, v, v_scale, q_block,
                                                           k_block, key_bias))
    try:
        block_sparse.check(block_index, block_count, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    except ValueError as e:
        raise ValueError(f"{kernel}: {e}") from None


def _validate(kernel: str, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias) -> bool:
    """:func:`validate`'s checks; ``True`` when they pass."""
    dims = head_dims(kernel)
    d, dv = q.shape[-1], v.shape[-1]
    if d not in dims or dv not in dims:
        bad = d if d not in dims else dv
        raise ValueError(f"{kernel} supports head_dim in {dims}; got head_dim={bad} (q/k {d}, v {dv}); valid: "
                         f"{', '.join(map(str, dims))}")
    if q.dtype not in QK_KIND:
        raise ValueError(f"{kernel}: q/k dtype {q.dtype} is invalid; valid: int8, float8_e4m3fn, bfloat16, float16")
    try:
        check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, None, kernel, key_bias)
    except ValueError as e:
        raise ValueError(f"{kernel}: {e}") from None
    return True


def seq_major(v: torch.Tensor) -> bool:
    """V stored sequence-fastest (unit stride on S; when both S and D are unit, Skv == 1 and D-major is exact)."""
    return v.stride(-2) == 1 and v.stride(-1) != 1


def scale_strides(s: Optional[torch.Tensor]) -> tuple[int, int, int]:
    """Strides of a 3-D scale with 0 on size-1 (broadcast) dims."""
    if s is None:
        return (0, 0, 0)
    return tuple(0 if n == 1 else st for n, st in zip(s.shape, s.stride()))


def bias_range(key_bias: torch.Tensor) -> torch.Tensor:
    """Per row of an fp32 key bias ``(B|1, Skv)``: ``[first, end)``, the first key whose bias is not 0 and one past
    the last (``[Skv, 0)`` for a row of zeros; NaN counts as nonzero), int32 ``(B|1, 2)`` on its device (a few
    small kernels, no synchronization). The Sage kernels add the bias only in the key tiles that meet this range
    (and the last tile); every other key's bias is 0, so those tiles run the loop without it."""
    skv = key_bias.shape[-1]
    keys = torch.arange(skv, device=key_bias.device, dtype=torch.int32)
    nonzero = key_bias != 0  # (NaN counts as nonzero)
    first = torch.where(nonzero, keys, skv).amin(-1)
    end = torch.where(nonzero, keys + 1, 0).amax(-1)
    return torch.stack([first, end], dim=-1).to(torch.int32)


def check_key_range(kernel: str, key_bias: Optional[torch.Tensor], key_range: Optional[torch.Tensor]) -> None:
    """``ValueError`` unless a launch's ``key_bias`` and its :func:`bias_range` ``key_range`` are given together."""
    if (key_bias is None) != (key_range is None):
        raise ValueError(f"{kernel}: key_bias and key_range (its bias_range) go together; got key_bias "
                         f"{'None' if key_bias is None else 'given'}, key_range "
                         f"{'None' if key_range is None else 'given'}")


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= ``cap`` dividing ``n`` (``cap`` for 0)."""
    p = 1
    while p < cap and n % (2 * p) == 0:
        p *= 2
    return p


def seq_bucket(n: int) -> int:
    """Tuning key of a sequence length: powers of 4 from 256 up (tiling choices change slowly with length)."""
    bucket = 256
    while bucket < n and bucket < (1 << 20):
        bucket *= 4
    return bucket


def batch_chunks(bsz: int, hq: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` batch ranges of at most :data:`MAX_GRID_Y` (batch, head) pairs each."""
    per_chunk = max(1, MAX_GRID_Y // hq)
    return [(lo, min(bsz, lo + per_chunk)) for lo in range(0, bsz, per_chunk)]


def batch_chunk(t: Optional[torch.Tensor], lo: int, hi: int) -> Optional[torch.Tensor]:
    """Rows ``lo:hi`` of a tensor's batch dim (a size-1 batch broadcasts, and ``0:B`` is every row: kept whole)."""
    return t if t is None or t.shape[0] == 1 or (lo == 0 and hi == t.shape[0]) else t[lo:hi]


@dataclasses.dataclass
class LastLaunch:
    """What a kernel's latest launch in this process ran (for reports and benchmarks): its config and, for
    gluon_sage, its tail split. Written by the kernels only."""

    config: object = None
    tail: object = None
