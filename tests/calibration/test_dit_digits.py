"""The trained DiT of examples/dit_digits.py (checkpoint in the repository): quantized samples keep the dense ones,
and a tight calibration budget gives a mixed plan that the backend reproduces and that keeps the budget."""

import importlib.util
from pathlib import Path

import pytest
import torch

from qattn_fx.calibration import calibrate
from qattn_fx.calibration.budget import worst

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("qattn_fx_example_dit_digits", ROOT / "examples" / "dit_digits.py")
dit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dit)


@pytest.fixture(scope="module")
def model():
    return dit.load()


@pytest.mark.slow
def test_default_recipe_samples_keep_30_db(model):
    """20 samples, 20 Euler steps, the default recipe on every site (emulated): PSNR >= 30 dB to the dense samples
    from the same noise (100 samples, BENCHMARKS.md: mean 59.09 dB, min 52.46)."""
    r = dit.quality(model, n=20, seed=0, sample_steps=20, compiler="aot_eager")
    assert r["report"].quantized == 4
    assert r["psnr_min"] >= 30.0, r["psnr_min"]
    assert r["ssim_min"] >= 0.99


@pytest.mark.slow
def test_a_tight_budget_gives_a_mixed_plan_that_keeps_it(model):
    calls, labels = dit.calibration_calls(model, 4)
    torch._dynamo.reset()
    result = calibrate(model, calls, budget={"cos": 0.9999}, emulate=True, labels=labels, speed=dit.accuracy_only)
    plan = {s.site: s.choice for s in result.sites}
    assert plan == {"blocks.0.attn": "int8-1-16-1", "blocks.1.attn": "dense", "blocks.2.attn": "dense",
                    "blocks.3.attn": "dense"}, plan
    assert result.sites[0].reason.startswith("first inside the budget in table order; worst cos 0.9999")
    chosen = result.table.lookup("blocks.0.attn", "int8-1-16-1")
    assert chosen.chosen and chosen.errors.cos >= 0.9999
    assert chosen.deploy == "gluon_sage on sm_90"  # head_dim 64: what an H200 would run
    report, e2e = dit.check(model, calls, result.spec)
    assert {s.module: s.rewritten for s in report.sites} == {k: v != "dense" for k, v in plan.items()}
    assert e2e.cos >= worst(result.plan_e2e).cos - 1e-6
    # re-measured with the chosen recipe only: the quantized site stays inside the budget at every call
    again = calibrate(model, calls, budget={"cos": 0.9999}, candidates=["int8-1-16-1"], emulate=True,
                      speed=dit.accuracy_only)
    assert {s.site: s.choice for s in again.sites} == plan
    # by the H200 cost data (the default source) 64 tokens promise no gain: every site dense, as auto would keep it
    costed = calibrate(model, calls, budget={"cos": 0.9999}, candidates=["int8-1-16-1"], emulate=True)
    assert all(s.choice == "dense" for s in costed.sites), [s.reason for s in costed.sites]
    assert costed.sites[0].reason.startswith("dense is faster: the fastest candidate inside the budget, "
                                             "int8-1-16-1, is predicted at most 0.88x of dense")


def test_block_sparse_candidates_on_its_larger_images_measure_real_lists(model, capsys):
    """``calibrate --side 16 --block-sparse`` (256 tokens: 2 x 2 blocks, positions interpolated): the guard-off
    sparse candidates are measured on the model's own lists, each with its fraction of blocks skipped, and every
    chosen candidate keeps the budget (BENCHMARKS / docs/block-sparsity.md: the 1,024-token run)."""
    calls, labels = dit.calibration_calls(model, 2, batch=4, sample_steps=4, side=16)
    assert calls[0][0][0].shape == (4, 1, 32, 32)
    torch._dynamo.reset()
    dit.main(["calibrate", "--side", "16", "--block-sparse", "--calls", "2", "--budget", "cos=0.999"])
    out = capsys.readouterr().out
    assert "int8-1-16-1+cdf0.95/sim0" in out and "int8-1-16-1+top_k0.5/sim0" in out
    assert "4/4 sites quantized within cos >= 0.999" in out


def test_training_runs_on_the_shipped_digits_and_writes_a_small_checkpoint(tmp_path):
    """A few steps of ``dit_digits.py train`` (the checkpoint in the repository is 2500 steps from seed 0): the data
    come from scikit-learn's wheel, the checkpoint loads and stays under 2 MB, and the thread count is restored."""
    pytest.importorskip("sklearn")
    images, labels = dit.digits()
    assert images.shape == (1797, 1, 16, 16) and images.min() >= -1 and images.max() <= 1
    assert sorted(set(labels.tolist())) == list(range(10))
    threads = torch.get_num_threads()
    dit.train(steps=3, seed=0, out=tmp_path / "ckpt.pt", log_every=3)
    assert torch.get_num_threads() == threads
    trained = dit.load(tmp_path / "ckpt.pt")
    assert sum(p.numel() for p in trained.parameters()) == sum(p.numel() for p in dit.TinyDiT().parameters())
    assert (tmp_path / "ckpt.pt").stat().st_size < 2e6 and dit.CHECKPOINT.stat().st_size < 2e6
