"""The block predictor's definition (:mod:`qattn_fx.kernels.predict_blocks.reference`) and the op
``qattn::predict_blocks`` on the CPU: properties of the lists it returns (the cdf set covers ``keep`` and is
minimal, top_k's counts, keep >= 1 is dense, sinks and the diagonal, the self-similarity guard, empty key tiles,
GQA, Sq != Skv, batch-1 key_bias), and the op's fake shapes under ``torch.compile(fullgraph=True)`` and errors.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

import qattn_fx.ops  # noqa: F401  (registers qattn::* ops)
from qattn_fx import block_sparse
from qattn_fx.kernels import predict_blocks
from qattn_fx.kernels.predict_blocks import reference

ops = torch.ops.qattn
R, K = block_sparse.BLOCK_ROWS, block_sparse.BLOCK_KEYS


def qk(b=2, hq=4, hkv=2, sq=700, skv=900, d=32, seed=0, dtype=torch.bfloat16):
    """Q and K whose tiles differ (a per-tile offset, so pooled scores spread out), BSHD views."""
    g = torch.Generator().manual_seed(seed)

    def make(h, s):
        n = -(-s // 128)
        offsets = torch.randn(b, n, h, d, generator=g).repeat_interleave(128, 1)[:, :s]
        return (offsets + 0.5 * torch.randn(b, s, h, d, generator=g)).to(dtype).transpose(1, 2)

    return make(hq, sq), make(hkv, skv)


def probabilities(q, k, key_bias, sm_scale):
    """P̄ (B, Hq, NQ, NK) fp32 and the non-empty key tiles (B, Hq, NQ, NK), from the torch pooling."""
    pooled = reference.pool(q, k, key_bias)
    g = q.shape[1] // k.shape[1]
    km = pooled.k_mean.repeat_interleave(g, 1)
    nonempty = pooled.k_kept[:, None, None, :].expand(q.shape[0], q.shape[1], pooled.q_mean.shape[2], -1)
    s = (pooled.q_mean @ km.transpose(-1, -2) * sm_scale).masked_fill(~nonempty, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0), nonempty


def padding_bias(b, skv, seed=0):
    """Key padding per batch: batch 0 keeps everything but its last 150 keys, batch 1 also loses key tile 1."""
    bias = torch.zeros(b, skv)
    bias[0, skv - 150:] = -math.inf
    if b > 1:
        bias[1, 128:256] = -math.inf
        bias[1, 300:310] = -math.inf
    return bias


# ------------------------------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.3, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("bias", [False, True])
def test_cdf_covers_keep_and_is_minimal(keep, bias):
    q, k = qk(seed=1)
    key_bias = padding_bias(2, k.shape[2]) if bias else None
    sm = 0.5
    blocks = reference.predict(q, k, key_bias, sm, keep, "cdf")
    probs, nonempty = probabilities(q, k, key_bias, sm)
    visit = block_sparse.to_mask(blocks)
    assert not bool((visit & ~nonempty).any())
    mass = (probs * visit).sum(-1)
    assert bool((mass >= keep - 1e-6).all()), mass.min()
    smallest = probs.masked_fill(~visit, math.inf).amin(-1)
    assert bool((mass - smallest < keep + 1e-6).all())  # dropping its smallest tile falls below keep
    # the chosen tiles are the most probable ones
    largest_left = probs.masked_fill(visit | ~nonempty, -1.0).amax(-1)
    assert bool((smallest >= largest_left).all())
    assert 0 < blocks.sparsity() < 1


@pytest.mark.parametrize("keep", [0.05, 0.15, 0.35, 0.5, 0.7, 0.99])
def test_top_k_keeps_ceil_of_keep_times_the_nonempty_tiles(keep):
    q, k = qk(sq=400, skv=1900, seed=2)
    key_bias = padding_bias(2, k.shape[2])
    blocks = reference.predict(q, k, key_bias, 0.5, keep, "top_k")
    probs, nonempty = probabilities(q, k, key_bias, 0.5)
    n = nonempty.sum(-1)
    want = torch.tensor([max(1, math.ceil(Fraction(str(keep)) * int(x))) for x in n.flatten()]).view(n.shape)
    assert torch.equal(blocks.count.long(), want)
    visit = block_sparse.to_mask(blocks)
    smallest = probs.masked_fill(~visit, math.inf).amin(-1)
    assert bool((smallest >= probs.masked_fill(visit | ~nonempty, -1.0).amax(-1)).all())


def test_top_k_count_of_a_decimal_keep_is_not_rounded_up():
    """0.15 · 100 non-empty tiles keep 15 (fp32 0.15 · 100 is 15.0000006, whose ceil was 16)."""
    q, k = qk(b=1, hq=1, hkv=1, sq=128, skv=100 * 128, d=16, seed=3)
    blocks = reference.predict(q, k, None, 0.25, 0.15, "top_k")
    assert blocks.count.tolist() == [[[15]]]


def test_ties_go_to_the_lower_index():
    """Identical key tiles: equal probabilities, so the lowest indices are chosen."""
    q, k = qk(b=1, hq=2, hkv=2, sq=256, skv=128, seed=4)
    k = k[:, :, :128].repeat(1, 1, 8, 1)  # 8 equal key tiles
    for mode, keep, n in (("top_k", 0.25, 2), ("top_k", 0.5, 4), ("cdf", 0.3, 3), ("cdf", 0.5, 4)):
        blocks = reference.predict(q, k, None, 0.5, keep, mode)
        assert bool((blocks.count == n).all()), (mode, keep, blocks.count)
        assert bool((blocks.index[..., :n] == torch.arange(n, dtype=torch.int32)).all())


@pytest.mark.parametrize("mode", ["cdf", "top_k"])
def test_keep_one_visits_every_nonempty_tile(mode):
    q, k = qk(seed=5)
    key_bias = padding_bias(2, k.shape[2])
    for keep in (1.0, 1.5):
        visit = block_sparse.to_mask(reference.predict(q, k, key_bias, 0.5, keep, mode, similarity=0.5))
        assert torch.equal(visit, probabilities(q, k, key_bias, 0.5)[1])
    assert reference.predict(q, k, None, 0.5, torch.tensor([1.0]), mode).sparsity() == 0.0


def test_dense_steps_pool_nothing_and_match_the_reference(monkeypatch):
    """keep >= 1 through the dispatcher: the reference's lists without pooling Q or K."""
    q, k = qk(seed=16)
    key_bias = padding_bias(2, k.shape[2])
    want = [reference.predict(q, k, key_bias, 0.5, 1.0, mode, 2, True, 0.5) for mode in ("cdf", "top_k")]
    monkeypatch.setattr(predict_blocks, "pool", lambda *a: pytest.fail("pooled on a dense step"))
    for mode, w in zip(("cdf", "top_k"), want):
        got = predict_blocks.predict(q, k, key_bias, 0.5, torch.tensor([1.0]), mode, 2, True, 0.5)
        assert torch.equal(got.index, w.index) and torch.equal(got.count, w.count)


