"""The predictor's fused Triton selection (:mod:`qattn_fx.kernels.predict_blocks.triton_select`) under the Triton
interpreter (CPU), against the torch selection :func:`qattn_fx.kernels.predict_blocks.reference.select` on the same
pooled values.

The lists must be equal, except where a choice sits on an fp32 rounding boundary (the numerics contract of
:mod:`~qattn_fx.kernels.predict_blocks.triton_select`): every block where they differ is checked against the
boundary in fp64 (``cdf``: the mass ranked above the tile within a tolerance of ``keep``; ``top_k``: the tile's
probability within a tolerance of the boundary tile's), and only a few may differ. Cases: cdf and top_k, GQA, key
bias (an empty key tile, ``B`` and ``1`` rows), odd and cross lengths (300 x 77), sinks, the diagonal, the guard,
``keep >= 1`` as a number and as tensors, a keep read by the kernel from a tensor (the device path), the key-tile
limit, the dispatcher, and an offline sm_90 compile without spills. The GPU file
(``tests/gpu/test_block_predictor.py``) repeats the comparison on the compiled kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from qattn_fx import block_sparse  # noqa: E402
from qattn_fx.kernels import predict_blocks  # noqa: E402
from qattn_fx.kernels.predict_blocks import reference  # noqa: E402
from qattn_fx.kernels.predict_blocks import triton_select as fused  # noqa: E402

#: fp64 distance from the boundary within which the lists may differ.
TOL = 1e-5


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """The kernel module is loaded per Triton mode at its first call in that mode: this suffices."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make(b, h, s, d, *, seed, dyadic=False):
    """(B, H, S, D) fp32 with a per-tile offset, so that pooled scores spread out and tiles differ in similarity."""
    g = torch.Generator().manual_seed(seed)
    if dyadic:  # multiples of 1/8: tile sums exact in any order
        return torch.randint(-8, 8, (b, h, s, d), generator=g).float() / 8
    n = -(-s // 128)
    spread = torch.rand(b, h, n, 1, generator=g).repeat_interleave(128, 2)[:, :, :s] * 3
    return torch.randn(b, h, n, d, generator=g).repeat_interleave(128, 2)[:, :, :s] * spread \
        + torch.randn(b, h, s, d, generator=g)


def bias_for(b, skv, *, batch1=False):
    bias = torch.zeros(1 if batch1 else b, skv)
    bias[0, skv // 2: skv // 2 + 40] = -math.inf
    bias[-1, :128] = -math.inf  # an empty key tile
    return bias


def probs64(pooled: reference.Pooled, sm_scale: float) -> torch.Tensor:
    """The reference's probabilities in fp64 (B, Hq, NQ, NK)."""
    g = pooled.q_mean.shape[1] // pooled.k_mean.shape[1]
    k = pooled.k_mean.double().repeat_interleave(g, 1)
    scores = (pooled.q_mean.double() @ k.transpose(-1, -2)) * sm_scale
    scores = scores.masked_fill(~pooled.k_kept[:, None, None, :], -math.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0)


def compare(pooled, sq, skv, sm_scale, keep, mode, sinks=0, diagonal=False, similarity=0.0) -> int:
    """Both selections on ``pooled``: equal lists, or differences only at the boundary (fp64); returns how many
    blocks differ."""
    got = fused.select(pooled, sq, skv, sm_scale, keep, mode, sinks, diagonal, similarity)
    want = reference.select(pooled, sq, skv, sm_scale, keep, mode, sinks, diagonal, similarity)
    return check_lists(got, want, pooled, sm_scale, keep, mode)


def check_lists(got, want, pooled, sm_scale, keep, mode) -> int:
    """``got`` (the fused selection's lists) against ``want`` (the torch selection's on ``pooled``), on any device:
    equal, or differing only at the boundary (fp64); returns how many blocks differ."""
    got, want = (block_sparse.Blocks(*(t.cpu() for t in x)) for x in (got, want))
    pooled = reference.Pooled(*(t.cpu() for t in pooled))
    keep = keep.cpu() if isinstance(keep, torch.Tensor) else keep
    assert got.index.dtype == torch.int32 and got.count.dtype == torch.int32
    assert got.index.shape == want.index.shape and got.count.shape == want.count.shape
    assert got.index.is_contiguous() and got.count.is_contiguous()
    if torch.equal(got.index, want.index) and torch.equal(got.count, want.count):
        return 0
    # the lists must still be well formed: ascending visited tiles, then -1
    nk = got.index.shape[-1]
    listed = torch.arange(nk) < got.count[..., None]
    assert bool((got.index[~listed] == -1).all())
    ordered = got.index[..., 1:] > got.index[..., :-1]
    assert bool((ordered | ~listed[..., 1:]).all())
    diff = block_sparse.to_mask(got) != block_sparse.to_mask(want)
    p = probs64(pooled, sm_scale)
    order = torch.sort(-p, dim=-1, stable=True).indices
    ranked = p.gather(-1, order)
    keep_v = float(keep)
    for b, h, i, j in diff.nonzero().tolist():
        if mode == "cdf":
            before = (ranked[b, h, i].cumsum(-1) - ranked[b, h, i])[(order[b, h, i] == j).nonzero()[0, 0]]
            assert abs(float(before) - keep_v) < TOL, (b, h, i, j, float(before), keep_v)
        else:
            n = int(pooled.k_kept[min(b, pooled.k_kept.shape[0] - 1)].sum())
            n_keep = max(1, math.ceil(n * keep_v - n * 1e-9))
            edge = float(ranked[b, h, i, n_keep - 1])
            assert abs(float(p[b, h, i, j]) - edge) <= TOL * max(edge, 1e-30), (b, h, i, j)
    count = int(diff.sum())
    assert count <= max(2, 0.01 * diff.numel()), count
    return count


CASES = {
    "gqa-bias": dict(b=2, hq=4, hkv=2, sq=300, skv=700, d=16, bias="batch"),
    "bias-b1": dict(b=2, hq=2, hkv=1, sq=260, skv=520, d=16, bias="batch1"),
    "cross-300x77": dict(b=1, hq=2, hkv=2, sq=300, skv=77, d=32, bias=None),
    "odd-1000x2000": dict(b=1, hq=3, hkv=1, sq=1000, skv=2000, d=24, bias=None),
}
RULES = [("cdf", 0.5), ("cdf", 0.9), ("top_k", 0.25), ("top_k", 0.15)]


def pooled_for(case, *, seed=0, dyadic=False):
    c = CASES[case]
    q = make(c["b"], c["hq"], c["sq"], c["d"], seed=seed + 1, dyadic=dyadic)
    k = make(c["b"], c["hkv"], c["skv"], c["d"], seed=seed + 2, dyadic=dyadic)
    key_bias = None if c["bias"] is None else bias_for(c["b"], c["skv"], batch1=c["bias"] == "batch1")
    return reference.pool(q, k, key_bias), c["sq"], c["skv"], 1 / math.sqrt(c["d"])


@pytest.mark.parametrize("mode,keep", RULES)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "gqa-bias" else c for c in CASES])
def test_lists_match_the_torch_selection(case, mode, keep):
    pooled, sq, skv, sm = pooled_for(case)
    compare(pooled, sq, skv, sm, keep, mode, 1, True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gqa-bias", "odd-1000x2000"])
def test_dyadic_inputs_give_the_same_lists(case):
    """Exact pooled means: the scores are exact in both, only exp and the sums' order differ."""
    pooled, sq, skv, sm = pooled_for(case, seed=10, dyadic=True)
    differ = sum(compare(pooled, sq, skv, sm, keep, mode) for mode, keep in RULES)
    assert differ <= 2


@pytest.mark.slow
def test_sinks_and_diagonal_without_scores():
    """Sinks and the diagonal on their own (keep tiny: cdf chooses only the top tile), cross lengths both ways."""
    for sq, skv in ((300, 77), (77, 300), (1000, 2000), (2000, 1000)):
        pooled = reference.pool(make(1, 2, sq, 16, seed=3), make(1, 1, skv, 16, seed=4), None)
        for sinks, diagonal in ((0, True), (2, False), (3, True)):
            compare(pooled, sq, skv, 0.25, 1e-6, "cdf", sinks, diagonal)


@pytest.mark.slow
def test_guard_visits_dissimilar_tiles():
    pooled, sq, skv, sm = pooled_for("odd-1000x2000", seed=20)
    sims = torch.cat([pooled.q_sim.flatten(), pooled.k_sim.flatten()])
    middle = float(sims.median())  # a guard with tiles on each side and none within 1e-4 of it
    guard = next(t for t in (middle + 1e-3, middle - 1e-3, middle + 3e-3) if float((sims - t).abs().min()) > 1e-4)
    assert bool((pooled.q_sim < guard).any()) and bool((pooled.k_sim >= guard).any())
    for mode, keep in (("cdf", 0.5), ("top_k", 0.25)):
        compare(pooled, sq, skv, sm, keep, mode, 1, True, guard)
    want = reference.select(pooled, sq, skv, sm, 0.5, "cdf", 0, False, 0.0)
    got = fused.select(pooled, sq, skv, sm, 0.5, "cdf", 0, False, guard)
    assert got.visited > want.visited  # the guard adds blocks


@pytest.mark.parametrize("keep", [1.0, 1.5, torch.tensor([1.0]), torch.tensor(2.0, dtype=torch.float64)])
def test_keep_at_least_one_visits_every_non_empty_tile(keep):
    pooled, sq, skv, sm = pooled_for("gqa-bias")
    got = fused.select(pooled, sq, skv, sm, keep, "cdf", 1, True, 0.6)
    want = block_sparse.from_mask(pooled.k_kept[:, None, None, :].expand(2, 4, 3, 6).contiguous())
    assert torch.equal(got.index, want.index) and torch.equal(got.count, want.count)
    assert 0 < got.sparsity() < 1  # the empty key tile of batch 1 and the masked keys


@pytest.mark.slow
def test_keep_as_a_cpu_tensor_is_read_on_the_host():
    pooled, sq, skv, sm = pooled_for("bias-b1")
    for mode, keep in RULES:
        compare(pooled, sq, skv, sm, torch.tensor([keep]), mode, 1, True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cdf", "top_k"])
def test_keep_read_by_the_kernel(monkeypatch, mode):
    """The device path (a keep tensor the kernel loads, as on CUDA) on a CPU tensor: both selections treat the
    tensor as a device keep (fp32; keep >= 1 decided in the kernel)."""
    monkeypatch.setattr(fused, "host_keep", lambda keep: None)
    monkeypatch.setattr(reference, "host_keep", lambda keep: None)
    pooled, sq, skv, sm = pooled_for("gqa-bias", seed=30)
    for value in (0.15, 0.5, 1.0):
        compare(pooled, sq, skv, sm, torch.tensor([value]), mode, 1, True, 0.0)


def test_zero_tiles_launch_nothing():
    pooled = reference.pool(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 5, 16), None)
    got = fused.select(pooled, 0, 5, 0.25, 0.5)
    assert got.index.shape == (1, 2, 0, 1) and got.count.shape == (1, 2, 0)
    pooled = reference.pool(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 0, 16), None)
    got = fused.select(pooled, 5, 0, 0.25, 0.5)
    assert got.index.shape == (1, 2, 1, 0) and got.count.tolist() == [[[0], [0]]]


