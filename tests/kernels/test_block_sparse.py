"""Block sparsity's format and numerics on the CPU (:mod:`qattn_fx.block_sparse`): the lists and their mask, the
argument checks, and what the reference kernel and the emulated tile loop compute with lists.

The reference is pinned to an independent expected value (dequantized fp32 attention with an explicit per-logit
mask from :func:`block_sparse.expand`); the emulation to itself (all-visited lists give the bits of no lists;
unvisited blocks' K/V data never reach the output; a query tile's rows equal the tile loop over its visited key
tiles alone).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qattn_fx.ops  # noqa: F401  (registers qattn::* ops)
from qattn_fx import block_sparse, formats, skip_softmax
from qattn_fx.kernels import emulation, reference
from support import make_qkv, quantize

ops = torch.ops.qattn
R, K = block_sparse.BLOCK_ROWS, block_sparse.BLOCK_KEYS


def random_visit(b, h, sq, skv, p=0.5, seed=0):
    nq, nk = block_sparse.tiles(sq, skv)
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, h, nq, nk, generator=g) < p


def inputs(b=1, hq=4, hkv=2, sq=300, skv=400, d=32, seed=0):
    """int8 Q (per token) / K (per 16 keys) and fp8 V (per channel), as the compiled graph feeds a kernel."""
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, seed=seed)
    return quantize(q, k, v, "int8", 1, 16)


def expected(args, sm_scale, visit, key_bias=None):
    """Dequantized fp32 attention with P rounded as the recipe's P·V sees it and the unvisited blocks' logits
    masked per logit: what the reference must return."""
    q, qs, k, ks, v, vs, qb, kb = args
    qf, kf = formats.dequantize_scaled(q, qs, qb), formats.dequantize_scaled(k, ks, kb)
    vf = formats.dequantize_v(v, vs)[:, :, : k.shape[2]]
    g = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = qf @ kf.transpose(-1, -2) * sm_scale
    if key_bias is not None:
        s = s + key_bias.float()[:, None, None, :]
    s = s.masked_fill(~block_sparse.expand(visit, q.shape[2], k.shape[2]), -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(m == -math.inf, 0.0, m))
    l = p.sum(-1, keepdim=True)
    out = formats.round_p_fp8(p) @ vf / torch.where(l == 0, 1.0, l)
    return out, (m + torch.log(l)).squeeze(-1)


def sink_inputs(sq=300, skv=640, seed=0):
    """int8 inputs (B=1, 2 heads) whose first key tile is a strong attention sink: later tiles fall below the
    running max, so Skip-Softmax's test skips some of them."""
    q, k, v = make_qkv(1, 2, 2, sq, skv, 32, seed=seed)
    k = k.clone()
    k[:, :, :128] += 3 * q.float().mean(2, keepdim=True).to(k.dtype)
    return quantize(q, k, v, "int8", 1, 16)


def lists(visit):
    blocks = block_sparse.from_mask(visit)
    return dict(block_index=blocks.index, block_count=blocks.count)


# ------------------------------------------------------------------------------------------------------------------
# The format
# ------------------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 3), h=st.integers(1, 3), nq=st.integers(0, 5), nk=st.integers(0, 7),
       p=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_from_mask_to_mask_round_trip(b, h, nq, nk, p, seed):
    visit = torch.rand(b, h, nq, nk, generator=torch.Generator().manual_seed(seed)) < p
    blocks = block_sparse.from_mask(visit)
    assert blocks.index.dtype == blocks.count.dtype == torch.int32
    assert blocks.index.shape == (b, h, nq, nk) and blocks.count.shape == (b, h, nq)
    assert blocks.index.is_contiguous() and blocks.count.is_contiguous()
    assert torch.equal(block_sparse.to_mask(blocks), visit)
    assert torch.equal(blocks.count, visit.sum(-1).int())
    listed = torch.arange(nk) < blocks.count[..., None]
    assert bool((blocks.index[~listed] == -1).all())  # past the count: -1
    idx = blocks.index.long()
    assert bool(((idx[..., 1:] > idx[..., :-1]) | ~listed[..., 1:]).all())  # ascending, each once
    assert blocks.visited == int(visit.sum()) and blocks.total == visit.numel()
    again = block_sparse.from_mask(block_sparse.to_mask(blocks))
    assert torch.equal(again.index, blocks.index) and torch.equal(again.count, blocks.count)


