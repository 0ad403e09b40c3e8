"""The benchmarks package and the tools: one shape table, and every command line answers --help without a GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time

import pytest
import torch
from torch._dynamo.utils import counters

import qattn_fx
from benchmarks import common, shapes

COMMANDS = ["benchmarks.attention_ops", "benchmarks.context_parallel", "benchmarks.cost_table", "benchmarks.dit_step",
            "benchmarks.tune",
            "tools.ab_tail_split",
            "tools.gluon_probe", "tools.host_overhead", "tools.kernel_in_step", "tools.profile_gluon",
            "tools.profile_predictor", "tools.profile_quantize"]


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_answers_help(module, capsys):
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--help"])
    assert exit_.value.code == 0
    assert f"usage: python -m {module}" in capsys.readouterr().out


@pytest.mark.parametrize("launch", ["8", "8,x", "0,32", "8,32,1"])
def test_profile_predictor_names_a_bad_pool_launch(launch, capsys):
    from tools import profile_predictor

    with pytest.raises(SystemExit) as exit_:
        profile_predictor.main(["--pool-launch", launch])
    assert exit_.value.code == 2
    assert f"--pool-launch {launch!r} is invalid; valid: two positive integers WARPS,ROWS" in capsys.readouterr().err


def test_kernel_in_step_captures_a_copy_of_each_call():
    """tools.kernel_in_step's spy forwards each call, keeps copies of its tensors (a later in-place change of the
    caller's tensor does not reach them) and its keyword arguments, and restores the entry."""
    import types

    from tools import kernel_in_step

    seen = []
    mod = types.SimpleNamespace(attention=lambda *a, **kw: seen.append((a, kw)) or "out")
    x = torch.ones(2)
    with kernel_in_step.captured_calls(mod, "attention") as calls:
        assert mod.attention(x, 3, key_bias=None, return_lse=True) == "out"
    x.add_(1)
    assert len(seen) == 1 and mod.attention.__name__ == "<lambda>"
    args, kwargs = calls[0]
    assert torch.equal(args[0], torch.ones(2)) and args[1] == 3
    assert kwargs == {"key_bias": None, "return_lse": True}
    assert kernel_in_step.gemm_burst(0) is None  # no GEMM context asked: nothing queued, no GPU needed


def test_kernel_in_step_reads_nvidia_smi_samples_into_phases():
    from tools import kernel_in_step

    text = ("2026/12/02 06:42:45.404, 1800, 686.56\n2026/12/02 06:42:45.505, 1860, 690.51\n"
            "garbage line\n2026/12/02 06:42:46.306, 1965, 608.72\n")
    samples = kernel_in_step.parse_smi(text)
    assert [s[1:] for s in samples] == [(1800.0, 686.56), (1860.0, 690.51), (1965.0, 608.72)]
    assert abs(samples[1][0] - samples[0][0] - 0.101) < 1e-3
    t0 = samples[0][0]
    stats = kernel_in_step.phase_medians(samples, {"a": [(t0, t0 + 0.2)], "b": [(t0 + 0.5, t0 + 1.0)], "c": []})
    assert stats["a"] == {"samples": 2, "clock_mhz": 1830.0, "power_w": (686.56 + 690.51) / 2}
    assert stats["b"]["samples"] == 1 and stats["b"]["clock_mhz"] == 1965.0
    assert stats["c"] == {"samples": 0, "clock_mhz": None, "power_w": None}


def test_host_overhead_times_a_mocked_gluon_sage_call_on_the_cpu():
    """tools.host_overhead runs the whole host path of a call, launches mocked, and restores what it patched."""
    pytest.importorskip("triton.experimental.gluon")
    from qattn_fx.kernels import gluon_sage
    from tools import host_overhead

    shape = shapes.Shape(1, 2, 1024, 1024, 128)
    launch = gluon_sage.launch._sage_fwd_ws
    fn = host_overhead.call(host_overhead.inputs(shape, "int8-1-16", True), shape, key_bias=False, lse=True,
                            skip=False)
    with host_overhead.mocked_device(), qattn_fx.config.patch(tuning_cache=""):
        out, lse = fn()
        times = host_overhead.time_calls(fn, iters=3, warmup=1)
    assert out.shape == (1, 2, 1024, 128) and lse.shape == (1, 2, 1024) and len(times) == 3
    assert gluon_sage.launch._sage_fwd_ws is launch
    with pytest.raises(SystemExit):  # the LSE op takes no Skip-Softmax threshold: refused by name, not a trace
        host_overhead.main(["--lse", "--skip"])


