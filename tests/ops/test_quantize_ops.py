"""Quantize ops (``torch.ops.qattn.*``): opcheck, hand-computed encodings, layouts, and a round-trip property test.

Dequantization here is written independently of ``qattn_fx.formats`` (plain tables and powers of two), so the
tests check the encoders against the format definitions, not against themselves.
"""

from __future__ import annotations

import math

import pytest
import torch
from support import fp8_comparable_allclose, inputs_unchanged
from hypothesis import given, settings
from hypothesis import strategies as st

import qattn_fx  # noqa: F401  (registers the ops)
from qattn_fx import formats
from qattn_fx.ops.quantize import QUANTIZE_OPS

ops = torch.ops.qattn
I8, F8 = torch.int8, torch.float8_e4m3fn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def bshd(b, h, s, d, dtype=torch.float32, scale=1.0):
    """A (B, H, S, D) view of a (B, S, H, D) buffer, like diffusers' attention inputs."""
    return (torch.randn(b, s, h, d) * scale).to(dtype).transpose(1, 2)


def e4m3_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |y| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6)."""
    a = y.abs().double().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3) / 2


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    return table[codes.long()]


def unpack(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def nvfp4_values(packed, sf, gs, n) -> torch.Tensor:
    vals = decode_e2m1(unpack(packed))
    scale = sf.double().repeat_interleave(16, dim=-1)[..., :vals.shape[-1]] * gs.double()  # sf: padded blocks too
    return (vals * scale)[..., :n]


def mx_scale(scales: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scales.view(torch.uint8).double() - 127)


def assert_layout(t: torch.Tensor, strides: tuple[int, ...]) -> None:
    """``t`` has ``strides`` on every dimension of size > 1 (a size-1 dimension's stride means nothing)."""
    got = tuple(st if n > 1 else None for n, st in zip(t.shape, t.stride()))
    want = tuple(st if n > 1 else None for n, st in zip(t.shape, strides))
    assert got == want, (t.shape, t.stride(), strides)


def expand_blocks(scale: torch.Tensor, block: int, n: int, dim: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, n)


# ----------------------------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------------------------

_X = torch.randn(1, 2, 37, 64)
_XB = bshd(1, 2, 37, 48, torch.bfloat16)
_BIAS = torch.zeros(2, 37).masked_fill(torch.rand(2, 37) > 0.6, float("-inf"))
OPCHECK_CASES = [
    (ops.smooth_k.default, (_X,)),
    (ops.smooth_k.default, (_XB,)),
    (ops.smooth_k.default, (_XB, _BIAS)),
    (ops.mask_keys.default, (_X.expand(2, 2, 37, 64), _BIAS)),
    (ops.mask_keys.default, (_XB, _BIAS[:1])),
    (ops.quantize_per_block.default, (_X, 16, I8)),
    (ops.quantize_per_block.default, (_XB, 4, F8)),
    (ops.quantize_per_head.default, (_X, F8, True)),
    (ops.quantize_per_head.default, (_XB, I8, False)),
    (ops.quantize_per_tensor.default, (_X, I8, False)),
    (ops.quantize_per_tensor.default, (_XB, F8, True)),
    (ops.quantize_per_channel.default, (_X, F8, True)),
    (ops.quantize_per_channel.default, (_XB, F8, False)),
    (ops.quantize_mxfp8.default, (_X, -1)),
    (ops.quantize_mxfp8.default, (_XB, -2)),
    (ops.quantize_nvfp4.default, (_X, False)),
    (ops.quantize_nvfp4.default, (_XB, True)),
    (ops.key_bias.default, (torch.rand(2, 1, 1, 37) > 0.3, _X.expand(2, 2, 37, 64))),
    (ops.key_bias.default, (torch.randn(1, 37), _X)),
    (ops.as_scalar_tensor.default, (0.125,)),
    (ops.lse_shift.default, (_X, _X[:, :1], 0.125)),
    (ops.lse_shift.default, (_XB, _XB, 0.125, torch.scalar_tensor(0.5, dtype=torch.float64))),
    (ops.lse_shift.default, (_XB, _XB, 0.125, None, _BIAS[:1])),
    (ops.skip_threshold.default, (_X, 0.01, 0.0, None, 0.0, 1000.0)),
    (ops.skip_threshold.default, (_XB, 0.0, 2000.0, torch.tensor([700]), 0.9, 1000.0)),
    (ops.kv_stats.default, (_XB, _X)),
    (ops.kv_stats.default, (_X.expand(2, 2, 37, 64), _XB.expand(2, 2, 37, 48), _BIAS)),
    (ops.quantize_kv.default, (_XB, _X, *ops.kv_stats(_XB, _X), None, 16, I8, True)),
    (ops.quantize_kv.default, (_X.expand(2, 2, 37, 64), _XB.expand(2, 2, 37, 48),
                               *ops.kv_stats(_X.expand(2, 2, 37, 64), _XB.expand(2, 2, 37, 48), _BIAS), _BIAS, 64,
                               F8, False)),
]


def test_opcheck_cases_cover_every_quantize_op():
    assert {op for op, _ in OPCHECK_CASES} == set(QUANTIZE_OPS)
    assert len(QUANTIZE_OPS) == 14


@pytest.mark.parametrize("op, args", OPCHECK_CASES, ids=lambda v: getattr(v, "__name__", None) or "")
def test_opcheck(op, args):
    with inputs_unchanged(args), fp8_comparable_allclose():
        torch.library.opcheck(op, args)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.quantize_per_block(_X, 0, I8),
         "quantize_per_block: block=0 is invalid; valid: an int >= 1 (tokens per scale)"),
        (lambda: ops.quantize_per_block(_X, 16, torch.float16),
         "dtype=torch.float16 is not a scaled 8-bit format; valid: torch.int8, torch.float8_e4m3fn"),
        (lambda: ops.quantize_per_head(_X[0], F8), "quantize_per_head expects a (B, H, S, D) tensor; got shape "
                                                   "(2, 37, 64)"),
        (lambda: ops.quantize_per_tensor(_X, torch.uint8),
         "dtype=torch.uint8 is not a scaled 8-bit format; valid: torch.int8, torch.float8_e4m3fn"),
        (lambda: ops.quantize_mxfp8(_X, 1), "quantize_mxfp8: axis=1 is invalid; valid: -1 (channels, Q/K), -2 "
                                            "(tokens, V)"),
        (lambda: ops.smooth_k(_X[0, 0]), "smooth_k expects a (B, H, S, D) tensor; got shape (37, 64)"),
        (lambda: ops.quantize_nvfp4(_X[0], False), "quantize_nvfp4 expects a (B, H, S, D) tensor; got shape "
                                                   "(2, 37, 64)"),
    ],
)
def test_argument_errors(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------------------------
# scaled int8 / fp8, hand-computed
# ----------------------------------------------------------------------------------------------------------------


def test_int8_per_block_known_values_round_half_to_even():
    # block 0 (tokens 0-1): amax 63.5 -> scale 0.5 exactly; x/scale = 127, 2.5, -3.5, 0.5, 1.5, -126.5, 5, 0
    # block 1 (tokens 2-3): amax 12.7 -> scale 0.1
    x = torch.tensor([[63.5, 1.25, -1.75, 0.25], [0.75, -63.25, 2.5, 0.0],
                      [12.7, -12.7, 0.05, 0.0], [0.0, 0.0, 0.0, 0.0]]).reshape(1, 1, 4, 4)
    data, scale = ops.quantize_per_block(x, 2, I8)
    assert data.dtype == I8 and scale.dtype == torch.float32 and scale.shape == (1, 1, 4)  # 2 blocks, padded
    assert scale[0, 0, 0].item() == 0.5
    assert scale[0, 0, 1].item() == pytest.approx(0.1, rel=1e-6)
    assert data[0, 0, :2].flatten().tolist() == [127, 2, -4, 0, 2, -126, 5, 0]
    assert data[0, 0, 2, :2].tolist() == [127, -127]
    assert abs(data[0, 0, 2, 2].item()) in (0, 1)  # 0.05/0.1 = 0.5 (up to fp32 rounding of the scale)


def test_saturation_int8_and_fp8():
    one = torch.tensor(1.0)
    y = formats.cast_scaled(torch.tensor([200.0, -300.0, 127.4, -127.6, 126.5]), one, I8)
    assert y.tolist() == [127, -127, 127, -127, 126]  # never -128
    f = formats.cast_scaled(torch.tensor([1000.0, -1e6, 448.0, 464.0, -470.0]), one, F8).float()
    assert f.tolist() == [448.0, -448.0, 448.0, 448.0, -448.0]  # clamped, never NaN
    assert formats.qmax(I8) == 127 and formats.qmax(F8) == 448


def test_fp8_per_tensor_known_values_ties_to_even():
    # amax 448 -> scale 1: 1.0625 is halfway between 1.0 and 1.125 -> 1.0 (even mantissa); 1.1875 -> 1.25
    x = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 0.0, 3.0, -448.0, 2.0**-9]).reshape(1, 1, 2, 4)
    data, scale = ops.quantize_per_tensor(x, F8)
    assert scale.shape == (1, 1, 1) and scale.item() == 1.0
    assert data.float().flatten().tolist() == [448.0, 1.0, 1.25, -1.0, 0.0, 3.0, -448.0, 2.0**-9]


