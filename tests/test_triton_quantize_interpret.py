"""The fused quantize kernels (:mod:`qattn_fx.kernels.triton_quantize`) under the Triton interpreter (CPU), against
the aten definitions (:mod:`qattn_fx.ops.quantize`), and which graphs use them (:mod:`qattn_fx.ops.fused_quantize`).

Scales and data must be bit-identical to the aten ops: Q's per-block quantization, V's per-channel e4m3 (both
layouts) and K's smoothed quantization given the same mean. K's mean from the column pass is an fp32 sum in another
order than torch's, so there data may differ by one unit where a value sits within an ulp of a rounding boundary.
Shapes are small (the interpreter runs each program in numpy): lengths that are not multiples of 16, batch > 1,
BSHD views and a slice of a fused QKV buffer, head_dim 64, 80, 128.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import qattn_fx  # noqa: E402
import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx.kernels import triton_quantize as tq  # noqa: E402
from qattn_fx.ops import fused_quantize  # noqa: E402
from qattn_fx.recipes import Recipe  # noqa: E402

ops = torch.ops.qattn
FP8 = torch.float8_e4m3fn
SHAPES = [(1, 2, 37, 64), (2, 3, 50, 128), (1, 1, 16, 80)]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make(shape, layout="bshd", dtype=torch.bfloat16, seed=0):
    """``(B, H, S, D)`` values with a per-channel offset (what smoothing removes), stored as ``layout``: ``bhsd``
    contiguous, ``bshd`` (a transposed view, diffusers' layout) or ``qkv`` (K's slice of a ``(B, S, 3, H, D)``
    buffer: not dense)."""
    b, h, s, d = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, d, generator=g) * 2 + torch.randn(1, 1, h, d, generator=g) * 3
    if layout == "bhsd":
        return x.transpose(1, 2).contiguous().to(dtype)
    if layout == "bshd":
        return x.to(dtype).transpose(1, 2)
    buf = torch.randn(b, s, 3, h, d, generator=g).to(dtype)
    buf[:, :, 1] = x.to(dtype)
    return buf[:, :, 1].transpose(1, 2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def strides(t: torch.Tensor) -> tuple:
    """Strides of the dims longer than 1 (a size-1 dim's stride addresses nothing)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def assert_same(got, want):
    (data, scale), (ref_data, ref_scale) = got, want
    assert data.shape == ref_data.shape and strides(data) == strides(ref_data) and data.dtype == ref_data.dtype
    assert scale.shape == ref_scale.shape and strides(scale) == strides(ref_scale)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(bits(data), bits(ref_data))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "qkv"])
@pytest.mark.parametrize("block,dtype", [(1, torch.int8), (16, torch.int8), (4, FP8), (32, FP8), (128, torch.int8)])
def test_per_block_matches_aten(shape, layout, block, dtype):
    x = make(shape, layout)
    assert_same(tq.quantize_per_block(x, block, dtype), ops.quantize_per_block(x, block, dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["bshd", "qkv"])
@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_smoothed_per_block_given_the_mean_matches_aten(shape, layout, dtype):
    x = make(shape, layout)
    mean = x.float().mean(dim=-2).contiguous()  # what qattn::smooth_k subtracts, from the same torch reduction
    got = tq.quantize_per_block(x, 16, dtype, smooth=True, mean=mean)
    assert_same(got, ops.quantize_per_block(ops.smooth_k(x), 16, dtype))


@pytest.mark.parametrize("shape", SHAPES + [(2, 2, 1000, 64)])
def test_smoothed_per_block_with_its_own_mean(shape):
    """The column pass's mean agrees with torch's to fp32 rounding; data then differs by at most one unit, rarely."""
    x = make(shape, "bshd")
    part = tq.column_pass(x, "sum")
    assert part.shape[:2] == x.shape[:2] and part.shape[-1] == x.shape[-1] and part.shape[2] <= 32
    torch.testing.assert_close(part.sum(dim=2) / x.shape[-2], x.float().mean(dim=-2), rtol=1e-5, atol=1e-6)
    data, scale = tq.quantize_per_block(x, 16, torch.int8, smooth=True)
    ref_data, ref_scale = ops.quantize_per_block(ops.smooth_k(x), 16, torch.int8)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    diff = (data.int() - ref_data.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "qkv"])
