"""The predictor's fused Triton pooling (:mod:`qattn_fx.kernels.predict_blocks.triton`) under the Triton interpreter
(CPU), against the torch pooling of :mod:`qattn_fx.kernels.predict_blocks.reference`.

Pooled values are compared with a tolerance on random inputs (the sums over a tile run in another order); on
inputs whose tile sums are exact in fp32 (multiples of 1/8 below 1, so any order gives the same sum, and the
divisions are correctly rounded in both) the means are bitwise equal, so the lists are equal too (the torch selection
runs on both), checked for every mode, with sinks, the diagonal and the guard at thresholds away from any tile's
similarity. The GPU file (``tests/gpu/test_block_predictor.py``) repeats this on the compiled kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from qattn_fx import block_sparse  # noqa: E402
from qattn_fx.kernels import predict_blocks  # noqa: E402
from qattn_fx.kernels.predict_blocks import reference  # noqa: E402
from qattn_fx.kernels.predict_blocks import triton as fused  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """The kernel module is loaded per Triton mode at its first call in that mode: this suffices."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make(b, h, s, d, *, dtype=torch.bfloat16, bshd=True, seed=0, dyadic=False):
    g = torch.Generator().manual_seed(seed)
    if dyadic:  # multiples of 1/8 in [-1, 1): tile sums exact in fp32 in any order
        x = torch.randint(-8, 8, (b, s, h, d), generator=g).float() / 8
    else:
        x = torch.randn(b, s, h, d, generator=g) + torch.randn(1, 1, h, d, generator=g)
    x = x.to(dtype).transpose(1, 2)
    return x if bshd else x.contiguous()


