"""gluon_sage's ``pair`` schedule without a GPU: the config and its refusals, the emulation that defines its numerics
(consecutive visited key tiles in online-softmax steps of two) and offline sm_90 compiles. The kernel against the
emulation: tests/gpu/test_gluon_sage_pair.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import support

from qattn_fx import block_sparse
from qattn_fx.kernels import emulation
from qattn_fx.kernels import gluon_sage as gs

PAIR = "128,3,permk,mmasum,pair"
FP8 = torch.float8_e4m3fn
LOG2_448 = math.log2(448.0)


def test_pair_is_a_serial_two_consumer_flag_with_numerics_of_its_own():
    config = gs.GluonConfig.parse(PAIR)
    assert config.pair == 1 and config.consumers == 2 and config.softmax_keys == 256
    assert gs.GluonConfig.parse(str(config)) == config
    plain = gs.GluonConfig.parse("128,3,permk,mmasum")
    assert plain.softmax_keys == 128 and config.numerics != plain.numerics
    assert gs.kernel_meta(config, QK_KIND=0, Q_BLOCK=1, K_BLOCK=16, RETURN_LSE=0, KS_TMA=1, PERMK=1, SPLIT_TAIL=0,
                          HAS_BIAS=0, SKIP=0, SPARSE=0)["PAIR"] == 1
    gs.check_sparse_config(config)  # (block-sparse launches may run it, forced by name)


@pytest.mark.parametrize("text", ["128,3,ahead,mmasum,pair", "128,3,trio,permk,mmasum,pair", "128,3,permk,pair",
                                  "64,3,mmasum,pair", "128,2,quad,permk,mmasum,pair"])
def test_pair_refuses_other_schedules_naming_the_valid_form(text):
    with pytest.raises(ValueError, match=r"pair .* runs the serial two-consumer schedule with mmasum and 128-key "
                                         r"tiles; got .*; valid: '128,STAGES,mmasum,pair"):
        gs.GluonConfig.parse(text)


@pytest.mark.parametrize("bias,skip", [(True, False), (False, True)])
def test_pair_launches_refuse_key_bias_and_skip_softmax(bias, skip):
    with pytest.raises(ValueError, match=r"\(pair\) runs launches without a key bias and without Skip-Softmax; got "
                                         r"one with .*valid there: the same config without 'pair', e\.g\. "
                                         r"'WS_BN128_s3_permk_mmasum'"):
        gs.check_pair_config(gs.GluonConfig.parse(PAIR), bias, skip)
    gs.check_pair_config(gs.GluonConfig.parse("128,3,permk,mmasum"), bias, skip)


def _args(sq=300, skv=700, d=64, seed=0, qk="int8"):
    q, k, v = support.make_qkv(b=1, hq=2, hkv=1, sq=sq, skv=skv, d=d, seed=seed)
    return support.quantize(q, k, v, qk, 1, 16)


def _pairs_by_row(args, sm_scale, visit):
    """The pair steps row by row, a loop per row over its visited tiles (``visit (B, H, NQ, NK)``): the rule
    :func:`emulation.emulate` vectorizes."""
    q, q_scale, k, k_scale, v, v_scale = args[:6]
    b, hq, sq, _ = q.shape
    skv = k.shape[2]
    g = hq // k.shape[1]
    out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            for r in range(sq):
                tiles = [j for j in range(visit.shape[-1]) if visit[bi, h, r // 128, j]]
                if not tiles:
                    continue
                s = (q[bi, h, r].double() @ k[bi, h // g].double().T).to(torch.int32)
                t_all = (s + emulation.INT8_ACC_BITS).view(torch.float32)
                ks = k_scale[bi, h // g].float()[torch.arange(skv) // 16]
                ks = (ks.view(torch.int32) & -4).view(torch.float32)
                t_all = (t_all - emulation.INT8_ACC_OFFSET) * ks
                rs = q_scale[bi, h, r].float() * torch.tensor(sm_scale * emulation.LOG2E, dtype=torch.float32)
                m, l, acc = torch.tensor(-math.inf), torch.tensor(0.0), torch.zeros(v.shape[-1], dtype=torch.float64)
                for step in range(0, len(tiles), 2):
                    keys = [torch.arange(j * 128, min(j * 128 + 128, skv)) for j in tiles[step:step + 2]]
                    m_new = torch.maximum(m, max(t_all[n].amax() * rs for n in keys))
                    alpha = torch.exp2(m - m_new)
                    ps = [torch.exp2(t_all[n] * rs - (m_new - LOG2_448)).to(FP8) for n in keys]
                    total = ps[0].float().sum()
                    if len(ps) == 2:
                        total = total + ps[1].float().sum()
                    l = l * alpha + total
                    acc = acc * alpha.double() + sum(p.double() @ v[bi, h // g, n].double() for p, n in zip(ps, keys))
                    m = m_new
                out[bi, h, r] = acc / l.double() * v_scale[bi, h // g].double()
    return out


@settings(max_examples=6, deadline=None)
@given(sq=st.integers(1, 260), skv=st.integers(1, 900), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_pair_emulation_steps_over_each_rows_visited_tiles_in_twos(sq, skv, density, seed):
    """Per row, its visited tiles in order make steps of two (the last alone when odd): one max, one rescale,
    ``l·alpha + (ΣP0 + ΣP1)``; rows visiting nothing give 0."""
    args = _args(sq=sq, skv=skv, seed=seed)
    nq, nk = block_sparse.tiles(sq, skv)
    gen = torch.Generator().manual_seed(seed)
    visit = torch.rand(1, 2, nq, nk, generator=gen) < density
    index, count = block_sparse.from_mask(visit)
    got = emulation.emulate(*args, 0.125, 128, True, block_index=index, block_count=count, pair=True)
    want = _pairs_by_row(args, 0.125, visit)
    # (fp32 sums in another order may flip a rare e4m3 rounding: ~1e-5; a wrong step structure moves ~1e-2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_pair_emulation_of_one_tile_and_of_every_block_listed():
    """One key tile is a single step either way (the same bits as without ``pair``); every block listed gives the
    dense pair launch's bits."""
    args = _args(skv=100)
    assert torch.equal(emulation.emulate(*args, 0.125, 128, True, pair=True),
                       emulation.emulate(*args, 0.125, 128, True))
    args = _args()
    index, count = block_sparse.dense(1, 2, 300, 700, "cpu")
    assert torch.equal(emulation.emulate(*args, 0.125, 128, True, block_index=index, block_count=count, pair=True),
                       emulation.emulate(*args, 0.125, 128, True, pair=True))