@pytest.mark.parametrize("seq_major", [True, False])
def test_per_channel_matches_aten(shape, layout, seq_major):
    x = make(shape, layout)
    assert_same(tq.quantize_per_channel(x, FP8, seq_major), ops.quantize_per_channel(x, FP8, seq_major))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_input_dtypes(dtype):
    x = make((1, 2, 33, 64), "bshd", dtype)
    assert_same(tq.quantize_per_block(x, 1, torch.int8), ops.quantize_per_block(x, 1, torch.int8))
    assert_same(tq.quantize_per_channel(x, FP8, True), ops.quantize_per_channel(x, FP8, True))


def test_zeros_and_saturation():
    """All-zero blocks give scale 0 and data 0; values at the e4m3 range edge and rounding ties stay exact."""
    x = make((1, 2, 40, 64), "bhsd", torch.float32)
    x[:, 0, :16] = 0
    x[:, 1, 3, :8] = torch.tensor([448.0, -448.0, 0.5, 1.5, 2.5, -2.5, 1e-8, -1e-8])
    for block, dtype in ((16, torch.int8), (1, FP8), (16, FP8)):
        assert_same(tq.quantize_per_block(x, block, dtype), ops.quantize_per_block(x, block, dtype))
    assert_same(tq.quantize_per_channel(x, FP8, True), ops.quantize_per_channel(x, FP8, True))


def test_errors(monkeypatch):
    x = make((1, 2, 16, 64))
    with pytest.raises(ValueError, match=r"block=3 is not served; valid: 1, 2, 4, 8, 16, 32, 64, 128"):
        tq.quantize_per_block(x, 3, torch.int8)
    with pytest.raises(ValueError, match=r"dtype=torch.int8 is not served; valid: torch.float8_e4m3fn"):
        tq.quantize_per_channel(x, torch.int8, True)
    with pytest.raises(ValueError, match=r"x.dtype=torch.int32 is not served"):
        tq.quantize_per_block(x.to(torch.int32), 1, torch.int8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"runs on CUDA tensors \(or under TRITON_INTERPRET=1\); got device cpu"):
        tq.quantize_per_block(x, 1, torch.int8)


@pytest.mark.parametrize("op,args", [
    (ops.fused_quantize_per_block.default, (make((2, 2, 37, 64)), 16, torch.int8, True)),
    (ops.fused_quantize_per_block.default, (make((1, 3, 20, 64), "qkv"), 1, FP8, False)),
    (ops.fused_quantize_per_channel.default, (make((2, 2, 37, 64)), FP8, True)),
    (ops.fused_quantize_per_channel.default, (make((1, 2, 21, 64), "bhsd"), FP8, False)),
])
def test_opcheck(op, args):
    """Schema, fake implementation (shapes and strides, also under symbolic sizes) against the kernels."""
    torch.library.opcheck(op, args)


