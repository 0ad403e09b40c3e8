"""The predictor's fused Triton steps compiled on a CUDA GPU: the pooling
(:mod:`qattn_fx.kernels.predict_blocks.triton`) against the torch pooling and the selection
(:mod:`qattn_fx.kernels.predict_blocks.triton_select`) against the torch selection
(:func:`qattn_fx.kernels.predict_blocks.reference.select`) on the same device, at Wan-like shapes (one video call:
B=1, 12 heads, 32,760 tokens, head_dim 128, bf16 BSHD views; and Wan2.1-14B 720p's 40 heads x 591 tiles).

Run: ``pytest -m gpu tests/gpu/test_block_predictor.py -v``. Pooled values agree to fp32 summation order; on
inputs whose tile sums are exact (multiples of 1/8) the means are bitwise equal. The op (fused pooling and fused
selection) gives the reference's lists except at the selection's rounding boundary (checked in fp64 per differing
block, :func:`tests.kernels.test_block_select_interpret.check_lists`); ``selection="torch"`` gives exactly the
torch selection of the fused pooling. The op on CUDA raises, naming triton, when triton is missing (no
fallback); a keep on the device is read by the kernel and captures in a CUDA graph. Timing-free checks: the fused
pooling allocates only its small outputs (no fp32 copy of Q or K), the fused selection only its lists.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import support

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx  # noqa: E402
import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx import block_sparse  # noqa: E402
from qattn_fx.kernels import predict_blocks  # noqa: E402
from qattn_fx.kernels.predict_blocks import reference  # noqa: E402
from qattn_fx.kernels.predict_blocks import triton as fused  # noqa: E402
from qattn_fx.kernels.predict_blocks import triton_select  # noqa: E402
from tests.kernels.test_block_select_interpret import check_lists  # noqa: E402

DEV = "cuda"
ops = torch.ops.qattn
WAN = dict(b=1, hq=12, hkv=12, sq=32760, skv=32760, d=128)
SHAPES = {"wan": WAN, "wan-d64-gqa-b2": dict(b=2, hq=8, hkv=2, sq=9000, skv=7777, d=64),
          "short-kv": dict(b=1, hq=4, hkv=4, sq=4096, skv=77, d=128)}


def make(b, h, s, d, *, seed, dyadic=False, dtype=torch.bfloat16):
    """BSHD-stored (B, H, S, D) views; per-tile offsets so pooled scores spread out."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if dyadic:
        x = torch.randint(-8, 8, (b, s, h, d), generator=g, device=DEV).float() / 8
    else:
        n = -(-s // 128)
        x = torch.randn(b, n, h, d, generator=g, device=DEV).repeat_interleave(128, 1)[:, :s]
        x = x + torch.randn(b, s, h, d, generator=g, device=DEV)
    return x.to(dtype).transpose(1, 2)


def padding(b, skv):
    bias = torch.zeros(b, skv, device=DEV)
    bias[-1, skv - 1000:] = -math.inf
    return bias


def op(q, k, key_bias, keep, mode="cdf", sinks=1, diagonal=True, similarity=0.0):
    return ops.predict_blocks(q, k, key_bias, 1 / math.sqrt(q.shape[-1]), None, torch.tensor([keep]), mode, sinks,
                              diagonal, similarity)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pooled_values_match_torch(shape, bias):
    s = SHAPES[shape]
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=1), make(s["b"], s["hkv"], s["skv"], s["d"], seed=2)
    key_bias = padding(s["b"], s["skv"]) if bias else None
    got, want = fused.pool(q, k, key_bias), reference.pool(q, k, key_bias)
    for name, x, y in zip(want._fields, got, want):
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device, name
        if x.dtype == torch.bool:
            assert torch.equal(x, y), name
        else:
            err = (x - y).abs().max().item()
            print(f"[pool {shape} bias={bias}] {name}: max abs diff {err:.2e}")
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("shape", ["wan", "wan-d64-gqa-b2"])
def test_exact_tile_sums_give_the_reference_lists(shape):
    s = SHAPES[shape]
    q = make(s["b"], s["hq"], s["sq"], s["d"], seed=3, dyadic=True)
    k = make(s["b"], s["hkv"], s["skv"], s["d"], seed=4, dyadic=True)
    key_bias = padding(s["b"], s["skv"])
    got, want = fused.pool(q, k, key_bias), reference.pool(q, k, key_bias)
    assert torch.equal(got.q_mean, want.q_mean) and torch.equal(got.k_mean, want.k_mean)
    sm = 1 / math.sqrt(s["d"])
    for mode, keep in (("cdf", 0.5), ("cdf", 0.9), ("top_k", 0.15), ("top_k", 0.35)):
        index, count = op(q, k, key_bias, keep, mode)
        r = reference.predict(q, k, key_bias, sm, keep, mode, 1, True)
        differ = check_lists(block_sparse.Blocks(index, count), r, want, sm, keep, mode)
        print(f"[lists {shape}] {mode} keep={keep}: sparsity {r.sparsity():.3f}, {differ} blocks at the boundary")
        a = predict_blocks.predict(q, k, key_bias, sm, keep, mode, 1, True, selection="torch")
        assert torch.equal(a.index, r.index) and torch.equal(a.count, r.count), (mode, keep)