def test_more_key_tiles_than_a_program_holds_are_refused():
    n = fused.MAX_KEY_TILES + 1
    pooled = reference.Pooled(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1), torch.zeros(1, 1, n, 8),
                              torch.zeros(1, 1, n), torch.ones(1, n, dtype=torch.bool))
    with pytest.raises(ValueError, match=f"at most {fused.MAX_KEY_TILES} key tiles .*selection='torch'"):
        fused.select(pooled, 128, n * 128, 0.25, 0.5)


@pytest.mark.slow
def test_dispatcher_runs_the_fused_steps_and_validates_the_knob():
    c = CASES["gqa-bias"]
    q, k = make(2, 4, c["sq"], 16, seed=40, dyadic=True), make(2, 2, c["skv"], 16, seed=41, dyadic=True)
    key_bias = bias_for(2, c["skv"])
    a = predict_blocks.predict(q, k, key_bias, 0.25, 0.5, "cdf", 1, True, pooling="triton", selection="triton")
    r = reference.predict(q, k, key_bias, 0.25, 0.5, "cdf", 1, True)
    differ = int((block_sparse.to_mask(a) != block_sparse.to_mask(r)).sum())
    assert differ <= 2
    # keep >= 1 on the host: nothing pooled, the kernel lists every non-empty key tile
    a = predict_blocks.predict(q, k, key_bias, 0.25, 1.0, "top_k", 1, True, 0.6, selection="triton")
    r = reference.predict(q, k, key_bias, 0.25, 1.0, "top_k", 1, True, 0.6)
    assert torch.equal(a.index, r.index) and torch.equal(a.count, r.count)
    with pytest.raises(ValueError, match="selection='cuda' is invalid; valid: torch, triton"):
        predict_blocks.predict(q, k, key_bias, 0.25, 0.5, selection="cuda")


