"""qattn_fx.kernels.gluon_sage without a GPU: configs, input checks, and offline compiles for sm_90.

The compiles use Triton's bundled ptxas (no GPU): they pin that every schedule builds a warp-specialized kernel
(``setmaxnreg`` in the PTX, wgmma for both products) that fits its registers without spilling. The numerics are
tested on the H200 (tests/gpu/test_gluon_sage.py).
"""

from __future__ import annotations

import re

import pytest
import torch

import support

import qattn_fx

from qattn_fx.kernels import _sage_common as common
from qattn_fx.kernels import gluon_sage as gs
from qattn_fx.kernels import triton_sage as ts
from qattn_fx.kernels._offline import sass_opcodes

pytest.importorskip("triton.experimental.gluon")


_meta_inputs = support.gluon_meta_inputs


@pytest.mark.parametrize("text,expected", [
    ("128,2", gs.GluonConfig(128, 2)),
    ("128,2,ahead", gs.GluonConfig(128, 2, ahead=1)),
    ("WS_BN128_s3_ahead_permk", gs.GluonConfig(128, 3, ahead=1, permk=1)),
    ("64,4,ahead,tarrive", gs.GluonConfig(64, 4, ahead=1, tarrive=1)),
    ("WS_BN128_s3_permk_tarrive_mmasum_trio", gs.GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1)),
])
def test_config_parse_and_str_round_trip(text, expected):
    assert gs.GluonConfig.parse(text) == expected
    assert gs.GluonConfig.parse(str(expected)) == expected


@pytest.mark.parametrize("text,message", [
    ("96,2", r"block_n=96 is invalid; valid: 64, 128"),
    ("128,5", r"stages=5 is invalid; valid: 2, 3, 4"),
    ("128", r"config '128' is invalid; valid: 'BLOCK_N,STAGES\[,ahead\]\[,permk\]\[,tarrive\]"
            r"\[,mmasum\]\[,trio\]\[,quad\]\[,persist\]\[,pair\]'"),
    ("128,3,trio,ahead", r"trio \(three consumers of 160 registers\) runs the serial schedule only; got "
                         r"WS_BN128_s3_ahead_trio; valid: 'BLOCK_N,STAGES,trio\[,permk\]\[,tarrive\]\[,mmasum\]'"),
    ("128,3,trio,quad", r"trio .* runs the serial schedule only"),
    ("128,3,quad,ahead", r"quad \(four consumers of 112 registers\) runs the serial schedule only; got "
                         r"WS_BN128_s3_ahead_quad; valid: 'BLOCK_N,STAGES,quad\[,permk\]\[,tarrive\]\[,mmasum\]'"),
    ("128,2,fast", r"config '128,2,fast' is invalid"),
    ("128,3,ahead,tree", r"config '128,3,ahead,tree' is invalid"),  # removed flags are unknown words
    ("128,3,ahead,solo", r"config '128,3,ahead,solo' is invalid"),
])
def test_bad_configs_name_the_value_and_the_choices(text, message):
    with pytest.raises(ValueError, match=message):
        gs.GluonConfig.parse(text)


def test_default_configs_and_env_override(monkeypatch):
    assert gs.current_config(128) == gs.DEFAULT_CONFIGS[128]
    with qattn_fx.config.patch(gluon_sage_config="128,3,mmasum"):  # default: $QATTN_GLUON_SAGE_CONFIG
        assert gs.current_config(64) == gs.GluonConfig(128, 3, mmasum=1)
    with gs.use_config("64,3,ahead"):
        assert gs.current_config(128) == gs.GluonConfig(64, 3, ahead=1)


