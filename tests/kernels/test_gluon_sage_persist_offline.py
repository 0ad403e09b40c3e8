"""gluon_sage's persistent schedule (``persist``, :mod:`qattn_fx.kernels.gluon_sage.schedule`) without a GPU: the
config, the launch plan and offline sm_90 compiles. Its numerics (bit-identical to the non-persistent launch) are
tested on the GPU: tests/gpu/test_gluon_sage_persist.py."""

from __future__ import annotations

import pytest
import torch

import support

from qattn_fx.kernels import gluon_sage as gs
from qattn_fx.kernels._offline import ptxas_report, sass_opcodes

pytest.importorskip("triton.experimental.gluon")

TRIO = "128,3,trio,permk,tarrive,mmasum"


_meta_inputs = support.gluon_meta_inputs


def test_persist_is_a_schedule_flag_with_the_same_numerics():
    config = gs.GluonConfig.parse(TRIO + ",persist")
    assert config.persist == 1 and str(config) == "WS_BN128_s3_permk_tarrive_mmasum_trio_persist"
    assert gs.GluonConfig.parse(str(config)) == config
    assert config.numerics == gs.GluonConfig.parse(TRIO).numerics and config.without_persist() == gs.TRIO_DEFAULT_CONFIG
    assert gs.kernel_meta(config, QK_KIND=0, Q_BLOCK=1, K_BLOCK=16, RETURN_LSE=0, KS_TMA=1, PERMK=1, SPLIT_TAIL=0,
                          HAS_BIAS=0, SKIP=0, SPARSE=0)["PERSIST"] == 1


def test_block_sparse_persistent_configs_have_the_sparse_tuners_numerics_and_no_tuner():
    """A persistent block-sparse config is a two-consumer config of a block-sparse tuner's numerics with ``persist``;
    forced by name it plans (tests/kernels/test_gluon_sage_launch_plan.py), and no block-sparse tuner times a persistent
    config (their GPU tests have not run: docs/kernel-design.md, "Persistent block-sparse launches")."""
    sparse = {c.numerics for c in gs.SPARSE_TUNED_CONFIGS + gs.SPARSE_KEY_ORDER_TUNED_CONFIGS}
    for config in gs.SPARSE_PERSIST_CONFIGS:
        gs.check_sparse_config(config)
        assert config.persist and config.consumers == 2 and config.without_persist().numerics in sparse
    sparse_tuners = (gs.SPARSE_TUNER, gs.SPARSE_SKIP_TUNER, gs.SPARSE_KEY_ORDER_TUNER)
    assert not any(gs.GluonConfig.parse(c).persist for tuner in sparse_tuners for c in tuner.candidates)


@pytest.mark.parametrize("tail", [None, gs.tail_split.TailPlan(ctas=96, main=60, splits=4, kv_split=1024)],
                         ids=["whole", "tail-split"])
def test_the_plan_passes_the_work_items_and_a_1d_grid(tail):
    """Offline (meta tensors: no SMs to count) a persistent plan has one CTA per work item; on a GPU
    ``min(items, SMs)`` (tests/gpu/test_gluon_sage_persist.py). The items are the non-persistent grid's CTAs: with
    a split tail its whole CTAs and pieces. ``ITEMS`` (before the three block-list arguments) is ``None`` (a
    constexpr, no argument) otherwise."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(s=4096, h=4)
    config = gs.GluonConfig.parse(TRIO + ",persist")
    ws = gs.tail_split.workspace(tail, config.rows, 128, "meta") if tail else None
    plan = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, config, tail, ws)
    items = tail.grid if tail else 4 * gs.q_blocks(4096, config)
    assert plan.grid == (items,) and plan.args[-4] == items and plan.meta["PERSIST"] == 1
    flat = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, config.without_persist(), tail, ws)
    assert flat.args[-4] is None and flat.meta["PERSIST"] == 0
    assert flat.grid == ((items,) if tail else (gs.q_blocks(4096, config), 4))


_loop_body = support.gluon_loop_body


@pytest.mark.parametrize("config,sparse", [(TRIO, False), ("128,3,ahead,permk,mmasum", False),
                                           ("128,3,ahead,permk,mmasum", True)], ids=["trio", "ahead", "ahead-sparse"])
def test_persistent_kernel_keeps_the_tile_loop(config, sparse):
    """The persistent kernel wraps the same per-item code in a loop over items: it compiles warp-specialized, its
    full tiles' loop is the non-persistent one's within 5 % of its instructions (the key tile is the visit position
    less the item's first one, no longer the position itself: 24 more of 731 in the ``ahead`` loop), with no more
    local-memory accesses; so does a block-sparse one, whose items find their own lists."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    loops, reports = {}, {}
    for text in (config, config + ",persist"):
        compiled = gs.compile_for(gs.GluonConfig.parse(text), q, qs, k, ks, v, vs, qb, kb, sparse=sparse)
        reports[text] = ptxas_report(compiled, (9, 0))
        assert reports[text]["ptxas_ok"] and "wgmma.mma_async" in compiled.asm["ptx"]
        body = _loop_body(sass_opcodes(compiled))
        loops[text] = (len(body), sum(op.startswith(("LDL", "STL")) for op in body))
    base, persist = loops[config], loops[config + ",persist"]
    assert abs(persist[0] - base[0]) <= 0.05 * base[0] and persist[1] <= base[1], (loops, reports)


def test_persist_configs_are_candidates_of_their_dense_classes_only():
    """Each persistent config is a candidate of the dense tuner of its class (the numerics of the others there), and
    of no block-sparse tuner."""
    assert gs.PERSIST_CONFIGS and set(gs.PERSIST_CONFIGS) <= set(gs.CONFIGS)
    with_persist = {tuner.kernel for tuner in gs.TUNERS
                    if any(gs.GluonConfig.parse(c).persist for c in tuner.candidates)}
    assert with_persist == {gs.TUNER.kernel, gs.KEY_ORDER_TUNER.kernel, gs.SKIP_TUNER.kernel}
