"""Skip-Softmax on the CPU: the contract's tile test, the reference and the emulated tile loop, both seed formats'
keys through the compile pass (the issue's two failures pinned), measured sparsity, the calibration for
``target_sparsity``, and step schedules that compile once."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import qattn_fx
import qattn_fx.ops  # noqa: F401  (registers qattn::*)
from benchmarks.common import local_qkv
from qattn_fx import AttentionSpec, Recipe, SkipSoftmax, Spec, skip_softmax
from qattn_fx.hardware import Hardware
from qattn_fx.kernels import emulation, reference
from support import quantize

SAGE = Recipe("int8", "fp8", 1, 16, 1)
SM_SCALE = 1.0 / math.sqrt(128)


# ----------------------------------------------------------------------------------------------------------------
# The tile test
# ----------------------------------------------------------------------------------------------------------------


def _logits(rows: int, keys: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((1, 1, rows, keys), fill)


def test_a_tile_is_skipped_only_when_every_row_of_it_is_below_the_threshold():
    z = _logits(64, 384)
    z[..., 0] = 10.0  # tile 0 sets every row's max at 10
    z[..., 128:256] = 3.0  # tile 1: 7 below: exp2(-7) = 0.0078
    z[..., 256:] = 3.0
    z[0, 0, 5, 300] = 9.9  # tile 2: one row only 0.1 below its max
    skipped = skip_softmax.skip_mask(z, torch.tensor(math.log2(0.01)))
    assert skipped.tolist() == [[[[False, True, False]]]]
    # λ = 0 skips nothing; a row's first tile is never skipped whatever λ is
    assert not skip_softmax.skip_mask(z, torch.tensor(-math.inf)).any()
    assert not skip_softmax.skip_mask(z, torch.tensor(100.0))[..., 0].any()


def test_rows_past_the_query_length_do_not_vote_and_masked_rows_never_skip():
    z = _logits(70, 256)  # row tiles: 64 rows, then 6
    z[..., 0] = 10.0
    skipped = skip_softmax.skip_mask(z, torch.tensor(-1.0))
    assert skipped[..., 1].tolist() == [[[True, True]]]
    masked = torch.full((1, 1, 64, 256), -math.inf)  # a row whose keys so far are all masked: -inf - -inf is NaN
    masked[..., 1:, 0] = 0.0
    assert not skip_softmax.skip_mask(masked, torch.tensor(0.0))[..., 1].any()


def test_tile_margins_give_the_sparsity_of_every_threshold():
    q, k, v = local_qkv(1, 2, 300, 1100, 128, width=150.0, device="cpu")
    z = (q.float() @ k.float().transpose(-1, -2)) * SM_SCALE * skip_softmax.LOG2E
    margins = skip_softmax.tile_margins(z)
    for lam in (1e-6, 1e-3, 0.1, 1.0):
        assert torch.equal(margins < math.log2(lam), skip_softmax.skip_mask(z, torch.tensor(math.log2(lam))))


# ----------------------------------------------------------------------------------------------------------------
# Reference and emulation
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_args():
    return quantize(*local_qkv(1, 2, 400, 900, 128, width=200.0, device="cpu"), "int8", 1, 16)


def test_zero_threshold_is_the_unskipped_computation(local_args):
    counts = []
    plain = emulation.emulate(*local_args, SM_SCALE, 128, True)
    zero = emulation.emulate(*local_args, SM_SCALE, 128, True, skip_threshold=0.0, skip_counts=counts)
    assert torch.equal(plain, zero) and counts == [0]
    dense = reference.scaled_attention(*local_args, SM_SCALE, torch.float32)
    with skip_softmax.measure() as measured:
        ref0 = reference.scaled_attention(*local_args, SM_SCALE, torch.float32, skip_threshold=torch.tensor(0.0),
                                          skip_label="s")
    assert torch.equal(dense, ref0) and measured.sites["s"].skipped == 0


@pytest.mark.parametrize("lam", [1e-4, 1e-2, 0.3])
def test_reference_and_emulation_skip_the_same_tiles(local_args, lam):
    counts = []
    emulated = emulation.emulate(*local_args, SM_SCALE, 128, True, skip_threshold=lam, skip_counts=counts)
    with skip_softmax.measure() as measured:
        ref = reference.scaled_attention(*local_args, SM_SCALE, torch.float32, skip_threshold=torch.tensor(lam),
                                         skip_label="s")
    site = measured.sites["s"]
    assert site.tiles == 2 * 7 * 8 and site.calls == 1
    assert 0.2 < site.sparsity < 0.9 and counts == [site.skipped]
    dense = reference.scaled_attention(*local_args, SM_SCALE, torch.float32)
    err = ((emulated.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 0.05  # the emulation rounds P against the running max, the reference against the row's
    cos = F.cosine_similarity(ref.flatten(), dense.flatten(), dim=0).item()
    assert cos > 0.999


def test_emulated_skips_need_the_contract_tile():
    args = quantize(*local_qkv(1, 1, 64, 256, 128, device="cpu"), "int8", 1, 16)
    with pytest.raises(ValueError, match="block_n=64 is invalid for Skip-Softmax; valid: 128"):
        emulation.emulate(*args, SM_SCALE, 64, skip_threshold=0.1)


def test_measurements_nest_per_thread_and_per_kind():
    """Skip-Softmax's and block sparsity's ``measure()`` share :mod:`qattn_fx.recording`'s collectors: the innermost
    block of each kind collects, the two kinds apart, and another thread sees none of them."""
    import threading

    from qattn_fx import block_sparse

    assert skip_softmax.active() is None and block_sparse.active() is None
    with skip_softmax.measure() as outer, block_sparse.measure() as blocks:
        skip_softmax.record("a", 1, 4)
        with skip_softmax.measure() as inner:
            skip_softmax.record("a", 2, 4)
        seen = []
        worker = threading.Thread(target=lambda: seen.append((skip_softmax.active(), block_sparse.active())))
        worker.start()
        worker.join()
        assert skip_softmax.active() is outer and block_sparse.active() is blocks
    assert seen == [(None, None)] and skip_softmax.active() is None and block_sparse.active() is None
    assert outer.sparsity() == {"a": 0.25} and inner.sparsity() == {"a": 0.5} and blocks.sites == {}


def test_op_takes_the_threshold_only_where_a_kernel_does(local_args):
    thr = torch.tensor([0.01])
    with skip_softmax.measure() as measured:
        out = torch.ops.qattn.scaled_attention(*local_args, SM_SCALE, torch.float32, "reference", None, None, thr,
                                               "site")
    assert measured.sites["site"].skipped > 0 and out.shape == (1, 2, 400, 128)
    with pytest.raises(ValueError, match="kernel 'triton_sage' takes no skip_threshold"):
        torch.ops.qattn.scaled_attention(*local_args, SM_SCALE, torch.float32, "triton_sage", None, None, thr, "s")
    with pytest.raises(ValueError, match="skip_threshold must be a one-element float tensor"):
        torch.ops.qattn.scaled_attention(*local_args, SM_SCALE, torch.float32, "reference", None, None,
                                         torch.tensor([1, 2]), "s")


def test_dense_skip_attention_is_fp32_attention_without_the_skipped_tiles():
    q, k, v = local_qkv(1, 2, 200, 600, 128, width=100.0, device="cpu")
    dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    zero = torch.ops.qattn.skip_softmax_attention(q, k, v, SM_SCALE, torch.float32, "reference", None, None,
                                                  torch.tensor(0.0), "")
    torch.testing.assert_close(zero, dense, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Seed formats through the compile pass (issue #21's failures)
# ----------------------------------------------------------------------------------------------------------------


class Attention(torch.nn.Module):
    """SDPA of its inputs, scaled by a function of the timestep (as a DiT's modulation uses it: a forward argument
    that the forward does not use is no graph input)."""

    def forward(self, q, k, v, timestep):
        return F.scaled_dot_product_attention(q, k, v) * (1.0 + 0.0 * timestep.float().mean())


def _attention_nodes(backend) -> list:
    return [n for gm in backend.graph_modules for n in gm.graph.nodes if "attention" in str(n.target)]


def test_vllm_quant_plus_skip_reaches_the_op_and_the_reason():
    spec = {"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8"}, "skip_softmax": {"threshold": 0.01}}}
    backend = qattn_fx.backend(spec, hardware=Hardware.supported_install("sm_100"), compiler="eager")
    q, k, v = local_qkv(1, 2, 128, 256, 128, device="cpu")
    with pytest.raises(Exception):  # compiles, then the Blackwell kernel cannot run on this CPU
        torch.compile(Attention(), backend=backend)(q, k, v, torch.tensor([1.0]))
    (site,) = backend.report.sites
    assert site.kernel == "flashinfer_trtllm_sage" and site.skip_softmax == "skip-softmax λ=0.01"
    assert "skip-softmax λ=0.01" in site.reason
    (node,) = _attention_nodes(backend)
    assert node.args[-2].name.endswith("skip_threshold") and node.args[-1] == "sdpa"


def test_vllm_skip_only_spec_is_emulated_and_explains_itself():
    spec = {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.01}}}
    q, k, v = local_qkv(1, 2, 200, 600, 128, width=100.0, device="cpu")
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager")
    with skip_softmax.measure() as measured:
        out = torch.compile(Attention(), backend=backend)(q, k, v, torch.tensor([1.0]))
    (site,) = backend.report.sites
    assert site.rewritten and site.kernel == "reference" and site.recipe is None
    assert "no kernel in qattn_fx runs bf16 + skip-softmax" in str(site.deployment)
    assert measured.sites["sdpa"].skipped > 0
    dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert F.cosine_similarity(out.float().flatten(), dense.flatten(), dim=0).item() > 0.999
    with pytest.raises(Exception, match="no kernel in qattn_fx runs bf16 attention with skip-softmax"):
        qattn_fx.explain(Attention(), q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.tensor([1.0]), spec=spec,
                         hardware=Hardware.supported_install("sm_100"))


def test_visualgen_sparse_attention_config():
    spec = Spec.from_dict({"attention_config": {
        "backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": 1,
                                                        "k_block_size": 16, "v_block_size": 1},
        "sparse_attention_config": {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": 2000.0}}}})
    assert spec.default.skip_softmax == SkipSoftmax(threshold_scale_factor=2000.0)
    assert spec.default.describe() == ("int8 Q/K 1/16, fp8 V per-channel, smooth K, skip-softmax λ=2000/Skv via "
                                       "TRTLLM")
    dense_skip = Spec.from_dict({"backend": "TRTLLM", "sparse_attention_config": {"algorithm": "skip_softmax",
                                                                                   "target_sparsity": 0.5}})
    assert dense_skip.default.recipe is None and dense_skip.default.skip_softmax.target_sparsity == 0.5
    with pytest.raises(ValueError, match=r"attention_config.sparse_attention_config.algorithm='vsa' is invalid; "
                                         r"valid: skip_softmax"):
        Spec.from_dict({"backend": "TRTLLM", "sparse_attention_config": {"algorithm": "vsa"}})
    assert Spec.from_dict(spec.to_dict()) == spec


def test_threshold_scale_factor_divides_by_the_key_length():
    k = torch.zeros(1, 2, 500, 64)
    lam = torch.ops.qattn.skip_threshold(k, 0.0, 1000.0, None, 0.0, 1000.0)
    assert lam.shape == (1,) and lam.item() == pytest.approx(2.0)
    gated = [torch.ops.qattn.skip_threshold(k, 0.05, 0.0, torch.tensor([t]), 0.9, 1000.0).item()
             for t in (999, 901, 900, 10)]
    assert gated == pytest.approx([0.0, 0.0, 0.05, 0.05])


# ----------------------------------------------------------------------------------------------------------------
# Step schedules: the timestep is data, the loop compiles once
# ----------------------------------------------------------------------------------------------------------------


def test_gated_site_without_a_timestep_input_raises_naming_the_fix():
    spec = Spec(default=AttentionSpec(recipe=SAGE, skip_softmax=SkipSoftmax(threshold=0.1,
                                                                            disabled_until_timestep=0.5)))

    class NoTimestep(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q, k, v = local_qkv(1, 2, 64, 64, 128, device="cpu")
    with pytest.raises(Exception, match=r"needs the denoising timestep in the compiled graph, but no graph input is "
                                        r"the model's 'timestep' argument"):
        torch.compile(NoTimestep(), backend=qattn_fx.backend(spec, emulate=True, compiler="eager"))(q, k, v)


def test_schedule_follows_the_timestep_without_recompiling():
    spec = Spec(default=AttentionSpec(recipe=SAGE, skip_softmax=SkipSoftmax(threshold=0.01,
                                                                            disabled_until_timestep=0.5)))
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager")
    q, k, v = local_qkv(1, 2, 256, 1024, 128, width=100.0, device="cpu")
    model = torch.compile(Attention(), backend=backend)
    skipped = []
    for i, t in enumerate((999, 700, 500, 100)):
        with skip_softmax.measure() as measured, torch.compiler.set_stance(
                "fail_on_recompile" if i else "default"):
            model(q, k, v, torch.tensor([t]))
        skipped.append(measured.sites["sdpa"].skipped)
    assert len(backend.graph_modules) == 1
    assert skipped[:2] == [0, 0] and skipped[2] > 0 and skipped[2] == skipped[3]


@pytest.mark.slow
def test_fifty_step_tiny_wan_loop_compiles_once():
    """The issue's target: a 50-step schedule on a tiny diffusers Wan compiles one graph (Inductor, CPU,
    emulation), the step reaching it as the model's timestep tensor."""
    pytest.importorskip("diffusers")
    from qattn_fx import tiny_models

    model, inputs = tiny_models.wan(head_dim=64)
    spec = Spec(default=AttentionSpec(recipe=SAGE, skip_softmax=SkipSoftmax(threshold=0.5,
                                                                            disabled_until_timestep=0.8)))
    backend = qattn_fx.backend(spec, emulate=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    timesteps = torch.linspace(999, 0, 50).round().long()
    with torch.no_grad(), skip_softmax.measure() as measured:
        compiled(**dict(inputs, timestep=timesteps[:1]))
        with torch.compiler.set_stance("fail_on_recompile"):
            for t in timesteps[1:]:
                compiled(**dict(inputs, timestep=t.reshape(1)))
    assert len(backend.graph_modules) == 1
    assert all(site.calls == 50 for site in measured.sites.values())
    backend.record_sparsity(measured)
    assert all(s.sparsity is not None for s in backend.report.sites if s.rewritten)


# ----------------------------------------------------------------------------------------------------------------
# Report, dumps, calibration
# ----------------------------------------------------------------------------------------------------------------


def test_report_shows_the_setting_and_the_measured_sparsity(tmp_path):
    spec = Spec(default=AttentionSpec(recipe=SAGE, skip_softmax=SkipSoftmax(threshold=0.01)))
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager", debug_dir=tmp_path)
    q, k, v = local_qkv(1, 2, 256, 1024, 128, width=100.0, device="cpu")
    model = torch.compile(Attention(), backend=backend)
    with skip_softmax.measure() as measured:
        model(q, k, v, torch.tensor([1.0]))
    report = backend.record_sparsity(measured)
    (site,) = report.to_dict()["sites"]
    assert site["skip_softmax"] == "skip-softmax λ=0.01" and site["sparsity"] == measured.sites["sdpa"].sparsity
    assert "int8 1/16, fp8/ch, skip 0.01" in str(report) and "skipped " in str(report)
    dump = json.loads((tmp_path / "sparsity.json").read_text())
    assert dump["sdpa"]["skipped"] == measured.sites["sdpa"].skipped and dump["sdpa"]["module"] == ""


@pytest.mark.parametrize("per", ["site", "model"])
def test_calibration_reaches_the_target_on_its_calls(per):
    class TwoSites(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Attention(), Attention()

        def forward(self, q, k, v, timestep):
            return self.a(q, k, v, timestep) + self.b(q * 0.5, k, v, timestep)

    q, k, v = local_qkv(1, 2, 256, 1024, 128, width=100.0, device="cpu")
    calls = [((q, k, v, torch.tensor([1.0])), {})]
    cal = qattn_fx.calibrate_skip_softmax(TwoSites(), calls, 0.5, spec=Spec(default=AttentionSpec(recipe=SAGE)),
                                          per=per)
    assert set(cal.thresholds) == {"a", "b"} and cal.per == per
    if per == "site":
        assert all(abs(s - 0.5) < 0.02 for s in cal.sparsity.values()), cal.sparsity
    else:
        assert len(set(cal.thresholds.values())) == 1
    backend = qattn_fx.backend(cal.spec, emulate=True, compiler="eager")
    with skip_softmax.measure() as measured:
        torch.compile(TwoSites(), backend=backend)(*calls[0][0])
    for module, label in (("a", "a"), ("b", "b")):
        assert measured.sites[label].sparsity == pytest.approx(cal.sparsity[module], abs=1e-6)


def test_calibration_errors_name_the_value():
    with pytest.raises(ValueError, match=r"per='layer' is invalid; valid: site, model"):
        qattn_fx.calibrate_skip_softmax(Attention(), [{}], 0.5, per="layer")
    with pytest.raises(ValueError, match=r"calibrate_skip_softmax.target_sparsity=1.5 is out of range"):
        qattn_fx.calibrate_skip_softmax(Attention(), [{}], 1.5)
    with pytest.raises(ValueError, match=r"calls is empty"):
        qattn_fx.calibrate_skip_softmax(Attention(), [], 0.5)


@pytest.mark.slow
def test_dense_until_switches_between_two_graphs_compiled_once():
    """Quantization in general on a schedule: the first steps dense, the rest quantized, two graphs each compiled
    once for a 20-step loop (CPU, emulation)."""
    pytest.importorskip("diffusers")
    from qattn_fx import tiny_models

    model, inputs = tiny_models.wan(head_dim=64)
    dense_backend = qattn_fx.backend(qattn_fx.spec.dense_spec(), compiler="eager")
    quant_backend = qattn_fx.backend(Spec(default=AttentionSpec(recipe=SAGE)), emulate=True, compiler="eager")
    switch = qattn_fx.DenseUntil(model, torch.compile(model, backend=dense_backend),
                                 torch.compile(model, backend=quant_backend), until_timestep=0.7)
    assert switch.config is model.config  # the model's attributes read through the wrapper
    timesteps = torch.linspace(999, 0, 20).round().long()
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            out = switch(**dict(inputs, timestep=t.reshape(1)))[0]
            if i == 0:
                torch.testing.assert_close(out, model(**dict(inputs, timestep=t.reshape(1)))[0])
    assert switch.calls == {"dense": 6, "quantized": 14}
    assert len(dense_backend.graph_modules) == 1 and len(quant_backend.graph_modules) == 1
    with pytest.raises(ValueError, match=r"timestep='t' is not an argument of WanTransformer3DModel.forward"):
        qattn_fx.DenseUntil(model, model, model, 0.5, timestep="t")