def bias_for(b, skv, *, batch1=False):
    bias = torch.zeros(1 if batch1 else b, skv)
    bias[0, skv // 2: skv // 2 + 40] = -math.inf
    bias[-1, :128] = -math.inf  # an empty key tile
    if skv > 300:
        bias[-1, 200:260] = -0.5  # finite: kept
    return bias


CASES = {
    "bf16-bshd-gqa-odd": dict(b=2, hq=4, hkv=2, sq=300, skv=77, d=64),
    "fp16-bhsd-d128": dict(b=1, hq=2, hkv=2, sq=256, skv=400, d=128, dtype=torch.float16, bshd=False),
    "fp32-d80": dict(b=1, hq=3, hkv=1, sq=130, skv=520, d=80, dtype=torch.float32),
}


@pytest.mark.parametrize("rows", [None, 256])  # 256: more than a tile, which is one step of its tokens
@pytest.mark.parametrize("bias", [None, "batch", "batch1"])
@pytest.mark.parametrize("case", list(CASES))
def test_pooled_values_match_torch(case, bias, rows, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(fused, "ROWS", rows)
    c = dict(CASES[case])
    b, hq, hkv, sq, skv, d = (c.pop(n) for n in ("b", "hq", "hkv", "sq", "skv", "d"))
    q, k = make(b, hq, sq, d, seed=1, **c), make(b, hkv, skv, d, seed=2, **c)
    key_bias = None if bias is None else bias_for(b, skv, batch1=bias == "batch1")
    got, want = fused.pool(q, k, key_bias), reference.pool(q, k, key_bias)
    for name, x, y in zip(want._fields, got, want):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if x.dtype == torch.bool:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_masked_keys_take_no_part_whatever_their_data():
    q, k = make(2, 2, 200, 32, seed=3), make(2, 2, 300, 32, seed=4)
    key_bias = bias_for(2, 300)
    k2 = k.clone()
    k2[1, :, :128] = float("nan")
    k2[0, :, 150:190] = float("inf")
    a, b = fused.pool(q, k, key_bias), fused.pool(q, k2, key_bias)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert bool((a.k_mean[1, :, 0] == 0).all()) and bool((a.k_sim[1, :, 0] == 0).all())


def test_exact_tile_sums_give_the_reference_lists():
    b, hq, hkv, sq, skv, d = 2, 4, 2, 600, 1000, 32
    q, k = make(b, hq, sq, d, seed=5, dyadic=True), make(b, hkv, skv, d, seed=6, dyadic=True)
    key_bias = bias_for(b, skv)
    got, want = fused.pool(q, k, key_bias), reference.pool(q, k, key_bias)
    assert torch.equal(got.q_mean, want.q_mean) and torch.equal(got.k_mean, want.k_mean)
    assert torch.equal(got.k_kept, want.k_kept)
    sims = torch.cat([want.q_sim.flatten(), want.k_sim.flatten()])
    middle = float(sims.median())  # a guard with tiles on each side and none within 1e-4 of it
    guard = next(t for t in (middle + 1e-3, middle - 1e-3, middle + 3e-3) if float((sims - t).abs().min()) > 1e-4)
    for mode, keep in (("cdf", 0.3), ("cdf", 0.7), ("top_k", 0.2), ("top_k", 0.5), ("cdf", 1.0)):
        for sinks, diagonal, similarity in ((0, False, 0.0), (1, True, 0.0), (2, True, guard)):
            rule = (sq, skv, 0.3, keep, mode, sinks, diagonal, similarity)
            a, r = reference.select(got, *rule), reference.select(want, *rule)
            assert torch.equal(a.index, r.index) and torch.equal(a.count, r.count), rule
            assert keep >= 1 or 0 < r.sparsity() < 1
    # the dispatcher with pooling="triton": the same lists as the reference
    a = predict_blocks.predict(q, k, key_bias, 0.3, 0.5, "cdf", 1, True, guard, pooling="triton")
    r = reference.predict(q, k, key_bias, 0.3, 0.5, "cdf", 1, True, guard)
    assert torch.equal(a.index, r.index) and torch.equal(a.count, r.count)


def test_without_triton_the_triton_pooling_names_the_requirement(monkeypatch):
    monkeypatch.setattr(fused.KERNELS, "missing", ImportError("No module named 'triton'"))
    q = torch.zeros(1, 1, 128, 32)
    for keep in (0.5, 1.0):  # dense steps too: the first call shows it
        with pytest.raises(RuntimeError, match="predict_blocks on CUDA needs triton .*install triton"):
            predict_blocks.predict(q, q, None, 0.5, keep, pooling="triton")
    assert predict_blocks.predict(q, q, None, 0.5, 0.5).count.tolist() == [[[1]]]  # CPU: torch pooling


def test_zero_tiles_launch_nothing():
    q = torch.zeros(1, 2, 0, 32)
    k = torch.zeros(1, 2, 5, 32)
    pooled = fused.pool(q, k, None)
    assert pooled.q_mean.shape == (1, 2, 0, 32) and pooled.k_mean.shape == (1, 2, 1, 32)
    assert block_sparse.tiles(0, 5) == (0, 1)
    # no heads: no program writes the kept-tile flags, which still follow the bias
    q, k = torch.zeros(2, 0, 128, 32), torch.zeros(2, 0, 300, 32)
    key_bias = bias_for(2, 300)
    assert torch.equal(fused.pool(q, k, key_bias).k_kept, reference.pool(q, k, key_bias).k_kept)


@pytest.mark.parametrize("capability", [(9, 0), (8, 9), (8, 0)])
def test_compiles_offline_without_spills(capability):
    """The compiled (not interpreted) kernel for a Wan-sized call: ptxas accepts it, nothing spills, and the
    divisions and square roots are the correctly rounded ones (the interpreter's numpy ops are)."""
    from qattn_fx.kernels._offline import ptxas_report

    q = torch.empty(1, 32760, 12, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    for bias, by_column in ((None, False), (torch.zeros(1, 32760, device="meta"), True)):  # (K: means by column)
        compiled = fused.compile_for(capability, q, block_sparse.BLOCK_KEYS, bias, by_column)
        report = ptxas_report(compiled, capability)
        assert report["ptxas_ok"] and report["spill_stores"] == 0 and report["spill_loads"] == 0, report
        ptx = compiled.asm["ptx"]
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
        assert "div.full" not in ptx and "sqrt.approx" not in ptx


def test_compiled_loop_has_no_barrier():
    """The loop over a tile's tokens keeps ``(ROWS, D)`` running sums and reduces them over rows once after it: its
    compiled body (sm_90 PTX, from the loop header to its back branch) has no ``bar.sync``, which a sum over rows per
    step would need (the rows lie across the program's warps)."""
    q = torch.empty(1, 32760, 12, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    lines = fused.compile_for((9, 0), q, block_sparse.BLOCK_KEYS).asm["ptx"].splitlines()
    header = next(i for i, line in enumerate(lines) if "Loop Header" in line)
    label = lines[header].split(":")[0].strip()
    back = next(i for i in range(header + 1, len(lines)) if "bra" in lines[i] and label in lines[i])
    body = lines[header:back]
    assert any("ld.global" in line for line in body)  # the loop that reads the tile
    assert not any("bar.sync" in line for line in body)