def test_tuning_key_and_tuned_configs():
    q = torch.empty(2, 24, 4608, 128, dtype=torch.int8, device="meta")
    k = torch.empty(2, 24, 300, 128, dtype=torch.int8, device="meta")
    assert gs.tuning_key(q, k, 1, 16, False) == (128, "int8", 1, 16, False, 16384, 1024, 64)
    assert gs.tuning_key(q[:1, :3], k, 0, 0, True)[-1] == 4
    assert gs.TUNER.candidates == [str(c) for c in gs.TUNED_CONFIGS]
    assert gs.KEY_ORDER_TUNER.candidates == [str(c) for c in gs.KEY_ORDER_TUNED_CONFIGS]
    assert gs.QUAD_TUNER.candidates == [str(c) for c in gs.QUAD_TUNED_CONFIGS]
    # every tuned config is also GPU-tested (the quad ones at head_dim 64: tests/gpu/test_gluon_sage.py)
    assert set(gs.TUNED_CONFIGS) | set(gs.KEY_ORDER_TUNED_CONFIGS) <= set(gs.CONFIGS)
    assert gs.TUNER.default((64,)) == gs.TUNER.default((128,)) == str(gs.TRIO_DEFAULT_CONFIG)
    assert gs.QUAD_TUNER.default((64,)) == str(gs.DEFAULT_CONFIGS[64]) and gs.DEFAULT_CONFIGS[64].quad


def test_each_tuner_chooses_among_configs_of_one_numerics_with_its_default():
    """The output never depends on the timing or the tuning cache: a tuner's candidates and its untuned default
    share :attr:`GluonConfig.numerics` (key tile, permk, mmasum, CTA rows)."""
    for tuner in gs.TUNERS:
        configs = tuner.candidates + [tuner.default((64,)), tuner.default((128,))]
        classes = {gs.GluonConfig.parse(c).numerics for c in configs}
        assert len(classes) == 1, (tuner.kernel, classes)
    assert gs.DEFAULT_CONFIGS == {128: gs.TRIO_DEFAULT_CONFIG, 64: gs.QUAD_TUNED_CONFIGS[0]}
    assert all(c.permk and c.trio for c in gs.TUNED_CONFIGS)
    assert all(c.permk and c.quad for c in gs.QUAD_TUNED_CONFIGS)
    assert not any(c.permk or c.trio for c in gs.KEY_ORDER_TUNED_CONFIGS)


@pytest.mark.parametrize("case,tuner", [("int8-k16", "TUNER"), ("fp8-k16", "TUNER"), ("int8-tensor", "TUNER"),
                                        ("int8-k1", "KEY_ORDER_TUNER"), ("int8-k4", "KEY_ORDER_TUNER"),
                                        ("bf16", "KEY_ORDER_TUNER"), ("key-bias", "TUNER"),
                                        ("key-bias-k1", "KEY_ORDER_TUNER"), ("skip", "SKIP_TUNER"),
                                        ("skip-key-bias", "SKIP_KEY_ORDER_TUNER"), ("int8-k16-d64", "QUAD_TUNER"),
                                        ("fp8-k16-d64", "QUAD_TUNER"), ("key-bias-d64", "TUNER"),
                                        ("skip-d64", "SKIP_TUNER"), ("int8-k1-d64", "KEY_ORDER_TUNER")])
def test_the_launch_class_follows_from_the_inputs(case, tuner):
    """K that the ``permk`` view takes (8-bit, scales per 16 keys or coarser) goes to :data:`TUNER`, with or
    without a key bias (at head_dim 64 without one: :data:`QUAD_TUNER`); everything else loads K in key order
    (:data:`KEY_ORDER_TUNER`). Skip-Softmax launches with a key bias load K in key order too (``trio`` spills with
    both)."""
    d = 64 if case.endswith("-d64") else 128
    case = case.removesuffix("-d64")
    qk = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}.get(case.split("-")[0], torch.int8)
    k_block = {"k1": 1, "k4": 4}.get(case.split("-")[-1], 16)
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(d=d, qk=qk, k_block=k_block)
    if case == "int8-tensor":
        ks = torch.empty(1, 1, 1, device="meta")
    if case == "bf16":
        ks = None
    bias = torch.empty(1, k.shape[2], device="meta") if "key-bias" in case else None
    assert gs.tuner_for(k, ks, kb, bias, case.startswith("skip")) is getattr(gs, tuner)


