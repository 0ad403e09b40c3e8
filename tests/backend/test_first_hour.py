"""What a new user meets first: the CLI (``qattn-fx`` / ``python -m qattn_fx``), the site table, node names in
the rewritten graph and its dumps, the deployment note of emulated sites, and progress logs."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import qattn_fx
from qattn_fx import AttentionSpec, Hardware, Recipe, Site, Spec, resolve, tiny_models
from qattn_fx.cli import main
from qattn_fx.hardware import supported_libraries
from qattn_fx.report import readable
from support import ROOT, subprocess_env
from tests.fx.test_golden_graphs import AttentionBlock, Model

TRTLLM_INT8 = Spec(default=AttentionSpec("TRTLLM", Recipe("int8", "fp8", 1, 16, 1)))


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m qattn_fx ARGS`` in a fresh process, with this checkout's package first on the path."""
    return subprocess.run([sys.executable, "-m", "qattn_fx", *args], capture_output=True, text=True,
                          env=subprocess_env(**(env or {})), cwd=ROOT, timeout=300)


# ------------------------------------------------------------------------------------------------------------------
# Supported installs: the library floors of the recipe table
# ------------------------------------------------------------------------------------------------------------------


def test_supported_install_takes_the_library_floors_of_the_table():
    assert supported_libraries("sm_90") == {"triton": "3.6.0", "cudnn": "9.1.0", "flashinfer-python": "0.6.0"}
    assert supported_libraries("sm_100") == {"flashinfer-python": "0.6.16rc1", "cudnn": "9.21.0"}
    assert supported_libraries("cpu") == {} and supported_libraries("sm_80") == {}
    hw = Hardware.supported_install("sm_100", {"cudnn": "9.19.0"})
    assert hw.libraries == {"flashinfer-python": "0.6.16rc1", "cudnn": "9.19.0"} and hw.arch == "sm_100"
    assert Hardware.for_arch("sm_100").libraries == {}  # for_arch stays a bare machine


# ------------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------------


