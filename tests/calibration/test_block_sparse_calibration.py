"""Block sparsity in the calibration (CPU, emulated): sparse candidates measured with the predictor's real lists and
chosen when they keep the budget (their measured sparsity in the table), refused when they do not, and the
``target_sparsity`` knob fitted per site; the specs compile and run with no recompile."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import qattn_fx
import qattn_fx.ops  # noqa: F401  (registers qattn::*)
from benchmarks.common import local_qkv
from qattn_fx import AttentionSpec, BlockSparse, Recipe, Spec, block_sparse
from qattn_fx.calibration import calibrate
from qattn_fx.calibration.candidates import make_candidates, parse_id
from qattn_fx import sparse_cost

SAGE = Recipe("int8", "fp8", 1, 16, 1)


class Attention(torch.nn.Module):
    """SDPA of its inputs, scaled by a function of the timestep (so the timestep is a graph input)."""

    def forward(self, q, k, v, timestep):
        return F.scaled_dot_product_attention(q, k, v) * (1.0 + 0.0 * timestep.float().mean())


class TwoSites(torch.nn.Module):
    """Two sites on local attention: ``b``'s queries are scaled down, so its maps are flatter (less sparse)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Attention(), Attention()

    def forward(self, q, k, v, timestep):
        return self.a(q, k, v, timestep) + self.b(q * 0.3, k, v, timestep)


def local_calls(n=2, s=512):
    """``n`` calls on local attention (width 200 tokens, 4 sink keys), timesteps 1000, 500, ..."""
    out = []
    for i in range(n):
        q, k, v = local_qkv(1, 2, s, s, 64, width=200.0, noise=0.5, sink=4, seed=i, device="cpu")
        out.append(((q.float(), k.float(), v.float()), {"timestep": torch.tensor([1000.0 * (1 - i / n)])}))
    return out


def two_x(*_, **__):
    """A speed source: every recipe predicted 2x at every site."""
    return 2.0


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()


def run_spec(spec, calls, model=None):
    """Compile ``model`` (default :class:`TwoSites`) with ``spec`` (emulated), run ``calls`` with recompiles
    refused after the first; per site label, the measured block sparsity, and the backend."""
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager")
    compiled = torch.compile(model or TwoSites(), backend=backend, dynamic=False)
    with torch.no_grad(), block_sparse.measure() as measured:
        for i, (args, kwargs) in enumerate(calls):
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                compiled(*args, **kwargs)
    return measured, backend


# ----------------------------------------------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------------------------------------------


def test_sparse_candidate_ids_names_and_order():
    assert parse_id("int8-1-16-1+cdf0.9") == AttentionSpec(recipe=parse_id("int8-1-16-1").recipe,
                                                           block_sparse=BlockSparse(cdf=0.9))
    assert parse_id("fp8-1-16-1+top_k0.5").block_sparse == BlockSparse(top_k=0.5)
    assert parse_id("int8-1-16-1+target0.5").block_sparse == BlockSparse(target_sparsity=0.5)
    cands = make_candidates(["bf16-0-0-1", "int8-1-16-1", "int8-1-16-1+cdf0.99", "int8-1-16-1+cdf0.9",
                             {"recipe": {"qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": 1,
                                         "k_block_size": 16, "v_block_size": 1},
                              "block_sparse": {"top_k": 0.5, "sink_tiles": 0, "diagonal": False}}])
    assert [c.name for c in cands] == ["int8-1-16-1+top_k0.5/sinks0/nodiag", "int8-1-16-1+cdf0.9",
                                       "int8-1-16-1+cdf0.99", "int8-1-16-1", "bf16-0-0-1"]
    with pytest.raises(ValueError, match=r"candidate 'int8-1-16-1\+cdf1.5': block_sparse.cdf=1.5 is out of range"):
        parse_id("int8-1-16-1+cdf1.5")
    with pytest.raises(ValueError, match=r"candidate 'int8-1-16-1\+cdfx' is invalid; valid: QK-Q-K-V"):
        parse_id("int8-1-16-1+cdfx")