def test_cpu_tensors_are_refused_with_the_reason():
    q, qs, k, ks, v, vs, qb, kb = (torch.empty_like(x, device="cpu") if isinstance(x, torch.Tensor) else x
                                   for x in _meta_inputs(s=64))
    v = torch.empty(1, 4, 128, 64, dtype=torch.float8_e4m3fn).transpose(-1, -2)  # sequence-major, as on the GPU
    with pytest.raises(RuntimeError, match=r"gluon_sage: needs an sm_90 \(Hopper\) GPU; got cpu"):
        gs.attention(q, qs, k, ks, v, vs, qb, kb, 0.1, torch.bfloat16)


def test_tma_alignment_rule():
    q, _, _, _, v, _, _, _ = _meta_inputs(s=64)
    assert gs.tma_aligned(q, (0, 1, 2)) and gs.tma_aligned(v, (0, 1, 3))
    odd = torch.empty(1, 64, 4, 72, dtype=torch.int8, device="meta")[..., :64].transpose(1, 2)  # 72-byte pitch
    assert not gs.tma_aligned(odd, (0, 1, 2))


@pytest.mark.parametrize("config,d,qk,blocks", [
    ("128,2,ahead", 128, torch.int8, (1, 16)),
    ("128,2,ahead", 128, torch.int8, (1, 1)),
    ("128,3,ahead,tarrive", 128, torch.int8, (1, 16)),
    ("128,2", 128, torch.int8, (1, 16)),
    ("128,3,ahead", 128, torch.float8_e4m3fn, (1, 16)),
    ("128,2,ahead,permk", 128, torch.int8, (1, 16)),
    ("128,2,ahead", 64, torch.bfloat16, (0, 0)),
])
def test_offline_compile_is_warp_specialized_without_spills(config, d, qk, blocks):
    q, qs, k, ks, v, vs, _, _ = _meta_inputs(d=d, qk=qk, q_block=max(blocks[0], 1), k_block=max(blocks[1], 1))
    if qk == torch.bfloat16:
        qs = ks = None
    compiled = gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, *blocks)
    ptx = compiled.asm["ptx"]
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx), "consumers not given 240 registers"
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx), "producer not reduced to 24 registers"
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    # per-column / per-group K scales come with the K tile (a 1-D TMA box), not as global loads
    assert ("cp.async.bulk.tensor.1d" in ptx) == (ks is not None)
    report = ts.ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] == 0, report


@pytest.mark.parametrize("k_block,shape,expected", [
    (16, (2, 4, 300), 32), (1, (2, 4, 4800), 128), (4, (2, 4, 1200), 32),  # boxes padded to >= 128 bytes
    (16, (2, 4, 94), None),  # a head's scales start off 16 bytes: loads
    (64, (2, 4, 76), None), (48, (2, 4, 100), None), (128, (2, 4, 38), None),  # < 4 groups, not a group: loads
])
def test_k_scale_box(k_block, shape, expected):
    assert gs.k_scale_box(torch.ones(shape), k_block, 128) == expected


def test_k_scale_box_needs_unit_token_stride_and_aligned_base():
    ks = torch.ones(2, 4, 300)
    assert gs.k_scale_box(ks.transpose(1, 2).contiguous().transpose(1, 2), 16, 128) is None
    assert gs.k_scale_box(torch.ones(2, 4, 301)[..., 1:], 16, 128) is None
    assert gs.k_scale_box(torch.ones(1, 1, 300).expand(2, 4, 300), 16, 128) == 32  # broadcast heads: flat offsets
    assert gs.k_scale_box(None, 16, 128) is None


def _key_of_row(rows: int) -> torch.Tensor:
    """Key held by each row of a permuted K tile: row ``16g + 8i + 2c + e`` holds key ``16g + 4c + 2i + e``."""
    r = torch.arange(rows)
    g, i, c, e = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
    return 16 * g + 4 * c + 2 * i + e


