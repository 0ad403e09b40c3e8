"""The measured time of block-sparse calls (:mod:`qattn_fx.sparse_cost`) and its generated points."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import cost_table
from qattn_fx import cost_data, sparse_cost

H100 = "NVIDIA H100 80GB HBM3"


def _measured() -> list[sparse_cost.SparsePoint]:
    return [sparse_cost.SparsePoint(*row) for row in cost_data.SPARSE_POINTS]


def test_each_measured_length_is_its_own_line_through_its_points():
    """The least-squares line of each measured shape stays within 0.02 of its measurements (through both where a
    shape has two)."""
    for p in _measured():
        arch = cost_data.SOURCES[p.source]["arch"]
        time = sparse_cost.sparse_time(p.kernel, arch, kv_len=p.kv_len, head_dim=p.head_dim, gpu=p.gpu)
        assert time.ratio(p.visited) == pytest.approx(p.ratio, abs=0.02), p
        assert time.data.startswith("H100 80GB HBM3 ")


def test_between_lengths_the_line_moves_with_log_kv_len_and_holds_outside():
    at = lambda n: sparse_cost.sparse_time("gluon_sage", "sm_90", kv_len=n, head_dim=128, gpu=H100)  # noqa: E731
    lengths = sorted({p.kv_len for p in _measured() if p.kernel == "gluon_sage" and p.head_dim == 128})
    assert len(lengths) >= 3
    short, long = at(lengths[0]), at(lengths[1])
    mid = at(int(math.sqrt(lengths[0] * lengths[1])))  # halfway in log kv_len
    assert mid.fixed == pytest.approx((short.fixed + long.fixed) / 2, rel=1e-3, abs=1e-4)
    assert mid.per_visited == pytest.approx((short.per_visited + long.per_visited) / 2, rel=1e-3)
    held = at(512)
    assert (held.fixed, held.per_visited) == (short.fixed, short.per_visited) and held.lower_bound
    assert at(10**6) == at(lengths[-1])
    # shorter calls keep more of their time whatever they skip (the predictor's launches, each tile's fixed work)
    assert short.ratio(0.5) > mid.ratio(0.5) > long.ratio(0.5) > at(lengths[-1]).ratio(0.5)


def test_a_listed_launch_costs_more_per_visited_block_at_video_lengths():
    """The line is not ``1 - sparsity`` plus a constant: at Wan lengths, visiting every block on lists costs more
    than the dense launch (the measured lines' slope is above 1)."""
    for n in (32760, 75600):
        time = sparse_cost.sparse_time("gluon_sage", "sm_90", kv_len=n, head_dim=128, gpu=H100)
        assert time.per_visited > 1.0 and time.ratio(1.0) > 1.0


def test_a_head_dim_without_points_takes_the_slower_measured_line():
    times = {d: sparse_cost.sparse_time("gluon_sage", "sm_90", kv_len=16384, head_dim=d) for d in (64, 96, 128)}
    assert times[96] == max(times[64], times[128], key=lambda t: t.ratio(0.5))


def test_without_points_the_model_says_so():
    time = sparse_cost.sparse_time("triton_sage", "sm_89", kv_len=4096, head_dim=128)
    assert time is sparse_cost.UNMEASURED and time.ratio(0.5) == pytest.approx(0.5 + sparse_cost.PREDICTOR_COST)
    assert "no block-sparse cost data" in time.data
    assert sparse_cost.sparse_speedup(2.0, 0.5, time) == pytest.approx(2.0 / 0.53)


def test_the_running_gpus_points_count_first(monkeypatch):
    own = sparse_cost.SparsePoint("k", "a", "s", 1, 1000, 1000, 128, 0.5, 0.8)
    other = sparse_cost.SparsePoint("k", "b", "s", 1, 1000, 1000, 128, 0.5, 0.6)
    monkeypatch.setitem(cost_data.SOURCES, "a", {"device": "NVIDIA H200", "arch": "sm_90", "date": "2026-12-01"})
    monkeypatch.setitem(cost_data.SOURCES, "b", {"device": H100, "arch": "sm_90", "date": "2026-12-02"})
    monkeypatch.setitem(sparse_cost._TABLE, ("k", "sm_90"), [own, other])
    h200 = sparse_cost.sparse_time("k", "sm_90", kv_len=1000, head_dim=128, gpu="NVIDIA H200")
    assert h200.ratio(0.5) == pytest.approx(0.8) and h200.data == "H200 2026-12-01"
    either = sparse_cost.sparse_time("k", "sm_90", kv_len=1000, head_dim=128, gpu="NVIDIA A100")
    assert either.data == "H100 80GB HBM3/H200 2026-12-02"


@pytest.mark.parametrize("visited", [-0.1, 1.5])
def test_ratio_names_a_bad_fraction(visited):
    with pytest.raises(ValueError, match=rf"visited={visited} is invalid; valid: a fraction of blocks in \[0, 1\]"):
        sparse_cost.UNMEASURED.ratio(visited)


def _bench_file(tmp_path, name, device, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"rows": rows, "env": {"device": device, "capability": [9, 0]},
                                "settings": {"timer": "graph", "keep": [0.5]}}))
    return str(path)


