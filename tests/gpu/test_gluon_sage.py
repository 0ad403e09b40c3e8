"""qattn_fx.kernels.gluon_sage (warp-specialized Hopper kernel) on a real sm_90 GPU.

Run: ``pytest -m gpu tests/gpu/test_gluon_sage.py -v -s``. The kernel runs triton_sage's tile algorithm with a
different schedule, so it is pinned the same ways: against a torch emulation of the tile loop (fp32 level, Hopper
FP8-MMA precision) and against the reference op (the recipe's definition) on identical quantized inputs.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import support
from support import emulate, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

triton = pytest.importorskip("triton")

import qattn_fx  # noqa: E402
import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx.kernels import gluon_sage as gs  # noqa: E402
from qattn_fx.kernels import emulation, reference  # noqa: E402

DEV = "cuda"
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != gs.CAPABILITY,
    reason="gluon_sage needs sm_90")

make_qkv = functools.partial(support.make_qkv, hq=8, hkv=4, sq=1000, skv=1500, d=128, device=DEV)
assert_close_to_reference = functools.partial(support.assert_close_to_reference, name="gluon_sage")
assert_fp32_level = functools.partial(support.assert_fp32_level, name="gluon_sage")


def emulate_launched(args, sm_scale, config, tail, return_lse=False):
    """The emulated tile loop as the kernel ran it (with its tail split, if any: :func:`emulation.emulate_launched`)."""
    return emulation.emulate_launched(*args, sm_scale, config, tail, return_lse=return_lse)


def check(args, what, sm_scale=None, out_dtype=torch.float32, config=None):
    """Run the kernel; assert fp32-level agreement with the emulated tile loop (as launched: with its tail split,
    if any) and closeness to the reference."""
    config = config or gs.current_config(args[0].shape[-1])
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(args[0].shape[-1])
    with gs.use_config(config):
        out = gs.scaled_attention(*args, sm_scale, out_dtype)
    fp8_qk = args[0].dtype == torch.float8_e4m3fn
    tail = gs.last_tail_plan()
    assert_fp32_level(out.float(), emulate_launched(args, sm_scale, config, tail),
                      f"{config} {what} vs emulation{f' ({tail})' if tail else ''}", fp8_qk=fp8_qk)
    assert_close_to_reference(out.float(), reference.scaled_attention(*args, sm_scale, torch.float32),
                              f"{config} {what}")
    return out


RECIPES = [("int8", (1, 16)), ("int8", (1, 1)), ("int8", (16, 1)), ("int8", (64, 128)), ("int8", (128, 32)),
           ("int8", (1, 64)), ("int8", (1, 4)), ("int8", (1, 48)), ("int8", (0, 0)), ("fp8", (1, 16)),
           ("fp8", (0, 0)), ("bf16", (0, 0)), ("fp16", (0, 0))]


@needs_sm90
@pytest.mark.parametrize("qk,blocks", RECIPES, ids=[f"{q}-q{b[0]}k{b[1]}" for q, b in RECIPES])
def test_recipes(qk, blocks):
    dtype = torch.float16 if qk == "fp16" else torch.bfloat16
    check(quantize(*make_qkv(dtype=dtype), qk, *blocks), f"{qk} {blocks}")


@needs_sm90
@pytest.mark.parametrize("k_block,skv", [(16, 1472), (4, 1472), (1, 1500), (32, 1536)])
def test_k_scales_by_tma(k_block, skv):
    """Per-column / per-group K scales on the K tile's TMA (aligned heads; a partial last tile reads zeros)."""
    args = quantize(*make_qkv(skv=skv), "int8", 1, k_block)
    assert gs.k_scale_box(args[3], k_block, 128) is not None
    check(args, f"k_block {k_block} by TMA")