@pytest.mark.parametrize("layout,b,skv", [("bshd", 1, 300), ("bshd", 2, 320), ("bhsd", 2, 320), ("bhsd", 1, 208)])
def test_permuted_k_view_rows_hold_the_permuted_keys(layout, b, skv):
    """The 5-D TMA view of K: read in box order, every 16-key group's rows hold its keys in the order that makes
    the Q·Kᵀ accumulator the FP8 P·V wgmma's A operand (gluon_sage.permk). Checked on real CPU data, batch and
    heads folded as the producer's coordinates fold them."""
    h, d = 3, 64
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(-100, 100, (b, skv, h, d) if layout == "bshd" else (b, h, skv, d), generator=gen,
                         dtype=torch.int8)
    k = data.transpose(1, 2) if layout == "bshd" else data
    desc, x_per_head, g_per_batch, g_per_head = gs.permuted_k(k, 16, 128)
    view = desc.base  # (groups, 2, 4, 2, inner), read row-major = the order TMA writes the box
    full = (skv // 16) * 16
    keys = _key_of_row(full)
    for bb in range(b):
        for hh in range(h):
            g0 = bb * g_per_batch + hh * g_per_head
            x0 = hh * x_per_head
            rows = view[g0:g0 + skv // 16].reshape(full, -1)[:, x0:x0 + d]
            torch.testing.assert_close(rows, k[bb, hh, keys], rtol=0, atol=0)


@pytest.mark.parametrize("case,why", [
    (dict(k_block=1), "per-key scales"), (dict(k_block=4), "scales per 4 keys"),
    (dict(dtype=torch.bfloat16), "16-bit K"), (dict(b=2, skv=300), "batches folded, Skv % 16 != 0"),
    (dict(bhsd=True, skv=300), "heads folded, Skv % 16 != 0"),
])
def test_permuted_k_is_refused_where_the_view_cannot_hold(case, why):
    b, skv, dtype = case.get("b", 1), case.get("skv", 320), case.get("dtype", torch.int8)
    if case.get("bhsd"):
        k = torch.zeros(b, 4, skv, 64, dtype=dtype)
    else:
        k = torch.zeros(b, skv, 4, 64, dtype=dtype).transpose(1, 2)
    k_block = case.get("k_block", 16)
    assert gs.permuted_k(k, k_block, 128) is None, why


def test_permuted_k_compiles_to_a_5d_tma_without_shuffles():
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    plain = gs.compile_for(gs.GluonConfig.parse("128,3,ahead"), q, qs, k, ks, v, vs, qb, kb)
    permuted = gs.compile_for(gs.GluonConfig.parse("128,3,ahead,permk"), q, qs, k, ks, v, vs, qb, kb)
    assert "cp.async.bulk.tensor.5d" in permuted.asm["ptx"] and "cp.async.bulk.tensor.5d" not in plain.asm["ptx"]
    assert ts.ptxas_report(permuted, (9, 0))["spill_stores"] == 0
    # only the peeled last tile still converts P with shuffles (the loop's tiles have none)
    assert permuted.asm["ptx"].count("shfl.sync.idx") < plain.asm["ptx"].count("shfl.sync.idx")


def test_permuted_k_and_p_relabeling_compose_to_keys_in_operand_order():
    """With K rows permuted (``_key_of_row``), the accumulator's column ``X`` holds key ``_key_of_row(X)``; the
    kernel's relabeling of P (``_pv_issue`` with ``PERMK``: reshape to (64, BN/32, 2, 2, 4, 2), swap the two middle
    dims, reshape back) must then put key ``k`` at operand position ``k``, so P·V needs V in its stored order."""
    bn = 128
    p_true = torch.arange(64 * bn, dtype=torch.float32).reshape(64, bn)  # distinct values: column k is key k
    accumulator = p_true[:, _key_of_row(bn)]
    operand = accumulator.reshape(64, bn // 32, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(64, bn)
    torch.testing.assert_close(operand, p_true, rtol=0, atol=0)


def test_thread_arrive_replaces_the_warpgroup_barrier():
    """``tarrive``: the slot release is every thread's own ``cp.async.mbarrier.arrive.noinc`` (barrier count 128 per
    consumer), so the warpgroup ``bar.sync`` Gluon puts before its one-thread arrive is gone from each release."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    plain = gs.compile_for(gs.GluonConfig.parse("128,3,ahead"), q, qs, k, ks, v, vs, qb, kb).asm["ptx"]
    per_thread = gs.compile_for(gs.GluonConfig.parse("128,3,ahead,tarrive"), q, qs, k, ks, v, vs, qb, kb).asm["ptx"]
    assert "cp.async.mbarrier.arrive.noinc" in per_thread and "cp.async.mbarrier.arrive" not in plain
    assert per_thread.count("bar.sync \t2, 128") < plain.count("bar.sync \t2, 128")


@pytest.mark.parametrize("config", ["128,3,ahead,permk,mmasum", "128,2,mmasum"])
def test_mmasum_takes_the_row_sum_from_a_second_wgmma(config):
    """``mmasum``: a second FP8 wgmma per tile (``P8 · 1``, an n8 accumulator) replaces the fp32 row sum: twice
    the FP8 (QGMMA) instructions, and the ~64 FADDs per tile and consumer are gone; no spills."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    plain = gs.compile_for(gs.GluonConfig.parse(config.replace(",mmasum", "")), q, qs, k, ks, v, vs, qb, kb)
    summed = gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, qb, kb)
    assert re.search(r"wgmma\.mma_async\.sp?\S*\.m64n8k32\.f32\.e4m3\.e4m3", summed.asm["ptx"])
    assert "m64n8k32" not in plain.asm["ptx"]
    assert summed.asm["ptx"].count("add.f32") < plain.asm["ptx"].count("add.f32") - 100
    report = ts.ptxas_report(summed, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] == 0, report


_loop_body = support.gluon_loop_body


@pytest.mark.parametrize("config", ["128,3,trio,permk,tarrive", "128,3,trio,permk"])
def test_trio_runs_three_consumers_in_160_registers(config):
    """``trio``: three consumer warpgroups (192 query rows) and the padded producer, 512 threads launched at 128
    registers; ``setmaxnreg`` gives the two worker consumers 160. The full tiles' loop (:func:`_loop_body`)
    touches no local memory; ptxas keeps one value on the stack outside it (<= 16 bytes).
    Without ``permk`` (P's layout conversion before P·V) it spills in the loop (84 bytes): those trio configs are
    GPU-tested, not tuned."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    cfg = gs.GluonConfig.parse(config)
    assert cfg.consumers == 3
    plan = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, cfg)
    grid, meta = plan.grid, plan.meta
    assert grid[0] == -(-q.shape[2] // 192) and meta["CONSUMER_NREG"] == gs.TRIO_CONSUMER_REGS == 160
    compiled = gs.compile_for(cfg, q, qs, k, ks, v, vs, qb, kb)
    ptx = compiled.asm["ptx"]
    assert re.search(r"\.maxnreg\s+128\b", ptx) and re.search(r"\.reqntid\s+512\b", ptx)
    assert len(re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;", ptx)) == 2
    report = ts.ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] <= 16, report
    assert not [op for op in _loop_body(sass_opcodes(compiled)) if op.startswith(("STL", "LDL"))]


def _loop_ops(config: str) -> list[str]:
    """:func:`_loop_body` of ``config`` compiled for the default meta inputs."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    return _loop_body(sass_opcodes(gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, qb, kb)))


def test_trio_mmasum_trades_a_few_spills_for_fewer_instructions():
    """``trio,mmasum``: the ones-MMA does not fit 160 registers without spilling (offline: ~150 bytes, a few
    local-memory accesses per tile), but it takes ~50 instructions out of each tile's ~555 — and measured 5-7 %
    faster than ``trio`` without it on the H200 (docs/kernel-profile.md, "Tuning: gluon_sage's default config")."""
    plain = _loop_ops("128,3,trio,permk,tarrive")
    summed = _loop_ops("128,3,trio,permk,tarrive,mmasum")
    assert len(summed) <= len(plain) - 40, (len(summed), len(plain))
    assert sum(op.startswith(("STL", "LDL")) for op in summed) <= 4


@pytest.mark.parametrize("config,d", [("128,3,trio,permk,tarrive,mmasum", 128), ("128,3,tarrive,mmasum", 128),
                                      ("128,4,permk,tarrive,mmasum,quad", 64)])
def test_tarrive_mmasum_loop_has_no_warpgroup_barrier(config, d):
    """With ``tarrive`` (no ``bar.sync`` before the slot release) the serial full tiles' loop synchronizes its
    warpgroup only through the wgmma instructions themselves: ``_fill_ones`` synchronizes once per CTA, so Triton's
    barrier analysis puts no ``bar.sync`` before each ones-MMA (``mmasum``)."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(d=d)
    body = _loop_body(sass_opcodes(gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, qb, kb)))
    assert any(op.startswith("QGMMA.64x8x32") for op in body)  # the ones-MMA is in the loop
    assert not [op for op in body if op.startswith("BAR")]


@pytest.mark.parametrize("config", ["128,3,trio,permk,tarrive,mmasum", "128,3,ahead,permk", "128,2,mmasum"])
def test_split_tail_launch_compiles_with_the_same_loop(config):
    """A tail-split launch (:mod:`qattn_fx.kernels.gluon_sage.tail_split`): a 1-D grid of ``main + tail · splits``
    CTAs, the ``SPLIT_TAIL`` kernel, whose full tiles' loop is no longer than the unsplit kernel's (but for a few
    instructions: the piece's key offset lives outside it; ptxas schedules the two a little differently, the
    ``ahead`` loops came out 11-22 instructions shorter) and has no more local-memory accesses."""
    from qattn_fx.kernels.gluon_sage import tail_split as _tail_split

    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    cfg = gs.GluonConfig.parse(config)
    tail = _tail_split.TailPlan(ctas=100, main=60, splits=4, kv_split=1024)
    ws = _tail_split.workspace(tail, cfg.rows, 128, "meta")
    plan = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, cfg, tail, ws)
    grid, meta = plan.grid, plan.meta
    assert grid == (60 + 40 * 4,) and meta["SPLIT_TAIL"] == 1
    loops = {}
    for plan in (None, tail):
        body = _loop_body(sass_opcodes(gs.compile_for(cfg, q, qs, k, ks, v, vs, qb, kb, tail=plan)))
        loops[plan] = (len(body), sum(op.startswith(("LDL", "STL")) for op in body))
    assert loops[tail][0] <= loops[None][0] + 8 and loops[tail][1] <= loops[None][1], loops


@pytest.mark.parametrize("config", [str(c) for c in gs.KEY_ORDER_TUNED_CONFIGS])
@pytest.mark.parametrize("d", [128, 64])
def test_key_order_key_bias_launches_compile_without_spills(config, d):
    """A key bias (masks) is loaded per tile at use (``HAS_BIAS``); with K the ``permk`` view cannot take (scales
    per key here) the launch reads K in key order and is tuned over configs that keep their registers."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(d=d, k_block=1)
    cfg = gs.GluonConfig.parse(config)
    bias = torch.empty(1, k.shape[2], device="meta")
    plan = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, cfg, key_bias=bias,
                          key_range=common.bias_range(bias))
    assert plan.meta["HAS_BIAS"] == 1 and plan.meta["PERMK"] == 0 and not plan.permuted_k
    compiled = gs.compile_for(cfg, q, qs, k, ks, v, vs, qb, kb, key_bias=bias)
    report = ts.ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] <= 80, report
    assert gs.tuner_for(k, ks, kb, bias) is gs.KEY_ORDER_TUNER