def test_without_triton_the_triton_selection_names_the_requirement(monkeypatch):
    monkeypatch.setattr(fused.KERNELS, "missing", ImportError("No module named 'triton'"))
    q = torch.zeros(1, 1, 128, 32)
    for keep in (0.5, 1.0):
        with pytest.raises(RuntimeError, match="predict_blocks on CUDA needs triton .*selection.*install triton"):
            predict_blocks.predict(q, q, None, 0.5, keep, selection="triton")


@pytest.mark.parametrize("nk,mode,device_keep", [(591, "cdf", False), (591, "top_k", True), (591, "top_k", False),
                                                 (4096, "cdf", True), (40, "cdf", False)])
def test_compiles_offline_for_sm90_without_spills(nk, mode, device_keep):
    """The compiled (not interpreted) kernel for a Wan-sized call (591 query and key tiles, D 128), the largest call
    it accepts and a short key set (16 query tiles a program, 4 warps): ptxas accepts it and nothing spills."""
    from qattn_fx.kernels._offline import ptxas_report

    m = "meta"
    pooled = reference.Pooled(torch.empty(1, 40, 591, 128, device=m), torch.empty(1, 40, 591, device=m),
                              torch.empty(1, 8, 128, nk, device=m).transpose(2, 3), torch.empty(1, 8, nk, device=m),
                              torch.empty(1, nk, dtype=torch.bool, device=m))
    keep = torch.empty(1, device=m) if device_keep else 0.5
    compiled = fused.compile_for((9, 0), pooled, 591 * 128, nk * 128, keep, mode)
    report = ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    assert "div.rn.f32" in compiled.asm["ptx"]