@needs_sm90
@pytest.mark.parametrize("layout", ["offset", "strided"])
def test_k_scales_tma_cannot_address(layout):
    """K scales with a base off 16 bytes or no unit stride on tokens: loaded from global memory instead (same
    results); the aligned, contiguous ones ride on the K tile's TMA."""
    q, qs, k, ks, v, vs, qb, kb = quantize(*make_qkv(skv=1472), "int8", 1, 16)  # 92 groups of 16: aligned heads
    assert gs.k_scale_box(ks, kb, 128) == 32
    if layout == "offset":
        storage = torch.zeros(*ks.shape[:-1], ks.shape[-1] + 1, device=DEV)
        storage[..., 1:] = ks
        ks_other = storage[..., 1:]
    else:
        ks_other = ks.transpose(1, 2).contiguous().transpose(1, 2)
    assert gs.k_scale_box(ks_other, kb, 128) is None
    out = check((q, qs, k, ks_other, v, vs, qb, kb), f"k scales {layout}")
    torch.testing.assert_close(out, check((q, qs, k, ks, v, vs, qb, kb), "k scales contiguous"), rtol=0, atol=0)


@needs_sm90
@pytest.mark.parametrize("case", [
    dict(b=1, skv=1500),  # BSHD, one batch: any Skv (the partial last tile loads unpermuted)
    dict(skv=1504),  # BSHD, two batches folded into the 16-key groups
    dict(skv=1504, bshd=False),  # BHSD: batches and heads folded
    dict(skv=1504, d=64),
], ids=["bshd-b1-tail", "bshd-b2", "bhsd", "d64"])
def test_permuted_k(case):
    """``permk``: K rows loaded permuted so P needs no shuffles; same results as the plain schedule (fp32 level)
    and the reference."""
    args = quantize(*make_qkv(**case), "int8", 1, 16)
    assert gs.permuted_k(args[2], args[7], 128) is not None
    out = check(args, "permk", config=gs.GluonConfig.parse("128,3,ahead,permk"))
    plain = check(args, "plain", config=gs.GluonConfig.parse("128,3,ahead"))
    assert_fp32_level(out.float(), plain.float(), "permk vs plain")


@needs_sm90
def test_autotuned_call_times_the_candidates_once_and_caches_the_choice(tmp_path, monkeypatch, qattn_config):
    """Without a forced config the first call of a problem key times every candidate of its class, writes the choice
    to the tuning cache and returns the chosen config's output; the next call reads the choice back."""
    qattn_config(gluon_sage_config=None)
    monkeypatch.setattr(gs.TUNER, "cache_path", tmp_path / "tuning.json")
    gs.TUNER.clear()
    args = quantize(*make_qkv(skv=1536, d=128), "int8", 1, 16)  # a K the permk view takes: gs.TUNER's class
    assert gs.tuner_for(args[2], args[3], 16) is gs.TUNER
    sm_scale = 1.0 / math.sqrt(128)
    out = gs.scaled_attention(*args, sm_scale, torch.float32)
    assert gs.TUNER.last_source() == "tuned"
    (entry, timings), = gs.TUNER.timings().items()
    assert sorted(timings) == sorted(gs.TUNER.candidates) and all(ms > 0 for ms in timings.values())
    best = min(timings, key=timings.__getitem__)
    assert (tmp_path / "tuning.json").read_text().count(best) == 1
    with gs.use_config(best):
        forced = gs.scaled_attention(*args, sm_scale, torch.float32)
    torch.testing.assert_close(out, forced, rtol=0, atol=0)
    gs.TUNER.clear()
    again = gs.scaled_attention(*args, sm_scale, torch.float32)
    assert gs.TUNER.last_source() == "cache"
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert_close_to_reference(out, reference.scaled_attention(*args, sm_scale, torch.float32), f"tuned {best}")
    gs.TUNER.clear()