def _row(shape, keep, ms_both, config="WS_A", kernel="gluon_sage", sparsity=None):
    return {"shape": shape, "B": 1, "H": 2, "Sq": 4096, "Skv": 4096, "D": 128, "kernel": kernel, "keep": keep,
            "config": config, "ms_dense": 1.0, "ms_both": ms_both,
            "sparsity_pred": 1 - keep if sparsity is None else sparsity}


def test_cost_table_takes_block_sparse_rows_below_keep_1(tmp_path):
    older = _bench_file(tmp_path, "2026-12-01_h100_bs.json", H100,
                        [_row("s", 1.0, 1.1), _row("s", 0.5, 0.7), _row("s", 0.25, 0.4, config="WS_B")])
    newer = _bench_file(tmp_path, "2026-12-02_h100_bs.json", H100, [_row("s", 0.5, 0.6)])
    _, points, sparse = cost_table.read_points([older, newer])
    assert not points
    assert sorted(sparse.values()) == [("gluon_sage", "2026-12-01_h100_bs", "s", 2, 4096, 4096, 128, 0.25, 0.4),
                                       ("gluon_sage", "2026-12-02_h100_bs", "s", 2, 4096, 4096, 128, 0.5, 0.6)]
    _, _, only_b = cost_table.read_points([older + ":WS_B"])
    assert [p[-2:] for p in only_b.values()] == [(0.25, 0.4)]
    with pytest.raises(ValueError, match=r"no row of kernel or config\(s\) WS_C; valid: WS_A, WS_B, gluon_sage"):
        cost_table.read_points([older + ":WS_C"])
    assert "SPARSE_POINTS = (\n    (\"gluon_sage\", \"2026-12-01_h100_bs\"" in cost_table.render([older])


def test_below_the_measured_lengths_the_held_line_is_a_lower_bound():
    """Shorter calls keep more of their time whatever they skip, so the line held below the shortest measured key
    length bounds the time from below: the cost rule then says ``at most`` (cross-attention to 512 text tokens)."""
    from qattn_fx.cost_rule import cost_rule
    from qattn_fx.hardware import Hardware
    from qattn_fx.site import Site
    from qattn_fx.block_sparse_spec import BlockSparse

    shortest = min(p.kv_len for p in _measured() if p.kernel == "gluon_sage" and p.head_dim == 128)
    at = lambda n: sparse_cost.sparse_time("gluon_sage", "sm_90", kv_len=n, head_dim=128, gpu=H100)  # noqa: E731
    assert at(shortest - 1).lower_bound and not at(shortest).lower_bound and not at(10**6).lower_bound
    sm90 = Hardware.for_arch("sm_90", {"triton": "3.6.0", "flashinfer-python": "0.7.2.post1", "cudnn": "9.19.0"})
    cross = Site(name="attn2", q_shape=(1, 40, 32760, 128), k_shape=(1, 40, 512, 128), v_shape=(1, 40, 512, 128),
                 module="blocks.0.attn2", layer=0, num_layers=1)
    dense, said = cost_rule("gluon_sage", cross, sm90, BlockSparse(top_k=0.5))
    assert dense and "gluon_sage with bs top_k 0.5 predicted at most " in said


@settings(max_examples=80, deadline=None)
@given(kernel=st.sampled_from(["gluon_sage", "triton_sage"]), kv_len=st.integers(1, 400_000),
       head_dim=st.sampled_from([64, 80, 128]), gpu=st.sampled_from([None, H100, "NVIDIA H200"]),
       v=st.floats(0.0, 1.0), dv=st.floats(0.0, 1.0))
def test_more_blocks_never_take_less_time(kernel, kv_len, head_dim, gpu, v, dv):
    """Over every length, head_dim and GPU: the time grows with the blocks visited and stays positive."""
    time = sparse_cost.sparse_time(kernel, "sm_90", kv_len=kv_len, head_dim=head_dim, gpu=gpu)
    hi = min(1.0, v + dv)
    assert 0 < time.ratio(v) <= time.ratio(hi) + 1e-12
    assert not time.lower_bound or kv_len < max(p.kv_len for p in _measured() if p.kernel == kernel)
