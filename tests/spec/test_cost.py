"""The cost rule: predicted speedups from the shipped H100 and H200 measurements, and ``auto`` keeping a site dense
where the kernel it would pick is predicted slower than dense attention (explicit backends and pinned kernels
untouched), without guards on symbolic lengths."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import qattn_fx
from benchmarks import cost_table
from qattn_fx import cost, cost_data
from qattn_fx.hardware import Hardware
from qattn_fx.cost_rule import MIN_PREDICTED_SPEEDUP, cost_rule
from qattn_fx.policy import Site, resolve
from qattn_fx.recipes import Recipe
from qattn_fx.spec import AttentionSpec, Spec

SM90 = Hardware.supported_install("sm_90")
SM100 = Hardware.supported_install("sm_100")
CPU = Hardware.for_arch("cpu")
SAGE_INT8 = Recipe("int8", "fp8", 1, 16, 1)


def site(b=1, h=40, sq=32760, skv=32760, d=128, **kwargs) -> Site:
    return Site(q_shape=(b, h, sq, d), k_shape=(b, h, skv, d), v_shape=(b, h, skv, d),
                role="self" if sq == skv else "cross", **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# The data and the model
# ------------------------------------------------------------------------------------------------------------------


def test_the_shipped_data_is_what_its_command_prints(monkeypatch):
    monkeypatch.chdir(Path(cost_data.__file__).parents[1])  # the command runs from the repository root
    words = shlex.split("".join(cost_data.COMMAND))
    assert words[:3] == ["python", "-m", "benchmarks.cost_table"] and words[-2:] == [">", "qattn_fx/cost_data.py"]
    with open(cost_data.__file__) as f:
        assert f.read() == cost_table.render(words[3:-2])


def test_runs_on_two_gpus_of_one_arch_keep_their_own_points(tmp_path):
    """A later run replaces a point of the same GPU; a run on another GPU adds its own beside it."""
    def run(name, device, speedup):
        row = {"kernel": "gluon_sage", "method": "gluon_sage/int8-1-16-1", "shape": "flux-1024", "B": 1, "H": 24,
               "Sq": 4608, "Skv": 4608, "D": 128, "speedup": speedup}
        path = tmp_path / name
        path.write_text(json.dumps({"rows": [row], "env": {"device": device, "capability": [9, 0]},
                                    "settings": {"timer": "graph"}}))
        return str(path)

    arguments = [run("2026-12-01_h200.json", "NVIDIA H200", 0.8), run("2026-12-02_h200.json", "NVIDIA H200", 0.9),
                 run("2026-12-06_h100.json", "NVIDIA H100 80GB HBM3", 0.85)]
    sources, points, _ = cost_table.read_points(arguments)
    assert sorted((p[1], p[-1]) for p in points.values()) == [("2026-12-02_h200", 0.9), ("2026-12-06_h100", 0.85)]
    assert sources["2026-12-06_h100"]["device"] == "NVIDIA H100 80GB HBM3"


def test_measured_self_attention_points_are_predicted_as_measured():
    """On the GPU that measured them; without a GPU, where two GPUs measured one shape, the smaller speedup."""
    for p in cost.POINTS:
        if p.q_len != p.kv_len:
            continue
        shape = dict(q_len=p.q_len, kv_len=p.kv_len, head_dim=p.head_dim, batch_heads=p.batch_heads)
        assert cost.predicted_speedup(p.kernel, p.arch, gpu=p.gpu, **shape) == pytest.approx(p.speedup), p
        assert cost.predicted_speedup(p.kernel, p.arch, **shape) <= p.speedup, p


def test_a_cross_attention_point_is_at_most_its_measurement():
    points = [p for p in cost.POINTS if p.kernel == "cudnn_fp8" and p.shape == "cross-512"]
    assert sorted(p.gpu for p in points) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    for p in points:
        got = cost.predicted_speedup("cudnn_fp8", "sm_90", q_len=p.q_len, kv_len=p.kv_len, head_dim=128,
                                     batch_heads=p.batch_heads, gpu=p.gpu)
        assert got <= p.speedup


def test_between_points_the_prediction_lies_between_them():
    flux = cost.predicted_speedup("gluon_sage", "sm_90", q_len=4608, kv_len=4608, head_dim=128, batch_heads=24)
    wan = cost.predicted_speedup("gluon_sage", "sm_90", q_len=32760, kv_len=32760, head_dim=128, batch_heads=12)
    mid = cost.predicted_speedup("gluon_sage", "sm_90", q_len=16384, kv_len=16384, head_dim=128, batch_heads=24)
    assert flux < mid < wan


def test_outside_the_measured_range_no_gain_is_extrapolated():
    largest = cost.predict("gluon_sage", "sm_90", q_len=75600, kv_len=75600, head_dim=128, batch_heads=40)
    longer = cost.predict("gluon_sage", "sm_90", q_len=200000, kv_len=200000, head_dim=128, batch_heads=40)
    assert longer.speedup == largest.speedup and not longer.upper_bound  # held above the range
    shortest_keys = cost.predicted_speedup("gluon_sage", "sm_90", q_len=32760, kv_len=512, head_dim=128,
                                           batch_heads=40)
    tiny = cost.predict("gluon_sage", "sm_90", q_len=256, kv_len=256, head_dim=128, batch_heads=24)
    assert tiny.speedup == shortest_keys and tiny.upper_bound  # held below the range, as an upper bound
    # below the smallest d64 work (sd3-1024: 0.879x on the H200, 0.908x on the H100) that value is held, as an
    # upper bound; without a GPU, the smaller of the two
    small_d64 = dict(q_len=2048, kv_len=2048, head_dim=64, batch_heads=24)
    assert cost.predict("gluon_sage", "sm_90", gpu="NVIDIA H200", **small_d64) == cost.Prediction(
        0.879, True, "H200 2026-12-02")
    assert cost.predict("gluon_sage", "sm_90", gpu="NVIDIA H100 80GB HBM3", **small_d64) == cost.Prediction(
        0.9083, True, "H100 80GB HBM3 2026-12-07")
    assert cost.predict("gluon_sage", "sm_90", **small_d64) == cost.Prediction(
        0.879, True, "H100 80GB HBM3/H200 2026-12-07")


def test_below_the_measured_range_a_gain_is_not_extrapolated(monkeypatch):
    """Where the smallest measured call is a gain, a smaller one is predicted at most 1.0: no gain."""
    source = next(iter(cost_data.SOURCES))
    points = (cost.Point("k", source, "a", 24, 4096, 4096, 64, 1.2),
              cost.Point("k", source, "b", 24, 8192, 8192, 64, 1.4))
    monkeypatch.setitem(cost._TABLE, ("k", "sm_90"), points)
    small = cost.predict("k", "sm_90", q_len=1024, kv_len=1024, head_dim=64, batch_heads=24)
    assert small.speedup == 1.0 and small.upper_bound
    assert cost.no_gain(small.speedup, small.upper_bound, 1.0)
    mid = cost.predict("k", "sm_90", q_len=5793, kv_len=5793, head_dim=64, batch_heads=24)
    assert 1.2 < mid.speedup < 1.4 and not mid.upper_bound


@pytest.mark.parametrize("measured, gpu, same", [
    ("NVIDIA H200", "NVIDIA H200", True),
    ("NVIDIA H100", "NVIDIA H100 80GB HBM3", True),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100", True),
    ("NVIDIA H100", "NVIDIA H100 NVL", True),
    ("NVIDIA H100", "NVIDIA H200", False),
    ("NVIDIA H20", "NVIDIA H200", False),
])
def test_a_run_speaks_for_the_gpus_that_share_its_name(measured, gpu, same):
    assert cost.same_gpu(measured, gpu) is same


def test_the_gpus_own_points_are_preferred_over_the_architectures(monkeypatch):
    """Points measured on the running GPU decide alone; a GPU without points of its own gets every point of the
    architecture; the label names the GPU whose points spoke."""
    h200 = next(iter(cost_data.SOURCES))
    monkeypatch.setitem(cost_data.SOURCES, "h100_run", {**cost_data.SOURCES[h200], "device": "NVIDIA H100",
                                                        "date": "2026-12-06"})
    points = (cost.Point("k", h200, "a", 24, 4096, 4096, 128, 1.2),
              cost.Point("k", "h100_run", "a", 24, 4096, 4096, 128, 0.9))
    monkeypatch.setitem(cost._TABLE, ("k", "sm_90"), points)
    kwargs = dict(q_len=4096, kv_len=4096, head_dim=128, batch_heads=24)
    on_h100 = cost.predict("k", "sm_90", gpu="NVIDIA H100 80GB HBM3", **kwargs)
    assert on_h100.speedup == 0.9 and on_h100.data == "H100 2026-12-06"
    assert cost.predict("k", "sm_90", gpu="NVIDIA H200", **kwargs).speedup == 1.2
    unknown = cost.predict("k", "sm_90", gpu="NVIDIA GH200 480GB", **kwargs)
    assert unknown.speedup == 0.9 and unknown.data.startswith("H100/H200")  # the smallest where points share x
    assert cost.predict("k", "sm_90", **kwargs) == unknown
    site_h100 = dataclasses.replace(SM90, gpu="NVIDIA H100 80GB HBM3")
    site_h200 = dataclasses.replace(SM90, gpu="NVIDIA H200")
    call = Site(q_shape=(1, 24, 4096, 128), k_shape=(1, 24, 4096, 128), v_shape=(1, 24, 4096, 128), role="self")
    monkeypatch.setattr(cost, "covered", lambda: (("k", "sm_90"),))
    assert cost_rule("k", call, site_h100)[0] and not cost_rule("k", call, site_h200)[0]


def test_short_keys_limit_the_prediction_whatever_the_query_length():
    cross = dict(q_len=32760, kv_len=512, head_dim=128, batch_heads=40)  # the measured cross-512 points
    assert cost.predicted_speedup("flashinfer_fa3_fp8", "sm_90", gpu="NVIDIA H200", **cross) == pytest.approx(0.5853)
    assert cost.predicted_speedup("flashinfer_fa3_fp8", "sm_90", gpu="NVIDIA H100 80GB HBM3",
                                  **cross) == pytest.approx(0.5683)
    only_keys = cost.predict("gluon_sage", "sm_90", q_len=None, kv_len=512, head_dim=128, batch_heads=None)
    assert only_keys.upper_bound and only_keys.speedup < 1


def test_a_head_dim_without_points_takes_the_smallest_prediction_over_the_measured_ones():
    kwargs = dict(q_len=32760, kv_len=32760, batch_heads=24)
    d96 = cost.predicted_speedup("gluon_sage", "sm_90", head_dim=96, **kwargs)
    assert d96 == min(cost.predicted_speedup("gluon_sage", "sm_90", head_dim=d, **kwargs) for d in (64, 128))


def test_no_data_gives_none():
    kwargs = dict(q_len=32760, kv_len=32760, head_dim=128, batch_heads=24)
    assert cost.predicted_speedup("gluon_sage", "sm_89", **kwargs) is None
    assert cost.predicted_speedup("flashinfer_trtllm_sage", "sm_100", **kwargs) is None
    assert ("gluon_sage", "sm_90") in cost.covered()


@pytest.mark.parametrize("name, value", [("q_len", 0), ("kv_len", True), ("head_dim", 1.5), ("batch_heads", None)])
def test_bad_lengths_are_named(name, value):
    kwargs = dict(q_len=4608, kv_len=4608, head_dim=128, batch_heads=24) | {name: value}
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid; valid: an int >= 1"):
        cost.predicted_speedup("gluon_sage", "sm_90", **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# The policy
# ------------------------------------------------------------------------------------------------------------------


def _reason(kernel, sq, skv, bh, *, bound=False):
    p = cost.predict(kernel, "sm_90", q_len=sq, kv_len=skv, head_dim=128, batch_heads=bh)
    assert p.speedup < MIN_PREDICTED_SPEEDUP and p.upper_bound == bound
    at_most = "at most " if bound else ""
    return (f"dense: {kernel} predicted {at_most}{p.speedup:.2f}x of cuDNN bf16 at Sq {sq}, Skv {skv} "
            f"(cost data: {p.data})")


def test_auto_keeps_wan_cross_attention_dense_on_sm90():
    decision = resolve(site(sq=32760, skv=512), SM90)
    assert not decision.quantized
    assert decision.reason == _reason("gluon_sage", 32760, 512, 40)  # the measured cross-512 point
    assert decision.reason.startswith("dense: gluon_sage predicted 0.66x of cuDNN bf16 at Sq 32760, Skv 512 "
                                      "(cost data: H100 80GB HBM3/H200 2026-12-07)")
    assert decision.predicted_slower == decision.reason.removeprefix("dense: ")  # the prediction, as data


def test_auto_quantizes_wan_self_attention_and_keeps_flux_dense_on_sm90():
    wan = resolve(site(h=12), SM90)
    assert wan.quantized and wan.kernel == "gluon_sage"
    assert wan.reason == "quantized: int8 Q/K 1/16, fp8 V per-channel, smooth K on gluon_sage (sm_90)"
    assert wan.predicted_slower is None
    flux = resolve(site(h=24, sq=4608, skv=4608), SM90)
    assert flux.reason == _reason("gluon_sage", 4608, 4608, 24)


def test_auto_applies_the_rule_to_the_kernel_it_picks():
    cudnn = Spec(default=AttentionSpec("auto", Recipe("fp8", "fp8")))
    assert resolve(site(sq=32760, skv=512), SM90, cudnn).reason == _reason("cudnn_fp8", 32760, 512, 40)
    old_triton = Hardware.supported_install("sm_90", {"triton": "3.5.0"})
    assert resolve(site(sq=32760, skv=512), old_triton).reason == _reason("triton_sage", 32760, 512, 40, bound=True)


@pytest.mark.parametrize("use", [AttentionSpec("TRITON", SAGE_INT8), AttentionSpec("auto", SAGE_INT8,
                                                                                     kernel="gluon_sage")],
                         ids=["explicit-backend", "pinned-kernel"])
def test_an_explicit_backend_or_kernel_still_quantizes_and_says_it_is_predicted_slower(use):
    decision = resolve(site(sq=32760, skv=512), SM90, Spec(default=use))
    assert decision.quantized and decision.kernel == "gluon_sage"
    assert decision.reason == ("quantized: int8 Q/K 1/16, fp8 V per-channel, smooth K on gluon_sage (sm_90); slower "
                               "than dense: " + _reason("gluon_sage", 32760, 512, 40).removeprefix("dense: ")
                               + "; auto would keep it dense")
    assert decision.predicted_slower == _reason("gluon_sage", 32760, 512, 40).removeprefix("dense: ")
    # where the cost data promise a gain (or have no data) the reason is the plain one
    wan = resolve(site(sq=32760, skv=32760), SM90, Spec(default=use))
    assert wan.reason == "quantized: int8 Q/K 1/16, fp8 V per-channel, smooth K on gluon_sage (sm_90)"
    assert wan.predicted_slower is None


def test_without_cost_data_auto_behaves_as_without_the_rule():
    decision = resolve(site(sq=32760, skv=512), SM100)
    assert decision.quantized and decision.kernel == "flashinfer_trtllm_sage"
    assert "predict" not in decision.reason
    assert cost_rule("flashinfer_trtllm_sage", site(sq=32760, skv=512), SM100) == (False, None)


def test_deployment_notes_follow_the_rule():
    cross = resolve(site(sq=32760, skv=512), CPU, emulate=True, target="sm_90")
    assert cross.quantized and cross.kernel == "reference"  # emulation runs every site
    assert str(cross.deployment) == f"on sm_90: dense ({_reason('gluon_sage', 32760, 512, 40)[7:]})"
    assert str(resolve(site(h=12), CPU, emulate=True, target="sm_90").deployment) == "on sm_90: gluon_sage"
    explicit = Spec(default=AttentionSpec("TRITON", SAGE_INT8))
    assert str(resolve(site(sq=32760, skv=512), CPU, explicit, emulate=True).deployment) == "on sm_90: gluon_sage"


def test_symbolic_lengths_get_no_prediction_and_a_static_key_length_bounds_it():
    """A symbolic query length (as Dynamo's fake tensors carry it under dynamic shapes) is never guarded on."""
    env = ShapeEnv()
    s0 = env.create_symintnode(env.create_symbol(300, ConstantSource("s"), dynamic_dim=DimDynamic.DYNAMIC), hint=300)
    self_attn = Site(q_shape=(1, 12, s0, 128), k_shape=(1, 12, s0, 128), v_shape=(1, 12, s0, 128))
    assert cost_rule("gluon_sage", self_attn, SM90) == (False, "no prediction: symbolic lengths")
    decision = resolve(self_attn, SM90)
    assert decision.quantized and decision.reason.endswith("(sm_90); no prediction: symbolic lengths")
    cross = Site(q_shape=(1, 12, s0, 128), k_shape=(1, 12, 512, 128), v_shape=(1, 12, 512, 128), role="cross")
    assert resolve(cross, SM90).reason == (
        "dense: gluon_sage predicted at most 0.66x of cuDNN bf16 at Sq symbolic, Skv 512 (cost data: H100 80GB "
        "HBM3/H200 2026-12-07)")
    assert not env.guards  # nothing was guarded on


class _CrossAttention(torch.nn.Module):
    """Self-attention over the input's tokens, then cross-attention to a fixed 512-token text (a parameter, so its
    length stays static under ``dynamic=True``); one head of 128 channels."""

    def __init__(self):
        super().__init__()
        self.text = torch.nn.Parameter(torch.randn(1, 1, 512, 128))

    def forward(self, x):
        x = F.scaled_dot_product_attention(x, x, x)
        return F.scaled_dot_product_attention(x, self.text, self.text)


def test_symbolic_lengths_add_no_recompile_and_decide_the_same_at_every_length():
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager", target="sm_90")
    torch._dynamo.reset()
    fn = torch.compile(_CrossAttention().eval(), backend=backend, fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for s in (256, 384):
            fn(torch.randn(1, 1, s, 128))
    assert len(backend.graph_modules) == 1, backend.report  # one symbolic graph for both lengths
    self_attn, cross = backend.report.sites
    assert isinstance(self_attn.q_shape[2], str) and cross.kv_shape[2] == 512
    assert self_attn.rewritten and cross.rewritten  # emulated: both run on the reference kernel
    assert str(self_attn.deployment) == "(as bf16) on sm_90: gluon_sage (no prediction: symbolic lengths)"
    assert str(cross.deployment) == ("(as bf16) on sm_90: dense (gluon_sage predicted at most 0.66x of cuDNN bf16 at Sq "
                                     "symbolic, Skv 512 (cost data: H100 80GB HBM3/H200 2026-12-07))")


def test_a_graph_whose_sites_all_stay_dense_reaches_the_compiler_unchanged():
    """What ``auto`` keeps dense costs what compiled dense costs: the graph handed to Inductor is Dynamo's own."""
    def flux_attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v).relu() * 2

    captured = []

    def plain(gm, example_inputs):
        captured.append(gm.code)
        return gm.forward

    backend = qattn_fx.backend(hardware=SM90, compiler="eager")
    x = torch.randn(1, 24, 4608, 128, dtype=torch.bfloat16)
    for compiler in (plain, backend):
        torch._dynamo.reset()
        torch.compile(flux_attention, backend=compiler, fullgraph=True)(x, x, x)
    (site,) = backend.report.sites
    assert not site.rewritten and "gluon_sage predicted 0.90x of cuDNN bf16 at Sq 4608" in site.reason
    assert backend.graph_modules[0].code == captured[0]
