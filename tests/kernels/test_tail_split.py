"""qattn_fx.kernels.gluon_sage.tail_split on CPU: the planner's choices at the benchmark shapes and the LSE merge's
algebra.

The merge kernel itself runs on the GPU
(tests/gpu/test_gluon_sage.py::test_split_tail_pieces_merge_to_the_emulated_split).
"""

from __future__ import annotations

import pytest
import torch

from qattn_fx.kernels.gluon_sage.tail_split import TailPlan, merge_reference, plan


@pytest.mark.parametrize("ctas,slots,kv,expected", [
    # wan1.3b-480p, trio (192 rows): 12 heads x 171 CTAs on 132 SMs = 15.55 waves; tail 72 CTAs x 5 pieces
    (2052, 132, 32760, TailPlan(ctas=2052, main=1980, splits=5, kv_split=6656)),
    # wan14b-720p, trio: 40 x 394 = 119.4 waves
    (15760, 132, 75600, TailPlan(ctas=15760, main=15708, splits=5, kv_split=15232)),
    # flux-1024 (4608 tokens, 24 heads): trio 576 CTAs = 4.36 waves; two consumers 864 = 6.55 waves
    (576, 132, 4608, TailPlan(ctas=576, main=528, splits=2, kv_split=2304)),
    (864, 132, 4608, TailPlan(ctas=864, main=792, splits=3, kv_split=1536)),
])
def test_plan_at_benchmark_shapes(ctas, slots, kv, expected):
    got = plan(ctas, slots, kv, 128, 16)
    assert got == expected
    assert got.grid == got.main + got.tail * got.splits
    assert (got.splits - 1) * got.kv_split < kv <= got.splits * got.kv_split  # every piece has keys


@pytest.mark.parametrize("ctas,slots,kv,why", [
    (264, 132, 32760, "whole waves"),
    (200, 132, 1500, "rows of 12 tiles are too short"),
    (131, 132, 2048, "16 tiles in two pieces: 2 x 10 / 16 of a CTA's time"),
])
def test_plan_declines(ctas, slots, kv, why):
    assert plan(ctas, slots, kv, 128, 16) is None, why


@pytest.mark.parametrize("k_block", [0, 1, 16, 128, 256, 384])
def test_pieces_are_whole_tiles_aligned_to_k_scales(k_block):
    got = plan(2052, 132, 32760, 128, k_block)
    assert got is not None and got.kv_split % 128 == 0 and got.kv_split >= 256
    if k_block:
        assert got.kv_split % k_block == 0
    last = 32760 - (got.splits - 1) * got.kv_split
    assert last > 128  # at least two tiles


def test_plan_names_bad_arguments():
    with pytest.raises(ValueError, match=r"plan: ctas=0, slots=132, block_n=128; valid: positive ints"):
        plan(0, 132, 1000, 128)


def test_merge_reference_recovers_unsplit_attention():
    """Softmax attention over all keys == the LSE-weighted mix of attention over disjoint key ranges."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for n in (5, 50, 50))

    def attend(kk, vv):
        s = q @ kk.transpose(-1, -2)
        return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)

    full, full_lse = attend(k, v)
    parts = [attend(k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 17), (17, 40), (40, 50))]
    out, lse = merge_reference(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)
