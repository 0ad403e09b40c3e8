"""Probe (not kept): gluon_sage ``pair`` configs against the emulated tile loop with 256-key softmax steps."""
import pytest
import torch

from test_gluon_sage import check, make_qkv, needs_sm90, quantize, gs

PAIRS = ["128,4,permk,tarrive,mmasum,pair", "128,3,permk,mmasum,pair", "128,2,permk,tarrive,mmasum,pair",
         "128,4,tarrive,mmasum,pair", "128,3,permk,tarrive,mmasum,solo,pair"]


@needs_sm90
@pytest.mark.parametrize("config", PAIRS)
@pytest.mark.parametrize("skv", [100, 128, 256, 300, 555, 1000, 1100, 1500, 4096])
def test_pair_int8(config, skv):
    args = quantize(*make_qkv(b=2, hq=4, hkv=2, sq=333, skv=skv, d=128), "int8", 1, 16)
    check(args, f"skv{skv}", config=gs.GluonConfig.parse(config))


@needs_sm90
@pytest.mark.parametrize("config", PAIRS[:2])
@pytest.mark.parametrize("qk,blocks", [("int8", (1, 1)), ("int8", (0, 0)), ("fp8", (1, 16)), ("bf16", (0, 0)),
                                       ("int8", (1, 64))])
def test_pair_recipes(config, qk, blocks):
    args = quantize(*make_qkv(b=1, hq=4, hkv=4, sq=700, skv=1300, d=128), qk, *blocks)
    check(args, f"{qk}{blocks}", config=gs.GluonConfig.parse(config))


@needs_sm90
@pytest.mark.parametrize("config", PAIRS[:2])
def test_pair_d64_and_tail(config):
    check(quantize(*make_qkv(b=2, hq=4, hkv=2, sq=333, skv=777, d=64), "int8", 1, 16), "d64",
          config=gs.GluonConfig.parse(config))
    check(quantize(*make_qkv(b=1, hq=24, hkv=24, sq=4608, skv=4608, d=128), "int8", 1, 16), "flux",
          config=gs.GluonConfig.parse(config))


@needs_sm90
@pytest.mark.parametrize("config", PAIRS[:2])
def test_pair_q_in_kernel_bits(config):
    from test_gluon_sage import DEV
    q, k, v = make_qkv(b=1, hq=8, hkv=8, sq=1000, skv=1500, d=128)
    args = quantize(q, k, v, "int8", 1, 16)
    with gs.use_config(gs.GluonConfig.parse(config)):
        expected = gs.attention(*args, 0.1, torch.bfloat16)
        got = gs.attention(q, None, *args[2:], 0.1, torch.bfloat16)
    assert torch.equal(got, expected)