def test_zero_blocks_have_zero_scale_and_zero_data():
    x = torch.randn(2, 3, 40, 64)
    x[:, :, 16:32] = 0  # the second 16-token block
    x[1, 2] = 0  # a whole head
    for dtype in (I8, F8):
        data, scale = ops.quantize_per_block(x, 16, dtype)
        assert (scale[:, :, 1] == 0).all() and (scale[1, 2] == 0).all()
        assert (data[:, :, 16:32].float() == 0).all() and (data[1, 2].float() == 0).all()
        assert (scale[0, 0, [0, 2]] > 0).all()
        data, scale = ops.quantize_per_head(x[1:], dtype)
        assert scale[0, 2, 0] == 0 and (data[0, 2].float() == 0).all()
        data, scale = ops.quantize_per_channel(x, dtype)
        assert (scale[1, 2] == 0).all() and not data.float().isnan().any()
    data, scale = ops.quantize_per_tensor(torch.zeros(1, 2, 3, 8), I8)
    assert scale.item() == 0 and (data == 0).all()


@pytest.mark.parametrize("s, block", [(37, 16), (33, 4), (5, 16), (64, 1), (17, 128)])
@pytest.mark.parametrize("dtype", [I8, F8])
def test_per_block_partial_last_block(s, block, dtype):
    x = torch.randn(2, 3, s, 32)
    data, scale = ops.quantize_per_block(x, block, dtype)
    nb = math.ceil(s / block)
    assert scale.shape == (2, 3, 4 * math.ceil(nb / 4)) and scale.is_contiguous()  # rows padded to 16 bytes
    assert (scale[:, :, nb:] == 0).all()
    for i in range(nb):
        tokens = x[:, :, i * block:(i + 1) * block]
        expected = tokens.abs().amax(dim=(-1, -2)) * formats.inv_qmax(dtype)  # amax · fp32(1/qmax)
        torch.testing.assert_close(scale[:, :, i], expected, rtol=0, atol=0)
    # the largest element of each block lands on qmax exactly
    back = data.float().abs().reshape(2, 3, -1).amax(-1)
    assert (back == formats.qmax(dtype)).all()


