"""benchmarks.common.time_ms: the timer choices (the timing itself needs a GPU); attention_ops' rounds."""

from __future__ import annotations

import pytest
import torch

from benchmarks import common


def test_unknown_timer_names_the_choices():
    with pytest.raises(ValueError, match=r"timer method='bogus' is invalid; valid: events, do_bench, graph"):
        common.time_ms(lambda: None, method="bogus")


def test_work_before_each_call_is_refused_by_the_timers_that_cannot_queue_it():
    with pytest.raises(ValueError, match=r"before= is only taken by the events timer; got method='graph'"):
        common.time_ms(lambda: None, method="graph", before=lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_timer_replays_the_call():
    x = torch.ones(1 << 20, device="cuda")
    out = torch.empty_like(x)
    ms = common.time_ms(lambda: torch.mul(x, 2.0, out=out), method="graph", iters=5)
    assert ms > 0
    torch.testing.assert_close(out, 2 * x)


def _attention_ops():
    from benchmarks import attention_ops  # noqa: PLC0415 - imports qattn_fx's ops

    return attention_ops


def test_rounds_keep_the_median_and_every_round():
    ops = _attention_ops()
    row = {"ms_kernel": 8.0, "ms_total": 7.9}
    ops.merge_rounds(row, {"ms_kernel": [8.0, 7.5, 7.6], "ms_total": [7.9, 7.9, 8.2]})
    assert row["ms_kernel"] == 7.6 and row["ms_total"] == 7.9
    assert row["ms_kernel_rounds"] == [8.0, 7.5, 7.6] and row["ms_total_rounds"] == [7.9, 7.9, 8.2]
    sdpa = {"ms_kernel": 11.7, "ms_total": 11.7}  # timed once per round: the total mirrors the kernel
    ops.merge_rounds(sdpa, {"ms_kernel": [11.7, 11.4, 11.5]})
    assert sdpa["ms_kernel"] == sdpa["ms_total"] == 11.5


def test_rounds_below_one_are_refused(capsys):
    ops = _attention_ops()
    with pytest.raises(SystemExit):
        ops.main(["--rounds", "0"])
    assert "--rounds=0 is invalid; valid: an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_run_shape_times_every_method_again_per_round(monkeypatch):
    """``--rounds 3``: after the first round (inside measure_method), each method's timed callables run again in
    method order, twice; the table gets medians and the speedups are computed from them."""
    ops = _attention_ops()
    order = []

    def fake_measure(m, q, k, v, ref, rows, s):
        if m.kind == "sdpa":
            return {"method": m.name, "ms_kernel": 11.6, "ms_total": 11.6}, {"ms_kernel": "sdpa"}
        return {"method": m.name, "ms_kernel": 7.8, "ms_total": 7.76}, {"ms_kernel": "gk", "ms_total": "gt"}

    times = {"sdpa": iter([11.4, 11.8]), "gk": iter([7.4, 7.5]), "gt": iter([7.9, 7.7])}  # rounds 2 and 3

    def fake_ms(call, s):
        order.append(call)
        return next(times[call])

    monkeypatch.setattr(ops, "measure_method", fake_measure)
    monkeypatch.setattr(ops, "_ms", fake_ms)
    monkeypatch.setattr(ops, "make_inputs", lambda *a: (torch.zeros(1), torch.zeros(1), torch.zeros(1)))
    monkeypatch.setattr(ops.common, "reference_rows", lambda sq, n, device=None: None)
    monkeypatch.setattr(ops.common, "fp32_attention_rows", lambda q, k, v, rows: None)
    monkeypatch.setattr(ops, "unavailable", lambda m, cap, d: None)
    methods = [ops.Method(ops.BASELINE, "sdpa"), ops.Method("gluon_sage/x", "qattn", kernel="gluon_sage")]
    rows = ops.run_shape("s", (1, 1, 8, 8, 64), methods, (9, 0), ops.Settings(rounds=3), outliers=False)
    assert order == ["sdpa", "gk", "gt", "sdpa", "gk", "gt"]
    base, glu = rows
    assert base["ms_kernel"] == base["ms_total"] == 11.6 and base["ms_kernel_rounds"] == [11.6, 11.4, 11.8]
    assert glu["ms_kernel"] == 7.5 and glu["ms_total"] == 7.76
    assert glu["speedup"] == pytest.approx(11.6 / 7.76) and glu["quant_pct"] == pytest.approx((7.76 - 7.5) / 7.5 * 100)