def test_readme_resolve_example_is_quantized_on_a_supported_install(capsys):
    assert main(["resolve", "--arch", "sm_100", "--q", "1,40,75600,128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantized"] is True and out["kernel"] == "flashinfer_trtllm_sage"
    assert out["hardware"] == "sm_100 (cudnn 9.21.0, flashinfer-python 0.6.16rc1)"
    assert "supported install of sm_100" in out["libraries"]


def test_resolve_lib_overrides_and_bare(capsys):
    assert main(["resolve", "--arch", "sm_100", "--lib", "flashinfer-python=0.6.0", "--q", "1,40,75600,128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantized"] is False and "needs flashinfer-python >= 0.6.16rc1, have 0.6.0" in out["reason"]
    assert main(["resolve", "--arch", "sm_100", "--bare", "--q", "1,40,75600,128"]) == 0
    assert json.loads(capsys.readouterr().out)["quantized"] is False


def test_resolve_emulated_says_what_the_target_does(capsys):
    assert main(["resolve", "--emulate", "--target", "sm_90", "--q", "1,2,128,12", "--dtype", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kernel"] == "reference"
    assert out["deployment"] == "(as bf16) on sm_90: dense (TRITON: head_dim 12 not in 64/128)"


@pytest.mark.parametrize("args, message", [
    (["resolve", "--arch", "h100", "--q", "1,2,8,64"],
     "qattn-fx: error: arch='h100' is invalid; valid: 'cpu' or 'sm_XY' such as sm_90, sm_100, sm_120"),
    (["resolve", "--spec", "no/such/spec.json", "--q", "1,2,8,64"],
     "qattn-fx: error: --spec 'no/such/spec.json': no such file"),
    (["resolve", "--lib", "cudnn", "--arch", "sm_90", "--q", "1,2,8,64"],
     "qattn-fx: error: argument --lib: 'cudnn' is invalid; valid: NAME=VERSION such as flashinfer-python=0.7.4 "
     "(see qattn-fx resolve --help)"),
    (["resolve", "--role", "both", "--q", "1,2,8,64"],
     "qattn-fx: error: argument --role: invalid choice: 'both' (choose from "),  # quoting: by Python version
    (["inspect", "qattn_fx.tiny_models:nope"],
     "qattn-fx: error: model 'qattn_fx.tiny_models:nope': qattn_fx.tiny_models has no 'nope'; callables there: "),
    (["inspect", "--config", "c.json", "--class", "UNet2DModel"],
     "qattn-fx: error: --class 'UNet2DModel' is invalid; valid: WanTransformer3DModel, FluxTransformer2DModel, "
     "DiTTransformer2DModel, HunyuanVideoTransformer3DModel"),
])
def test_bad_values_print_one_error_line_and_exit_2(capsys, args, message):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), captured.err


def test_bad_spec_content_names_the_field(tmp_path, capsys):
    bad = tmp_path / "spec.json"
    bad.write_text(json.dumps({"default": {"backend": "TRTLLM", "recipe": {"qk_dtype": "int4", "v_dtype": "fp8"}}}))
    assert main(["resolve", "--spec", str(bad), "--q", "1,2,8,64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qattn-fx: error: --spec '{bad}': ") and "qk_dtype='int4' is invalid; valid: " in err
    assert len(err.splitlines()) == 1


def test_broken_pipe_is_quiet(monkeypatch):
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return sys.__stdout__.fileno()

    saved = os.dup(1)  # main points fd 1 at /dev/null after a broken pipe: give pytest its stdout back
    try:
        monkeypatch.setattr(sys, "stdout", Closed())
        assert main(["recipes"]) == 1
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@pytest.mark.slow
def test_module_entry_point_version_and_a_pipe_to_head():
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith(f"qattn-fx {qattn_fx.__version__} (torch ")
    helped = cli("--help")
    assert all(command in helped.stdout for command in ("recipes", "resolve", "inspect"))
    piped = subprocess.run(f"{sys.executable} -m qattn_fx recipes | head -1", shell=True, capture_output=True,
                           text=True, cwd=ROOT, env=subprocess_env(), timeout=120)
    assert piped.stdout.startswith("| backend |") and "Error" not in piped.stderr, piped.stderr


def test_inspect_a_factory_on_a_named_arch(capsys):
    assert main(["inspect", "qattn_fx.tiny_models:wan", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "WanTransformer3DModel from qattn_fx.tiny_models:wan" in out
    assert "hardware: sm_90 (cudnn 9.1.0, flashinfer-python 0.6.0, triton 3.6.0); assumed a supported install" in out
    assert "blocks.0.attn1  0      self   128/128  12" in out
    assert "qattn_fx: 0/4 attention sites quantized, 4 dense: 4x no kernel serves" in out  # head_dim 12, bf16
    assert max(map(len, out.splitlines()[3:-1])) <= 120  # the table; the summary is the logged line, whole


def test_inspect_a_diffusers_config_emulated(tmp_path, capsys):
    model, _ = tiny_models.wan(num_layers=1, head_dim=64)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model.config)))
    # --arch cpu: the fp32 model on this CPU whatever the machine (on a CUDA machine inspect would run it in bf16)
    args = ["inspect", "--config", str(config), "--class", "WanTransformer3DModel", "--emulate", "--target", "sm_90",
            "--arch", "cpu", "--frames", "1", "--height", "8", "--width", "8", "--text-len", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "hidden_states (1, 4, 1, 8, 8)" in out
    assert "blocks.0.attn2  0      cross  16/5   64  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: " in out
    assert main(args + ["--json"]) == 0
    sites = json.loads(capsys.readouterr().out)["sites"]
    # gluon_sage is what sm_90 runs; at 16 tokens (below every measured call) auto keeps such sites dense there
    assert [s["deployment"].split(" of ")[0] for s in sites] == [
        "(as bf16) on sm_90: dense (gluon_sage predicted at most 0.88x"] * 2


def test_repeated_explains_reuse_one_trace_and_leave_compile_its_recompilations():
    """Trying specs with explain in a loop: each call decides under its own spec, Dynamo traces the model once, and
    a compile afterwards still quantizes (explain's traces used to fill the model's recompile limit of 8)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model, inputs = tiny_models.wan()
    torch._dynamo.reset()
    with torch.no_grad():
        for i in range(10):
            spec = {"default": "dense"} if i % 2 else None
            report = qattn_fx.explain(model, **inputs, spec=spec, emulate=True)
            assert report.quantized == (0 if i % 2 else 4), report
        entries = len(_debug_get_cache_entry_list(type(model).forward.__code__))
        backend = qattn_fx.backend(emulate=True, compiler="eager")
        torch.compile(model, backend=backend)(**inputs)
    assert entries == 1 and backend.report.quantized == 4, (entries, backend.report)


def test_explain_says_when_dynamo_traced_nothing():
    model, inputs = tiny_models.wan()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        with pytest.raises(RuntimeError, match=r"^qattn_fx.explain: Dynamo ran no traced graph for this call"):
            qattn_fx.explain(model, **inputs, emulate=True)


def test_explain_notes_attention_in_code_dynamo_runs_eagerly(caplog):
    """Mochi's joint attention sits in a loop over the batch with a data-dependent op (``nonzero``): without
    fullgraph Dynamo skips that frame, so the attention there is compiled by no backend and is in no report."""
    class TokensPerSample(torch.nn.Module):
        def forward(self, x):
            return self.per_sample(F.scaled_dot_product_attention(x, x, x))  # traced

        def per_sample(self, x):
            out = []
            for sample in x:  # a graph break inside the loop: Dynamo runs this frame eagerly
                kept = sample[:, torch.nonzero(sample[0, :, 0] > -10).flatten()]
                out.append(F.scaled_dot_product_attention(kept, kept, kept))
            return torch.stack(out)

    torch._dynamo.reset()
    model = TokensPerSample()
    for _ in range(2):  # the second explain finds the frame already marked to skip: still noted
        report = qattn_fx.explain(model, torch.randn(2, 2, 16, 8), emulate=True)
        assert len(report.sites) == 1 and report.notes == [
            "2 of the call's 3 attention calls ran outside every traced graph, in code Dynamo runs eagerly (Dynamic "
            "shape operator); torch.compile skips it too, so those calls stay dense and no report lists them. "
            "torch.compile(..., fullgraph=True) names the code (for a data-dependent op, "
            "torch._dynamo.config.capture_dynamic_output_shape_ops = True may let Dynamo trace it)"], report.notes
    assert "qattn_fx.explain: 2 of the call's 3 attention calls" in caplog.text


def _qwen_image():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(in_channels=16, out_channels=4, num_layers=1, attention_head_dim=32,
                                       num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(8, 12, 12)), None


@pytest.mark.parametrize("name, cls, sites", [
    ("sd3", "SD3Transformer2DModel", 3), ("cogvideox", "CogVideoXTransformer3DModel", 2),
    ("ltx_video", "LTXVideoTransformer3DModel", 2), ("qwen_image", "QwenImageTransformer2DModel", 1),
    ("hunyuan_video15", "HunyuanVideo15Transformer3DModel", 1)])
def test_inspect_configs_of_more_model_classes(tmp_path, capsys, name, cls, sites):
    """--config + --class builds inputs for SD3, CogVideoX, LTX-Video, Qwen-Image and HunyuanVideo-1.5 too; every
    site is found and emulated (HunyuanVideo-1.5: its blocks' one graph and ``m_i & m_j`` mask)."""
    made = {"qwen_image": _qwen_image, "hunyuan_video15": tiny_models.hunyuan_video15}
    model, _ = made[name]() if name in made else tiny_models.MODELS[name]()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model.config)))
    assert main(["inspect", "--config", str(config), "--class", cls, "--emulate", "--frames", "2", "--height", "8",
                 "--width", "8", "--text-len", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rewritten = [s["rewritten"] for s in report["sites"] if "token_refiner" not in s["module"]]
    assert rewritten == [True] * sites, report


# ------------------------------------------------------------------------------------------------------------------
# Emulation that predicts deployment
# ------------------------------------------------------------------------------------------------------------------


def test_emulated_trtllm_on_head_dim_12_says_it_will_not_deploy():
    model, inputs = tiny_models.wan()  # head_dim 12; TRTLLM's kernel needs 128 on sm_100
    with torch.no_grad():
        report = qattn_fx.explain(model, **inputs, spec=TRTLLM_INT8, emulate=True)
    assert {s.kernel for s in report.sites} == {"reference"}
    assert {str(s.deployment) for s in report.sites} == {"(as bf16) on sm_100: error (TRTLLM: head_dim 12 not in 128)"}
    assert "on sm_100: error (TRTLLM: head_dim 12 not in 128)" in str(report).replace("\n" + " " * 73, " ")
    assert report.to_dict()["sites"][0]["deployment"].endswith("head_dim 12 not in 128)")


def test_deployment_targets_come_from_the_recipe_backend_or_target():
    site = Site(q_shape=(1, 24, 32760, 128), k_shape=(1, 24, 32760, 128), v_shape=(1, 24, 32760, 128))
    cpu = Hardware.for_arch("cpu")
    assert str(resolve(site, cpu, TRTLLM_INT8, emulate=True).deployment) == "on sm_100: flashinfer_trtllm_sage"
    cudnn = Spec(default=AttentionSpec("CUDNN", Recipe("fp8", "fp8")))
    assert str(resolve(site, cpu, cudnn, emulate=True).deployment) == "on sm_100: cudnn_fp8; on sm_90: cudnn_fp8"
    assert str(resolve(site, cpu, Spec(), emulate=True).deployment) == \
        "on sm_90: gluon_sage; on sm_100: flashinfer_trtllm_sage"
    old = Hardware.for_arch("sm_90", {"triton": "3.5.0"})
    assert str(resolve(site, cpu, Spec(), emulate=True, target=old).deployment) == "on sm_90: triton_sage"
    assert resolve(site, cpu, Spec(), emulate=False).deployment is None
    with pytest.raises(ValueError, match="target= names where an emulated compile"):
        qattn_fx.backend(target="sm_90")


# ------------------------------------------------------------------------------------------------------------------
# The table, node names, dumps
# ------------------------------------------------------------------------------------------------------------------


def test_table_fits_120_columns_and_markdown_keeps_everything():
    model, inputs = tiny_models.hunyuan_video()  # a 52-character module path and a long dense reason
    with torch.no_grad():
        report = qattn_fx.explain(model, **inputs, emulate=True)
    lines = str(report).splitlines()
    assert max(map(len, lines[:-1])) <= 120  # the summary line is the logged one, whole
    assert lines[0].split() == ["module", "layer", "role", "q/kv", "d", "recipe", "kernel", "reason"]
    assert lines[2].startswith("context_embedder.token_refiner...0.attn  0      self")
    assert "quantized (emulated)" not in str(report)  # recipe and kernel have their own columns
    md = report.markdown()
    assert "context_embedder.token_refiner.refiner_blocks.0.attn" in md
    assert "per-key masks are served" in md and "int8 Q/K 1/16, fp8 V per-channel, smooth K" in md
    assert report.table(width=None).count("\n") == 4  # one line a site when asked


class TwoCalls(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(F.scaled_dot_product_attention(q, k, v), k, v)


class TwoSites(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TwoCalls()])

    def forward(self, q, k, v):
        return self.blocks[0](q, k, v)


def test_inserted_nodes_are_named_after_the_module_and_stay_unique():
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    with torch.no_grad():
        torch.compile(TwoSites(), backend=backend, fullgraph=True)(q, k, v)
    names = [n.name for n in backend.graph_modules[0].graph.nodes if "qattn_fx_site" in n.meta]
    assert "blocks_0_q_quant" in names and "blocks_0_attention" in names
    assert "blocks_0_1_q_quant" in names and "blocks_0_1_attention" in names
    assert len(names) == len(set(names))


def test_readable_dump_wraps_the_signature():
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    with torch.no_grad():
        torch.compile(Model().eval(), backend=backend, fullgraph=True)(torch.randn(1, 8, 64))
    text = readable(backend.graph_modules[0])
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "def forward(" in line)
    assert lines[start].rstrip().endswith("def forward(")
    assert lines[start + 1].strip() == 'self,'
    assert lines[start + 2].strip().startswith('L_x_: "f32[1, 8, 64][512, 64, 1]cpu",')
    assert all(len(line) <= 120 for line in lines[start:start + 8])
    compile(text.replace("class GraphModule(torch.nn.Module):", "class GraphModule:"), "after.py", "exec")


# ------------------------------------------------------------------------------------------------------------------
# Progress logs
# ------------------------------------------------------------------------------------------------------------------


def test_logs_per_graph_and_per_site(caplog):
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    with caplog.at_level(logging.DEBUG, logger="qattn_fx"), torch.no_grad():
        torch.compile(block, backend=qattn_fx.backend(emulate=True, compiler="eager"), fullgraph=True)(x)
    messages = [r.getMessage() for r in caplog.records if r.name == "qattn_fx"]
    assert messages[0] == "qattn_fx: rewriting graph 0: 1 SDPA sites"
    assert any(m.startswith("qattn_fx: graph 0 site o (no module, layer None, self")
               and "; inserted sdpa_k_smooth, sdpa_q_quant," in m for m in messages)
    assert ("qattn_fx: 1/1 attention sites quantized (emulated; on sm_90 the spec would quantize 0 of 1, on sm_100 0 "
            "of 1), 0 dense (graph 0): without emulation the deployment would quantize none of them") in messages


@pytest.mark.slow
def test_torch_logs_controls_the_qattn_fx_logger():
    script = ("import torch, qattn_fx\n"
              "from qattn_fx import tiny_models\n"
              "m, i = tiny_models.dit()\n"
              "with torch.no_grad(): qattn_fx.explain(m, **i, emulate=True)\n")
    info = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(TORCH_LOGS="qattn_fx"))
    assert info.returncode == 0, info.stderr
    assert "qattn_fx: rewriting graph 0: 1 SDPA sites" in info.stderr and " site " not in info.stderr
    debug = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                           env=subprocess_env(TORCH_LOGS="+qattn_fx"))
    assert "qattn_fx: graph 0 site " in debug.stderr, debug.stderr