def test_permk_key_bias_launches_keep_the_plain_loop_in_registers():
    """With K the ``permk`` view takes, a key-bias launch is in the ``trio`` class: the bias is loaded in the
    permuted key order (a relabeling of registers, checked by ``assert_trivial`` at compile time), and only the
    tiles the bias's nonzero span meets run the loop with it; the loop without it (the first one in the SASS)
    touches local memory at most 8 times (``trio`` spills in the biased loop and the last tile)."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    cfg = gs.DEFAULT_CONFIGS[128]
    bias = torch.empty(1, k.shape[2], device="meta")
    plan = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, cfg, key_bias=bias,
                          key_range=common.bias_range(bias))
    assert plan.meta["HAS_BIAS"] == 1 and plan.meta["PERMK"] == 1 and plan.permuted_k
    assert gs.tuner_for(k, ks, kb, bias) is gs.TUNER
    body = _loop_body(sass_opcodes(gs.compile_for(cfg, q, qs, k, ks, v, vs, qb, kb, key_bias=bias)))
    assert sum(op.startswith(("LDL", "STL")) for op in body) <= 8


# ----------------------------------------------------------------------------------------------------------------
# Skip-Softmax (the tile test in the serial consumer loop)
# ----------------------------------------------------------------------------------------------------------------


def test_skip_launches_have_tuners_of_their_own_whose_bits_agree():
    """Each Skip-Softmax tuner's candidates share their numerics and are serial (the test needs it)."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    assert gs.tuner_for(k, ks, kb, None, skip=True) is gs.SKIP_TUNER
    bias = torch.empty(1, k.shape[2], device="meta")
    assert gs.tuner_for(k, ks, kb, bias, skip=True) is gs.SKIP_KEY_ORDER_TUNER
    for tuner in (gs.SKIP_TUNER, gs.SKIP_KEY_ORDER_TUNER):
        configs = [gs.GluonConfig.parse(c) for c in tuner.candidates]
        assert len({c.numerics for c in configs}) == 1 and not any(c.ahead for c in configs)
    assert gs.tuning_key(q, k, 1, 16, False, skip=True)[-1] == "skip"


