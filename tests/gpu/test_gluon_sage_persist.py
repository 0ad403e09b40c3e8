"""gluon_sage's persistent schedule (``persist``, :mod:`qattn_fx.kernels.gluon_sage.schedule`) on a real sm_90 GPU.

A persistent launch runs the work items of the non-persistent grid, several per CTA, in the same order and with the
same per-item computation, so its output (and LSE) must equal the non-persistent launch of the same config bit for
bit, in every launch class: with the tail split's pieces among the items, items of one key tile (shorter than the
rings), many items per CTA, a grid smaller than the SMs, Q quantized in the kernel, GQA, key bias, LSE and
Skip-Softmax; and block-sparse launches (:data:`~qattn_fx.kernels.gluon_sage.SPARSE_PERSIST_CONFIGS`), whose items
find their own lists and visit different numbers of key tiles, none for some. Run: ``pytest -m gpu
tests/gpu/test_gluon_sage_persist.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import support
from support import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx.kernels import gluon_sage as gs  # noqa: E402
from qattn_fx.kernels import reference  # noqa: E402

DEV = "cuda"
needs_sm90 = support.needs_capability(gs.CAPABILITY, reason="gluon_sage needs sm_90")
make_qkv = functools.partial(support.make_qkv, hq=8, hkv=4, sq=1000, skv=1500, d=128, device=DEV)

TRIO = "128,3,trio,permk,tarrive,mmasum"
AHEAD = "128,3,ahead,mmasum"
#: (config, make_qkv overrides, recipe (qk, q_block, k_block), call extras): the launch classes.
CASES = {
    "trio": (TRIO, {}, ("int8", 1, 16), {}),
    "trio-many-items": (TRIO, dict(b=2, hq=24, hkv=24, sq=4608, skv=4608), ("int8", 1, 16), {}),
    "trio-one-key-tile": (TRIO, dict(sq=3000, skv=100), ("int8", 1, 16), {}),
    "trio-small-grid": (TRIO, dict(b=1, hq=2, hkv=1, sq=700, skv=2000), ("int8", 1, 16), {}),
    "trio-q-in-kernel": (TRIO, {}, ("q-in-kernel", 1, 16), {}),
    "trio-fp8": (TRIO, {}, ("fp8", 1, 16), {}),
    "trio-lse": (TRIO, {}, ("int8", 1, 16), dict(return_lse=True)),
    "trio-key-bias": (TRIO, {}, ("int8", 1, 16), dict(key_bias="pad")),
    "trio-skip": (TRIO, dict(skv=4000), ("int8", 1, 16), dict(skip_threshold=0.05)),
    "ahead-permk": ("128,3,ahead,permk,mmasum", {}, ("int8", 1, 16), {}),
    "ahead-k1": (AHEAD, {}, ("int8", 1, 1), {}),
    "ahead-bf16": (AHEAD, {}, ("bf16", 0, 0), {}),
    "ahead-key-bias-lse": (AHEAD, {}, ("int8", 1, 1), dict(key_bias="pad", return_lse=True)),
    "serial-2": ("128,2,mmasum", dict(sq=2000, skv=300), ("int8", 1, 16), {}),
    "block64": ("64,3,ahead", {}, ("int8", 1, 16), {}),
    "quad-d64": ("128,2,quad,permk,mmasum", dict(d=64, sq=4700), ("int8", 1, 16), {}),
}


def _inputs(overrides, recipe):
    qk, q_block, k_block = recipe
    q, k, v = make_qkv(**overrides)
    args = quantize(q, k, v, "int8" if qk == "q-in-kernel" else qk, q_block, k_block)
    if qk == "q-in-kernel":
        args = (q.to(torch.bfloat16), None, *args[2:])
    return args


def _call(args, config, extras, lists=None):
    extras = dict(extras)
    if lists is not None:
        extras["block_index"], extras["block_count"] = lists
    if extras.get("key_bias") == "pad":  # batch 0 sees all keys, batch 1 the first 60 %
        skv = args[2].shape[2]
        bias = torch.zeros(args[0].shape[0], skv, device=DEV)
        bias[-1, int(skv * 0.6):] = float("-inf")
        extras["key_bias"] = bias
    if "skip_threshold" in extras:
        extras["skip_threshold"] = torch.tensor([extras["skip_threshold"]], device=DEV)
    with gs.use_config(config):
        return gs.attention(*args, 0.125, torch.float32, **extras)


@needs_sm90
@pytest.mark.parametrize("tail_split", [False, True], ids=["whole", "tail-split"])
@pytest.mark.parametrize("case", list(CASES))
def test_persistent_launch_gives_the_bits_of_the_non_persistent_one(case, tail_split, monkeypatch, qattn_config):
    """Same config with and without ``persist``: equal output (and LSE) bit for bit; with the tail split (40
    stand-in SMs make the last wave partial) both run the same pieces, the persistent one among its items on every
    real SM; the result is close to the reference op."""
    config, overrides, recipe, extras = CASES[case]
    if tail_split and "skip_threshold" in extras:
        pytest.skip("Skip-Softmax launches run without the tail split")
    monkeypatch.setattr(gs.launch, "sm_count", lambda index: 40)
    qattn_config(gluon_tail_split=tail_split)
    if tail_split:  # rows of at least MIN_KV_TILES key tiles, so that the partial last wave is split
        overrides = {**overrides, "skv": max(overrides.get("skv", 1500), 2500)}
    args = _inputs(overrides, recipe)
    base = gs.GluonConfig.parse(config)
    persistent = gs.GluonConfig.parse(config + ",persist")
    want = _call(args, base, extras)
    want_tail = gs.last_tail_plan()
    got = _call(args, persistent, extras)
    assert gs.last_tail_plan() == want_tail and gs.last_config() == persistent
    if tail_split and want_tail is None:  # (the planner found too little to win: tail_split.plan)
        pytest.skip(f"{case}: the partial last wave on 40 slots is not split")
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w), f"{case}: max |diff| {(g - w).abs().max().item()}"
    out = got[0] if isinstance(got, tuple) else got
    if not extras and recipe[0] != "q-in-kernel":  # (the other classes' references: tests/gpu/test_gluon_sage.py)
        support.assert_close_to_reference(out, reference.scaled_attention(*args, 0.125, torch.float32),
                                          f"{case} persistent", name="gluon_sage")


@needs_sm90
def test_persistent_grid_is_one_cta_per_sm_at_most():
    """The grid: ``min(work items, SMs)`` CTAs, one dimension."""
    args = _inputs(dict(b=2, hq=24, hkv=24, sq=4608, skv=4608), ("int8", 1, 16))
    out = torch.empty(2, 24, 4608, 128, device=DEV, dtype=torch.bfloat16)
    config = gs.GluonConfig.parse(TRIO + ",persist")
    plan = gs.plan_launch(*args[:6], 1, 16, 0.125, out, out, False, config)
    assert plan.grid == (min(2 * 24 * gs.q_blocks(4608, config), gs.sm_count(torch.cuda.current_device())),)


#: Block-sparse launch classes (config, make_qkv overrides, recipe, call extras, share of blocks listed); the lists
#: leave some query tiles empty (:func:`support.block_lists`).
SPARSE_CASES = {
    "permk": ("128,3,ahead,permk,mmasum", {}, ("int8", 1, 16), {}, 0.5),
    "permk-many-items": ("128,2,ahead,permk,mmasum", dict(b=2, hq=24, hkv=24, sq=4608, skv=4608), ("int8", 1, 16),
                         {}, 0.5),
    "permk-few-blocks": ("128,3,ahead,permk,mmasum", dict(skv=4000), ("int8", 1, 16), {}, 0.1),
    "permk-q-in-kernel-lse": ("128,3,ahead,permk,mmasum", {}, ("q-in-kernel", 1, 16), dict(return_lse=True), 0.5),
    "permk-fp8": ("128,3,ahead,permk,mmasum", {}, ("fp8", 1, 16), {}, 0.5),
    "permk-key-bias-lse": ("128,3,ahead,permk,mmasum", {}, ("int8", 1, 16), dict(key_bias="pad", return_lse=True),
                           0.6),
    "key-order-k1": (AHEAD, {}, ("int8", 1, 1), {}, 0.5),
    "key-order-bf16-key-bias": (AHEAD, {}, ("bf16", 0, 0), dict(key_bias="pad"), 0.5),
    "serial-skip": ("128,3,permk,mmasum", dict(skv=4000), ("int8", 1, 16), dict(skip_threshold=0.05), 0.6),
}


@needs_sm90
@pytest.mark.parametrize("tail_split", [False, True], ids=["whole", "tail-split"])
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_persistent_block_sparse_launch_gives_the_bits_of_the_non_persistent_one(case, tail_split, monkeypatch,
                                                                                 qattn_config):
    """A block-sparse launch with and without ``persist``: equal output (and LSE) bit for bit, each persistent work
    item reading its own query tile's list (and its piece's list positions under a split tail) while the rings count
    on across items of different visit counts."""
    config, overrides, recipe, extras, density = SPARSE_CASES[case]
    if tail_split and "skip_threshold" in extras:
        pytest.skip("Skip-Softmax launches run without the tail split")
    monkeypatch.setattr(gs.launch, "sm_count", lambda index: 40)
    qattn_config(gluon_tail_split=tail_split)
    if tail_split:
        overrides = {**overrides, "skv": max(overrides.get("skv", 1500), 2500)}
    args = _inputs(overrides, recipe)
    b, hq, sq, _ = args[0].shape
    lists = support.block_lists(b, hq, sq, args[2].shape[2], density, device=DEV)
    base = gs.GluonConfig.parse(config)
    persistent = gs.GluonConfig.parse(config + ",persist")
    want = _call(args, base, extras, lists)
    want_tail = gs.last_tail_plan()
    got = _call(args, persistent, extras, lists)
    assert gs.last_tail_plan() == want_tail and gs.last_config() == persistent
    if tail_split and want_tail is None:
        pytest.skip(f"{case}: the partial last wave on 40 slots is not split")
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w), f"{case}: max |diff| {(g - w).abs().max().item()}"