def test_pair_emulation_is_launched_by_the_config_and_refuses_what_pair_does_not_run():
    args = _args()
    config = gs.GluonConfig.parse(PAIR)
    assert torch.equal(emulation.emulate_launched(*args, 0.125, config, None),
                       emulation.emulate(*args, 0.125, 128, True, pair=True))
    with pytest.raises(ValueError, match="pair steps are emulated with mmasum"):
        emulation.emulate(*args, 0.125, 128, False, pair=True)
    with pytest.raises(ValueError, match="pair steps are emulated with mmasum"):
        emulation.emulate(*args, 0.125, 128, True, pair=True, key_bias=torch.zeros(1, 700))


@pytest.mark.parametrize("config,options", [
    (PAIR, {}), ("128,3,permk,tarrive,mmasum,pair", dict(sparse=True)),
    ("128,4,permk,tarrive,mmasum,pair", dict(sparse=True, tail=True, lse=True)), ("128,3,mmasum,pair", dict(k_block=1)),
    ("128,3,permk,mmasum,pair,persist", dict(sparse=True)), (PAIR, dict(qk="bf16q")),
], ids=["dense", "sparse", "sparse-tail-lse", "key-order", "sparse-persist", "q-in-kernel"])
def test_pair_kernels_compile_for_sm90(config, options):
    pytest.importorskip("triton.experimental.gluon")
    from qattn_fx.kernels._offline import ptxas_report  # noqa: PLC0415

    from .test_gluon_sage_sparse_offline import _compile  # noqa: PLC0415
    compiled = _compile(config, qk=options.get("qk", "int8"), k_block=options.get("k_block", 16),
                        lse=options.get("lse", False), tail=options.get("tail", False),
                        sparse=options.get("sparse", False))
    report = ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and compiled.asm["ptx"].count("wgmma.mma_async") >= 4, report