@pytest.mark.parametrize("d", [64, 96, 128])
def test_scope_shapes_and_values(d):
    x = torch.randn(2, 3, 20, d) * torch.tensor([1.0, 4.0, 0.25]).reshape(1, 3, 1, 1)
    data, scale = ops.quantize_per_head(x, F8)
    assert data.shape == x.shape and scale.shape == (1, 3, 1)
    torch.testing.assert_close(scale.flatten(), x.abs().amax(dim=(0, 2, 3)) * (1 / 448), rtol=0, atol=0)
    data, scale = ops.quantize_per_tensor(x, I8)
    assert scale.shape == (1, 1, 1) and scale.item() == pytest.approx(x.abs().max().item() / 127, rel=1e-7)
    data, scale = ops.quantize_per_channel(x, F8)
    assert scale.shape == (2, 3, d)
    torch.testing.assert_close(scale, x.abs().amax(dim=2) * (1 / 448), rtol=0, atol=0)
    err = (data.double() * scale.unsqueeze(2).double() - x.double()).abs()
    assert (err <= e4m3_half_step(x.double() / scale.unsqueeze(2).double()) * scale.unsqueeze(2) * 1.0001).all()


def test_smooth_k_subtracts_the_token_mean_in_fp32_keeping_the_layout():
    k = bshd(2, 3, 50, 64, torch.bfloat16) + 5
    out = ops.smooth_k(k)
    assert out.dtype == torch.float32 and out.shape == k.shape and out.stride() == k.stride()
    expected = k.float() - k.float().mean(dim=2, keepdim=True)
    assert torch.equal(out, expected)
    assert out.mean(dim=2).abs().max() < 1e-5


