"""benchmarks.block_sparse (``python -m benchmarks.attention_ops --block-sparse``) on the CPU: its arguments, the
forced block lists, and a whole run with the reference kernel on a tiny shape (wall-clock timings), down to the
table, the JSON and the PNG."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import attention_ops
from benchmarks import block_sparse as bench
from qattn_fx import block_sparse, kernels

TINY = ["--device", "cpu", "--shapes", "none", "--shape", "tiny:1:2:384:256:64", "--iters", "1", "--acc-rows", "128"]


def test_arguments_and_their_errors(capsys):
    a = bench.parse_args([])
    assert a.keep == [1.0, 0.75, 0.5, 0.35, 0.25, 0.15] and a.kernels == ["gluon_sage", "triton_sage"]
    assert (a.shapes, a.timer, a.pattern, a.mode, a.device) == (bench.DEFAULT_SHAPES, "graph", "predicted", "top_k",
                                                                "cuda")
    a = bench.parse_args(["--keep", "1,0.5", "--kernels", "reference, gluon_sage", "--pattern", "banded"])
    assert a.keep == [1.0, 0.5] and a.kernels == ["reference", "gluon_sage"] and a.pattern == "banded"
    for bad in (["--keep", "0"], ["--keep", "1.5"], ["--keep", "x"], ["--pattern", "banded", "--mode", "cdf"],
                ["--recipe", "int4"], ["--skip-json", "/nonexistent/skip.json"], ["--timer", "wall"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # attention_ops hands --block-sparse over, as --skip-softmax
        attention_ops.main(["--block-sparse", "--help"])
    assert exit_.value.code == 0
    assert "usage: python -m benchmarks.attention_ops --block-sparse" in capsys.readouterr().out


@pytest.mark.parametrize("pattern", ["banded", "random"])
def test_forced_lists_keep_exactly_round_keep_nk_tiles(pattern):
    b, h, sq, skv = 2, 3, 1000, 1300  # NQ 8, NK 11 (both partial)
    for keep, n in ((1.0, 11), (0.5, 6), (0.25, 3), (0.01, 1)):
        blocks = bench.forced_blocks(pattern, keep, b, h, sq, skv, "cpu")
        assert blocks.index.shape == (b, h, 8, 11) and blocks.index.dtype == torch.int32
        block_sparse.check(blocks.index, blocks.count, b, h, sq, skv)
        assert (blocks.count == n).all() and bench.tiles_kept(keep, 11) == n
        assert bench.sparsity(blocks.count, blocks.index) == pytest.approx(1 - n / 11)
        listed = blocks.index[..., :n]
        assert (listed >= 0).all() and (listed < 11).all() and (blocks.index[..., n:] == -1).all()
        if pattern == "banded":  # contiguous, and it holds the diagonal tile
            assert (listed.diff(dim=-1) == 1).all()
            diag = torch.tensor([min((128 * i + 64) * skv // sq, skv - 1) // 128 for i in range(8)])
            assert ((listed == diag[:, None]).any(-1)).all()
    with pytest.raises(ValueError, match="pattern='predicted' is invalid here"):
        bench.forced_blocks("predicted", 0.5, b, h, sq, skv, "cpu")


def test_derive_leaves_out_what_was_not_timed():
    row = {"ms_dense": 10.0, "ms_cudnn": 12.0, "ms_lists": 5.0, "ms_pred": 1.0}
    bench.derive(row)
    assert row["speedup"] == 2.0 and row["speedup_cudnn"] == pytest.approx(2.4) and row["pred_pct"] == 10.0
    assert "speedup_pred" not in row and "speedup_cudnn_pred" not in row


@pytest.mark.slow
def test_cpu_run_with_the_reference_kernel_writes_table_json_and_png(tmp_path, capsys):
    skip_json = tmp_path / "skip.json"  # the --skip-softmax JSON's rows (a base row without λ, then λ rows)
    skip_json.write_text(json.dumps({"rows": [
        {"shape": "tiny", "config": "cfg", "lambda": "-", "sparsity": 0.0, "speedup": 1.0},
        {"shape": "tiny", "config": "cfg", "lambda": 1e-3, "sparsity": 0.6, "speedup": 1.4},
        {"shape": "tiny", "config": "cfg", "lambda": 1e-5, "sparsity": 0.3, "speedup": 1.1}]}))
    assert bench.skip_softmax_curves(str(skip_json)) == {"tiny": {"cfg": [(0.3, 1.1), (0.6, 1.4)]}}
    out, png = tmp_path / "bs.json", tmp_path / "bs.png"
    rc = attention_ops.main(["--block-sparse", *TINY, "--keep", "1,0.5", "--kernels", "reference,gluon_sage",
                             "--out", str(out), "--plot", str(png), "--skip-json", str(skip_json)])
    assert rc == 0
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert payload["settings"]["keep"] == [1.0, 0.5] and payload["settings"]["device"] == "cpu"
    assert [(r["kernel"], r.get("keep")) for r in rows] == [
        ("sdpa_cudnn_bf16", None), ("reference", None), ("reference", 1.0), ("reference", 0.5), ("gluon_sage", None)]
    dense, full, half = rows[1], rows[2], rows[3]
    assert dense["ms_dense"] > 0 and dense["note"].startswith("dense (no lists)")
    assert full["sparsity"] == 0.0 and full["sparsity_pred"] == 0.0 and full["cos_dense"] == pytest.approx(1, abs=1e-5)
    assert half["sparsity"] == pytest.approx(0.5) and half["pattern"] == "predicted" and half["mode"] == "top_k"
    for r in (full, half):
        for key in ("ms_lists", "ms_pred", "ms_both", "speedup", "speedup_pred", "speedup_cudnn",
                    "speedup_cudnn_pred", "pred_pct", "cos", "rel_l1", "cos_dense"):
            assert r[key] is not None and r[key] == r[key], key  # set and not NaN
        assert r["speedup"] == pytest.approx(r["ms_dense"] / r["ms_lists"])
    # a kernel that cannot run here is a row that says why (on a CPU: no block lists yet, or no CUDA device)
    assert rows[4]["note"].startswith("skipped: ") and (
        "block_sparse is False" in rows[4]["note"] or "needs a CUDA device" in rows[4]["note"])
    assert full["config"] == half["config"] == "auto"  # (--configs applies to gluon_sage only)
    assert "| shape | kernel | config | keep | skip |" in text and "| tiny | reference | auto | 0.50 | 0.500 |" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no PNG: matplotlib not importable" in text
    else:
        assert png.exists() and png.stat().st_size > 0 and f"wrote {png}" in text


def test_max_seconds_stops_new_measurements(tmp_path, capsys, monkeypatch):
    """Out of time: the kernel rows say so, the baseline and the table still come."""
    monkeypatch.setattr(bench.Settings, "out_of_time", lambda self: True)
    out = tmp_path / "bs.json"
    assert bench.run([*TINY, "--kernels", "reference", "--keep", "0.5", "--max-seconds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["sdpa_cudnn_bf16", "reference"]
    assert rows[1]["note"] == "skipped: --max-seconds 1 reached"
    assert "| tiny | reference |" in capsys.readouterr().out


def test_kernels_are_gated_on_block_sparse():
    assert bench.unavailable("reference", "cpu", 64) is None
    assert "is unknown" in bench.unavailable("nope", "cpu", 64)
    for name in ("gluon_sage", "triton_sage"):
        why = bench.unavailable(name, "cpu", 128)
        if kernels.info(name).block_sparse:
            assert why == f"{name} needs a CUDA device"
        else:
            assert why.startswith(f"kernels.info({name!r}).block_sparse is False")


def test_plot_without_measured_rows_says_why(tmp_path):
    assert bench.plot([{"shape": "x", "kernel": "k", "note": "skipped"}], str(tmp_path / "p.png")) == \
        "no measured keep row to plot"


def test_configs_option_parses_auto_and_gluon_configs_and_refuses_bad_ones():
    """``--configs``: gluon_sage's list calls once per config (``auto``: the tuner's choice), so next session's
    benchmark can run trio (the default) beside the two-consumer block-sparse config in one run."""
    a = bench.parse_args(["--configs", "auto; 128,3,ahead,permk,mmasum"])
    assert a.configs == ["auto", "128,3,ahead,permk,mmasum"]
    assert bench.parse_args([]).configs == ["auto"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "auto;128,5,trio"])
    import contextlib

    from qattn_fx.kernels import gluon_sage as gs

    assert isinstance(bench.forced_config("gluon_sage", "auto"), contextlib.nullcontext)
    assert isinstance(bench.forced_config("triton_sage", "128,3,trio"), contextlib.nullcontext)
    with bench.forced_config("gluon_sage", "128,3,ahead,permk,mmasum"):
        assert gs.forced_config() == gs.GluonConfig.parse("128,3,ahead,permk,mmasum")
    assert gs.forced_config() is None or str(gs.forced_config()) != "WS_BN128_s3_ahead_permk_mmasum"