#: One case per launch class and way into it: (Q/K dtype, q_block, k_block, key bias, head_dim, its tuner).
CLASS_CASES = {"permk-int8-k16": ("int8", 1, 16, None, 128, "TUNER"),
               "permk-fp8-k16": ("fp8", 1, 16, None, 128, "TUNER"),
               "quad-int8-k16-d64": ("int8", 1, 16, None, 64, "QUAD_TUNER"),
               "quad-fp8-k16-d64": ("fp8", 1, 16, None, 64, "QUAD_TUNER"),
               "permk-bias-suffix-d64": ("int8", 1, 16, "suffix", 64, "TUNER"),
               "permk-bias-middle": ("int8", 1, 16, "middle", 128, "TUNER"),
               "key-order-bias-middle": ("int8", 1, 1, "middle", 64, "KEY_ORDER_TUNER"),
               "key-order-k1": ("int8", 1, 1, None, 64, "KEY_ORDER_TUNER"),
               "key-order-bf16": ("bf16", 0, 0, None, 64, "KEY_ORDER_TUNER")}


@needs_sm90
@pytest.mark.parametrize("case", list(CLASS_CASES))
def test_every_tuned_candidate_gives_the_same_output(case, monkeypatch, qattn_config):
    """The autotuner's choice changes only the time: every candidate of the launch's class (:func:`gs.tuner_for`),
    the untuned default and the tuned call return the same bits, with the tail split running (40 stand-in SMs
    make the last wave partial for 128- and 192-row CTAs alike); the result matches the reference."""
    monkeypatch.setattr(gs.launch, "sm_count", lambda index: 40)
    qattn_config(gluon_tail_split=True, gluon_sage_config=None)
    qk, q_block, k_block, with_bias, d, tuner_name = CLASS_CASES[case]
    # Skv a multiple of 16: the permk view takes batched K only then (permuted_k)
    args = quantize(*make_qkv(skv=2496, d=d), qk, q_block, k_block)
    bias = None
    if with_bias == "suffix":  # batch 0 sees 2000 keys, batch 1 sees 1200
        bias = torch.zeros(2, 2496, device=DEV)
        bias[0, 2000:] = float("-inf")
        bias[1, 1200:] = float("-inf")
    elif with_bias == "middle":  # biased keys inside the sequence: tiles with and without the bias on both sides
        bias = torch.zeros(2, 2496, device=DEV)
        bias[0, 700:1100] = float("-inf")
        bias[1, 1290] = -2.5
    sm_scale = 1.0 / math.sqrt(128)
    tuner = gs.tuner_for(args[2], args[3], args[7], bias)
    assert tuner is getattr(gs, tuner_name)
    outs = {}
    for config in tuner.candidates:
        with gs.use_config(config):
            outs[config] = gs.scaled_attention(*args, sm_scale, torch.float32, key_bias=bias)
        assert gs.last_tail_plan() is not None and gs.last_tail_plan().splits >= 2, (config, gs.last_tail_plan())
    tuner.clear()
    qattn_config(autotune=False)
    outs["default"] = gs.scaled_attention(*args, sm_scale, torch.float32, key_bias=bias)
    assert tuner.last_source() == "default"
    qattn_config(autotune=True)
    outs["tuned"] = gs.scaled_attention(*args, sm_scale, torch.float32, key_bias=bias)
    assert tuner.last_source() == "tuned"
    tuner.clear()
    first, *rest = outs
    for name in rest:
        torch.testing.assert_close(outs[name], outs[first], rtol=0, atol=0, msg=lambda m: f"{name} vs {first}: {m}")
    expected = reference.scaled_attention(*args, sm_scale, torch.float32, key_bias=bias)
    assert_close_to_reference(outs[first], expected, f"{case} {first}")


SHAPES = support.GPU_SHAPE_CLASSES


@needs_sm90
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name):
    check(quantize(*make_qkv(**SHAPES[name]), "int8", 1, 16), name)