@pytest.mark.slow
def test_compiled_smoothing_keeps_k_in_its_own_dtype():
    """Under Inductor, K from a fused producer (here RMSNorm and a rotary embedding, as in Flux and Wan) is stored
    once in bf16 and upcast where the mean, the block amax and the cast read it, not stored as an fp32 copy (twice
    the bytes, each read three times: ~40 µs per attention site at Flux's length on the H200)."""
    import re

    from torch._inductor.utils import run_and_get_code

    def k_quantized(x, w, cos, sin):
        k = torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6).float()
        rotated = torch.stack((-k[..., 1::2], k[..., ::2]), -1).flatten(-2)
        k = (k * cos + rotated * sin).to(x.dtype).transpose(1, 2)
        return ops.quantize_per_block(ops.smooth_k(k), 16, I8)

    b, s, h, d = 1, 256, 2, 32
    x, w = torch.randn(b, s, h, d, dtype=torch.bfloat16), torch.randn(d, dtype=torch.bfloat16)
    cos, sin = torch.randn(s, 1, d), torch.randn(s, 1, d)
    torch._dynamo.reset()
    (data, scale), code = run_and_get_code(torch.compile(k_quantized, dynamic=False), x, w, cos, sin)
    buffers = re.findall(r"empty_strided_cpu\(\(([\d, ]+)\), \([\d, ]+\), torch\.(\w+)\)", code[0])
    dims = [([int(n) for n in shape.split(",") if n.strip()], dtype) for shape, dtype in buffers]
    k_sized = [dtype for shape, dtype in dims if len(shape) == 4 and math.prod(shape) == b * s * h * d]
    assert "bfloat16" in k_sized and "float32" not in k_sized, buffers
    assert data.dtype == I8 and scale.dtype == torch.float32  # (values: the eager tests above)


def test_masked_keys_reach_neither_the_mean_nor_the_data():
    """Issue #43, item 2: with a key bias, smooth_k's mean is over the kept keys (bias not -inf) and masked keys'
    rows are 0; mask_keys zeroes them in x's dtype and layout; lse_shift takes the same mean. Whatever masked keys
    hold (huge, inf, nan), nothing changes; a finite bias masks nothing."""
    k = bshd(2, 3, 50, 64, torch.float16) + 5
    bias = torch.zeros(2, 50)
    bias[0, 30:] = float("-inf")
    bias[1, ::3] = float("-inf")
    valid = (bias != float("-inf"))[:, None, :, None]
    out = ops.smooth_k(k, bias)
    assert out.dtype == torch.float32 and out.stride() == k.stride()
    kept = torch.where(valid, k.float(), 0)
    mean = kept.sum(2, keepdim=True) / valid.sum(2, keepdim=True)
    torch.testing.assert_close(out, torch.where(valid, k.float() - mean, 0), rtol=0, atol=1e-5)
    masked = ops.mask_keys(k, bias)
    assert masked.dtype == k.dtype and masked.stride() == k.stride() and torch.equal(masked, torch.where(valid, k, 0))
    q = torch.randn(2, 6, 20, 64)
    shift = ops.lse_shift(q, k, 0.125, None, bias)
    for junk in (6e4, float("inf"), float("nan")):
        k_junk = k.clone()
        k_junk[~valid.expand_as(k)] = junk
        assert torch.equal(ops.smooth_k(k_junk, bias), out)
        assert torch.equal(ops.mask_keys(k_junk, bias), masked)
        assert torch.equal(ops.lse_shift(q, k_junk, 0.125, None, bias), shift)
    assert torch.equal(ops.smooth_k(k, torch.full((1, 50), -1e4)), ops.smooth_k(k))
    every = torch.full((1, 50), float("-inf"))  # no key kept: mean 0, every row 0
    assert torch.equal(ops.smooth_k(k, every), torch.zeros(k.shape))


