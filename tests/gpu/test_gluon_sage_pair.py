"""gluon_sage's ``pair`` schedule (two key tiles per online-softmax step) on a real sm_90 GPU.

The kernel against :func:`qattn_fx.kernels.emulation.emulate_launched` with ``pair`` (fp32 level, Hopper FP8-MMA
precision) in the launch classes it serves: dense and block-sparse (lists with empty query tiles, odd and even
visit counts), split tails, LSE, Q quantized in the kernel, fp8 Q/K, K in key order, and persistent launches (the
bits of the non-persistent one). Run: ``pytest -m gpu tests/gpu/test_gluon_sage_pair.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import support
from support import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx import config as qattn_config  # noqa: E402
from qattn_fx.kernels import emulation  # noqa: E402
from qattn_fx.kernels import gluon_sage as gs  # noqa: E402

DEV = "cuda"
needs_sm90 = support.needs_capability(gs.CAPABILITY, reason="gluon_sage needs sm_90")

PAIR = "128,3,permk,tarrive,mmasum,pair"
#: name: (config, make_qkv overrides, recipe (qk, q_block, k_block), return_lse, share of blocks listed or None)
CASES = {
    "dense-even-tiles": (PAIR, dict(sq=1000, skv=1024), ("int8", 1, 16), False, None),  # 8 key tiles: 4 pairs
    "dense-odd-tiles": (PAIR, dict(sq=1000, skv=1400), ("int8", 1, 16), True, None),  # 11 key tiles: last alone
    "dense-one-tile": (PAIR, dict(sq=700, skv=100), ("int8", 1, 16), False, None),
    "dense-4-stages-fp8": ("128,4,permk,tarrive,mmasum,pair", dict(sq=1000, skv=2000), ("fp8", 1, 16), False, None),
    "dense-q-in-kernel": (PAIR, dict(sq=1000, skv=1500), ("q-in-kernel", 1, 16), True, None),
    "key-order-k1": ("128,3,mmasum,pair", dict(sq=1000, skv=1500), ("int8", 1, 1), False, None),
    "sparse-half": (PAIR, dict(sq=2000, skv=4000), ("int8", 1, 16), True, 0.5),
    "sparse-few": (PAIR, dict(sq=2000, skv=4000), ("int8", 1, 16), False, 0.15),
    "sparse-q-in-kernel": (PAIR, dict(sq=2000, skv=3000), ("q-in-kernel", 1, 16), False, 0.5),
}


def _inputs(overrides, recipe):
    qk, q_block, k_block = recipe
    q, k, v = support.make_qkv(**{**dict(b=1, hq=4, hkv=2, d=128, device=DEV), **overrides})
    args = quantize(q, k, v, "int8" if qk == "q-in-kernel" else qk, q_block, k_block)
    if qk == "q-in-kernel":
        return (q.to(torch.bfloat16), None, *args[2:]), args
    return args, args


@needs_sm90
@pytest.mark.parametrize("tail_split", [False, True], ids=["whole", "tail-split"])
@pytest.mark.parametrize("case", list(CASES))
def test_pair_matches_the_emulation_as_launched(case, tail_split, monkeypatch):
    config, overrides, recipe, lse, density = CASES[case]
    monkeypatch.setattr(gs.launch, "sm_count", lambda index: 40)  # (a partial last wave to split)
    args, emulated = _inputs(overrides, recipe)
    b, hq, sq, d = args[0].shape
    lists = None if density is None else support.block_lists(b, hq, sq, args[2].shape[2], density, device=DEV)
    extras = {} if lists is None else dict(block_index=lists[0], block_count=lists[1])
    sm_scale = 1.0 / math.sqrt(d)
    with gs.use_config(config), qattn_config.patch(gluon_tail_split=tail_split):
        got = gs.attention(*args, sm_scale, torch.float32, return_lse=lse, **extras)
    cfg, tail = gs.last_config(), gs.last_tail_plan()
    assert cfg == gs.GluonConfig.parse(config) and cfg.pair
    want = emulation.emulate_launched(*emulated, sm_scale, cfg, tail, return_lse=lse, **extras)
    out, want_out = (got[0], want[0]) if lse else (got, want)
    label = f"{case} {config}{f' ({tail})' if tail else ''}"
    assert not out.isnan().any(), label
    support.assert_fp32_level(out, want_out, label, fp8_qk=args[2].dtype == torch.float8_e4m3fn, name="gluon_sage",
                              mmasum=True)
    if lse:
        finite = want[1] > float("-inf")
        assert torch.equal(got[1] > float("-inf"), finite), label
        assert (got[1][finite] - want[1][finite].float()).abs().max() < 2e-2, label


@needs_sm90
@pytest.mark.parametrize("density", [None, 0.5], ids=["dense", "sparse"])
def test_persistent_pair_gives_the_bits_of_the_non_persistent_one(density, monkeypatch):
    monkeypatch.setattr(gs.launch, "sm_count", lambda index: 40)
    args, _ = _inputs(dict(b=2, hq=8, hkv=8, sq=2000, skv=3000), ("int8", 1, 16))
    b, hq, sq, _ = args[0].shape
    lists = None if density is None else support.block_lists(b, hq, sq, args[2].shape[2], density, device=DEV)
    extras = {} if lists is None else dict(block_index=lists[0], block_count=lists[1])
    outs = []
    for config in (PAIR, PAIR + ",persist"):
        with gs.use_config(config):
            outs.append(gs.attention(*args, 0.125, torch.float32, **extras))
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()


@needs_sm90
def test_pair_refuses_a_key_bias():
    args, _ = _inputs(dict(sq=500, skv=700), ("int8", 1, 16))
    with gs.use_config(PAIR), pytest.raises(ValueError, match=r"\(pair\) runs launches without a key bias"):
        gs.attention(*args, 0.1, torch.bfloat16, key_bias=torch.zeros(1, 700, device=DEV))
