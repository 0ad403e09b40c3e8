"""benchmarks/_common.time_ms: the timer choices (the timing itself needs a GPU)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import _common as common  # noqa: E402


def test_unknown_timer_names_the_choices():
    with pytest.raises(ValueError, match=r"timer method='bogus' is invalid; valid: events, do_bench, graph"):
        common.time_ms(lambda: None, method="bogus")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_timer_replays_the_call():
    x = torch.ones(1 << 20, device="cuda")
    out = torch.empty_like(x)
    ms = common.time_ms(lambda: torch.mul(x, 2.0, out=out), method="graph", iters=5)
    assert ms > 0
    torch.testing.assert_close(out, 2 * x)