@pytest.mark.parametrize("sq,skv", [(700, 900), (900, 300), (129, 1000), (1000, 129)])
def test_sinks_and_diagonal_are_always_visited(sq, skv):
    q, k = qk(sq=sq, skv=skv, seed=6)
    blocks = reference.predict(q, k, None, 0.5, 0.05, "cdf", sink_tiles=2, diagonal=True)
    visit = block_sparse.to_mask(blocks)
    nq, nk = block_sparse.tiles(sq, skv)
    assert bool(visit[..., : min(2, nk)].all())
    for i in range(nq):
        middle = min(i * R + R // 2, sq - 1)
        assert bool(visit[:, :, i, middle * skv // sq // K].all()), i
    if sq == skv:
        assert bool(visit.diagonal(dim1=-2, dim2=-1).all())


def test_sinks_and_diagonal_skip_empty_key_tiles():
    q, k = qk(b=1, sq=512, skv=512, seed=7)
    key_bias = torch.zeros(1, 512)
    key_bias[0, :128] = -math.inf  # key tile 0 (a sink) empty
    key_bias[0, 256:384] = -math.inf  # key tile 2 (query tile 2's diagonal) empty
    for keep in (0.2, 1.0):
        visit = block_sparse.to_mask(reference.predict(q, k, key_bias, 0.5, keep, "cdf", sink_tiles=1,
                                                       diagonal=True, similarity=1.0))
        assert not bool(visit[..., 0].any()) and not bool(visit[..., 2].any())
        assert bool(visit[:, :, 1, 1].all()) and bool(visit[:, :, 3, 3].all())


def test_similarity_guard_forces_full_rows_and_columns():
    """Tiles of near-identical tokens are self-similar; one query tile and one key tile of random tokens are not:
    that query tile visits every key tile and that key tile is visited by every query tile."""
    g = torch.Generator().manual_seed(8)
    d = 32

    def tiles_of(n, noisy):
        base = torch.randn(1, 1, n, d, generator=g).repeat_interleave(128, 2)
        x = base + 0.01 * torch.randn(base.shape, generator=g)
        x[:, :, noisy * 128:(noisy + 1) * 128] = torch.randn(1, 1, 128, d, generator=g)
        return x

    q, k = tiles_of(6, 2), tiles_of(8, 5)
    pooled = reference.pool(q, k, None)
    assert bool(pooled.q_sim[0, 0, 2] < 0.2) and bool(pooled.k_sim[0, 0, 5] < 0.2)
    assert bool((pooled.q_sim[0, 0, [0, 1, 3, 4, 5]] > 0.99).all())
    guarded = block_sparse.to_mask(reference.predict(q, k, None, 0.2, 0.3, "cdf", similarity=0.5))
    plain = block_sparse.to_mask(reference.predict(q, k, None, 0.2, 0.3, "cdf"))
    assert not bool(plain[0, 0, 2].all()) and not bool(plain[0, 0, :, 5].all())
    assert bool(guarded[0, 0, 2].all()) and bool(guarded[0, 0, :, 5].all())
    other = torch.ones_like(guarded)
    other[0, 0, 2] = False
    other[0, 0, :, 5] = False
    assert torch.equal(guarded & other, plain & other)  # elsewhere the selection is the plain one


def test_similarity_is_the_mean_pairwise_cosine():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 1, 100, 16, generator=g)
    _, sim = reference._pool(x, 128)
    unit = x[0, 0] / x[0, 0].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(sim[0, 0, 0], (unit @ unit.T).mean(), rtol=1e-5, atol=1e-6)


def test_masked_key_tiles_are_never_visited_whatever_their_data():
    q, k = qk(seed=10)
    key_bias = padding_bias(2, k.shape[2])
    k2 = k.clone()
    k2[1, :, 128:256] = float("nan")
    k2[0, :, -150:] = float("inf")
    for mode in ("cdf", "top_k"):
        a = reference.predict(q, k, key_bias, 0.5, 0.5, mode, sink_tiles=2, diagonal=True, similarity=0.3)
        b = reference.predict(q, k2, key_bias, 0.5, 0.5, mode, sink_tiles=2, diagonal=True, similarity=0.3)
        assert torch.equal(a.index, b.index) and torch.equal(a.count, b.count)
        visit = block_sparse.to_mask(a)
        assert not bool(visit[1, :, :, 1].any())  # batch 1's key tile 1 is masked
        assert bool(visit[1, :, :, 2].any())  # a partly masked tile is not empty


def test_gqa_equals_repeated_k_heads():
    q, k = qk(hq=6, hkv=2, seed=11)
    for mode in ("cdf", "top_k"):
        a = reference.predict(q, k, None, 0.5, 0.4, mode, similarity=0.2)
        b = reference.predict(q, k.repeat_interleave(3, 1), None, 0.5, 0.4, mode, similarity=0.2)
        assert torch.equal(a.index, b.index) and torch.equal(a.count, b.count)


def test_batch_one_key_bias_broadcasts():
    q, k = qk(seed=12)
    bias = torch.zeros(1, k.shape[2])
    bias[0, 500:700] = -math.inf
    bias[0, :40] = -2.0  # finite bias: kept keys, pooled as any other
    a = reference.predict(q, k, bias, 0.5, 0.5, "cdf")
    b = reference.predict(q, k, bias.expand(2, -1).contiguous(), 0.5, 0.5, "cdf")
    assert torch.equal(a.index, b.index) and torch.equal(a.count, b.count)


def test_select_shares_the_rule_given_pooled_values():
    """predict == select(pool(...)); the dispatcher's torch pooling is the reference's."""
    q, k = qk(seed=13)
    key_bias = padding_bias(2, k.shape[2])
    a = reference.predict(q, k, key_bias, 0.5, 0.4, "cdf", 1, True, 0.2)
    b = reference.select(reference.pool(q, k, key_bias), q.shape[2], k.shape[2], 0.5, 0.4, "cdf", 1, True, 0.2)
    c = predict_blocks.predict(q, k, key_bias, 0.5, 0.4, "cdf", 1, True, 0.2)
    assert torch.equal(a.index, b.index) and torch.equal(a.index, c.index) and torch.equal(a.count, c.count)
    with pytest.raises(ValueError, match="pooling='cuda' is invalid; valid: torch, triton"):
        predict_blocks.predict(q, k, None, 0.5, 0.4, pooling="cuda")
    with pytest.raises(ValueError, match="mode='mass' is invalid; valid: cdf, top_k"):
        reference.predict(q, k, None, 0.5, 0.4, "mass")


# ------------------------------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------------------------------


def op(q, k, key_bias=None, keep=0.5, mode="cdf", sink_tiles=0, diagonal=False, similarity=0.0, label="",
       sm_scale=0.5, runtime_scale=None):
    return ops.predict_blocks(q, k, key_bias, sm_scale, runtime_scale, torch.tensor([keep]), mode, sink_tiles,
                              diagonal, similarity, label)


def test_op_returns_the_reference_lists_and_records_sparsity():
    q, k = qk(seed=14)
    key_bias = padding_bias(2, k.shape[2])
    with block_sparse.measure() as m:
        index, count = op(q, k, key_bias, 0.4, "top_k", 1, True, 0.1, label="site")
        op(q, k, key_bias, 0.4, "top_k", 1, True, 0.1, label="site", sm_scale=9.0, runtime_scale=torch.tensor(0.5))
    want = reference.predict(q, k, key_bias, 0.5, 0.4, "top_k", 1, True, 0.1)
    assert torch.equal(index, want.index) and torch.equal(count, want.count)
    site = m.sites["site"]
    assert site.calls == 2 and site.tiles == 2 * want.total and site.skipped == 2 * (want.total - want.visited)


def test_op_fake_shapes_under_fullgraph_compile():
    def f(q, k, key_bias, keep):
        index, count = ops.predict_blocks(q, k, key_bias, 0.5, None, keep, "cdf", 1, True, 0.0, "c")
        return index + 0, count * 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # fake tensors trace the op
    for sq, skv in ((300, 400), (129, 1000)):
        q, k = qk(sq=sq, skv=skv, seed=15)
        key_bias = padding_bias(2, skv)
        keep = torch.tensor([0.4])
        got, want = compiled(q, k, key_bias, keep), f(q, k, key_bias, keep)
        nq, nk = block_sparse.tiles(sq, skv)
        assert got[0].shape == (2, 4, nq, nk) and got[1].shape == (2, 4, nq)
        assert got[0].dtype == got[1].dtype == torch.int32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.library.opcheck(ops.predict_blocks.default, (q, k, key_bias, 0.5, None, keep, "cdf", 1, True, 0.0, "c"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("kwargs,message", [
    (dict(q=torch.zeros(2, 4, 8)), r"q must be a 4-D \(B, H, S, D\) float tensor"),
    (dict(k=torch.zeros(2, 2, 8, 32, dtype=torch.int8)), r"k must be a 4-D \(B, H, S, D\) float tensor"),
    (dict(k=torch.zeros(2, 3, 8, 32)), "must share B and D with Hq a multiple of Hk"),
    (dict(k=torch.zeros(2, 2, 8, 16)), "must share B and D"),
    (dict(key_bias=torch.zeros(3, 8)), r"key_bias must have shape \(B\|1, Skv\) = \(2\|1, 8\); got \(3, 8\)"),
    (dict(keep=torch.tensor([0.5, 0.5])), "keep must be a one-element float tensor"),
    (dict(keep=torch.tensor([1])), "keep must be a one-element float tensor"),
    (dict(mode="mass"), "mode='mass' is invalid; valid: cdf, top_k"),
    (dict(sink_tiles=-1), "sink_tiles=-1 is invalid; valid: an integer >= 0"),
    (dict(similarity=1.5), r"similarity=1.5 is invalid; valid: a number in \[0, 1\]"),
])
def test_op_errors_name_the_argument(kwargs, message):
    args = dict(q=torch.zeros(2, 4, 8, 32), k=torch.zeros(2, 2, 8, 32), key_bias=None, keep=torch.tensor([0.5]),
                mode="cdf", sink_tiles=0, similarity=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ops.predict_blocks(args["q"], args["k"], args["key_bias"], 0.5, None, args["keep"], args["mode"],
                           args["sink_tiles"], False, args["similarity"])