@pytest.mark.parametrize("sq,skv", [(1, 1), (128, 128), (129, 300), (300, 77), (1000, 257)])
def test_tiles_dense_and_expand_on_odd_lengths(sq, skv):
    nq, nk = block_sparse.tiles(sq, skv)
    assert (nq, nk) == (math.ceil(sq / 128), math.ceil(skv / 128))
    d = block_sparse.dense(2, 3, sq, skv)
    assert bool((d.count == nk).all()) and d.sparsity() == 0.0
    visit = random_visit(1, 2, sq, skv, seed=sq)
    full = block_sparse.expand(visit, sq, skv)
    assert full.shape == (1, 2, sq, skv)
    rows, cols = torch.meshgrid(torch.arange(sq), torch.arange(skv), indexing="ij")
    assert torch.equal(full, visit[:, :, rows // R, cols // K])
    assert torch.equal(block_sparse.row_mask(visit, sq), visit[:, :, torch.arange(sq) // R])


def test_measure_records_each_label():
    visit = random_visit(1, 2, 300, 400)
    with block_sparse.measure() as m:
        block_sparse.record("a", block_sparse.from_mask(visit))
        block_sparse.record("a", block_sparse.dense(1, 2, 300, 400))
    site = m.sites["a"]
    assert (site.skipped, site.tiles) == (int((~visit).sum()), 2 * visit.numel())
    block_sparse.record("outside", block_sparse.dense(1, 1, 1, 1))  # no measurement: no-op


def test_check_names_the_argument_and_the_expected_shape():
    good = block_sparse.from_mask(random_visit(2, 4, 300, 400))
    block_sparse.check(*good, 2, 4, 300, 400)
    block_sparse.check(None, None, 2, 4, 300, 400)
    with pytest.raises(ValueError, match="got only block_index"):
        block_sparse.check(good.index, None, 2, 4, 300, 400)
    with pytest.raises(ValueError, match="got only block_count"):
        block_sparse.check(None, good.count, 2, 4, 300, 400)
    with pytest.raises(ValueError, match="block_index must be int32; got torch.int64"):
        block_sparse.check(good.index.long(), good.count, 2, 4, 300, 400)
    with pytest.raises(ValueError, match="block_count must be int32"):
        block_sparse.check(good.index, good.count.float(), 2, 4, 300, 400)
    with pytest.raises(ValueError, match=r"block_index must have shape \(2, 4, 3, 6\) .*Skv/128.*got \(2, 4, 3, 4\)"):
        block_sparse.check(good.index, good.count, 2, 4, 300, 700)
    with pytest.raises(ValueError, match=r"block_count must have shape \(2, 8, 3\)"):
        block_sparse.check(good.index.repeat(1, 2, 1, 1), good.count, 2, 8, 300, 400)
    with pytest.raises(ValueError, match="block_index must be contiguous"):
        block_sparse.check(good.index.transpose(0, 1).contiguous().transpose(0, 1), good.count, 2, 4, 300, 400)
    with pytest.raises(ValueError, match="block_index is on cpu and block_count on meta"):
        block_sparse.check(good.index, good.count.to("meta"), 2, 4, 300, 400)
    block_sparse.check(*good, 2, 4, 300, 400, torch.device("cpu"))
    with pytest.raises(ValueError, match="^block_index and block_count are on cpu; they must be on Q's device meta$"):
        block_sparse.check(*good, 2, 4, 300, 400, torch.device("meta"))
    with pytest.raises(ValueError, match="bool"):
        block_sparse.from_mask(torch.ones(2, 3, 4))


# ------------------------------------------------------------------------------------------------------------------
# The reference kernel
# ------------------------------------------------------------------------------------------------------------------

SHAPES = {"gqa-odd": dict(b=1, hq=4, hkv=2, sq=300, skv=400), "mha-b2": dict(b=2, hq=2, hkv=2, sq=257, skv=129),
          "sq<skv-short": dict(b=1, hq=2, hkv=1, sq=77, skv=600), "multiples": dict(b=1, hq=2, hkv=2, sq=256, skv=384)}


@pytest.mark.parametrize("bias", [None, "padding", "batch1-additive"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_with_lists_is_attention_with_the_unvisited_logits_masked(shape, bias):
    s = SHAPES[shape]
    args = inputs(**s, seed=len(shape))
    b, skv = s["b"], s["skv"]
    key_bias = None
    if bias == "padding":
        key_bias = torch.zeros(b, skv)
        key_bias[0, skv - 100:] = -math.inf
    elif bias == "batch1-additive":
        key_bias = torch.randn(1, skv, generator=torch.Generator().manual_seed(1))
    visit = random_visit(b, s["hq"], s["sq"], skv, p=0.6, seed=3)
    visit[0, 0, 0] = False  # a query tile that visits nothing
    sm = 1 / math.sqrt(args[0].shape[-1])
    out, lse = reference.scaled_attention(*args, sm, torch.float32, key_bias=key_bias, return_lse=True,
                                          **lists(visit))
    want, want_lse = expected(args, sm, visit, key_bias)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert not out.isnan().any() and not lse.isnan().any()
    assert bool((out[0, 0, :R] == 0).all()) and bool((lse[0, 0, :R] == -math.inf).all())


def test_reference_lists_that_skip_whole_key_tiles_equal_masking_those_keys():
    args = inputs(b=1, hq=2, hkv=2, sq=300, skv=400)
    visit = torch.ones(1, 2, 3, 4, dtype=torch.bool)
    visit[..., 1] = False
    key_bias = torch.zeros(1, 400)
    key_bias[0, 128:256] = -math.inf
    a = reference.scaled_attention(*args, 0.125, torch.float32, **lists(visit))
    b = reference.scaled_attention(*args, 0.125, torch.float32, key_bias=key_bias)
    assert torch.equal(a, b)


def test_reference_empty_lists_give_zeros_and_lse_minus_inf():
    args = inputs(b=1, hq=2, hkv=1, sq=200, skv=300)
    visit = torch.zeros(1, 2, 2, 3, dtype=torch.bool)
    out, lse = reference.scaled_attention(*args, 0.125, torch.bfloat16, return_lse=True, **lists(visit))
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())
    dense = reference.dense_attention(*(x.float() for x in make_qkv(1, 2, 1, 200, 300, 32)), 0.125, torch.float32,
                                      **lists(visit))
    assert bool((dense == 0).all())


def test_reference_skip_softmax_tests_only_visited_tiles():
    args = sink_inputs()
    visit = random_visit(1, 2, 300, 640, p=0.5, seed=5)
    visit[..., 0] = True
    # 64-row Skip-Softmax tiles per query tile: 2, 2, 1 (rows 256..299)
    per_tile = torch.tensor([2, 2, 1])
    want_tested = int((visit.sum(-1) * per_tile).sum())
    sm = 1 / math.sqrt(32)
    with skip_softmax.measure() as m:
        plain = reference.scaled_attention(*args, sm, torch.float32, **lists(visit))
        zero = reference.scaled_attention(*args, sm, torch.float32, skip_threshold=torch.tensor(0.0),
                                          skip_label="zero", **lists(visit))
        some = reference.scaled_attention(*args, sm, torch.float32, skip_threshold=torch.tensor(0.5),
                                          skip_label="some", **lists(visit))
    assert m.sites["zero"].tiles == m.sites["some"].tiles == want_tested
    assert m.sites["zero"].skipped == 0 and torch.equal(zero, plain)
    assert 0 < m.sites["some"].skipped < want_tested
    # all-visited lists: the same output and counts as no lists
    with skip_softmax.measure() as m:
        a = reference.scaled_attention(*args, sm, torch.float32, skip_threshold=torch.tensor(0.5), skip_label="a",
                                       **lists(torch.ones_like(visit)))
        b = reference.scaled_attention(*args, sm, torch.float32, skip_threshold=torch.tensor(0.5), skip_label="b")
    assert torch.equal(a, b)
    assert (m.sites["a"].skipped, m.sites["a"].tiles) == (m.sites["b"].skipped, m.sites["b"].tiles)


# ------------------------------------------------------------------------------------------------------------------
# The emulated tile loop
# ------------------------------------------------------------------------------------------------------------------


def emulate(args, visit=None, **kw):
    extra = {} if visit is None else lists(visit)
    return emulation.emulate(*args, 1 / math.sqrt(args[0].shape[-1]), 128, return_lse=True, **extra, **kw)


@pytest.mark.parametrize("bias", [False, True])
def test_emulation_with_every_block_listed_is_bitwise_without_lists(bias):
    args = inputs(b=1, hq=4, hkv=2, sq=300, skv=400, seed=1)
    key_bias = None
    if bias:
        key_bias = torch.zeros(1, 400)
        key_bias[0, 350:] = -math.inf
    full = torch.ones(1, 4, 3, 4, dtype=torch.bool)
    for a, b in zip(emulate(args, full, key_bias=key_bias), emulate(args, key_bias=key_bias)):
        assert torch.equal(a, b)


def test_emulation_ignores_the_data_of_unvisited_blocks():
    """Key tiles 1 and 3 unvisited by every query tile of batch 0 (all heads of a K head's group): any K/V data
    there leaves every output bit as it was."""
    args = inputs(b=2, hq=4, hkv=2, sq=300, skv=400, seed=2)
    visit = random_visit(2, 4, 300, 400, p=0.7, seed=7)
    visit[0, :, :, 1] = visit[0, :, :, 3] = False
    q, qs, k, ks, v, vs, qb, kb = args
    g = torch.Generator().manual_seed(9)
    k2, v2 = k.clone(), v.clone()
    for lo, hi in ((128, 256), (384, 400)):
        k2[0, :, lo:hi] = torch.randint(-127, 128, k2[0, :, lo:hi].shape, generator=g, dtype=torch.int8)
        v2.view(torch.uint8)[0, :, lo:hi] = torch.randint(0, 0x7F, v2[0, :, lo:hi].shape, generator=g,
                                                          dtype=torch.uint8)
    assert not torch.equal(k2, k)
    a = emulate(args, visit)
    b = emulate((q, qs, k2, ks, v2, vs, qb, kb), visit)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("bias", [False, True])
def test_emulation_rows_equal_the_tile_loop_over_their_visited_tiles(bias):
    """A query tile's rows are the tile loop over its listed key tiles alone (concatenated in order): skipping a
    block leaves the state as it was, bit for bit. Per head of a GQA call (calls of different head counts differ
    at ~1e-8 already without lists, so each side is a one-head call)."""
    b, hq, hkv, sq, skv = 1, 4, 2, 300, 600
    q, qs, k, ks, v, vs, qb, kb = inputs(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, seed=3)
    key_bias = None
    if bias:
        key_bias = torch.randn(1, skv, generator=torch.Generator().manual_seed(4))
        key_bias[0, 500:] = -math.inf
    visit = random_visit(b, hq, sq, skv, p=0.5, seed=11)
    visit[0, 1, 2] = False
    visit[0, 1, 2, 4] = True  # the partial last key tile alone
    visit[0, 3, 1] = False  # nothing
    g = hq // hkv
    for h in range(hq):
        kv = slice(h // g, h // g + 1)
        head = (q[:, h:h + 1], qs[:, h:h + 1], k[:, kv], ks[:, kv], v[:, kv], vs[:, kv], qb, kb)
        out, lse = emulate(head, visit[:, h:h + 1], key_bias=key_bias)
        for i in range(visit.shape[2]):
            rows = slice(i * R, min((i + 1) * R, sq))
            keys = [torch.arange(j * K, min((j + 1) * K, skv)) for j in range(visit.shape[3]) if visit[0, h, i, j]]
            if not keys:
                assert bool((out[0, 0, rows] == 0).all()) and bool((lse[0, 0, rows] == -math.inf).all())
                continue
            keys = torch.cat(keys)
            sub = (q[:, h:h + 1, rows], qs[:, h:h + 1, rows], k[:, kv, keys], ks[:, kv][..., keys[::16] // 16],
                   v[:, kv, keys], vs[:, kv], qb, kb)
            want, want_lse = emulate(sub, key_bias=None if key_bias is None else key_bias[:, keys])
            assert torch.equal(out[0, 0, rows], want[0, 0]), (h, i)
            assert torch.equal(lse[0, 0, rows], want_lse[0, 0]), (h, i)


def test_emulation_empty_lists_and_skip_counts():
    args = sink_inputs(seed=4)
    out, lse = emulate(args, torch.zeros(1, 2, 3, 5, dtype=torch.bool))
    assert bool((out == 0).all()) and bool((lse == -math.inf).all()) and not out.isnan().any()
    visit = random_visit(1, 2, 300, 640, p=0.5, seed=5)
    visit[..., 0] = True
    counts, dense_counts = [], []
    a = emulate(args, visit, skip_threshold=0.0, skip_counts=counts)
    assert counts == [0]
    for x, y in zip(a, emulate(args, visit)):
        assert torch.equal(x, y)
    emulate(args, visit, skip_threshold=0.5, skip_counts=counts)
    emulate(args, torch.ones_like(visit), skip_threshold=0.5, skip_counts=dense_counts)
    emulate(args, skip_threshold=0.5, skip_counts=dense_counts)
    visited_tiles = int((visit.sum(-1) * torch.tensor([2, 2, 1])).sum())
    assert 0 < counts[1] <= visited_tiles
    assert dense_counts[0] == dense_counts[1]


def test_emulation_with_lists_stays_close_to_the_reference():
    args = inputs(b=1, hq=4, hkv=2, sq=300, skv=400, seed=6)
    visit = random_visit(1, 4, 300, 400, p=0.6, seed=2)
    visit[..., 0] = True  # every query tile visits something
    out, _ = emulate(args, visit)
    ref = reference.scaled_attention(*args, 1 / math.sqrt(32), torch.float32, **lists(visit))
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 5e-2, err


# ------------------------------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------------------------------


def test_op_passes_the_lists_to_the_reference_kernel():
    args = inputs(b=1, hq=4, hkv=2, sq=300, skv=400, seed=8)
    visit = random_visit(1, 4, 300, 400, seed=4)
    blocks = block_sparse.from_mask(visit)
    out = ops.scaled_attention(*args, 0.125, torch.bfloat16, "reference", block_index=blocks.index,
                               block_count=blocks.count)
    want = reference.scaled_attention(*args, 0.125, torch.bfloat16, **lists(visit))
    assert torch.equal(out, want)
    assert not torch.equal(out, ops.scaled_attention(*args, 0.125, torch.bfloat16, "reference"))
    with pytest.raises(ValueError, match=r"block_count must have shape \(1, 4, 3\)"):
        ops.scaled_attention(*args, 0.125, torch.bfloat16, "reference", block_index=blocks.index,
                             block_count=blocks.count[:, :2].contiguous())
    with pytest.raises(ValueError, match="got only block_index"):
        ops.scaled_attention(*args, 0.125, torch.bfloat16, "reference", block_index=blocks.index)


def test_op_names_the_kernels_with_block_sparsity_for_one_without():
    from qattn_fx import kernels

    without = [n for n, i in kernels.KERNELS.items() if not i.block_sparse and i.scaled]
    assert without, "every kernel takes lists: pick another"
    args = inputs(b=1, hq=2, hkv=2, sq=128, skv=128, seed=9)
    blocks = block_sparse.dense(1, 2, 128, 128)
    with pytest.raises(ValueError, match=rf"kernel '{without[0]}' takes no block_index .*kernels that do: reference"):
        ops.scaled_attention(*args, 0.125, torch.bfloat16, without[0], block_index=blocks.index,
                             block_count=blocks.count)