def test_smooth_k_of_large_fp16_channels_stays_finite():
    k = bshd(1, 2, 40, 64, torch.float16)
    k[:, :, :20] = 6e4  # k - mean reaches 6e4 + 3e4: past fp16's 65504
    k[:, :, 20:] = -3e4
    out = ops.smooth_k(k)
    assert torch.isfinite(out).all() and out.abs().max().item() == pytest.approx(4.5e4, rel=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------------------------


def test_bshd_input_keeps_its_layout_and_is_not_mutated():
    x = bshd(2, 4, 33, 64, torch.bfloat16)
    before = x.clone()
    assert not x.is_contiguous()
    for data, _ in (ops.quantize_per_block(x, 16, I8), ops.quantize_per_head(x, F8), ops.quantize_per_tensor(x, F8),
                    ops.quantize_per_channel(x, F8)):
        assert data.shape == x.shape and data.stride() == x.stride()
    assert torch.equal(x, before) and x.stride() == before.stride()
    # and a contiguous BHSD input stays contiguous
    c = x.contiguous()
    for data, _ in (ops.quantize_per_block(c, 16, F8), ops.quantize_per_channel(c, F8)):
        assert data.is_contiguous()


@pytest.mark.parametrize("op", ["head", "tensor", "channel"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_seq_major_layout(op, layout):
    b, h, s, d = 2, 3, 37, 64
    x = torch.randn(b, h, s, d) if layout == "bhsd" else bshd(b, h, s, d)
    fn = {"head": ops.quantize_per_head, "tensor": ops.quantize_per_tensor, "channel": ops.quantize_per_channel}[op]
    data, scale = fn(x, F8, True)
    plain, plain_scale = fn(x, F8, False)
    s16 = 48  # 37 tokens padded to 16-byte rows; the padding is part of the logical shape
    assert data.shape == (b, h, s16, d)
    assert data.stride() == (h * d * s16, d * s16, 1, s16)  # physically (B, H, D, S16): tokens fastest
    assert torch.equal(data[:, :, :s].view(torch.uint8), plain.view(torch.uint8)) and torch.equal(scale, plain_scale)
    assert (data[:, :, s:].view(torch.uint8) == 0).all()


def test_block_scaled_layouts():
    x = bshd(2, 3, 40, 48)
    data, scales = ops.quantize_mxfp8(x, -1)
    assert data.shape == x.shape and data.is_contiguous() and data.dtype == F8
    # E8M0 scales as their bytes: Inductor's C++ backend has no float8_e8m0fnu (test_recipes.py compiles them)
    assert scales.shape == (2, 3, 40, 2) and scales.dtype == torch.uint8 and scales.is_contiguous()
    data, scales = ops.quantize_mxfp8(x, -2)  # V: 2 token blocks, zero-padded to 4 (a block count never 1)
    assert scales.shape == (2, 3, 4, 48) and (scales[:, :, 2:] == 0).all()
    packed, sf, gs = ops.quantize_nvfp4(x, False)
    assert packed.shape == (2, 3, 40, 24) and packed.dtype == torch.uint8
    assert sf.shape == (2, 3, 40, 3) and sf.dtype == F8 and gs.shape == () and gs.dtype == torch.float32
    packed, sf, gs = ops.quantize_nvfp4(x, True)  # V: along the sequence, padded to 48; 3 blocks padded to 4
    assert packed.shape == (2, 3, 48, 24) and sf.shape == (2, 3, 48, 4) and (sf[..., 3:].float() == 0).all()


# ----------------------------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, exponent",
    [(448.0, 0), (896.0, 1), (224.0, -1), (449.0, 1), (447.0, 0), (1.0, -8), (2.0, -7), (3.5, -7),
     (448 * 2.0**-20, -20), (448 * 2.0**40, 40), (2.0**-30, -38), (6.0, -6), (1e-30, -108)],
)
def test_mx_exponent_rounds_up(amax, exponent):
    assert exponent == math.ceil(math.log2(amax / 448))  # the definition, in float64
    assert formats.mx_exponent(torch.tensor([amax])).item() == exponent
    x = torch.zeros(1, 1, 1, 32)
    x[..., 5] = -amax
    x[..., 7] = amax / 3
    data, scales = ops.quantize_mxfp8(x, -1)
    assert scales.view(torch.uint8).item() == exponent + 127
    assert data.float().abs().max().item() <= 448
    if amax / 2.0**exponent == 448:  # exact powers of two times 448 map onto 448 itself
        assert data[..., 5].float().item() == -448.0


def test_mx_exponent_every_power_of_two():
    for k in range(-100, 100):
        assert formats.mx_exponent(torch.tensor([448 * 2.0**k])).item() == k
        assert formats.mx_exponent(torch.tensor([2.0**k])).item() == math.ceil(math.log2(2.0**k / 448))


def test_mxfp8_zero_blocks_and_partial_blocks():
    x = torch.randn(1, 2, 5, 80) * 10  # D=80: blocks of 32, 32, 16
    x[:, :, :, 32:64] = 0
    data, scales = ops.quantize_mxfp8(x, -1)
    assert scales.shape == (1, 2, 5, 3)
    assert (scales.view(torch.uint8)[..., 1] == 0).all()
    assert (data[..., 32:64].float() == 0).all()
    last = x[..., 64:].abs().amax(-1)
    expected = torch.ceil(torch.log2(last.double() / 448)).long() + 127
    assert torch.equal(scales.view(torch.uint8)[..., 2].long(), expected)
    # along the sequence (V): S=40 -> blocks of 32 and 8 tokens
    v = torch.randn(1, 2, 40, 16)
    data, scales = ops.quantize_mxfp8(v, -2)
    assert scales.shape == (1, 2, 4, 16) and (scales.view(torch.uint8)[:, :, 2:] == 0).all()  # padded to 4 blocks
    expected = torch.ceil(torch.log2(v[:, :, 32:].abs().amax(2).double() / 448)).long() + 127
    assert torch.equal(scales.view(torch.uint8)[:, :, 1].long(), expected)


def test_mxfp8_round_trip_within_half_a_step():
    x = torch.randn(2, 2, 33, 96) * torch.logspace(-3, 3, 96)
    data, scales = ops.quantize_mxfp8(x, -1)
    scale = expand_blocks(mx_scale(scales), 32, 96, -1)
    y = x.double() / scale
    assert y.abs().max() <= 448
    err = (data.double() * scale - x.double()).abs()
    assert (err <= e4m3_half_step(y) * scale).all()


# ----------------------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------------------


def test_e2m1_code_table_and_sign():
    codes = torch.arange(16, dtype=torch.uint8)
    assert formats.e2m1_decode(codes).tolist() == list(E2M1) + [-v for v in E2M1]
    assert formats.e2m1_encode(torch.tensor(E2M1)).tolist() == list(range(8))
    assert formats.e2m1_encode(-torch.tensor(E2M1[1:])).tolist() == list(range(9, 16))
    assert formats.e2m1_encode(torch.tensor([-0.0, -0.1, -0.25])).tolist() == [0, 0, 0]  # no negative zero


@pytest.mark.parametrize(
    "value, decoded",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
     (0.26, 0.5), (0.74, 0.5), (2.51, 3.0), (4.99, 4.0), (5.01, 6.0), (6.0, 6.0), (7.0, 6.0), (1e9, 6.0)],
)
def test_e2m1_round_to_nearest_ties_to_even_code_and_saturate(value, decoded):
    for sign in (1.0, -1.0):
        code = formats.e2m1_encode(torch.tensor([sign * value]))
        assert formats.e2m1_decode(code).item() == (sign * decoded if decoded else 0.0)


def test_nibble_packing_order():
    codes = torch.tensor([[1, 2, 3, 15, 0, 8]], dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0xF3, 0x80]]  # element 2i in the low nibble
    assert torch.equal(formats.unpack_nibbles(packed), codes)


