"""gluon_sage's block sparsity (:mod:`qattn_fx.block_sparse`) on a real sm_90 GPU.

Run: ``pytest -m gpu tests/gpu/test_gluon_sage_sparse.py -v -s``. The kernel visits only the listed key tiles of
each 128-row query tile; it is pinned to :func:`qattn_fx.kernels.emulation.emulate_launched` with the same lists
(fp32 level, Hopper FP8-MMA precision, as tests/gpu/test_gluon_sage.py), with the tail split it launched
(``last_tail_plan``: its pieces visit the listed tiles of their key ranges), and to the dense kernel's bits when
every block is listed. Kept small: one compile per launch class it needs.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import support
from support import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx  # noqa: E402
import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx import block_sparse  # noqa: E402
from qattn_fx import config as qattn_config  # noqa: E402
from qattn_fx.kernels import emulation  # noqa: E402
from qattn_fx.kernels import gluon_sage as gs  # noqa: E402

DEV = "cuda"
needs_sm90 = support.needs_capability(gs.CAPABILITY, reason="gluon_sage needs sm_90")

SPARSE = str(gs.SPARSE_TUNED_CONFIGS[0])  # 128,3,ahead,permk,mmasum: the permk class's two-consumer default


_lists = functools.partial(support.block_lists, device=DEV)  # (some query tiles list nothing)


def _inputs(qk="int8", blocks=(1, 16), b=1, hq=4, hkv=2, sq=4096, skv=4096, d=128, seed=0):
    q, k, v = support.make_qkv(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, seed=seed, device=DEV)
    return quantize(q, k, v, qk, *blocks)


def _check(args, config, lists, what, key_bias=None):
    """Run the kernel with ``lists`` (LSE too) under ``config``; assert fp32-level agreement with the emulation as
    launched, LSE included, and that query tiles listing nothing give 0 and LSE -inf."""
    sm_scale = 1.0 / math.sqrt(args[0].shape[-1])
    index, count = lists
    with gs.use_config(config), qattn_config.patch(gluon_tail_split=True):
        out, lse = gs.attention(*args, sm_scale, torch.float32, return_lse=True, key_bias=key_bias,
                                block_index=index, block_count=count)
    cfg, tail = gs.last_config(), gs.last_tail_plan()
    assert cfg == gs.GluonConfig.parse(config) and cfg.consumers == 2
    want, want_lse = emulation.emulate_launched(*args, sm_scale, cfg, tail, return_lse=True, key_bias=key_bias,
                                                block_index=index, block_count=count)
    label = f"{config} {what}{f' ({tail})' if tail else ''}"
    assert not out.isnan().any() and not lse.isnan().any(), label
    support.assert_fp32_level(out, want, label, fp8_qk=args[0].dtype == torch.float8_e4m3fn, name="gluon_sage",
                              mmasum=bool(cfg.mmasum))
    finite = want_lse > float("-inf")
    assert torch.equal(lse > float("-inf"), finite), label
    atol = 1e-2 if args[0].dtype == torch.float8_e4m3fn else 2e-3  # FP8 Q/K logits: the MMA's ~22-bit sums
    # A row that visits few keys may see one e4m3 P round the other way (the kernel's exp2 is not torch's), which
    # moves its LSE by up to ~1e-2 under mmasum (H100: 7.2e-3 in 1 of 65,520 one-tile rows): rare rows may exceed atol.
    diff = (lse[finite] - want_lse[finite].float()).abs()
    worst, outside = (float(diff.max()) if diff.numel() else 0.0), int((diff > atol).sum())
    assert outside <= max(1, diff.numel() // 10_000) and worst < 2e-2, (label, worst, outside)
    empty = block_sparse.row_mask((count == 0)[..., None], args[0].shape[2])[..., 0]  # rows listing nothing
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and (lse[empty] == float("-inf")).all(), label
    return out, lse, tail


CASES = {  # name: (config, inputs, density, key bias, expect a tail split)
    "int8-gqa-4096": (SPARSE, dict(), 0.5, False, False),
    "int8-4608-partial-tail": (SPARSE, dict(hq=5, hkv=5, sq=4608, skv=4600), 0.4, False, True),
    "fp8-4096": (SPARSE, dict(qk="fp8"), 0.5, False, False),
    "int8-mask-4096": (SPARSE, dict(b=2, hq=2, hkv=2), 0.6, True, False),
    "int8-32760-keys-tail": (SPARSE, dict(hq=5, hkv=5, sq=4000, skv=32760), 0.3, False, True),  # partial q tile
    "key-order-k1": (str(gs.KEY_ORDER_TUNED_CONFIGS[0]), dict(blocks=(1, 1), b=2, hq=2, hkv=2, sq=1000, skv=1500),
                     0.5, False, False),
}


@needs_sm90
@pytest.mark.parametrize("name", list(CASES))
def test_lists_match_the_emulation_as_launched(name):
    config, inputs, density, masked, split = CASES[name]
    args = _inputs(**inputs)
    b, hq, sq, _ = args[0].shape
    skv = args[2].shape[2]
    key_bias = None
    if masked:  # a key-padding mask: batch row 1 keeps its first 70 % of keys
        key_bias = torch.zeros(b, skv, device=DEV)
        key_bias[-1, int(0.7 * skv):] = float("-inf")
    _, _, tail = _check(args, config, _lists(b, hq, sq, skv, density), name, key_bias)
    if gs.sm_count(torch.cuda.current_device()) == 132:  # (the shapes' tails are sized for 132 SMs)
        assert (tail is not None) == split, (name, tail)
    assert tail is None or tail.kv_split % block_sparse.BLOCK_KEYS == 0


@needs_sm90
def test_all_listed_gives_the_dense_bits():
    """Lists of every block: the same tiles in the same order as the dense launch of the config (its tail split,
    key bias and LSE included), so the same bits."""
    args = _inputs(b=1, hq=5, hkv=5, sq=4608, skv=4600)  # 180 CTAs: a tail of 48 on 132 SMs
    b, hq, sq, _ = args[0].shape
    skv = args[2].shape[2]
    key_bias = torch.zeros(b, skv, device=DEV)
    key_bias[0, 4000:] = float("-inf")
    index, count = block_sparse.dense(b, hq, sq, skv, DEV)
    sm_scale = 1.0 / math.sqrt(128)
    with gs.use_config(SPARSE), qattn_config.patch(gluon_tail_split=True):
        dense, dense_lse = gs.attention(*args, sm_scale, torch.bfloat16, return_lse=True, key_bias=key_bias)
        dense_tail = gs.last_tail_plan()
        out, lse = gs.attention(*args, sm_scale, torch.bfloat16, return_lse=True, key_bias=key_bias,
                                block_index=index, block_count=count)
    assert gs.last_tail_plan() == dense_tail
    assert dense_tail is not None or gs.sm_count(torch.cuda.current_device()) != 132
    assert torch.equal(out, dense), (out.float() - dense.float()).abs().max()
    assert torch.equal(lse, dense_lse)


@needs_sm90
def test_skip_softmax_tests_the_visited_tiles():
    """Skip-Softmax's online test runs on the listed tiles only (no tail split with it): the emulation with the
    same lists and threshold, and the skipped-tile count."""
    from benchmarks.common import local_qkv

    q, k, v = local_qkv(2, 4, 2000, 3000, 128, sharpness=4.0, width=300.0, seed=0, device=DEV)
    args = quantize(q, k, v, "int8", 1, 16)
    index, count = _lists(2, 4, 2000, 3000, 0.6, seed=1)
    config = str(gs.SPARSE_SKIP_TUNED_CONFIGS[0])
    sm_scale = 1.0 / math.sqrt(128)
    skipped = torch.zeros(1, dtype=torch.int32, device=DEV)
    with gs.use_config(config):
        out = gs.attention(*args, sm_scale, torch.float32, skip_threshold=torch.tensor([0.05], device=DEV),
                           skip_count=skipped, block_index=index, block_count=count)
    assert gs.last_tail_plan() is None
    counts = []
    want = emulation.emulate(*args, sm_scale, 128, True, skip_threshold=0.05, skip_counts=counts, block_index=index,
                             block_count=count)
    assert counts[0] > 0, "structured inputs should skip some visited tiles"
    total = int(count.sum()) * 2  # visited (64-row, 128-key) tiles
    assert abs(int(skipped) - counts[0]) <= max(2, 0.002 * total), (int(skipped), counts[0], total)
    support.assert_fp32_level(out, want, f"{config} skip λ=0.05 + lists", name="gluon_sage", mmasum=True)


@needs_sm90
def test_trio_is_refused_and_the_op_runs_lists_on_gluon_sage():
    args = _inputs()
    index, count = _lists(1, 4, 4096, 4096, 0.5)
    with gs.use_config(gs.TRIO_DEFAULT_CONFIG), pytest.raises(ValueError, match="cannot run block-sparse calls"):
        gs.attention(*args, 0.1, torch.bfloat16, block_index=index, block_count=count)
    with gs.use_config(SPARSE):
        out = torch.ops.qattn.scaled_attention(*args, 0.1, torch.bfloat16, "gluon_sage", block_index=index,
                                               block_count=count)
        direct = gs.attention(*args, 0.1, torch.bfloat16, block_index=index, block_count=count)
    assert torch.equal(out, direct)
