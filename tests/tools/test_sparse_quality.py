"""benchmarks.sparse_quality on the CPU: the command runs end to end at a tiny grid and writes its JSON; its exact
block masses, chunking and oracle are checked against direct computations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import common, sparse_quality
from qattn_fx import block_sparse


def test_answers_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        sparse_quality.main(["--help"])
    assert exit_.value.code == 0
    assert "usage: python -m benchmarks.sparse_quality" in capsys.readouterr().out


def test_runs_on_a_tiny_grid_and_writes_json(tmp_path, capsys):
    out = tmp_path / "q.json"
    assert sparse_quality.main(["--grid", "4x8x8", "--heads", "2", "--head-dim", "32", "--top-k", "0.25,1.0",
                                "--cdf", "0.9", "--device", "cpu", "--max-bytes", "100000", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert payload["tokens"] == 256 and len(rows) == 6
    assert {(r["inputs"], r["mode"], r["keep"]) for r in rows} == {
        (i, m, k) for i in ("grid", "random") for m, k in (("top_k", 0.25), ("top_k", 1.0), ("cdf", 0.9))}
    for r in rows:
        assert 0.0 <= r["sparsity"] <= 1.0
        assert r["mass"] <= r["oracle"] + 1e-6 and 0 < r["ratio"] <= 1 + 1e-6
        if r["keep"] == 1.0:
            assert r["sparsity"] == 0.0 and r["ratio"] == pytest.approx(1.0) and r["cos"] == pytest.approx(1.0)
    assert "ratio p05" in capsys.readouterr().out


def test_runs_on_the_trained_digits_dit(tmp_path):
    """``--inputs digits``: one row per attention call of the trained checkpoint (4 blocks per noise level) and
    keep, at ``--digits-side``² tokens."""
    out = tmp_path / "d.json"
    assert sparse_quality.main(["--inputs", "digits", "--digits-side", "16", "--digits-images", "1",
                                "--digits-timesteps", "0.5", "--top-k", "0.5", "--cdf", "", "--device", "cpu",
                                "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["digits_tokens"] == 256
    assert [r["inputs"] for r in payload["rows"]] == [f"digits t=0.5 blocks.{i}" for i in range(4)]
    for r in payload["rows"]:
        assert r["mass"] <= r["oracle"] + 1e-6 and 0.5 <= r["ratio"] <= 1 + 1e-6


def test_the_digits_dit_serves_a_larger_image_with_its_trained_positions_kept():
    """At its training size the model uses its own positions (outputs unchanged); a larger image interpolates
    them onto the same extent (:func:`examples.dit_digits.sincos_positions`' ``step``)."""
    from examples import dit_digits

    model = dit_digits.TinyDiT()
    assert torch.equal(dit_digits.sincos_positions(8, 128), model.pos)
    assert torch.equal(dit_digits.sincos_positions(16, 128, 0.5)[::2][:8], dit_digits.sincos_positions(8, 128)[:8])
    x = torch.randn(2, 1, 32, 32)
    assert model(x, torch.rand(2), torch.tensor([1, 2])).shape == (2, 1, 32, 32)


def test_masses_chunking_and_oracle():
    q, k, v = common.grid_qkv(1, 2, (3, 10, 10), 32, windows=((1, 2, 2), (2, 4, 4)), sink=2, device="cpu")
    sm = 1 / math.sqrt(32)
    out, mass = sparse_quality.attention_and_masses(q, k, v, sm, masses=True)
    chunked, mass_c = sparse_quality.attention_and_masses(q, k, v, sm, masses=True, max_bytes=1)  # 128-row chunks
    torch.testing.assert_close(chunked, out)
    torch.testing.assert_close(mass_c, mass)
    p = torch.softmax(q.float() @ k.float().transpose(-1, -2) * sm, -1)
    torch.testing.assert_close(out, p @ v.float(), rtol=1e-5, atol=1e-5)
    assert mass.shape == (1, 2, 3, 3)
    torch.testing.assert_close(mass.sum(-1), torch.ones(1, 2, 3))
    want = torch.stack([p[:, :, 256:, 128 * j:128 * (j + 1)].sum(-1).mean(-1) for j in range(3)], -1)
    torch.testing.assert_close(mass[:, :, 2], want)  # the partial last query tile: mean over its 44 rows
    count = torch.tensor([[[1, 2, 0], [3, 1, 2]]], dtype=torch.int32)
    oracle = sparse_quality.oracle_visit(mass, count)
    assert torch.equal(oracle.sum(-1).int(), count)
    best = mass.sort(-1, descending=True).values.cumsum(-1)
    for h in range(2):
        for i in range(3):
            c = int(count[0, h, i])
            assert (mass[0, h, i] * oracle[0, h, i]).sum().item() == pytest.approx(best[0, h, i, c - 1].item()
                                                                                   if c else 0.0)
    visit = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    visit[0, 0, 1, 2] = False
    masked, _ = sparse_quality.attention_and_masses(q, k, v, sm, visit, max_bytes=1)
    logits = (q.float() @ k.float().transpose(-1, -2) * sm).masked_fill(~block_sparse.expand(visit, 300, 300),
                                                                        -math.inf)
    torch.testing.assert_close(masked, torch.softmax(logits, -1) @ v.float(), rtol=1e-5, atol=1e-5)
