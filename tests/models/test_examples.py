"""The examples run as the README says (CPU: tiny models, recipes emulated)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import qattn_fx
from support import ROOT, subprocess_env

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location("qattn_fx_example_pipeline", ROOT / "examples" / "pipeline.py")
pipeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pipeline)
_spec = importlib.util.spec_from_file_location("qattn_fx_example_calibrate_wan", ROOT / "examples" / "calibrate_wan.py")
calibrate_wan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calibrate_wan)


@pytest.mark.slow
def test_pipeline_example_runs_dense_and_quantized(capsys):
    torch._dynamo.reset()
    result = pipeline.main(["--steps", "2", "--compiler", "aot_eager", "--device", "cpu"])
    out = capsys.readouterr().out
    assert result["sites"] == result["quantized"] == 4 and result["steps"] == 2
    assert result["cosine"] > 0.9999 and result["relative_l2"] < 1e-2  # measured 0.99999992, 3.9e-4
    assert "blocks.0.attn1  0      self   48/48  12  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90:" in out
    assert "dense:     step 1 " in out and "quantized: step 1 " in out and " ms/step (" in out
    assert "output (video frames (1, 9, 3, 64, 64)) vs dense: cosine " in out


@pytest.mark.slow
def test_pipeline_example_with_two_experts_compiles_and_reports_each(capsys):
    """Wan2.2-A14B's layout: ``transformer`` above the boundary timestep, ``transformer_2`` below; both are compiled,
    each with its own backend, and the 4 steps use both."""
    torch._dynamo.reset()
    result = pipeline.main(["--steps", "4", "--experts", "2", "--compiler", "aot_eager", "--device", "cpu"])
    out = capsys.readouterr().out
    assert result["sites_per_transformer"] == {"transformer": 4, "transformer_2": 4}
    assert result["sites"] == result["quantized"] == 8 and result["cosine"] > 0.9999  # measured 0.99999827
    assert "WanPipeline, 2 experts (boundary_ratio 0.875), each 2 blocks, head_dim 12" in out
    assert "\ntransformer:\n" in out and "\ntransformer_2:\n" in out


@pytest.mark.slow
def test_pipeline_example_as_a_user_runs_it():
    """``python examples/pipeline.py`` with its defaults: Inductor compiles the rewritten transformer (~40 s)."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "pipeline.py"), "--steps", "2", "--device", "cpu"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "qattn_fx: 4/4 attention sites quantized (emulated; on sm_90 the spec would quantize 0 of 4" in done.stdout


@pytest.mark.slow
def test_calibrate_wan_example_on_the_cpu_writes_spec_table_and_plot(tmp_path, capsys):
    """The tiny Wan path of examples/calibrate_wan.py (the device step runs --real-size on the H200)."""
    pytest.importorskip("matplotlib")
    torch._dynamo.reset()
    result = calibrate_wan.main(["--out", str(tmp_path), "--calls", "2", "--budget", "cos=0.99993"])
    out = capsys.readouterr().out
    assert len(result.sites) == 4 and result.calls == ["t=1.00", "t=0.50"]
    assert "] t=1.00 (1/2) blocks.0.attn1 (layer 0, self, q/kv 128/128, d 12): int8-1-16-1 cos " in out
    assert "qattn_fx calibration: " in out and f"wrote {tmp_path}/spec.json" in out
    assert qattn_fx.Spec.from_file(tmp_path / "spec.json") == result.spec
    assert (tmp_path / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="real_size needs a CUDA GPU; on a CPU use examples.calibrate_wan:tiny"):
            calibrate_wan.real_size()


@pytest.mark.slow
def test_pipeline_example_with_torchao_linears_and_first_block_cache(capsys):
    """The whole stack in the pipeline: int8 weight-only linears (TorchAO) and First Block Cache on the compiled
    transformer; the cache breaks the graph by design, and every site of every graph is quantized."""
    pytest.importorskip("torchao")
    torch._dynamo.reset()
    result = pipeline.main(["--steps", "3", "--compiler", "eager", "--device", "cpu", "--linears", "int8wo",
                            "--cache", "fbc", "--cache-threshold", "0.5"])
    out = capsys.readouterr().out
    assert result["sites"] == result["quantized"] >= 4 and result["steps"] == 3
    assert result["cosine"] > 0.99
    assert "3 steps, linears int8wo, cache fbc; " in out
    with pytest.raises(SystemExit):
        pipeline.main(["--device", "cpu", "--linears", "fp8"])

    torch._dynamo.reset()  # fp8static calibrates on a run from other noise first (the tiny widths, 24, stay bf16)
    result = pipeline.main(["--steps", "2", "--compiler", "eager", "--device", "cpu", "--linears", "fp8static"])
    out = capsys.readouterr().out
    assert "calibrated 0 linears as fp8static on a run from seed 1\n" in out and result["cosine"] > 0.9999