def test_host_overhead_in_step_timers_count_each_call_and_its_launch(monkeypatch):
    """--in-step's timers: one entry and one launch per call (mocked here), the first call's arguments replay as the
    op, the per-step rows count the calls, and everything patched is restored."""
    pytest.importorskip("triton.experimental.gluon")
    from qattn_fx.kernels import gluon_sage
    from tools import host_overhead

    shape = shapes.Shape(1, 2, 1024, 1024, 128)
    fn = host_overhead.call(host_overhead.inputs(shape, "int8-1-16", True), shape, key_bias=False, lse=False,
                            skip=False)
    entry, timer = gluon_sage.scaled_attention, host_overhead.PathTimer()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with host_overhead.mocked_device(), qattn_fx.config.patch(tuning_cache="", gluon_tail_split=False):
        with timer.active():
            rows = host_overhead.step_times(lambda: (fn(), fn()), steps=3, timer=timer)
            assert [r["calls"] for r in rows] == [2, 2, 2] and len(timer.launch) == 2
            assert all(r["entry_us"] >= r["launch_us"] > 0 and r["wall_ms"] >= r["host_ms"] for r in rows)
            timer.clear()
            out = host_overhead.eager_call(timer.first)()
            assert out.shape == fn().shape == (1, 2, 1024, 128) and len(timer.entry) == 2
        assert isinstance(gluon_sage.launch._sage_fwd_ws, host_overhead._NoLaunch)  # the timer's proxy is gone
    assert gluon_sage.scaled_attention is entry


def test_host_overhead_on_the_gpu_queues_each_group_of_calls_behind_a_workload(monkeypatch):
    """--cuda: calls go in groups of ``chunk``, each after a synchronization and one queued ``busy()``."""
    from tools import host_overhead

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    times = host_overhead.time_calls(lambda: events.append("call"), iters=45, warmup=2,
                                     busy=lambda: events.append("busy"), chunk=20)
    assert len(times) == 45
    group = ["sync", "busy"]
    assert events == ["call"] * 2 + group + ["call"] * 20 + group + ["call"] * 20 + group + ["call"] * 5 + ["sync"]


