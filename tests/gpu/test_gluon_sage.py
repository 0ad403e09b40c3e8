"""qattn_fx.kernels.gluon_sage_sm90 (the Hopper Gluon SageAttention kernel) on a real sm_90 GPU.

Run: ``pytest -m gpu tests/gpu/test_gluon_sage.py -v -s``. Same contract as triton_sage (the recipe's reference op
defines the numerics), so the same checks: every recipe/shape class against the reference (flash-kernel P
rounding tolerance), fp32-level agreement with the torch emulation of the tile loop for every config, first-tile
exactness, LSE, out dtypes and storage, inputs untouched, CUDA graphs, and clear errors for inputs TMA cannot take.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import support
from support import emulate, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton.experimental.gluon")

from qattn_fx.kernels import gluon_sage_sm90 as gs  # noqa: E402
from qattn_fx.kernels import reference  # noqa: E402
from qattn_fx.ops import formats  # noqa: E402

DEV = "cuda"
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != (9, 0),
                                reason="gluon_sage_sm90 needs sm_90")
assert_close_to_reference = functools.partial(support.assert_close_to_reference, name="gluon_sage_sm90")
assert_fp32_level = functools.partial(support.assert_fp32_level, name="gluon_sage_sm90")
make_qkv = functools.partial(support.make_qkv, hq=8, hkv=4, sq=1000, skv=1500, d=128, device=DEV)


@pytest.fixture(autouse=True)
def _no_forced_config(monkeypatch):
    monkeypatch.delenv(gs.ENV_CONFIG, raising=False)


def run_both(args, sm_scale=None, out_dtype=torch.float32):
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(args[0].shape[-1])
    full = (*args, sm_scale, out_dtype)
    return gs.scaled_attention(*full), reference.scaled_attention(*full)


RECIPES = [("int8", (1, 16)), ("int8", (1, 4)), ("int8", (1, 1)), ("int8", (4, 4)), ("int8", (16, 1)),
           ("int8", (32, 64)), ("int8", (64, 128)), ("int8", (128, 32)), ("int8", (0, 0)), ("int8", (1, 3)),
           ("fp8", (1, 16)), ("fp8", (1, 4)), ("fp8", (16, 1)), ("fp8", (0, 0)),
           ("bf16", (0, 0)), ("fp16", (0, 0))]


@needs_sm90
@pytest.mark.parametrize("qk,blocks", RECIPES, ids=[f"{q}-q{b[0]}k{b[1]}" for q, b in RECIPES])
def test_recipes_match_reference(qk, blocks):
    dtype = torch.float16 if qk == "fp16" else torch.bfloat16
    args = quantize(*make_qkv(dtype=dtype), qk, *blocks)
    out, ref = run_both(args)
    assert out.shape == (2, 8, 1000, 128)
    assert_close_to_reference(out, ref, f"{qk} {blocks}")


SHAPES = {
    "d64": dict(d=64),
    "bhsd": dict(bshd=False),
    "b1-mha": dict(b=1, hq=12, hkv=12, sq=777, skv=777),
    "gqa8": dict(b=1, hq=16, hkv=2, sq=300, skv=2000),
    "sq>skv": dict(sq=2000, skv=300),
    "short-kv": dict(sq=512, skv=77),
    "one-tile": dict(sq=100, skv=64),
    "single-query": dict(b=3, sq=1, skv=4097),
    "multiples": dict(b=1, hq=4, hkv=4, sq=1024, skv=2048),
}


@needs_sm90
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes_match_reference(name):
    args = quantize(*make_qkv(**SHAPES[name]), "int8", 1, 16)
    assert_close_to_reference(*run_both(args), name)


@needs_sm90
@pytest.mark.parametrize("config", [str(c) for c in gs.CONFIGS])
@pytest.mark.parametrize("qk,blocks", [("int8", (1, 16)), ("fp8", (1, 16)), ("int8", (0, 0)), ("int8", (1, 1))],
                         ids=["int8-1-16", "fp8-1-16", "int8-tensor", "int8-1-1"])
@pytest.mark.parametrize("d", [128, 64])
def test_every_config_matches_emulation_and_reference(config, qk, blocks, d):
    cfg = gs.GluonConfig.parse(config)
    args = quantize(*make_qkv(b=2, hq=4, hkv=2, sq=333, skv=555, d=d), qk, *blocks)
    with gs.use_config(cfg):
        out = gs.scaled_attention(*args, 0.125, torch.float32)
    assert_fp32_level(out, emulate(*args, 0.125, cfg.block_n), f"{cfg} d{d} {qk} {blocks} vs emulation",
                      fp8_qk=qk == "fp8")
    assert_close_to_reference(out, reference.scaled_attention(*args, 0.125, torch.float32), f"{cfg} d{d} {qk}")


@needs_sm90
@pytest.mark.parametrize("qk,blocks", [("fp8", (1, 16)), ("int8", (1, 16)), ("int8", (0, 0)), ("bf16", (0, 0))])
def test_exact_when_row_max_is_in_first_tile(qk, blocks):
    g = torch.Generator(device=DEV).manual_seed(7)
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=300, skv=700, k_bias=0.0, q_bias=0.0, dtype=torch.float32)
    u = torch.randn(q.shape[-1], generator=g, device=DEV)
    q = u + 0.3 * q
    k = k.clone()
    k[:, :, 0] = 0.5 * u
    args = quantize(q.bfloat16(), k.bfloat16(), v.bfloat16(), qk, *blocks, smooth=False)
    assert_fp32_level(*run_both(args), f"first-tile max {qk} {blocks}", fp8_qk=qk == "fp8")


@needs_sm90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_storage_and_lse(out_dtype):
    args = quantize(*make_qkv(), "int8", 1, 16)
    out, lse = gs.attention(*args, 0.1, out_dtype, return_lse=True)
    b, h, s, d = out.shape
    assert out.dtype == out_dtype and out.stride() == (s * h * d, d, h * d, 1)
    assert_close_to_reference(out.float(), reference.scaled_attention(*args, 0.1, torch.float32), str(out_dtype))
    q, qs, k, ks, _, _, qb, kb = args
    qf = formats.dequantize_scaled(q, qs, qb)
    kf = formats.dequantize_scaled(k, ks, kb).repeat_interleave(2, 1)
    expect = torch.logsumexp((qf @ kf.transpose(-1, -2)).double() * 0.1, dim=-1)
    assert lse.shape == (2, 8, 1000) and (lse.double() - expect).abs().max().item() < 1e-3


@needs_sm90
def test_inputs_not_mutated_and_cuda_graph():
    args = quantize(*make_qkv(), "int8", 1, 16)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    out = gs.scaled_attention(*args, 0.1, torch.bfloat16)
    for a, b in zip([a for a in args if isinstance(a, torch.Tensor)], before):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gs.scaled_attention(*args, 0.1, torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@needs_sm90
def test_misaligned_inputs_are_refused_with_reason():
    q, k, v = make_qkv(sq=64, skv=64)
    args = list(quantize(q, k, v, "int8", 1, 16))
    args[0] = torch.empty(2, 8, 64, 129, dtype=torch.int8, device=DEV)[..., 1:]  # base off by one byte
    assert gs.ineligible(args[0], args[2], args[4]) is not None
    with pytest.raises(RuntimeError, match=r"gluon_sage_sm90: q needs a 16-byte aligned base"):
        gs.scaled_attention(*args, 0.1, torch.bfloat16)


def test_config_parsing_errors():
    assert gs.GluonConfig.parse("64,3") == gs.GluonConfig(64, 3)
    assert gs.GluonConfig.parse(str(gs.GluonConfig(128, 2))) == gs.GluonConfig(128, 2)
    with pytest.raises(ValueError, match=r"block_n=96 is invalid; valid: 64, 128"):
        gs.GluonConfig(96, 2)
    with pytest.raises(ValueError, match=r"'64' is invalid; valid: 'BLOCK_N,STAGES'"):
        gs.GluonConfig.parse("64")