@pytest.mark.slow
def test_ties_go_to_the_lower_index():
    """Exact ties (equal key means, a query mean of 0: every probability 1/8): both selections take the lower
    index first, so the lists are equal, not merely equal up to the boundary."""
    g = torch.Generator().manual_seed(50)
    k_mean = torch.randn(1, 1, 4, 8, generator=g).repeat_interleave(2, 2)[:, :, [0, 2, 1, 3, 4, 6, 5, 7]]
    q_mean = torch.randn(1, 2, 3, 8, generator=g)
    q_mean[0, 1, 0] = 0.0
    pooled = reference.Pooled(q_mean, torch.ones(1, 2, 3), k_mean, torch.ones(1, 1, 8),
                              torch.ones(1, 8, dtype=torch.bool))
    for mode, keep in (("cdf", 0.5), ("cdf", 0.3), ("top_k", 0.25), ("top_k", 0.5), ("top_k", 0.375)):
        assert compare(pooled, 384, 1024, 0.5, keep, mode) == 0, (mode, keep)
    got = fused.select(pooled, 384, 1024, 0.5, 0.5, "cdf")
    assert got.index[0, 1, 0].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]  # uniform row: mass 0.125 a tile


@pytest.mark.parametrize("capability", [(8, 9), (8, 0)])
def test_compiles_offline_for_older_gpus_without_spills(capability):
    """The op also runs on sm_89 / sm_80 (the predictor has no architecture floor of its own)."""
    from qattn_fx.kernels._offline import ptxas_report

    m = "meta"
    pooled = reference.Pooled(torch.empty(1, 40, 591, 128, device=m), torch.empty(1, 40, 591, device=m),
                              torch.empty(1, 40, 128, 591, device=m).transpose(2, 3), torch.empty(1, 40, 591, device=m),
                              torch.empty(1, 591, dtype=torch.bool, device=m))
    compiled = fused.compile_for(capability, pooled, 591 * 128, 591 * 128, 0.5, "cdf")
    report = ptxas_report(compiled, capability)
    assert report["ptxas_ok"] and report["spill_stores"] == 0 and report["spill_loads"] == 0, report