def test_host_overhead_mocks_every_tuner_head_dim_64_included(capsys):
    """At head_dim 64 the quad class's tuner serves the call: its timing is mocked like every other tuner's."""
    pytest.importorskip("triton.experimental.gluon")
    from tools import host_overhead

    with qattn_fx.config.patch(tuning_cache=""):
        assert host_overhead.main(["--shape", "d64-small:1:2:1024:1024:64", "--iters", "3", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "config WS_BN128_s2_permk_mmasum_quad" in out and "launches mocked" in out


def test_one_shape_table_serves_the_benchmarks_and_the_tools():
    from benchmarks import attention_ops
    from tools import profile_quantize  # noqa: F401  (imports benchmarks.attention_ops and benchmarks.shapes)

    assert not hasattr(attention_ops, "SHAPES")  # no second table
    assert shapes.SHAPES["wan1.3b-480p"] == (1, 12, 32760, 32760, 128)
    assert shapes.SHAPES["cross-512"].skv == 512
    assert shapes.SELF_ATTENTION == ("flux-1024", "wan1.3b-480p", "wan14b-720p", "d64")
    assert shapes.SHAPES["d64"].flops == 4.0 * 2 * 16 * 16384 * 16384 * 64


def test_shape_selection():
    assert [n for n, _ in shapes.select("all")] == list(shapes.SHAPES)
    assert [n for n, _ in shapes.select("all", default=shapes.SELF_ATTENTION)] == list(shapes.SELF_ATTENTION)
    assert [n for n, _ in shapes.select("wan1.3b-480p;d64")] == ["wan1.3b-480p", "d64"]  # the tuner's old separator
    (name, shape), = shapes.select("none", ["mine:2:24:4096:1024:64"])
    assert name == "mine" and shape == shapes.Shape(2, 24, 4096, 1024, 64)
    with pytest.raises(ValueError, match=r"--shapes: 'bogus' is unknown; valid: flux-1024, .*, all, none"):
        shapes.select("bogus")
    with pytest.raises(ValueError, match=r"valid: name:B:H:Sq:Skv:D"):
        shapes.select("none", ["mine:1:2:3"])
    with pytest.raises(ValueError, match="no shape selected"):
        shapes.select("none")


def test_tune_takes_one_kernel():
    from benchmarks import tune

    assert tune.parse_args(["--kernel", "gluon_sage"]).shapes == ",".join(shapes.SELF_ATTENTION)
    with pytest.raises(SystemExit):
        tune.parse_args([])  # --kernel is required
    with pytest.raises(SystemExit):
        tune.parse_args(["--kernel", "gluon"])
    assert tune.parse_args(["--kernel", "gluon_sage"]).timer == "do_bench"
    assert tune.parse_args(["--kernel", "gluon_sage", "--timer", "graph"]).timer == "graph"
    with pytest.raises(SystemExit):
        tune.parse_args(["--kernel", "gluon_sage", "--timer", "events"])


def test_quantized_inputs_names_the_valid_recipes():
    with pytest.raises(ValueError, match=r"recipe 'int4' is invalid; valid: int8-1-16, "):
        common.quantized_inputs(shapes.SHAPES["flux-1024"], "int4")


# ------------------------------------------------------------------------------------------------------------------
# dit_step: arguments, and the model builders and the denoising loop at tiny sizes on the CPU
# ------------------------------------------------------------------------------------------------------------------

#: Each model's builder arguments for a tiny CPU build: the published block layout cut to one block of each kind,
#: two heads of 16 channels, the smallest input (one frame, 128 x 128 pixels).
TINY_DIT = {
    "wan": dict(frames=1, dims=dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=1)),
    "hunyuan_video": dict(frames=1, text_tokens=7, dims=dict(num_attention_heads=2, attention_head_dim=16,
                                                             num_layers=1, num_single_layers=1, num_refiner_layers=1,
                                                             rope_axes_dim=(4, 6, 6))),
    "ltx_video": dict(frames=9, text_tokens=5, dims=dict(num_attention_heads=2, attention_head_dim=16,
                                                         cross_attention_dim=32, num_layers=1)),
    "flux": dict(resolution=128, blocks=1, single_blocks=1,
                 dims=dict(num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 6, 6))),
    "cogvideox": dict(frames=5, dims=dict(num_attention_heads=2, attention_head_dim=16, num_layers=1)),
    "hunyuan_video15": dict(frames=1, text_tokens=7, dims=dict(num_attention_heads=2, attention_head_dim=16,
                                                               num_layers=1, num_refiner_layers=1, text_embed_dim=24,
                                                               text_embed_2_dim=20, image_embed_dim=16,
                                                               rope_axes_dim=(4, 6, 6))),
    "qwen_image": dict(resolution=64, text_tokens=6, dims=dict(num_attention_heads=2, attention_head_dim=16,
                                                               joint_attention_dim=24, num_layers=1,
                                                               axes_dims_rope=(4, 6, 6))),
    "sd3": dict(resolution=128, blocks=1, dims=dict(num_attention_heads=2, attention_head_dim=16, joint_attention_dim=24,
                                                    caption_projection_dim=32, pooled_projection_dim=20)),
}