def test_compiled_with_symbolic_lengths():
    """One graph serves every length: no guard on S (padded scale rows and sequence-major V are symbolic)."""
    torch._dynamo.reset()
    counts = {"graphs": 0}

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        return gm

    @torch.compile(backend=backend, dynamic=True, fullgraph=True)
    def quantize(q, k, v):
        return (ops.fused_quantize_per_block(q, 1, torch.int8, False),
                ops.fused_quantize_per_block(k, 16, torch.int8, True),
                ops.fused_quantize_per_channel(v, FP8, True))

    for s in (37, 48, 70):
        q, k, v = (make((1, 2, s, 64), "bshd", seed=i) for i in range(3))
        got = quantize(q, k, v)
        assert_same(got[0], ops.quantize_per_block(q, 1, torch.int8))
        assert_same(got[2], ops.quantize_per_channel(v, FP8, True))
        assert got[1][0].shape == k.shape and got[1][1].shape == (1, 2, (-(-s // 16) + 3) // 4 * 4)
    assert counts["graphs"] == 1


# ---- which graphs use the fused ops -----------------------------------------------------------------------------

SAGE = Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)


def fake_operands(device: str, dtype=torch.bfloat16, d: int = 128):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        q, k, v = (torch.empty(1, 64, 4, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
    return mode, q, k, v


@pytest.mark.parametrize("setting,want", [("qkv", (True, True, True)), ("kv", (False, True, True)),
                                          ("q", (True, False, False)), ("", (False, False, False))])
def test_plan_follows_the_setting_on_cuda(qattn_config, setting, want):
    qattn_config(triton_quantize=setting)
    _, q, k, v = fake_operands("cuda")
    assert fused_quantize.plan(SAGE, q, k, v) == fused_quantize.Plan(*want)


def test_plan_keeps_aten_ops_by_default():
    _, q, k, v = fake_operands("cuda")
    assert fused_quantize.plan(SAGE, q, k, v) == fused_quantize.Plan()


def test_plan_keeps_aten_ops_where_the_kernels_do_not_serve(qattn_config):
    qattn_config(triton_quantize="qkv")
    _, q, k, v = fake_operands("cpu")
    assert fused_quantize.plan(SAGE, q, k, v) == fused_quantize.Plan()  # CPU graphs: the aten definitions
    _, q, k, v = fake_operands("cuda")
    assert fused_quantize.plan(Recipe("fp8", "fp8"), q, k, v) == fused_quantize.Plan()  # per-tensor (cuDNN)
    assert fused_quantize.plan(Recipe("bf16", "fp8", 0, 0, 1), q, k, v) == fused_quantize.Plan(v=True)
    assert fused_quantize.plan(Recipe("int8", "fp8", 1, 16, 0), q, k, v) == fused_quantize.Plan(q=True, k=True)
    _, q, k, v = fake_operands("cuda", torch.float8_e4m3fn)
    assert fused_quantize.plan(SAGE, q, k, v) == fused_quantize.Plan()


@pytest.mark.parametrize("value", ["qq", "x", "QKV"])
def test_invalid_setting(qattn_config, value):
    qattn_config(triton_quantize=value)
    _, q, k, v = fake_operands("cuda")
    with pytest.raises(ValueError, match=r"triton_quantize \(\$QATTN_TRITON_QUANTIZE\) = .* is invalid; valid: "):
        fused_quantize.plan(SAGE, q, k, v)


@pytest.mark.parametrize("setting", ["qkv", ""])
def test_lowering_on_cuda_emits_the_plan(qattn_config, setting):
    """On (fake) CUDA operands the recipe's nodes are the fused ops; with the setting empty, the aten ops."""
    qattn_config(triton_quantize=setting)
    _, q, k, v = fake_operands("cuda")
    emitted = []

    def emit(target, args, name):  # records the nodes (fake CUDA tensors cannot run every aten op on a CPU build)
        emitted.append((name, target))

    qattn_fx.ops.quantized_attention(q, k, v, SAGE, kernel="gluon_sage", emit=emit)
    assert emitted[-1] == ("attention", ops.scaled_attention.default)
    quant = {name: target for name, target in emitted if name.endswith(("_quant", "_smooth"))}
    if setting:
        assert quant == {"q_quant": ops.fused_quantize_per_block.default,
                         "k_quant": ops.fused_quantize_per_block.default,
                         "v_quant": ops.fused_quantize_per_channel.default}
    else:
        assert quant == {"k_smooth": ops.smooth_k.default, "q_quant": ops.quantize_per_block.default,
                         "k_quant": ops.quantize_per_block.default, "v_quant": ops.quantize_per_channel.default}


# ---- offline compile for sm_90 (Triton's bundled ptxas, no GPU) -----------------------------------------------------

@pytest.mark.parametrize("op,kwargs", [
    ("quantize_per_block", dict(block=1, dtype=torch.int8)),
    ("quantize_per_block", dict(block=16, dtype=torch.int8, smooth=True)),
    ("quantize_per_block", dict(block=128, dtype=FP8)),
    ("quantize_per_channel", dict(dtype=FP8, seq_major=True)),
])
def test_compiles_for_sm90_without_spills(monkeypatch, op, kwargs):
    """The compiled kernels of a flux-1024 BSHD launch: 16-byte loads, IEEE divisions, no spills."""
    from qattn_fx.kernels import _offline
    from qattn_fx.kernels.triton_quantize import launch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.empty(1, 4608, 24, 128, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    for compiled in launch.compile_for((9, 0), x, op, **kwargs):
        report = _offline.ptxas_report(compiled, (9, 0))
        assert report["ptxas_ok"] and report["spill_stores"] == 0, report
        ptx = compiled.asm["ptx"]
        assert "ld.global.v4" in ptx and "div.full" not in ptx
        if compiled.name != "_column_pass":
            assert "div.rn.f32" in ptx