# ----------------------------------------------------------------------------------------------------------------
# Sparse candidates in the plan
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sparse_candidates_are_measured_and_the_sparsest_within_budget_is_chosen(tmp_path):
    calls = local_calls()
    result = calibrate(TwoSites(), calls, budget="cos=0.99",
                       candidates=["int8-1-16-1", "int8-1-16-1+cdf0.5", "int8-1-16-1+cdf0.9"], emulate=True,
                       speed=two_x, progress=lambda line: None)
    rows = {(r.site, r.candidate): r for r in result.table}
    for site in ("a", "b"):
        dense, mid, low = (rows[(site, n)] for n in ("int8-1-16-1", "int8-1-16-1+cdf0.9", "int8-1-16-1+cdf0.5"))
        assert dense.sparsity is None and dense.speedup == 2.0
        assert 0 < mid.sparsity <= low.sparsity and len(mid.per_call_sparsity) == 2
        assert mid.sparsity == pytest.approx(sum(mid.per_call_sparsity) / 2)  # the mean over the calls
        kernel, _, arch = mid.deploy.partition(" on ")
        time = sparse_cost.sparse_time(kernel, arch, kv_len=512, head_dim=64)  # (local_calls' keys and head_dim)
        assert mid.speedup == pytest.approx(sparse_cost.sparse_speedup(2.0, mid.sparsity, time))
        assert f"block-sparse: {time.data}" in mid.speed_source
        assert mid.errors.cos < dense.errors.cos
    # every sparse candidate that keeps the budget is predicted faster than the recipe alone: the sparsest wins
    chosen = {s.site: s.choice for s in result.sites}
    for site, name in chosen.items():
        inside = [r for r in result.table if r.site == site and r.within_budget]
        assert name == max(inside, key=lambda r: r.speedup).candidate and rows[(site, name)].sparsity > 0
        assert "skipping" in next(s.reason for s in result.sites if s.site == site)
    text = str(result)
    assert "skipped" in text.splitlines()[3] and f"{rows[('a', chosen['a'])].sparsity:.2f}" in text
    assert "| skipped |" in result.table.markdown()
    # the spec deploys what was measured: the same lists, the same sparsity, one graph for every call
    measured, backend = run_spec(result.spec, calls)
    assert len(backend.graph_modules) == 1
    for site in ("a", "b"):
        row = rows[(site, chosen[site])]
        per_call = sum(s for s in row.per_call_sparsity) / len(calls)
        assert measured.sites[site].sparsity == pytest.approx(per_call, abs=1e-9)
    # JSON round trip and plot keep the column
    loaded = qattn_fx.calibration.load(result.save(tmp_path / "c.json"))
    assert [r.sparsity for r in loaded.table] == [r.sparsity for r in result.table]
    pytest.importorskip("matplotlib")
    assert loaded.plot(tmp_path / "c.png").stat().st_size > 0


@pytest.mark.slow
def test_a_tight_budget_refuses_the_sparse_candidates():
    result = calibrate(TwoSites(), local_calls(1), budget="cos=0.9992",
                       candidates=["int8-1-16-1", "int8-1-16-1+cdf0.5", "int8-1-16-1+cdf0.9"], emulate=True,
                       speed=two_x, progress=lambda line: None)
    assert {s.site: s.choice for s in result.sites} == {"a": "int8-1-16-1", "b": "int8-1-16-1"}
    assert all(not r.within_budget for r in result.table if r.sparsity is not None)
    measured, _ = run_spec(result.spec, local_calls(1))
    assert not measured.sites  # no site predicts blocks


# ----------------------------------------------------------------------------------------------------------------
# The target knob
# ----------------------------------------------------------------------------------------------------------------


