"""Shared cases of the fused K/V quantize (``qattn::quantize_kv``, :mod:`qattn_fx.kernels.quantize_kv`): the
interpreter test (``tests/kernels/test_quantize_kv_interpret.py``), the CPU op tests (``tests/ops/test_quantize_kv.py``)
and the GPU test (``tests/gpu/test_quantize_kv.py``) run the same inputs and compare the same way, bit for bit.

Cases cover lengths that are multiples of neither 128 nor 16 (and one shorter than 16), ``Dk != Dv`` and a head dim
that is not a power of two, K and V stored BSHD (diffusers' buffers), BHSD, as views with gaps, V sequence-major, key
masks (a batch element with every key masked, a ``(1, S)`` bias), int8 and fp8 K, ``k_block`` 16, 64 and 128 (and
1), and V written D-major or sequence-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import support
from qattn_fx.ops.quantize import _quantize_kv_composed

ops = torch.ops.qattn
I8, F8 = torch.int8, torch.float8_e4m3fn


@dataclass(frozen=True)
class Case:
    b: int
    h: int
    s: int
    dk: int
    dv: int
    k_dtype: torch.dtype = I8
    k_block: int = 16
    seq_major: bool = True
    k_layout: str = "bshd"
    v_layout: str = "bshd"
    bias: str | None = None  # None, "batch" (B, S) with a batch element all masked, "batch1" (1, S)
    dtype: torch.dtype = torch.bfloat16


CASES = {
    "bshd-int8-k16-seq": Case(2, 2, 300, 64, 128),
    "bhsd-fp8-k64-dmajor": Case(1, 3, 77, 128, 64, F8, 64, False, "contiguous", "contiguous"),
    "gaps-int8-k128-masked": Case(3, 2, 200, 64, 64, I8, 128, True, "gaps", "gaps", "batch"),
    "bshd-fp8-k16-bias1-fp16": Case(2, 2, 145, 128, 128, F8, 16, True, bias="batch1", dtype=torch.float16),
    "vseq-int8-k64-masked-dmajor": Case(2, 1, 129, 64, 64, I8, 64, False, "bshd", "transposed", "batch"),
    "short-d80-k1-fp32": Case(1, 2, 5, 80, 48, F8, 1, True, "contiguous", "bshd", dtype=torch.float32),
}


def make(case: Case, device="cpu", seed=0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(k, v, key_bias)`` of ``case``: K with per-(head, channel) offsets (what smoothing takes off), V plain,
    stored as the case's layouts say (:data:`support.LAYOUTS`, made in the case's dtype so views keep their gaps)."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = support.make_layout(case.k_layout, case.b, case.h, case.s, case.dk, dtype=case.dtype, generator=g)
    offsets = 4 * torch.randn(case.h, 1, case.dk, generator=g, device=device)
    k.mul_(2).add_(offsets.to(case.dtype))  # in place: the layout stays
    v = support.make_layout(case.v_layout, case.b, case.h, case.s, case.dv, dtype=case.dtype, generator=g)
    return k, v, bias(case, device)


def bias(case: Case, device="cpu") -> torch.Tensor | None:
    if case.bias is None:
        return None
    rows = 1 if case.bias == "batch1" else case.b
    key_bias = torch.zeros(rows, case.s, device=device)
    key_bias[0, case.s // 3: case.s // 3 + 40] = -math.inf
    key_bias[0, 1::7] = -math.inf
    key_bias[0, 2::7] = -0.5  # finite: kept
    if rows > 1:
        key_bias[-1] = -math.inf  # a batch element with every key masked
    return key_bias


def ties(device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, k_mean, v_scale)`` whose scaled values are exact, for statistics given to the op (not computed):
    every int8 tie (K blocks whose amax is ``127 · 2^j`` have the scale ``2^j`` exactly, with a mean of 0), e4m3
    ties, subnormal ties and values past 448 (V with scale 1)."""
    b, h, s, d = 1, 2, 128, 32
    halves = torch.arange(-127, 127).float() + 0.5
    k = torch.cat([halves, torch.full((s * d - halves.numel(),), 127.0)]).reshape(1, 1, s, d).expand(b, h, -1, -1)
    k = (k * torch.tensor([1.0, 0.25]).reshape(1, h, 1, 1)).to(torch.bfloat16).contiguous()
    e4m3 = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-7 + 2.0**-10, 13.0, 15.0, 300.0, 464.0,
                         480.0, 1e4, 2.0**-12])
    v = torch.cat([e4m3, -e4m3]).repeat(s * d // 24 + 1)[:s * d].reshape(1, 1, s, d).expand(b, h, -1, -1)
    stats = torch.zeros(b, h, 1, d), torch.ones(b, h, d)
    return tuple(x.contiguous().to(device) for x in (k, v.float(), *stats))


def unfused(k, v, key_bias, k_block, k_dtype, seq_major):
    """``(k_data, k_scale, v_data, v_scale)`` of the separate ops the lowering emits without the fused one:
    ``smooth_k`` then ``quantize_per_block`` for K, ``mask_keys`` then ``quantize_per_channel`` for V."""
    smoothed = ops.smooth_k(k) if key_bias is None else ops.smooth_k(k, key_bias)
    k_data, k_scale = ops.quantize_per_block(smoothed, k_block, k_dtype)
    v_data, v_scale = ops.quantize_per_channel(v if key_bias is None else ops.mask_keys(v, key_bias), F8, seq_major)
    return k_data, k_scale, v_data, v_scale


def defined(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major):
    """``(k_data, k_scale, v_data)`` as the op defines them for given statistics: the separate ops with ``k_mean``
    for K's mean and ``v_scale`` for V's scales (on any device)."""
    return _quantize_kv_composed(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major)


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bits as integers of its width (so NaNs and signed zeros compare, and float8 needs no kernel)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_bitwise(got, want, names=("k_data", "k_scale", "v_data")) -> None:
    """Same shapes, dtypes and bits, output by output."""
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.shape, b.dtype)
        differ = bits(a) != bits(b)
        assert not bool(differ.any()), f"{name}: {int(differ.sum())} of {differ.numel()} differ, first at " \
                                       f"{differ.nonzero()[0].tolist()}"