@pytest.mark.parametrize("case,mode,keep", [("cross-300x77", "top_k", 0.25), ("odd-1000x2000", "cdf", 0.9),
                                            pytest.param("gqa-bias", "cdf", 0.5, marks=pytest.mark.slow)])
def test_dot_scores_match_the_torch_selection(case, mode, keep):
    """Programs of 16 query tiles score as FMA ``tl.dot`` chunks: the reference's lists up to the boundary, as the
    scalar-load scores give."""
    pooled, sq, skv, sm = pooled_for(case)
    assert fused.dot_scores(fused.rows_per_program(pooled.k_mean.shape[2]))
    compare(pooled, sq, skv, sm, keep, mode, 1, True)


def test_dot_scores_give_the_lists_of_the_scalar_scores():
    """On dyadic means (every product and partial sum exact) both ways of scoring give the same lists, bit for bit
    (the scalar loads forced where a program holds 16 query tiles)."""
    pooled, sq, skv, sm = pooled_for("odd-1000x2000", seed=10, dyadic=True)
    for mode, keep in RULES:
        lists = {}
        for dot in (True, False):
            with pytest.MonkeyPatch.context() as mp:
                if not dot:
                    mp.setattr(fused, "dot_scores", lambda rows: False)  # the scalar loads everywhere
                lists[dot] = fused.select(pooled, sq, skv, sm, keep, mode, 1, True)
        dot, rows = lists[True], lists[False]
        assert torch.equal(dot.index, rows.index) and torch.equal(dot.count, rows.count), (mode, keep)


@pytest.mark.parametrize("nk", [40, 256, 512])
def test_dot_scores_compile_offline_for_sm90_in_fewer_registers(nk):
    """With 16 query tiles a program (up to 512 key tiles), scoring by ``tl.dot`` chunks compiles without spills
    and in fewer registers than one scalar load per query tile and ``d`` (so more programs fit an SM)."""
    from qattn_fx.kernels._offline import ptxas_report

    m = "meta"
    pooled = reference.Pooled(torch.empty(1, 12, 256, 128, device=m), torch.empty(1, 12, 256, device=m),
                              torch.empty(1, 12, 128, nk, device=m).transpose(2, 3), torch.empty(1, 12, nk, device=m),
                              torch.empty(1, nk, dtype=torch.bool, device=m))
    reports = {}
    for dot in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if not dot:
                mp.setattr(fused, "dot_scores", lambda rows: False)  # the scalar loads everywhere
            reports[dot] = ptxas_report(fused.compile_for((9, 0), pooled, 256 * 128, nk * 128, 0.5, "top_k"), (9, 0))
    assert reports[True]["ptxas_ok"] and reports[True]["spill_stores"] == 0, reports
    assert reports[True]["registers"] < reports[False]["registers"], reports