class WithCross(TwoSites):
    """:class:`TwoSites` plus ``c``: attention to the first 128 keys only (one key tile: nothing can be skipped)."""

    def __init__(self):
        super().__init__()
        self.c = Attention()

    def forward(self, q, k, v, timestep):
        return super().forward(q, k, v, timestep) + self.c(q, k[:, :, :128], v[:, :, :128], timestep)


@pytest.mark.slow
def test_target_knob_reaches_the_target_per_site_and_the_spec_runs_it():
    calls = local_calls(2)
    cal = qattn_fx.calibrate_block_sparse(WithCross(), calls, 0.4, spec=Spec(default=AttentionSpec(recipe=SAGE)))
    assert set(cal.keep) == {"a", "b", "c"} and cal.mode == "cdf" and cal.per == "site"
    for m in ("a", "b"):
        assert cal.reached(m) and cal.sparsity[m] >= 0.4
        higher = [keep for keep, s in cal.curve[m] if keep > cal.keep[m]]
        assert all(s < 0.4 for keep, s in cal.curve[m] if keep in higher)  # the highest keep that reaches it
    assert not cal.reached("c") and cal.sparsity["c"] == 0.0 and cal.keep["c"] == min(k for k, _ in cal.curve["c"])
    assert "target not reached" in str(cal)
    use = cal.spec.rules[0].use
    assert use.recipe == SAGE and use.block_sparse == BlockSparse(cdf=cal.keep["a"])
    measured, backend = run_spec(cal.spec, calls, WithCross())
    assert len(backend.graph_modules) == 1  # every call on one graph: no recompile
    for m in ("a", "b", "c"):
        assert measured.sites[m].sparsity == pytest.approx(cal.sparsity[m], abs=1e-9)


@pytest.mark.slow
def test_target_knob_per_model_and_top_k():
    calls = local_calls(1)
    cal = qattn_fx.calibrate_block_sparse(TwoSites(), calls, 0.5, per="model", mode="top_k",
                                          disabled_until_timestep=0.9)
    assert len(set(cal.keep.values())) == 1 and cal.mode == "top_k"
    pooled = sum(cal.sparsity.values()) / 2  # both sites have as many blocks
    assert pooled >= 0.5
    setting = cal.spec.rules[0].use.block_sparse
    assert setting.top_k == cal.keep["a"] and setting.disabled_until_timestep == 0.9
    # the default recipe with the knob from the spec's own block_sparse.target_sparsity
    own = Spec(default=AttentionSpec(recipe=SAGE, block_sparse=BlockSparse(target_sparsity=0.3, sink_tiles=0)))
    cal = qattn_fx.calibrate_block_sparse(TwoSites(), calls, spec=own)
    assert all(s >= 0.3 for s in cal.sparsity.values())
    assert all(r.use.block_sparse.sink_tiles == 0 for r in cal.spec.rules[:2])


def test_target_knob_errors_name_the_value():
    calls = local_calls(1)
    with pytest.raises(ValueError, match=r"per='layer' is invalid; valid: site, model"):
        qattn_fx.calibrate_block_sparse(TwoSites(), calls, 0.5, per="layer")
    with pytest.raises(ValueError, match=r"mode='mass' is invalid; valid: cdf, top_k"):
        qattn_fx.calibrate_block_sparse(TwoSites(), calls, 0.5, mode="mass")
    with pytest.raises(ValueError, match=r"calibrate_block_sparse.target_sparsity=1.5 is out of range"):
        qattn_fx.calibrate_block_sparse(TwoSites(), calls, 1.5)
    with pytest.raises(ValueError, match=r"no site to calibrate"):
        qattn_fx.calibrate_block_sparse(TwoSites(), calls)  # no target anywhere