@pytest.mark.parametrize("config", ["128,3,ahead,mmasum", "64,3,mmasum", "128,4,quad,permk,mmasum"])
def test_skip_refuses_configs_without_its_schedule_or_tile(config):
    with pytest.raises(ValueError, match=rf"gluon_sage config {gs.GluonConfig.parse(config)} cannot run "
                                         r"Skip-Softmax; valid: serial schedules with 128-key tiles"):
        gs.check_skip_config(gs.GluonConfig.parse(config))


@pytest.mark.parametrize("config,qk,blocks", [("128,3,permk,mmasum", torch.int8, (1, 16)),
                                              ("128,3,mmasum", torch.int8, (1, 4)),
                                              ("128,3,tarrive,mmasum", torch.bfloat16, (0, 0))])
def test_skip_compiles_without_spills_in_two_consumer_configs(config, qk, blocks):
    """The test adds a warpgroup-wide min (shared memory, named barriers of 128 threads) and a branch around the
    step; the two-consumer serial configs keep 0 spills with it, counting included."""
    q, qs, k, ks, v, vs, _, _ = _meta_inputs(qk=qk, q_block=max(blocks[0], 1), k_block=max(blocks[1], 1))
    if qk == torch.bfloat16:
        qs = ks = None
    for skip in (1, 2):
        compiled = gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, *blocks, skip=skip)
        ptx = compiled.asm["ptx"]
        assert re.search(r"bar\.sync\s+\d+,\s*128;", ptx) and ("atom.global" in ptx) == (skip == 2)
        report = ts.ptxas_report(compiled, (9, 0))
        assert report["ptxas_ok"] and report["spill_stores"] == 0, report