@needs_sm90
@pytest.mark.parametrize("config", [str(c) for c in gs.CONFIGS])
@pytest.mark.parametrize("d", [128, 64])
def test_every_config(config, d):
    args = quantize(*make_qkv(b=2, hq=4, hkv=2, sq=333, skv=555, d=d), "int8", 1, 16)
    check(args, f"d{d}", config=gs.GluonConfig.parse(config))


@needs_sm90
@pytest.mark.parametrize("v_scale", ["tensor", "head"])
def test_v_scales(v_scale):
    check(quantize(*make_qkv(hkv=8), "int8", 1, 16, v_scale=v_scale), f"V per-{v_scale}")


@needs_sm90
@pytest.mark.parametrize("out_dtype,config", [(torch.bfloat16, gs.DEFAULT_CONFIGS[128]),
                                              (torch.float16, gs.DEFAULT_CONFIGS[128]),
                                              (torch.bfloat16, gs.GluonConfig(128, 3, ahead=1, permk=1, mmasum=1))],
                         ids=str)
def test_out_dtype_bshd_storage_and_lse(out_dtype, config):
    """LSE against triton_sage's with the same tile size (the same running maxima): equal for fp32 row sums; under
    ``mmasum`` the denominator is the sum of the e4m3-rounded P, ~1 % off the fp32 sum per row on these inputs
    (e4m3 has 3 mantissa bits), so its LSE differs by up to ~0.01 (log units). The config is forced: the tuner may
    pick either kind."""
    from qattn_fx.kernels import triton_sage as ts

    args = quantize(*make_qkv(), "int8", 1, 16)
    with gs.use_config(config):
        out, lse = gs.attention(*args, 0.125, out_dtype, return_lse=True)
    b, h, s, d = out.shape
    assert out.dtype == out_dtype and out.stride() == (s * h * d, d, h * d, 1)
    assert_close_to_reference(out.float(), reference.scaled_attention(*args, 0.125, torch.float32), str(out_dtype))
    with ts.use_config("128,128,8,3,pipe"):
        _, ts_lse = ts.attention(*args, 0.125, torch.float32, return_lse=True)
    if config.mmasum:
        torch.testing.assert_close(lse, ts_lse, atol=2e-2, rtol=0)
    else:
        torch.testing.assert_close(lse, ts_lse, atol=1e-4, rtol=1e-5)


@needs_sm90
def test_inputs_not_mutated():
    args = quantize(*make_qkv(), "int8", 1, 16)
    with support.inputs_unchanged(args):
        gs.scaled_attention(*args, 0.125, torch.bfloat16)
    torch.cuda.synchronize()