def test_calibrate_turns_a_target_candidate_into_fitted_cdf_candidates():
    result = calibrate(TwoSites(), local_calls(1), budget="cos=0.99", candidates=["int8-1-16-1+target0.4"],
                       emulate=True, speed=two_x, progress=lambda line: None)
    names = [c["name"] for c in result.candidates]
    assert all("+cdf" in n for n in names) and names
    assert any(n.startswith("int8-1-16-1+target0.4: target_sparsity 0.4 fitted per site") for n in result.notes)
    for s in result.sites:  # a fitted candidate at its own site reaches the target
        assert max(r.sparsity for r in result.table if r.site == s.site) >= 0.4


def factory():
    """``(model, calls)`` for the CLI tests."""
    return TwoSites(), local_calls(1)


@pytest.mark.slow
def test_cli_block_sparse_target(tmp_path, capsys):
    from qattn_fx.cli import main

    out, table = tmp_path / "spec.json", tmp_path / "fit.json"
    model = "tests.calibration.test_block_sparse_calibration:factory"
    assert main(["calibrate", "--model", model, "--calls", "1", "--block-sparse-target", "0.4", "--out", str(out),
                 "--table", str(table)]) == 0
    spec = Spec.from_json(out.read_text())
    assert [r.match.module for r in spec.rules] == ["a", "b"] and spec.rules[0].use.block_sparse.cdf
    assert set(json.loads(table.read_text())["sites"]) == {"a", "b"}
    assert "skipped" in capsys.readouterr().out
    assert main(["calibrate", "--model", model, "--calls", "1", "--block-sparse-target", "0.4", "--budget",
                 "cos=0.99", "--candidates", "int8-1-16-1", "--emulate", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8-1-16-1+target0.4: target_sparsity 0.4 fitted" in text and "+cdf" in text
    assert main(["calibrate", "--model", model, "--out", str(out)]) == 2
    assert "give --budget" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# Step windows
# ----------------------------------------------------------------------------------------------------------------


def step_calls(ts=(1.0, 0.5, 0.1)):
    """Calls whose maps are noisier at high t (the early steps), where the predictor's pooled scores miss more."""
    out = []
    for i, t in enumerate(ts):
        q, k, v = local_qkv(1, 2, 512, 512, 64, width=200.0, noise=0.5 + 0.35 * t, sink=4, seed=i, device="cpu")
        out.append(((q.float(), k.float(), v.float()), {"timestep": torch.tensor([1000.0 * t])}))
    return out


@pytest.mark.slow
def test_a_sparse_candidate_that_breaks_the_budget_early_gets_a_step_window():
    calls = step_calls()
    result = calibrate(Attention(), calls, budget="cos=0.9982", candidates=["int8-1-16-1", "int8-1-16-1+cdf0.9"],
                       emulate=True, speed=two_x, progress=lambda line: None)
    sparse = result.table.lookup("sdpa", "int8-1-16-1+cdf0.9")
    gated = result.table.lookup("sdpa", "int8-1-16-1+cdf0.9/t<=0.5")
    alone = result.table.lookup("sdpa", "int8-1-16-1")
    assert not sparse.within_budget and sparse.worst_call == 0  # breaks it at t = 1 only
    assert gated.chosen and result.sites[0].choice == gated.candidate
    assert gated.per_call == [alone.per_call[0], *sparse.per_call[1:]]  # every block at t = 1
    assert gated.per_call_sparsity == [0.0, *sparse.per_call_sparsity[1:]]
    assert gated.sparsity == pytest.approx(sum(sparse.per_call_sparsity[1:]) / 3)
    assert alone.speedup < gated.speedup < sparse.speedup
    assert any("step windows" in n and "t<=0.5" in n for n in result.notes)
    assert result.spec.rules[0].use.block_sparse.disabled_until_timestep == 0.5
    # the plan's model output at t = 1 is the recipe alone's (every block visited), and the gate reaches the spec
    assert result.plan_e2e[0] == result.e2e["int8-1-16-1"][0]
    measured, backend = run_spec(result.spec, calls, Attention())
    assert len(backend.graph_modules) == 1  # the gate is data: one graph for every step
    assert measured.sites["sdpa"].sparsity == pytest.approx(gated.sparsity, abs=1e-9)
