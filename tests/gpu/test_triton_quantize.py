"""The fused quantize kernels on the GPU at real shapes, against the aten definitions (eager and Inductor-compiled),
and inside compiled attention graphs.

Bit-identical to the eager aten ops: Q per block, V per channel (both layouts), K smoothed given torch's mean. K with
the column pass's own mean: scales within fp32 rounding, data within one unit at a tiny fraction of elements.
"""

from __future__ import annotations

import pytest
import torch

import qattn_fx
import qattn_fx.ops  # noqa: F401  (registers qattn::* ops)
from qattn_fx.kernels import triton_quantize as tq
from qattn_fx.recipes import Recipe

pytestmark = pytest.mark.gpu

ops = torch.ops.qattn
FP8 = torch.float8_e4m3fn
SHAPES = {"flux-1024": (1, 24, 4608, 128), "wan1.3b-480p": (1, 12, 32760, 128), "odd-d64": (2, 5, 1003, 64)}


def make(shape, seed=0, dtype=torch.bfloat16):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, s, h, d, generator=g, device="cuda") * 2 + 3 * torch.randn(1, 1, h, d, generator=g,
                                                                                  device="cuda")
    return x.to(dtype).transpose(1, 2)


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def assert_same(got, want):
    (data, scale), (ref_data, ref_scale) = got, want
    assert data.shape == ref_data.shape and data.dtype == ref_data.dtype
    assert all(a == b for n, a, b in zip(data.shape, data.stride(), ref_data.stride()) if n > 1)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(bits(data), bits(ref_data))


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("block,dtype", [(1, torch.int8), (16, torch.int8), (1, FP8), (128, torch.int8)])
def test_per_block(name, block, dtype):
    x = make(SHAPES[name])
    assert_same(tq.quantize_per_block(x, block, dtype), ops.quantize_per_block(x, block, dtype))


@pytest.mark.parametrize("name", SHAPES)
def test_smoothed_given_the_mean(name):
    x = make(SHAPES[name])
    mean = x.float().mean(dim=-2).contiguous()
    got = tq.quantize_per_block(x, 16, torch.int8, smooth=True, mean=mean)
    assert_same(got, ops.quantize_per_block(ops.smooth_k(x), 16, torch.int8))


@pytest.mark.parametrize("name", SHAPES)
def test_smoothed_with_its_own_mean(name):
    x = make(SHAPES[name])
    data, scale = tq.quantize_per_block(x, 16, torch.int8, smooth=True)
    ref_data, ref_scale = ops.quantize_per_block(ops.smooth_k(x), 16, torch.int8)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    diff = (data.int() - ref_data.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-4


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("seq_major", [True, False])
def test_per_channel(name, seq_major):
    x = make(SHAPES[name])
    assert_same(tq.quantize_per_channel(x, FP8, seq_major), ops.quantize_per_channel(x, FP8, seq_major))


def test_against_inductor_compiled_aten():
    """What Inductor compiles from the aten ops (the graphs' quantization before these kernels, and with
    ``triton_quantize=""``): the same scales; data one unit off at a few elements in 10^4, where Inductor's fp32
    division (not IEEE) lands on the other side of a rounding boundary (2026-12-01, H200: 4488 of 14.2 M for Q)."""
    x = make(SHAPES["flux-1024"])
    torch._dynamo.reset()
    q_ref = torch.compile(lambda t: ops.quantize_per_block(t, 1, torch.int8), fullgraph=True)(x)
    v_ref = torch.compile(lambda t: ops.quantize_per_channel(t, FP8, True), fullgraph=True)(x)
    for (data, scale), (ref_data, ref_scale) in ((tq.quantize_per_block(x, 1, torch.int8), q_ref),
                                                 (tq.quantize_per_channel(x, FP8, True), v_ref)):
        assert torch.equal(scale, ref_scale)
        diff = (bits(data).int() - bits(ref_data).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize("kernel", ["gluon_sage", "triton_sage"])
def test_compiled_attention_with_fused_quantize(qattn_config, kernel):
    """The compiled recipe with the fused ops (``triton_quantize="qkv"``) gives the output of the one with Inductor's
    quantize kernels (K's mean aside: rare one-unit differences), at lengths that are not multiples of 16, with one
    graph for all."""
    qattn_config(autotune=False)
    recipe = Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)
    torch._dynamo.reset()
    counts = {"graphs": 0}

    def attend(q, k, v):
        return qattn_fx.ops.quantized_attention(q, k, v, recipe, kernel=kernel)

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

        return compile_fx(gm, example_inputs)

    fused = torch.compile(attend, backend=backend, dynamic=True, fullgraph=True)
    for s in (1003, 2050):
        q, k, v = (make((2, 4, s, 128), seed=i) for i in range(3))
        with qattn_fx.config.patch(triton_quantize=""):
            want = attend(q, k, v)
        with qattn_fx.config.patch(triton_quantize="qkv"):
            got = fused(q, k, v)
        cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)
        assert cos > 0.99999
    assert counts["graphs"] == 1