@pytest.mark.parametrize("mode,keep", [("cdf", 0.5), ("top_k", 0.25)])
def test_random_inputs_lists_are_the_selection_of_the_fused_pooling(mode, keep):
    s = WAN
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=5), make(s["b"], s["hkv"], s["skv"], s["d"], seed=6)
    sm = 1 / math.sqrt(s["d"])
    index, count = op(q, k, None, keep, mode, similarity=0.05)
    pooled = fused.pool(q, k, None)
    own = reference.select(pooled, s["sq"], s["skv"], sm, keep, mode, 1, True, 0.05)
    check_lists(block_sparse.Blocks(index, count), own, pooled, sm, keep, mode)
    a = predict_blocks.predict(q, k, None, sm, keep, mode, 1, True, 0.05, selection="torch")
    assert torch.equal(a.index, own.index) and torch.equal(a.count, own.count)
    torch_lists = reference.predict(q, k, None, sm, keep, mode, 1, True, 0.05)
    differ = (block_sparse.to_mask(own) != block_sparse.to_mask(torch_lists)).sum().item()
    print(f"[lists wan] {mode} keep={keep}: {differ} of {own.total} blocks differ from the torch pooling's")
    assert differ <= 1e-3 * own.total


def test_fused_pooling_allocates_only_its_outputs():
    s = WAN
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=7), make(s["b"], s["hkv"], s["skv"], s["d"], seed=8)
    key_bias = padding(1, s["skv"])
    fused.pool(q, k, key_bias)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    pooled = fused.pool(q, k, key_bias)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = sum(t.numel() * t.element_size() for t in pooled)
    print(f"[memory] peak extra {extra / 2**20:.2f} MiB, outputs {outputs / 2**20:.2f} MiB, "
          f"Q {q.numel() * q.element_size() / 2**20:.0f} MiB")
    assert extra < outputs + (4 << 20)


def test_op_replays_in_a_cuda_graph():
    """The op issues no host synchronization outside :func:`block_sparse.measure` (keep a CPU tensor): it captures
    in a CUDA graph and its replays follow new Q/K data."""
    s = dict(b=1, hq=4, hkv=4, sq=4096, skv=4096, d=128)
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=10), make(s["b"], s["hkv"], s["skv"], s["d"], seed=11)
    q, k = q.clone(), k.clone()
    key_bias = padding(1, s["skv"])
    op(q, k, key_bias, 0.5)  # compile and warm up outside the capture
    graph, (index, count) = support.capture_graph(lambda: op(q, k, key_bias, 0.5))
    for seed in (12, 13):
        q.copy_(make(s["b"], s["hq"], s["sq"], s["d"], seed=seed))
        graph.replay()
        want = op(q, k, key_bias, 0.5)
        assert torch.equal(index, want[0]) and torch.equal(count, want[1]), seed