def test_dit_step_arguments():
    from benchmarks import dit_step

    args = dit_step.parse_args(["--model", "flux", "--blocks", "2", "--single-blocks", "4", "--compile", "whole",
                                "--mode", "reduce-overhead", "--steps", "8", "--skip-no-attention", "--only", "auto"])
    assert (args.model, args.compile, args.mode, args.steps, args.skip_no_attention) == \
        ("flux", "whole", "reduce-overhead", 8, True)
    assert dit_step.parse_args([]).steps == 0 and dit_step.parse_args([]).mode == "default"
    for bad in (["--mode", "max-autotune"], ["--steps", "-1"], ["--steps", "0", "--iters", "0"], ["--model", "sd35"]):
        with pytest.raises(SystemExit):
            dit_step.parse_args(bad)
    # Flux.1-dev's published transformer config; the README's one line is among the variants
    assert {k: dit_step.FLUX_DEV[k] for k in ("num_layers", "num_single_layers", "num_attention_heads",
                                              "attention_head_dim", "guidance_embeds")} == \
        dict(num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128, guidance_embeds=True)
    assert dit_step.VARIANTS["qattn auto (default spec)"] == qattn_fx.Spec()
    hv15 = dit_step.build_hunyuan_video15(device="cpu", **TINY_DIT["hunyuan_video15"])  # 16x VAE: 30 x 53 patches
    assert hv15.inputs["hidden_states"].shape == (1, 65, 1, 30, 53) and "= 1590 video tokens + 1000 text (7 valid)" in (
        hv15.header)
    with pytest.raises(ValueError, match="resolution=1000 is invalid; valid: a multiple of 16"):
        dit_step.build_flux(resolution=1000, device="cpu")
    with pytest.raises(ValueError, match="resolution=1024 is invalid for Wan2.1-1.3b; valid: 480, 720"):
        dit_step.build_wan(resolution=1024, device="cpu")
    wan720 = dit_step.build_wan(resolution=720, device="cpu", **TINY_DIT["wan"])  # 1280 x 720: 45 x 80 patches
    assert wan720.inputs["hidden_states"].shape[-2:] == (90, 160) and "1 frames 720p = 3600 tokens" in wan720.header
    with pytest.raises(ValueError, match="resolution=480 is invalid for Wan2.2-5b; valid: 720"):
        dit_step.build_wan(config="2.2-5b", resolution=480, device="cpu")
    # Wan2.2-TI2V-5B: 48 channels through a 16x VAE (1280 x 704: 22 x 40 patches), a timestep per token
    wan5b = dit_step.build_wan(config="2.2-5b", device="cpu", **TINY_DIT["wan"])
    assert wan5b.inputs["hidden_states"].shape == (1, 48, 1, 44, 80) and wan5b.timestep(0.25).shape == (1, 880)
    assert "Wan2.2-5b config (1 blocks" in wan5b.header and "1 frames 704p = 880 tokens" in wan5b.header
    with pytest.raises(ValueError, match="resolution=600 is invalid for HunyuanVideo; valid: 480, 720"):
        dit_step.build_hunyuan_video(resolution=600, device="cpu")
    for resolution, latent, tokens in ((None, (60, 106), 1590), (720, (90, 160), 3600)):
        hv = dit_step.build_hunyuan_video(resolution=resolution, device="cpu", **TINY_DIT["hunyuan_video"])
        assert hv.inputs["hidden_states"].shape[-2:] == latent and f"= {tokens} video tokens" in hv.header
    with pytest.raises(ValueError, match="resolution=480 is invalid for LTX-Video; valid: 512, 704"):
        dit_step.build_ltx_video(resolution=480, device="cpu")
    with pytest.raises(ValueError, match=r"frames=10 is invalid for LTX-Video; valid: 8·k \+ 1"):
        dit_step.build_ltx_video(device="cpu", **{**TINY_DIT["ltx_video"], "frames": 10})
    for resolution, grid, tokens in ((None, (2, 16, 22), 704), (704, (2, 22, 38), 1672)):  # 9 frames: 2 latent
        ltx = dit_step.build_ltx_video(resolution=resolution, device="cpu", **TINY_DIT["ltx_video"])
        assert (ltx.inputs["num_frames"], ltx.inputs["height"], ltx.inputs["width"]) == grid
        assert ltx.inputs["hidden_states"].shape == (1, tokens, 128) and f"= {tokens} tokens" in ltx.header
    with pytest.raises(ValueError, match=r"frames=6 is invalid for CogVideoX; valid: 4·k \+ 1"):
        dit_step.build_cogvideox(device="cpu", **{**TINY_DIT["cogvideox"], "frames": 6})
    with pytest.raises(ValueError, match="resolution=1000 is invalid; valid: a multiple of 16"):
        dit_step.build_qwen_image(resolution=1000, device="cpu")
    qwen = dit_step.build_qwen_image(device="cpu", **{**TINY_DIT["qwen_image"], "resolution": None})
    assert qwen.inputs["hidden_states"].shape == (1, 83 * 83, 64) and qwen.inputs["img_shapes"] == [[(1, 83, 83)]]
    assert "1328x1328 = 6889 image tokens + 6 text (key-masked)" in qwen.header
    cog = dit_step.build_cogvideox(device="cpu", **TINY_DIT["cogvideox"])  # 5 frames: 2 latent, 30 x 45 patches
    cos, sin = cog.inputs["image_rotary_emb"]
    assert cog.inputs["hidden_states"].shape == (1, 2, 16, 60, 90) and cos.shape == sin.shape == (2700, 16)
    assert "5 frames 720x480 = 2700 video tokens + 226 text" in cog.header
    sd3 = dit_step.build_sd3(device="cpu", **{**TINY_DIT["sd3"], "resolution": None})  # 1024²: 64 x 64 patches
    assert sd3.inputs["hidden_states"].shape == (1, 16, 128, 128) and sd3.inputs["encoder_hidden_states"].shape[1] == 333
    assert "1024x1024 = 4096 image tokens + 333 text" in sd3.header and dit_step.timestep_scale(sd3) == 1000.0
    assert {k: dit_step.SD3_MEDIUM[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim")} == \
        dict(num_layers=24, num_attention_heads=24, attention_head_dim=64)


def test_dit_step_timer_keeps_the_gpu_and_the_host_time_of_each_step(monkeypatch):
    """cuda_timer: the GPU time between its events and, apart, the host's time to run the block (to issue it)."""
    from benchmarks import dit_step

    class Event:  # CUDA events on the CPU: 5 ms apart, whatever the block did
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def elapsed_time(self, end):
            return 5.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    gpu, host = [], []
    timed = dit_step.cuda_timer(gpu, host)
    for _ in range(2):
        with timed():
            time.sleep(0.02)
    assert gpu == [5.0, 5.0] and len(host) == 2 and all(20.0 <= ms < 1000.0 for ms in host)


def test_dit_step_profile_classes():
    """--profile's kernel classes, on kernel names as the H200's profiler shows them."""
    from benchmarks import dit_step

    assert dit_step.parse_args(["--profile"]).profile and not dit_step.parse_args([]).profile
    names = {"_sage_fwd_ws": "attention", "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0":
             "attention", "triton_red_fused_quantize_per_block_0": "quantize",
             "triton_poi_fused_smooth_k_1": "quantize", "nvjet_tst_192x192_64x4_2x1_v_bz_TNN": "gemm",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "gemm",
             "triton_poi_fused_add_mul_native_layer_norm_3": "other",
             # Inductor kernels around the ops, as the H200's profiler named them in a Flux and a Wan step
             "triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention__to_copy_add_mul_neg_permute_st":
             "other",
             "triton_red_fused__to_copy_abs_add_amax_arange_clamp_constant_pad_nd_copy_div_eq_floor_divide_index_s":
             "quantize",
             "triton_red_fused__to_copy_add_copy_mean_permute_slice_sub_7": "quantize",
             "triton_red_fused__fused_rms_norm_view_5": "other",
             "triton_red_fused__fused_rms_norm__to_copy_add_arange_clamp_clone_eq_floor_divide_index_select_mean_m":
             "quantize"}
    assert {n: dit_step.kernel_class(n) for n in names} == names


@pytest.mark.parametrize("model", list(TINY_DIT))
def test_dit_step_models_denoise_on_cpu(model):
    """Every model's output has the shape of the latents it updates, so the denoising loop feeds it back."""
    from benchmarks import dit_step

    case = dit_step.MODELS[model](device="cpu", **TINY_DIT[model])
    with torch.no_grad():
        latents = dit_step.denoise(case.model, case, 1)
    shape = list(case.inputs["hidden_states"].shape)
    shape[1] = case.latent_channels or shape[1]  # HunyuanVideo-1.5: 32 latent channels of 65
    assert list(latents.shape) == shape and torch.isfinite(latents).all()
    assert case.timestep(0.25).shape == case.inputs["timestep"].shape


def test_wan22_5b_timestep_per_token_denoises_quantized_in_one_graph():
    """Wan2.2-TI2V-5B's pipeline passes a ``(B, tokens)`` timestep: the whole model compiled with the backend
    (emulated) quantizes every self-attention site, and a loop whose timestep changes compiles no new graph."""
    from benchmarks import dit_step

    case = dit_step.build_wan(config="2.2-5b", device="cpu", **TINY_DIT["wan"])
    torch._dynamo.reset()
    counters.clear()
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    step = torch.compile(case.model, backend=backend)
    with torch.no_grad():
        dense = dit_step.denoise(case.model, case, 2)
        quantized = dit_step.denoise(step, case, 2)
    assert dit_step.graphs_compiled() == 1
    assert [(s.role, s.rewritten) for s in backend.report.sites] == [("self", True), ("cross", True)]
    assert torch.nn.functional.cosine_similarity(quantized.flatten().float(), dense.flatten().float(), dim=0) > 0.99


def test_dit_step_denoising_loop_compiles_once():
    """A timestep that changes every step (a new tensor, as pipelines pass it) compiles no new graph."""
    from benchmarks import dit_step

    case = dit_step.build_flux(device="cpu", **TINY_DIT["flux"])
    torch._dynamo.reset()
    counters.clear()
    step = dit_step.compile_model(case.model, "eager", "whole", "default")
    with torch.no_grad():
        step(**case.inputs)
        first = dit_step.graphs_compiled()
        dit_step.denoise(step, case, 3)
    assert first >= 1 and dit_step.graphs_compiled() == first


def test_dit_step_loop_timer_synchronizes_only_around_the_loop(monkeypatch):
    """``loop_step_ms`` times the whole loop (one event pair, a synchronization before and after, none between the
    steps, as a pipeline runs) and returns the time per step; CUDA's events and synchronization stubbed on the CPU."""
    from benchmarks import dit_step

    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            log.append("record")

        def elapsed_time(self, end):
            return 12.0

    def step(**inputs):
        log.append("step")
        return (torch.zeros_like(inputs["hidden_states"]),)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    case = dit_step.build_flux(device="cpu", **TINY_DIT["flux"])
    assert dit_step.loop_step_ms(step, case, 4) == 3.0
    assert log == ["sync", "record", "step", "step", "step", "step", "record", "sync"]


def test_dit_step_stack_rows():
    """--linears / --cache: each row of the stack table is a row of one command, in the order the model's state
    allows (TorchAO quantizes the weights in place), every cosine against the first row."""
    from benchmarks import dit_step

    args = dit_step.parse_args(["--linears", "fp8", "--cache", "fbc", "--steps", "4", "--only", "auto",
                                "--skip-no-attention"])
    auto = "qattn auto (default spec)"
    assert [(r.name, r.attention, r.linears, r.cache) for r in dit_step.plan(args)] == [
        ("compiled dense (torch SDPA)", "dense", "bf16", "none"), (auto, auto, "bf16", "none"),
        ("compiled dense + fbc 0.05", "dense", "bf16", "fbc"), (auto + " + fbc 0.05", auto, "bf16", "fbc"),
        ("compiled dense + fp8 linears", "dense", "fp8", "none"), (auto + " + fp8 linears", auto, "fp8", "none"),
        ("compiled dense + fp8 linears + fbc 0.05", "dense", "fp8", "fbc"),
        (auto + " + fp8 linears + fbc 0.05", auto, "fp8", "fbc")]
    plain = dit_step.parse_args([])
    assert (plain.linears, plain.cache) == (["bf16"], "none")
    assert [r.name for r in dit_step.plan(plain)][:3] == ["compiled dense (torch SDPA)", "compiled, no attention", auto]
    assert (args.fp8_gemms, plain.fp8_gemms) == ("cublas", "cublas")
    assert dit_step.parse_args(["--linears", "fp8", "--fp8-gemms", "autotune"]).fp8_gemms == "autotune"
    only = dit_step.parse_args(["--linears", "fp8", "--only", "auto", "--skip-no-attention", "--stack-only"])
    assert [r.name for r in dit_step.plan(only)] == ["compiled dense (torch SDPA)", "compiled dense + fp8 linears",
                                                      auto + " + fp8 linears"]
    both = dit_step.parse_args(["--linears", "fp8", "fp8static", "--only", "auto", "--skip-no-attention",
                                "--stack-only"])
    assert [(r.name, r.linears) for r in dit_step.plan(both)] == [
        ("compiled dense (torch SDPA)", "bf16"), ("compiled dense + fp8 linears", "fp8"),
        (auto + " + fp8 linears", "fp8"), ("compiled dense + fp8static linears", "fp8static"),
        (auto + " + fp8static linears", "fp8static")]
    for bad in (["--cache", "fbc"], ["--cache", "fbc", "--steps", "1"], ["--linears", "int4"],
                ["--fp8-gemms", "triton"], ["--stack-only"]):
        with pytest.raises(SystemExit):
            dit_step.parse_args(bad)


@pytest.mark.slow
def test_dit_step_int8_linears_and_first_block_cache_denoise_on_cpu():
    """The stack rows' model states on a tiny bf16 Wan on the CPU: TorchAO int8 weight-only linears and First Block
    Cache, compiled whole with the backend (emulated): every self-attention site quantized, the cache's decisions
    taken in its context, the final latents near the dense loop's."""
    pytest.importorskip("torchao")
    from benchmarks import dit_step

    case = dit_step.build_wan(device="cpu", **{**TINY_DIT["wan"], "dims": {**TINY_DIT["wan"]["dims"],
                                                                           "num_layers": 2}})
    fresh = dit_step.build_wan(device="cpu", **{**TINY_DIT["wan"], "dims": {**TINY_DIT["wan"]["dims"],
                                                                            "num_layers": 2}})
    args = dit_step.parse_args(["--linears", "int8wo", "--cache", "fbc", "--cache-threshold", "0.5", "--steps", "3"])
    row = dit_step.plan(args)[-1]
    assert (row.linears, row.cache) == ("int8wo", "fbc")
    with torch.no_grad():
        dense = dit_step.denoise(case.model, case, 3)
        assert dit_step.prepare(case, row, args, None) is case
        assert case.model.is_cache_enabled and case.model._dit_step_linears == "int8wo"
        torch._dynamo.reset()
        backend = qattn_fx.backend(emulate=True, compiler="eager")
        recomputed = []
        step = dit_step.in_cache_context(dit_step.compile_model(case.model, backend, "whole", "default"), case.model,
                                         recomputed)
        stacked = dit_step.denoise(step, case, 3)
    assert recomputed[0] is True and len(recomputed) == 3
    assert {(s.role, s.rewritten) for s in backend.report.sites} == {("self", True), ("cross", True)}
    assert torch.nn.functional.cosine_similarity(stacked.flatten().float(), dense.flatten().float(), dim=0) > 0.99
    assert dit_step.prepare(case, dit_step.Row("x", "dense", "int8wo", "none"), args, None) is case
    assert not case.model.is_cache_enabled

    # another kind: the model built afresh (the same weights), its activation scales calibrated on other noise
    with torch.no_grad():
        rebuilt = dit_step.prepare(case, dit_step.Row("y", "dense", "fp8static", "none"), args, lambda: fresh)
    assert rebuilt is fresh and rebuilt.model._dit_step_linears == "fp8static"
    to_q = rebuilt.model.blocks[0].attn1.to_q.weight
    assert type(to_q).__name__ == "PrototypeFloat8Tensor"
    with torch.no_grad():
        calibration_in = dit_step.calibration_case(fresh).inputs["hidden_states"]
    assert calibration_in.shape == case.inputs["hidden_states"].shape
    assert not torch.equal(calibration_in, case.inputs["hidden_states"])
    conditioned = dataclasses.replace(fresh, latent_channels=2)  # HunyuanVideo-1.5's layout: the rest conditions
    calibration_in = dit_step.calibration_case(conditioned).inputs["hidden_states"]
    assert torch.equal(calibration_in[:, 2:], fresh.inputs["hidden_states"][:, 2:])
    assert not torch.equal(calibration_in[:, :2], fresh.inputs["hidden_states"][:, :2])


def _block_sparse_spec(keep: float = 0.5, disabled_until: float | None = None):
    """The dit_step +bs spec of the default spec."""
    from benchmarks import dit_step

    return dit_step.block_sparse_spec(qattn_fx.Spec(), keep, disabled_until)


def test_dit_step_block_sparse_rows_and_dense_steps():
    """--block-keep adds a '+bsF' row after each qattn variant; --block-dense-steps N (or P% of --steps) puts the
    schedule's threshold half a step below the last dense step's timestep."""
    from benchmarks import dit_step

    args = dit_step.parse_args(["--block-keep", "0.5,0.25", "--steps", "8", "--block-dense-steps", "25%", "--only",
                                "auto", "--skip-no-attention"])
    assert (args.block_keep, args.block_dense_steps) == ([0.5, 0.25], 2)
    auto = "qattn auto (default spec)"
    assert [(r.name, r.attention, r.block_keep, r.block_dense_steps) for r in dit_step.plan(args)] == [
        ("compiled dense (torch SDPA)", "dense", None, 0), (auto, auto, None, 0),
        (auto + " +bs0.5 dense2/8", auto, 0.5, 2), (auto + " +bs0.25 dense2/8", auto, 0.25, 2)]
    plain = dit_step.parse_args(["--block-keep", "0.5", "--only", "gluon_sage int8"])
    assert [r.name for r in dit_step.plan(plain)][-2:] == ["qattn gluon_sage int8 1/16/1",
                                                           "qattn gluon_sage int8 1/16/1 +bs0.5"]
    assert dit_step.parse_args([]).block_keep == [] and dit_step.parse_args([]).block_dense_steps == 0
    assert dit_step.parse_dense_steps("3", 8) == 3 and dit_step.parse_dense_steps("25%", 20) == 5
    # step i runs at t = 1 - i/steps and is dense while t > D: with 2 of 8 dense, t = 1, 0.875 dense, 0.75 sparse
    d = dit_step.dense_until_timestep(2, 8)
    assert [1 - i / 8 > d for i in range(8)] == [True, True] + [False] * 6
    assert dit_step.dense_until_timestep(0, 8) is None and dit_step.dense_until_timestep(8, 8) > 0
    # the schedule reads t = timestep / scale: Wan passes 1000 · sigma, Flux sigma itself
    assert dit_step.timestep_scale(dit_step.build_wan(device="cpu", **TINY_DIT["wan"])) == 1000.0
    assert dit_step.timestep_scale(dit_step.build_flux(device="cpu", **TINY_DIT["flux"])) == 1.0
    for bad in (["--block-keep", "1"], ["--block-keep", "0"], ["--block-keep", "x"],
                ["--block-keep", "0.5", "--block-dense-steps", "2"],  # no --steps
                ["--block-keep", "0.5", "--steps", "4", "--block-dense-steps", "5"],
                ["--block-keep", "0.5", "--steps", "4", "--block-dense-steps", "x%"],
                ["--steps", "4", "--block-dense-steps", "1"]):  # no --block-keep
        with pytest.raises(SystemExit):
            dit_step.parse_args(bad)


def test_dit_step_block_sparse_spec_sets_every_attention_spec():
    from benchmarks import dit_step

    _block_sparse_spec()
    row = dit_step.Row("x", "qattn gluon_sage, cross dense", block_keep=0.25, block_dense_steps=2)
    data = dit_step.spec_of(row, steps=8).to_dict()
    setting = data["default"]["block_sparse"]  # (to_dict may leave out values at their defaults)
    assert setting["top_k"] == 0.25 and setting.get("similarity", 0) == 0 and setting.get("sink_tiles", 0) == 0
    assert not setting.get("diagonal", False) and setting["disabled_until_timestep"] == pytest.approx(0.8125)
    assert data["rules"][0]["use"] == "dense"
    assert dit_step.spec_of(dit_step.Row("y", "qattn auto (default spec)")) == qattn_fx.Spec()


@pytest.mark.slow
def test_dit_step_block_sparse_loop_with_dense_steps_compiles_once():
    """A +bs0.5 variant with its first step dense (emulated, on a tiny Wan): one graph for the whole loop, the
    predictor's lists skipping blocks on the sparse steps only."""
    from benchmarks import dit_step
    from qattn_fx import block_sparse

    spec = _block_sparse_spec(0.5, dit_step.dense_until_timestep(1, 3))
    case = dit_step.build_wan(device="cpu", **TINY_DIT["wan"])  # 480p, 1 frame: 1560 tokens, 13 key tiles
    torch._dynamo.reset()
    counters.clear()
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager")
    step = torch.compile(case.model, backend=backend)
    skipped = []

    @contextlib.contextmanager
    def measured():
        with block_sparse.measure() as m:
            yield
        skipped.append(m.overall())

    with torch.no_grad():
        step(**case.inputs)
        graphs = dit_step.graphs_compiled()
        dit_step.denoise(step, case, 3, measured)
    assert dit_step.graphs_compiled() == graphs
    assert skipped[0] == 0.0 and all(s > 0.2 for s in skipped[1:]), skipped


def test_dit_step_compile_phases_are_the_time_spent_between_snapshots():
    from benchmarks import dit_step

    before = dit_step.compile_phases()
    torch.compile(lambda x: x.cos() * 2, backend="eager")(torch.randn(3))
    phases = dit_step.top_phases(before, dit_step.compile_phases(), top=3)
    assert 0 < len(phases) <= 3 and all(t > 0 for t in phases.values())
    assert list(phases.values()) == sorted(phases.values(), reverse=True)
    assert dit_step.top_phases({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 2.0, "c": 0.1}) == {"a": 0.5, "c": 0.1}