def test_nvfp4_known_block():
    # tensor amax 2688 = 448 * 6 -> tensor scale 1; block 1 has amax 6 -> block scale 1: codes are the values
    x = torch.zeros(1, 1, 1, 32)
    x[..., 0] = 2688.0
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x[..., 16:24] = torch.tensor(ties)
    x[..., 24:32] = -torch.tensor(ties)
    packed, sf, gs = ops.quantize_nvfp4(x, False)
    assert gs.item() == 1.0
    assert sf.float().flatten().tolist() == [448.0, 1.0]
    codes = unpack(packed)[0, 0, 0]
    assert codes[16:].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0, 10, 10, 12, 12, 14, 14, 15]
    assert packed[0, 0, 0, 8:].tolist() == [0x20, 0x42, 0x64, 0x76, 0xA0, 0xCA, 0xEC, 0xFE]
    assert codes[0].item() == 7 and (codes[1:16] == 0).all()  # 2688 / 448 = 6


def test_nvfp4_tensor_scale_and_zero():
    x = torch.randn(1, 2, 3, 32) * 100
    _, sf, gs = ops.quantize_nvfp4(x, False)
    assert gs.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)
    assert sf.float().max().item() == 448.0
    packed, sf, gs = ops.quantize_nvfp4(torch.zeros(1, 1, 2, 16), False)
    assert gs.item() == 1.0 and (packed == 0).all() and (sf.float() == 0).all()