@pytest.mark.parametrize("mode", ["cdf", "top_k"])
def test_a_keep_on_the_device_selects_there_and_captures_in_a_graph(mode):
    """A step schedule's keep (``qattn::block_keep``) lives on the GPU: the op uses it there, with the lists of the
    same keep on the CPU (keep 1: every block), and captures in a CUDA graph whose replays follow the keep."""
    s = dict(b=1, hq=4, sq=4096, d=128)
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=20), make(s["b"], s["hq"], s["sq"], s["d"], seed=21)
    scale = 1 / math.sqrt(s["d"])
    keep = torch.tensor([0.5], device="cuda")

    def run():
        return ops.predict_blocks(q, k, None, scale, None, keep, mode, 1, True, 0.6)

    for value in (0.5, 1.0):
        keep.fill_(value)
        want = op(q, k, None, value, mode, 1, True, 0.6)
        got = run()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), value
    graph, (index, count) = support.capture_graph(run)
    for value in (1.0, 0.5):
        keep.fill_(value)
        graph.replay()
        want = op(q, k, None, value, mode, 1, True, 0.6)
        assert torch.equal(index, want[0]) and torch.equal(count, want[1]), value


SELECT_SHAPES = {"wan-720p": dict(b=1, hq=40, hkv=40, sq=75600, skv=75600, d=128, bias=False),
                 "gqa-b2-bias": dict(b=2, hq=8, hkv=2, sq=9000, skv=7777, d=64, bias=True),
                 "short-kv": dict(b=1, hq=4, hkv=4, sq=4096, skv=77, d=128, bias=False)}


@functools.lru_cache(maxsize=1)
def _select_inputs(shape):
    """The pooled Q and K of ``SELECT_SHAPES[shape]``, made once per worker: the Wan-720p inputs take ~3 GB while
    they are made, which several GPU workers at once could not hold beside the other tests."""
    s = SELECT_SHAPES[shape]
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=30), make(s["b"], s["hkv"], s["skv"], s["d"], seed=31)
    return fused.pool(q, k, padding(s["b"], s["skv"]) if s["bias"] else None)


@pytest.mark.parametrize("mode,keep,similarity", [("cdf", 0.5, 0.0), ("cdf", 0.9, 0.6), ("top_k", 0.15, 0.0),
                                                  ("top_k", 0.3, 0.6)])
@pytest.mark.parametrize("shape", list(SELECT_SHAPES))
def test_fused_selection_matches_the_torch_selection(shape, mode, keep, similarity):
    s = SELECT_SHAPES[shape]
    pooled = _select_inputs(shape)
    sm = 1 / math.sqrt(s["d"])
    rule = (s["sq"], s["skv"], sm, keep, mode, 1, True, similarity)
    got, want = triton_select.select(pooled, *rule), reference.select(pooled, *rule)
    differ = check_lists(got, want, pooled, sm, keep, mode)
    print(f"[select {shape}] {mode} keep={keep} sim={similarity}: sparsity {want.sparsity():.3f}, "
          f"{differ} of {want.total} blocks at the boundary")
    device_keep = torch.tensor([keep], device=DEV)  # read by the kernel: the same lists (keep exact in fp32 or not)
    again = triton_select.select(pooled, s["sq"], s["skv"], sm, device_keep, mode, 1, True, similarity)
    check_lists(again, reference.select(pooled, s["sq"], s["skv"], sm, device_keep, mode, 1, True, similarity),
                pooled, sm, device_keep, mode)