@pytest.mark.parametrize("config,spill_bound", [("128,3,trio,permk,tarrive,mmasum", 512), ("128,3,permk,mmasum", 0)])
def test_skip_kernels_hold_the_loop_without_the_test_for_a_zero_threshold(config, spill_bound):
    """λ = 0 (log2 λ = -inf) can skip nothing, so a Skip-Softmax kernel branches once per warpgroup to the key loop
    and epilogue without the test (the test costs 11-13 % on the H200): it holds both loops, twice the plain
    kernel's wgmma, and each branch has its own epilogue, which keeps trio's spills to a few hundred bytes (one join
    after both loops spilled 1516)."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    plain, skip = (gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, qb, kb, skip=s) for s in (0, 1))
    count = [c.asm["ptx"].count("wgmma.mma_async") for c in (plain, skip)]
    assert count[1] == 2 * count[0], count
    report = ts.ptxas_report(skip, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] <= spill_bound, report


def test_skip_launches_refuse_the_tail_split():
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs()
    tail = gs.tail_split.TailPlan(main=1, ctas=2, splits=2, kv_split=2048)
    skip = (torch.empty(1, device="meta"), None)
    with pytest.raises(ValueError, match="Skip-Softmax launches run without the tail split"):
        gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, gs.DEFAULT_CONFIGS[128], tail, None,
                       None, skip)


@pytest.mark.parametrize("config", ["128,3,trio,permk,tarrive,mmasum", "128,3,ahead,mmasum"])
def test_q_quantized_in_the_kernel_compiles_without_the_q_load(config):
    """A bf16 Q with int8 K: the consumers read Q by pointer and quantize it with IEEE divisions (``div.rn``); the
    producer issues no Q TMA; registers as with an int8 Q (spills no more than it)."""
    q, qs, k, ks, v, vs, _, _ = _meta_inputs()
    cfg = gs.GluonConfig.parse(config)
    int8_q = gs.compile_for(cfg, q, qs, k, ks, v, vs, 1, 16)
    bf16_q = gs.compile_for(cfg, q.to(torch.bfloat16), None, k, ks, v, vs, 1, 16)
    tma_4d = [c.asm["ptx"].count("cp.async.bulk.tensor.4d") for c in (int8_q, bf16_q)]
    assert tma_4d[0] - tma_4d[1] == cfg.consumers, tma_4d  # one Q box load per consumer is gone
    assert "div.rn.f32" in bf16_q.asm["ptx"] and "div.rn.f32" not in int8_q.asm["ptx"]
    reports = [ts.ptxas_report(c, (9, 0)) for c in (int8_q, bf16_q)]
    assert reports[1]["ptxas_ok"] and reports[1]["spill_stores"] <= reports[0]["spill_stores"], reports


# ----------------------------------------------------------------------------------------------------------------
# quad (four consumers at head_dim 64)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,bias,message", [
    (128, False, r"head_dim 64 without a key bias; got head_dim 128; valid there: e\.g\. "
                 r"'WS_BN128_s3_permk_tarrive_mmasum_trio'"),
    (64, True, r"head_dim 64 without a key bias; got head_dim 64 with a key bias"),
])
def test_quad_runs_head_dim_64_without_a_key_bias(d, bias, message):
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(d=d)
    key_bias = torch.empty(1, k.shape[2], device="meta") if bias else None
    key_range = torch.empty(1, 2, dtype=torch.int32, device="meta") if bias else None
    with pytest.raises(ValueError, match=rf"gluon_sage config {gs.QUAD_TUNED_CONFIGS[0]} \(four consumers of "
                                         r"112 registers\) runs " + message):
        gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.125, q, None, False, gs.QUAD_TUNED_CONFIGS[0], None, None,
                       key_bias, None, key_range)


@pytest.mark.parametrize("config", [str(c) for c in gs.QUAD_TUNED_CONFIGS])
def test_quad_compiles_with_four_consumers_and_few_spills(config):
    """Four consumer warpgroups of 112 registers (consumer 0: 120) and the producer's 24 in a CTA launched at 96
    registers per thread; at head_dim 64 ptxas spills ~200 bytes (a key bias: 1.8 KB, hence its refusal)."""
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(d=64)
    compiled = gs.compile_for(gs.GluonConfig.parse(config), q, qs, k, ks, v, vs, qb, kb)
    ptx = compiled.asm["ptx"]
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t112") == 3 and "setmaxnreg.dec.sync.aligned.u32 \t120" in ptx
    assert compiled.metadata.num_warps == 20  # (4 + 4 + 4 + 4 + the padded producer: 5 warpgroups)
    report = ts.ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] <= 256, report