def _nvfp4_bound(x: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 gap at each element's scaled magnitude (saturation costs < one e4m3 step of the block scale)."""
    n = x.shape[-1]
    step = expand_blocks(sf.double(), 16, n, -1) * gs.double()
    y = (x.double() / step).abs()
    half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    return half_gap * step * (1 + 1e-6)


@pytest.mark.parametrize("n", [16, 64, 40])
def test_nvfp4_round_trip_error_bound(n):
    x = torch.randn(2, 3, 10, n) * torch.logspace(-1, 1, n)
    packed, sf, gs = ops.quantize_nvfp4(x, False)
    back = nvfp4_values(packed, sf, gs, n)
    assert ((back - x.double()).abs() <= _nvfp4_bound(x, sf, gs)).all()
    rel = (back - x.double()).norm() / x.double().norm()
    assert rel < 0.15
    # transpose=True quantizes along the sequence
    packed, sf, gs = ops.quantize_nvfp4(x, True)
    back = nvfp4_values(packed, sf, gs, 10).transpose(-1, -2)
    assert back.shape == x.shape
    assert ((back - x.double()).abs().transpose(-1, -2) <= _nvfp4_bound(x.transpose(-1, -2), sf, gs)).all()


# ----------------------------------------------------------------------------------------------------------------
# property test
# ----------------------------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    sq=st.integers(1, 70),
    skv=st.integers(1, 70),
    d=st.sampled_from([16, 32, 48, 64, 80]),
    block=st.sampled_from([1, 4, 16, 32, 64]),
    layout=st.sampled_from(["bhsd", "bshd"]),
    dtype=st.sampled_from(sorted(DTYPES)),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_quantize_property(b, h, sq, skv, d, block, layout, dtype, magnitude, seed):
    torch.manual_seed(seed)
    dt = DTYPES[dtype]

    def make(s):
        if layout == "bhsd":
            return (torch.randn(b, h, s, d) * magnitude).to(dt)
        return bshd(b, h, s, d, dt, magnitude)

    q, k = make(sq), make(skv)
    for x in (q, k):
        before = x.clone()
        s = x.shape[2]
        xd = x.double()
        # per-block int8 / fp8
        for qdtype in (I8, F8):
            data, scale = ops.quantize_per_block(x, block, qdtype)
            assert data.dtype == qdtype and data.shape == x.shape
            assert_layout(data, x.stride())
            assert scale.dtype == torch.float32 and scale.shape == (b, h, 4 * math.ceil(math.ceil(s / block) / 4))
            sc = expand_blocks(scale.double(), block, s, -1).unsqueeze(-1)
            err = (data.double() * sc - xd).abs()
            half = sc / 2 if qdtype == I8 else e4m3_half_step(xd / sc.clamp(min=1e-300)) * sc
            assert (err <= half * (1 + 1e-5) + 1e-30).all()
        # per-head / per-tensor / per-channel fp8, with both layouts of the data
        for fn, shape in ((ops.quantize_per_head, (1, h, 1)), (ops.quantize_per_tensor, (1, 1, 1)),
                          (ops.quantize_per_channel, (b, h, d))):
            for seq_major in (False, True):
                data, scale = fn(x, F8, seq_major)
                s16 = -(-s // 16) * 16  # sequence-major rows are padded to 16 bytes (padding in the shape)
                assert data.dtype == F8 and scale.shape == shape
                assert data.shape == ((b, h, s16, d) if seq_major else x.shape)
                assert_layout(data, (h * d * s16, d * s16, 1, s16) if seq_major else x.stride())
                data = data[:, :, :s]
                sc = scale.double().unsqueeze(-2)
                err = (data.double() * sc - xd).abs()
                assert (err <= e4m3_half_step(xd / sc.clamp(min=1e-300)) * sc * (1 + 1e-5)).all()
        # MXFP8 along channels (Q/K) and tokens (V)
        for axis, n in ((-1, d), (-2, s)):
            data, scales = ops.quantize_mxfp8(x, axis)
            assert data.dtype == F8 and data.shape == x.shape and data.is_contiguous()
            expect = list(x.shape)
            blocks = math.ceil(n / 32)
            expect[axis] = blocks if axis == -1 else 4 * math.ceil(blocks / 4)  # V's token blocks: padded to 4
            assert scales.dtype == torch.uint8 and list(scales.shape) == expect
            assert (scales.narrow(axis, blocks, expect[axis] - blocks) == 0).all()
            sc = expand_blocks(mx_scale(scales), 32, n, axis)
            assert (data.double().abs() <= 448).all()
            err = (data.double() * sc - xd).abs()
            assert (err <= e4m3_half_step(xd / sc) * sc).all()
        # NVFP4 along channels
        packed, sf, gs = ops.quantize_nvfp4(x, False)
        assert packed.dtype == torch.uint8 and packed.shape == (b, h, s, math.ceil(d / 16) * 8)
        assert sf.dtype == F8 and sf.shape == (b, h, s, math.ceil(d / 16)) and gs.shape == ()
        back = nvfp4_values(packed, sf, gs, d)
        assert ((back - xd).abs() <= _nvfp4_bound(x.float(), sf, gs) + 1e-30).all()
        # the input is untouched
        assert torch.equal(x, before) and x.stride() == before.stride()


def test_int8_data_is_x_times_the_ieee_reciprocal_of_the_scale():
    """The definition a kernel that quantizes Q itself reproduces bit for bit (gluon_sage: one reciprocal per row,
    one multiply per element): scale = amax · fp32(1/127), data = round_half_even(x · (1/scale)), saturated."""
    x = torch.randn(1, 2, 300, 128).bfloat16()
    data, scale = ops.quantize_per_block(x, 1, I8)
    amax = x.float().abs().amax(-1)
    assert torch.equal(scale[..., :300], amax * torch.tensor(1 / 127, dtype=torch.float32))
    expected = (x.float() * torch.reciprocal(scale[..., :300, None])).round().clamp(-127, 127).to(I8)
    assert torch.equal(data, expected)