@pytest.mark.parametrize("mode,keep", [("cdf", 0.9), ("top_k", 0.25)])
@pytest.mark.parametrize("shape", list(SELECT_SHAPES))
def test_dot_scores_give_the_lists_of_the_scalar_scores(shape, mode, keep):
    """The FMA ``tl.dot`` chunks (programs of 16 query tiles) sum in the scalar loop's order, so the compiled
    kernel's lists are the same bit for bit with the scalar loads forced (elsewhere both are the scalar loop)."""
    s = SELECT_SHAPES[shape]
    pooled = _select_inputs(shape)
    rule = (s["sq"], s["skv"], 1 / math.sqrt(s["d"]), keep, mode, 1, True, 0.6)
    lists = {}
    for dot in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not dot:
                mp.setattr(triton_select, "dot_scores", lambda rows: False)  # the scalar loads everywhere
            lists[dot] = triton_select.select(pooled, *rule)
    assert torch.equal(lists[True].index, lists[False].index) and torch.equal(lists[True].count, lists[False].count)


def test_fused_selection_allocates_only_its_lists():
    s = SELECT_SHAPES["wan-720p"]
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=32), make(s["b"], s["hkv"], s["skv"], s["d"], seed=33)
    pooled = fused.pool(q, k, None)
    rule = (s["sq"], s["skv"], 1 / math.sqrt(s["d"]), 0.5, "cdf", 1, True, 0.6)
    triton_select.select(pooled, *rule)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    blocks = triton_select.select(pooled, *rule)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = sum(t.numel() * t.element_size() for t in blocks)
    print(f"[memory select] peak extra {extra / 2**20:.2f} MiB, lists {outputs / 2**20:.2f} MiB")
    assert extra < outputs + (1 << 20)


@pytest.mark.parametrize("mode", ["cdf", "top_k"])
def test_fused_selection_with_a_device_keep_captures_in_a_graph(mode):
    """The fused selection alone, captured with a keep on the device: replays follow the keep (1: every non-empty
    block) and new pooled values, and equal the eager selection."""
    s = SELECT_SHAPES["gqa-b2-bias"]
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=34), make(s["b"], s["hkv"], s["skv"], s["d"], seed=35)
    key_bias = padding(s["b"], s["skv"])
    pooled = fused.pool(q, k, key_bias)
    keep = torch.tensor([0.5], device=DEV)
    rule = (s["sq"], s["skv"], 1 / math.sqrt(s["d"]))

    def run():
        return triton_select.select(pooled, *rule, keep, mode, 1, True, 0.6)

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        with torch.cuda.graph(graph, stream=stream):
            index, count = run()
    torch.cuda.current_stream().wait_stream(stream)
    for value, seed in ((0.3, 36), (1.0, 37), (0.9, 38)):
        keep.fill_(value)
        pooled.q_mean.copy_(fused.pool(make(s["b"], s["hq"], s["sq"], s["d"], seed=seed), k, key_bias).q_mean)
        graph.replay()
        want = run()
        assert torch.equal(index, want.index) and torch.equal(count, want.count), value
        if value >= 1:
            assert torch.equal(block_sparse.to_mask(want),
                               pooled.k_kept[:, None, None, :].expand_as(block_sparse.to_mask(want)))


@pytest.mark.parametrize("step", ["pooling", "selection"])
def test_op_on_cuda_without_triton_names_the_step(monkeypatch, step):
    """Each fused step names triton when it does not import; the torch implementation of that step still runs."""
    monkeypatch.setattr((fused if step == "pooling" else triton_select).KERNELS, "missing",
                        ImportError("No module named 'triton'"))
    q = make(1, 2, 256, 64, seed=9)
    with pytest.raises(RuntimeError, match=f"needs triton .*{step}"):
        op(q, q, None, 0.5)
    assert predict_blocks.predict(q, q, None, 0.1, 0.5, **{step: "torch"}).count.shape == (1, 2, 2)
