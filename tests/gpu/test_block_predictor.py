"""The predictor's fused Triton pooling (:mod:`qattn_fx.kernels.predict_blocks.triton`) compiled on a CUDA GPU,
against the torch pooling of :mod:`qattn_fx.kernels.predict_blocks.reference` on the same device, at Wan-like
shapes (one video call: B=1, 12 heads, 32,760 tokens, head_dim 128, bf16 BSHD views).

Run: ``pytest -m gpu tests/gpu/test_block_predictor.py -v``. Pooled values agree to fp32 summation order; on
inputs whose tile sums are exact (multiples of 1/8) the means are bitwise equal and the op's lists are the
reference's; on random inputs the op's lists are the selection of its own pooled values and differ from the torch
pooling's in at most a few blocks (choices at the cdf boundary). The op on CUDA runs the Triton pooling and
raises, naming triton, when triton is missing (no fallback). A timing-free check: the fused pooling allocates
only its small outputs (no fp32 copy of Q or K).
"""

from __future__ import annotations

import math

import pytest
import torch

import support

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx import block_sparse  # noqa: E402
from qattn_fx.kernels import predict_blocks  # noqa: E402
from qattn_fx.kernels.predict_blocks import reference  # noqa: E402
from qattn_fx.kernels.predict_blocks import triton as fused  # noqa: E402

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
    for mode, keep in (("cdf", 0.5), ("cdf", 0.9), ("top_k", 0.15), ("top_k", 0.35)):
        index, count = op(q, k, key_bias, keep, mode)
        r = reference.predict(q, k, key_bias, 1 / math.sqrt(s["d"]), keep, mode, 1, True)
        assert torch.equal(index, r.index) and torch.equal(count, r.count), (mode, keep)
        print(f"[lists {shape}] {mode} keep={keep}: sparsity {r.sparsity():.3f}")


@pytest.mark.parametrize("mode,keep", [("cdf", 0.5), ("top_k", 0.25)])
def test_random_inputs_lists_are_the_selection_of_the_fused_pooling(mode, keep):
    s = WAN
    q, k = make(s["b"], s["hq"], s["sq"], s["d"], seed=5), make(s["b"], s["hkv"], s["skv"], s["d"], seed=6)
    sm = 1 / math.sqrt(s["d"])
    index, count = op(q, k, None, keep, mode, similarity=0.05)
    own = reference.select(fused.pool(q, k, None), s["sq"], s["skv"], sm, keep, mode, 1, True, 0.05)
    assert torch.equal(index, own.index) and torch.equal(count, own.count)
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


def test_op_on_cuda_without_triton_names_the_requirement(monkeypatch):
    monkeypatch.setattr(fused, "triton", None)
    monkeypatch.setattr(fused, "_TRITON_ERROR", ImportError("No module named 'triton'"))
    q = make(1, 2, 256, 64, seed=9)
    with pytest.raises(RuntimeError, match="needs triton"):
        op(q, q, None, 0.5)
    assert predict_blocks.predict(q, q, None, 0.1, 0.5, pooling="torch").count.shape == (1, 2, 2)
