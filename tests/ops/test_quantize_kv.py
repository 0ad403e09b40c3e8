"""``qattn::kv_stats`` and ``qattn::quantize_kv`` on the CPU (the separate ops' composition, bit for bit), their fake
and meta implementations' layouts, their errors, and the lowering's choice of them (:func:`uses_fused_kv`) with the
graph it emits for a CUDA site (fake CUDA tensors, the compile pass's emitter). The kernel itself:
``tests/kernels/test_quantize_kv_interpret.py`` and ``tests/gpu/test_quantize_kv.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import support
import qattn_fx
from qattn_fx.fx.rewrite import FxEmitter
from qattn_fx.ops.lowering import quantized_attention, uses_fused_kv
from qattn_fx.recipes import Recipe
from tests.kernels import quantize_kv_cases as cases

ops = torch.ops.qattn
I8, F8 = torch.int8, torch.float8_e4m3fn
SAGE = Recipe("int8", "fp8", 1, 16, 1)


def quantize_kv(k, v, key_bias, k_block=16, k_dtype=I8, seq_major=True):
    return ops.quantize_kv(k, v, *ops.kv_stats(k, v, key_bias), key_bias, k_block, k_dtype, seq_major)


def layout(x: torch.Tensor) -> tuple:
    """Shape, dtype and the strides of the dims of size > 1 (a size-1 dim's stride means nothing)."""
    return tuple(x.shape), x.dtype, tuple(st if n > 1 else None for n, st in zip(x.shape, x.stride()))


# ----------------------------------------------------------------------------------------------------------------
# the ops on the CPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(cases.CASES))
def test_cpu_op_is_the_unfused_ops_bit_for_bit_in_their_layouts(name):
    case = cases.CASES[name]
    k, v, key_bias = cases.make(case)
    k_mean, v_scale = ops.kv_stats(k, v, key_bias)
    got = ops.quantize_kv(k, v, k_mean, v_scale, key_bias, case.k_block, case.k_dtype, case.seq_major)
    want = cases.unfused(k, v, key_bias, case.k_block, case.k_dtype, case.seq_major)
    cases.assert_bitwise((*got, v_scale), want, ("k_data", "k_scale", "v_data", "v_scale"))
    assert [layout(x) for x in got] == [layout(x) for x in want[:3]]
    assert k_mean.shape == (case.b, case.h, 1, case.dk) and k_mean.dtype == torch.float32


@pytest.mark.parametrize("seq_major", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(support.LAYOUTS))
def test_real_fake_and_meta_layouts_agree(name, masked, seq_major):
    """Every layout SDPA takes: the CPU op's outputs have the strides the fake promises (the composition's are
    copied into them where they differ, e.g. a sequence-first K under a mask), and so do meta tensors'."""
    k = support.make_layout(name, 2, 3, 37, 16, dtype=torch.bfloat16)
    v = support.make_layout(name, 2, 3, 37, 32, dtype=torch.bfloat16, seed=1)
    key_bias = torch.zeros(2, 37).masked_fill(torch.arange(37) % 5 == 0, -math.inf) if masked else None
    args = (k, v, *ops.kv_stats(k, v, key_bias), key_bias, 16, I8, seq_major)
    real = ops.quantize_kv(*args)
    with FakeTensorMode() as mode:
        fake = ops.quantize_kv(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    meta = ops.quantize_kv(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    for r, f, m in zip(real, fake, meta):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype) == (m.shape, m.stride(), m.dtype)


@pytest.mark.parametrize("call, message", [
    (lambda k, v, b: quantize_kv(k, v, b, k_block=48),
     "quantize_kv: k_block=48 is invalid; valid: a power of 2 up to 128 (1, 2, 4, 8, 16, 32, 64, 128)"),
    (lambda k, v, b: quantize_kv(k, v, b, k_block=256), "quantize_kv: k_block=256 is invalid; valid: a power of 2"),
    (lambda k, v, b: quantize_kv(k, v, b, k_dtype=torch.float16),
     "dtype=torch.float16 is not a scaled 8-bit format; valid: torch.int8, torch.float8_e4m3fn"),
    (lambda k, v, b: ops.quantize_kv(k, v[:, :, :10], *ops.kv_stats(k, v), None, 16, I8, True),
     "quantize_kv: k (2, 3, 37, 16) and v (2, 3, 10, 32) must share B, H and S"),
    (lambda k, v, b: ops.quantize_kv(k, v, ops.kv_stats(k, v)[0][:, :, 0], ops.kv_stats(k, v)[1], None, 16, I8,
                                     True),
     "quantize_kv: k_mean must be fp32 of shape (2, 3, 1, 16) (qattn::kv_stats); got torch.float32 of shape "
     "(2, 3, 16)"),
    (lambda k, v, b: ops.quantize_kv(k, v, *ops.kv_stats(k, v), b[:, :5], 16, I8, True),
     "quantize_kv: key_bias must be a float (B|1, S) = (2|1, 37) tensor; got torch.float32 of shape (2, 5)"),
    (lambda k, v, b: ops.quantize_kv(k[0], v, *ops.kv_stats(k, v), None, 16, I8, True),
     "quantize_kv: k must be a (B, H, S, D) float tensor; got torch.bfloat16 of shape (3, 37, 16)"),
    (lambda k, v, b: ops.kv_stats(k, v[0]), "kv_stats expects a (B, H, S, D) tensor; got shape (3, 37, 32)"),
])
def test_argument_errors_name_the_value_and_the_choices(call, message):
    k = support.make_layout("bshd", 2, 3, 37, 16, dtype=torch.bfloat16)
    v = support.make_layout("bshd", 2, 3, 37, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        call(k, v, torch.zeros(2, 37))
    assert str(e.value).startswith(message), str(e.value)


def test_the_cpu_op_runs_no_triton_and_meta_tensors_need_no_device(monkeypatch):
    from qattn_fx.kernels import quantize_kv as fused

    monkeypatch.setattr(fused, "launch", None)  # the CPU implementation never launches the kernel
    k = support.make_layout("bshd", 1, 2, 40, 16, dtype=torch.bfloat16)
    assert quantize_kv(k, k, None)[0].shape == k.shape
    assert quantize_kv(k.to("meta"), k.to("meta"), None)[2].shape == (1, 2, 48, 16)


# ----------------------------------------------------------------------------------------------------------------
# the lowering's choice
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hopper(monkeypatch):
    """``torch.cuda`` answers for an sm_90 device (the fake CUDA tensors below need no GPU), with the fused K/V
    quantize on (its default, pinned here against an environment that turns it off)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with qattn_fx.config.patch(fused_kv_quantize=True):
        yield


def test_the_fused_kv_quantize_is_on_by_default(monkeypatch):
    """On by default: a CUDA Sage site takes the fused op unless ``$QATTN_FUSED_KV_QUANTIZE=0`` turns it off."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert qattn_fx.config._config["fused_kv_quantize"].default is True
    with qattn_fx.config.patch(fused_kv_quantize=False):
        assert not uses_fused_kv(SAGE, *fake_cuda((1, 2, 300, 64), (1, 2, 300, 64)))


def fake_cuda(*shapes, dtype=torch.bfloat16, mode=None):
    mode = mode or FakeTensorMode()
    with mode:
        return [torch.empty(b, s, h, d, dtype=dtype, device="cuda").transpose(1, 2) for b, h, s, d in shapes]


@pytest.mark.parametrize("recipe, covered", [
    (SAGE, True),
    (Recipe("fp8", "fp8", 1, 64, 1), True),
    (Recipe("int8", "fp8", 128, 128, 1), True),
    (Recipe("int8", "fp8", 1, 1, 1), True),
    (Recipe("int8", "fp8", 1, 48, 1), False),  # not a power of 2
    (Recipe("int8", "fp8", 1, 256, 1), False),  # more than a tile
    (Recipe("int8", "fp8", 0, 0, 0), False),  # per-tensor K and V
    (Recipe("int8", "fp8", 1, 16, 0), False),  # per-tensor V
    (Recipe("int8", "fp8", 1, 16, 1, smooth_k=False), False),
    (Recipe("bf16", "fp8", 0, 0, 1), False),
    (Recipe("mxfp8", "mxfp8"), False),
    (Recipe("int8", "mxfp8", 1, 16), False),
])
def test_uses_fused_kv_for_the_recipes_it_covers_on_cuda(hopper, recipe, covered):
    k, v = fake_cuda((1, 2, 300, 64), (1, 2, 300, 128))
    assert uses_fused_kv(recipe, k, v) is covered


def test_uses_fused_kv_only_on_cuda_devices_and_operands_it_takes(hopper, monkeypatch):
    k, v = fake_cuda((1, 2, 300, 64), (1, 2, 300, 64))
    assert uses_fused_kv(SAGE, k, v)
    assert not uses_fused_kv(SAGE, torch.zeros(1, 2, 300, 64), torch.zeros(1, 2, 300, 64))  # CPU graphs: unchanged
    assert not uses_fused_kv(SAGE, *fake_cuda((1, 2, 300, 512), (1, 2, 300, 64)))  # head dim past the kernel's
    assert not uses_fused_kv(SAGE, *fake_cuda((1, 2, 300, 64), (1, 2, 300, 64), dtype=torch.float64))
    with qattn_fx.config.patch(fused_kv_quantize=False):
        assert not uses_fused_kv(SAGE, k, v)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # no e4m3 converts
    assert not uses_fused_kv(SAGE, k, v)


def test_an_invalid_setting_is_refused_by_name(hopper):
    k, v = fake_cuda((1, 2, 300, 64), (1, 2, 300, 64))
    with qattn_fx.config.patch(fused_kv_quantize="yes"), pytest.raises(
            ValueError, match=r"qattn_fx.config.fused_kv_quantize \(\$QATTN_FUSED_KV_QUANTIZE\) = 'yes' is invalid; "
                              r"valid: 0, 1"):
        uses_fused_kv(SAGE, k, v)
    assert not uses_fused_kv(Recipe("int8", "fp8", 0, 0, 0), k, v)  # (read only where the recipe is covered)


FUSED = ["kv_stats", "k_mean", "v_scale", "kv_quant", "k_data", "k_scale", "v_data"]
UNFUSED = ["k_smooth", "k_quant", "k_data", "k_scale", "v_quant", "v_data", "v_scale"]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_a_cuda_site_gets_the_fused_ops_unless_the_setting_is_off(hopper, fused, masked):
    """The compile pass's emitter on a graph of fake CUDA values: the site's K and V go through ``kv_stats`` and
    ``quantize_kv`` (the seq-major V gluon_sage wants; with a mask, its key bias) or, with the setting off, the
    separate ops; Q's quantization and the attention op's output are the same either way."""
    mode = FakeTensorMode()
    q, k, v = fake_cuda((2, 4, 77, 64), (2, 4, 300, 64), (2, 4, 300, 64), mode=mode)
    graph = fx.Graph()
    inputs = [q, k, v]
    if masked:
        with mode:
            inputs.append(torch.ones(2, 1, 1, 300, dtype=torch.bool, device="cuda"))
    nodes = []
    for name, value in zip("qkvm", inputs):
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["example_value"] = value
    emit = FxEmitter(graph, "site", mode, {})
    with qattn_fx.config.patch(fused_kv_quantize=fused):
        out = quantized_attention(*nodes[:3], SAGE, kernel="gluon_sage", emit=emit,
                                  attn_mask=nodes[3] if masked else None)
    names = [n.name.removeprefix("site_") for n in emit.created]
    kv = [n for n in names if n in set(FUSED + UNFUSED + ["v_masked"])]
    assert kv == (FUSED if fused else UNFUSED[:4] + (["v_masked"] if masked else []) + UNFUSED[4:])
    quant = next(n for n in emit.created if n.name == "site_kv_quant") if fused else None
    if fused:
        assert quant.args[4] is (next(n for n in emit.created if n.name == "site_key_bias") if masked else None)
        assert quant.args[5:] == (16, I8, True)
        k_data, k_scale, v_data = (n.meta["example_value"] for n in emit.created if n.name in
                                   ("site_k_data", "site_k_scale", "site_v_data"))
        assert k_data.shape == (2, 4, 300, 64) and k_data.stride() == k.stride() and k_scale.shape == (2, 4, 20)
        assert v_data.shape == (2, 4, 304, 64) and v_data.stride(2) == 1
    assert out.meta["example_value"].shape == (2, 4, 77, 64)


def test_one_compiled_graph_serves_every_length():
    """Under dynamic shapes the fake's lengths (K's scales rows, sequence-major V's padding) are written as the
    separate ops write theirs: one graph for every length, its outputs those of the eager op."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def fused(k, v):
        return ops.quantize_kv(k, v, *ops.kv_stats(k, v), None, 16, I8, True)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fused, backend=counter, dynamic=True)
    for s in (40, 77, 300):
        k = support.make_layout("bshd", 1, 2, s, 16, dtype=torch.bfloat16, seed=s)
        got, want = compiled(k, k), fused(k, k)
        cases.assert_bitwise(got, want)
        assert [x.stride() for x in got] == [x.stride() for x in want]
    assert counter.frame_count == 1