@needs_sm90
def test_d_major_v_is_refused_with_reason():
    args = quantize(*make_qkv(sq=64, skv=64), "int8", 1, 16, v_seq_major=False)
    with pytest.raises(RuntimeError, match=r"gluon_sage: needs sequence-major fp8 V"):
        gs.scaled_attention(*args, 0.1, torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("config", [gs.GluonConfig(128, 3, permk=1, tarrive=1, trio=1), gs.DEFAULT_CONFIGS[128]],
                         ids=str)
def test_exact_when_row_max_is_in_first_tile(config):
    """No rescaling after the first tile: fp32 row sums match the reference at fp32 level; an ``mmasum`` config
    (the default) sums the e4m3-rounded P instead, so it is held to the emulation that models that sum (with the
    FP8 accumulator's error in that sum allowed for: :func:`support.assert_fp32_level`)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=300, skv=700, k_bias=0.0, q_bias=0.0, dtype=torch.float32)
    u = torch.randn(q.shape[-1], generator=g, device=DEV)
    q = u + 0.3 * q
    k = k.clone()
    k[:, :, 0] = 0.5 * u
    args = quantize(q.bfloat16(), k.bfloat16(), v.bfloat16(), "int8", 1, 16, smooth=False)
    sm_scale = 1.0 / math.sqrt(128)
    with gs.use_config(config):
        out = gs.scaled_attention(*args, sm_scale, torch.float32)
    if config.mmasum:
        expected = emulate(*args, sm_scale, config.block_n, config.mmasum)
    else:
        expected = reference.scaled_attention(*args, sm_scale, torch.float32)
    assert_fp32_level(out, expected, f"{config} first-tile max", mmasum=bool(config.mmasum))


@needs_sm90
@pytest.mark.parametrize("config", [str(c) for c in gs.QUAD_TUNED_CONFIGS])
@pytest.mark.parametrize("qk", ["int8", "fp8", "q-in-kernel"])
def test_quad_gives_the_bits_of_trio_without_the_tail_split(config, qk, qattn_config):
    """``quad`` (256-row CTAs at head_dim 64) changes only the CTA's row count: without the tail split (which cuts
    the last wave by CTA rows) its output and LSE equal ``trio``'s bit for bit, and match the emulated tile loop and
    the reference (:func:`check`). With the tail split: ``test_every_tuned_candidate_gives_the_same_output``."""
    q, k, v = make_qkv(b=2, hq=8, hkv=4, sq=1500, skv=1200, d=64)
    args = quantize(q, k, v, "fp8" if qk == "fp8" else "int8", 1, 16)
    if qk == "q-in-kernel":
        args = (q, None, *args[2:])
    qattn_config(gluon_tail_split=False)
    outs = []
    for cfg in (config, gs.TRIO_DEFAULT_CONFIG):
        with gs.use_config(cfg):
            outs.append(gs.attention(*args, 0.125, torch.float32, return_lse=True))
    for got, want in zip(*outs):
        assert torch.equal(got, want), (got - want).abs().max()
    if qk != "q-in-kernel":  # (check emulates pre-quantized Q)
        check(args, f"quad {qk}", sm_scale=0.125, config=gs.GluonConfig.parse(config))


TAIL_CASES = [(gs.DEFAULT_CONFIGS[128], 16), (gs.GluonConfig(128, 3, ahead=1), 16),
              (gs.GluonConfig(128, 3, ahead=1), 1)]


@needs_sm90
@pytest.mark.parametrize("config,k_block", TAIL_CASES, ids=[f"{c}-k{kb}" for c, kb in TAIL_CASES])
def test_split_tail_pieces_merge_to_the_emulated_split(config, k_block, monkeypatch, qattn_config):
    """With 40 slots (a stand-in SM count) the grid's partial last wave is split over the keys
    (:mod:`qattn_fx.kernels.gluon_sage.tail_split`): output and LSE match the emulation of that
    (:func:`emulate_launched`) and the reference op, and the unsplit launch within the reference tolerance."""
    monkeypatch.setattr(gs.launch, "sm_count", lambda index: 40)
    qattn_config(gluon_tail_split=True)
    args = quantize(*make_qkv(skv=2500), "int8", 1, k_block)
    q, k = args[0], args[2]
    sm_scale = 1.0 / math.sqrt(128)
    with gs.use_config(config):
        out, lse = gs.attention(*args, sm_scale, torch.float32, return_lse=True)
    tail = gs.last_tail_plan()
    ctas = q.shape[0] * q.shape[1] * gs.q_blocks(q.shape[2], config)
    assert tail == gs.tail_split.plan(ctas, 40, k.shape[2], 128, k_block) and tail.splits >= 2, tail
    want, want_lse = emulate_launched(args, sm_scale, config, tail, return_lse=True)
    assert_fp32_level(out.float(), want, f"{config} {tail} vs emulation", mmasum=bool(config.mmasum))
    # mmasum: l is the ones-MMA's sum, with the FP8 accumulator's error (~1e-4 relative, up to ~1e-3 measured:
    # support.assert_fp32_level), which the emulation's fp32 sum does not have
    torch.testing.assert_close(lse, want_lse.float(), atol=2e-3 if config.mmasum else 1e-4, rtol=1e-5)
    assert_close_to_reference(out, reference.scaled_attention(*args, sm_scale, torch.float32), f"{config} split")
    qattn_config(gluon_tail_split=False)
    with gs.use_config(config):
        whole = gs.scaled_attention(*args, sm_scale, torch.float32)
    assert gs.last_tail_plan() is None
    assert_close_to_reference(out, whole, f"{config} split vs whole")


#: (config, make_qkv overrides, call extras) of the launches whose Q the kernel quantizes: the permk and key-order
#: classes, the tail split (1000 rows: a partial last wave), short and odd lengths, contiguous BHSD, fp16, the LSE,
#: a key bias and Skip-Softmax.
Q_IN_KERNEL_CASES = {
    "trio-permk": (gs.DEFAULT_CONFIGS[128], {}, {}),
    "ahead-key-order": (gs.KEY_ORDER_DEFAULT_CONFIG, {}, {}),
    "short": (gs.GluonConfig(128, 3, ahead=1, permk=1), dict(sq=77, skv=333), {}),
    "bhsd-fp16": (gs.DEFAULT_CONFIGS[128], dict(bshd=False, dtype=torch.float16, sq=4097), {}),
    "d64": (gs.DEFAULT_CONFIGS[64], dict(d=64), {}),
    "lse": (gs.DEFAULT_CONFIGS[128], {}, dict(return_lse=True)),
    "key-bias": (gs.KEY_ORDER_DEFAULT_CONFIG, {}, dict(key_bias="pad")),
    "key-bias-permk": (gs.DEFAULT_CONFIGS[128], {}, dict(key_bias="pad")),
    "skip": (gs.DEFAULT_CONFIGS[128], {}, dict(skip_threshold=0.05)),
}


@needs_sm90
@pytest.mark.parametrize("case", list(Q_IN_KERNEL_CASES))
def test_q_quantized_in_the_kernel_is_bit_identical(case):
    """A bf16/fp16 Q with int8 K (``KernelInfo.quantizes_q``): the consumers quantize their Q rows per token with
    ``qattn::quantize_per_block``'s numerics (IEEE divisions, ties to even), so the output (and LSE) equal the
    launch on the eagerly quantized Q bit for bit, as the op and compiled graphs call it."""
    config, shape, extra = Q_IN_KERNEL_CASES[case]
    q, k, v = make_qkv(**shape)
    args = quantize(q, k, v, "int8", 1, 16)
    extra = dict(extra)
    if extra.get("key_bias") == "pad":
        mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=DEV)
        mask[:, -200:] = False
        extra["key_bias"] = torch.ops.qattn.key_bias(mask[:, None, None, :], k)
    if "skip_threshold" in extra:
        extra["skip_threshold"] = torch.tensor([extra["skip_threshold"]], device=DEV)
    with gs.use_config(config):
        expected = gs.attention(*args, 0.1, torch.bfloat16, **extra)
        got = gs.attention(q, None, *args[2:], 0.1, torch.bfloat16, **extra)
        via_op = torch.ops.qattn.scaled_attention(q, None, *args[2:], 0.1, torch.bfloat16, "gluon_sage")
    for e, g in zip(*((x if isinstance(x, tuple) else (x,)) for x in (expected, got))):
        assert torch.equal(g, e), f"{case}: max |diff| {(g.float() - e.float()).abs().max().item()}"
    if not extra:
        assert torch.equal(via_op, expected)


@needs_sm90
def test_q_in_the_kernel_is_refused_for_other_q_blocks():
    q, k, v = make_qkv()
    args = quantize(q, k, v, "int8", 16, 16)
    with pytest.raises(ValueError, match=r"gluon_sage: kernel 'gluon_sage' quantizes a torch.bfloat16 q itself "
                                         r"only at q_block in \(1,\); got q_block=16; valid: q_block in \(1,\)"):
        gs.attention(q, None, *args[2:], 0.1, torch.bfloat16)
