"""Attention ops (``qattn::scaled_attention``, ``qattn::block_scaled_attention``) on the reference kernel."""

from __future__ import annotations

import math

import pytest
import torch
from support import fp8_comparable_allclose, inputs_unchanged
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import qattn_fx  # noqa: F401  (registers the ops)
from qattn_fx.ops import quantized_attention
from qattn_fx.ops.attention import ATTENTION_OPS
from qattn_fx.recipes import TABLE, Recipe

ops = torch.ops.qattn
I8, F8, E8M0 = torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu


def bshd(b, h, s, d, dtype=torch.bfloat16):
    return torch.randn(b, s, h, d).to(dtype).transpose(1, 2)


def capture(recipe: Recipe, q, k, v, **kwargs):
    """(attention op, its args) that ``quantized_attention`` builds for ``recipe``."""
    calls = []

    def emit(target, args, name):
        if target in ATTENTION_OPS:
            calls.append((target, args))
        return target(*args)

    out = quantized_attention(q, k, v, recipe, emit=emit, **kwargs)
    (call,) = calls
    return call[0], call[1], out


RECIPES = {
    "int8-1-16-1": Recipe("int8", "fp8", 1, 16, 1),
    "int8-64-128-0": Recipe("int8", "fp8", 64, 128, 0),
    "fp8-1-4-1": Recipe("fp8", "fp8", 1, 4, 1),
    "fp8-tensor": Recipe("fp8", "fp8", 0, 0, 0),
    "fp8-head": Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head"),
    "bf16-pv8": Recipe("bf16", "fp8", 0, 0, 1),
    "mxfp8-mxfp8": Recipe("mxfp8", "mxfp8"),
    "mxfp8-fp8": Recipe("mxfp8", "fp8", 0, 0, 1),
    "nvfp4-fp8": Recipe("nvfp4", "fp8", 0, 0, 0),
    "nvfp4-nvfp4": Recipe("nvfp4", "nvfp4"),
}


def _inputs(seed=0, hq=4, hk=2, sq=21, skv=37, d=32, dv=None, layout="bshd"):
    torch.manual_seed(seed)
    dv = dv or d
    if layout == "bshd":
        return bshd(1, hq, sq, d), bshd(1, hk, skv, d), bshd(1, hk, skv, dv)
    return (torch.randn(1, hq, sq, d).bfloat16(), torch.randn(1, hk, skv, d).bfloat16(),
            torch.randn(1, hk, skv, dv).bfloat16())


def _bshd_strides(out: torch.Tensor) -> tuple[int, ...]:
    b, h, s, d = out.shape
    return (s * h * d, d, h * d, 1)


# ----------------------------------------------------------------------------------------------------------------
# opcheck, fake kernels, no mutation
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_opcheck(name):
    op, args, _ = capture(RECIPES[name], *_inputs())
    assert op == (ops.scaled_attention.default if RECIPES[name].family == "scaled" else
                  ops.block_scaled_attention.default)
    with fp8_comparable_allclose():
        torch.library.opcheck(op, args)


def test_opcheck_seq_major_v():
    """fp8 V stored tokens-fastest (what the Triton kernel asks the quantize node for) is a valid input too."""
    q, k, v = _inputs()
    op, args, out = capture(RECIPES["int8-1-16-1"], q, k, v)
    args = list(args)
    v_data = args[4]
    args[4] = v_data.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert args[4].stride(-2) == 1
    with fp8_comparable_allclose():
        torch.library.opcheck(op, tuple(args))
    assert torch.equal(op(*args), out)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fake_matches_real_shape_and_strides_and_inputs_are_untouched(name, out_dtype):
    q, k, v = _inputs(sq=19, skv=40, dv=32)
    op, args, _ = capture(RECIPES[name], q, k, v, out_dtype=out_dtype)
    with inputs_unchanged(args):
        real = op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    assert fake.shape == real.shape == (1, 4, 19, 32)
    assert fake.stride() == real.stride() == _bshd_strides(real)
    assert fake.dtype == real.dtype == out_dtype
    assert torch.isfinite(real.float()).all()


def test_quantized_inputs_to_quantized_attention_are_untouched():
    q, k, v = _inputs()
    copies = [t.clone() for t in (q, k, v)]
    for recipe in RECIPES.values():
        quantized_attention(q, k, v, recipe)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c) and t.stride() == c.stride()


# ----------------------------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------------------------


def _scaled_args():
    q, k, v = (torch.randn(1, 4, 33, 64), torch.randn(1, 2, 45, 64), torch.randn(1, 2, 45, 64))
    qd, qs = ops.quantize_per_block(q, 1, I8)
    kd, ks = ops.quantize_per_block(k, 16, I8)
    vd, vs = ops.quantize_per_channel(v, F8)
    return [qd, qs, kd, ks, vd, vs, 1, 16, 0.125, torch.bfloat16, "reference", None, None]


def _with(args, **changes):
    names = ["q", "q_scale", "k", "k_scale", "v", "v_scale", "q_block", "k_block", "sm_scale", "out_dtype", "kernel",
             "key_bias", "runtime_scale"]
    args = list(args)
    for key, value in changes.items():
        args[names.index(key)] = value
    return args


_S = _scaled_args()
SCALED_ERRORS = [
    (dict(kernel="flash"), "kernel='flash' is unknown; valid: reference, triton_sage, gluon_sage, cudnn_fp8, "
                           "cudnn_mxfp8, flashinfer_fa3_fp8, flashinfer_trtllm_sage"),
    (dict(kernel="cudnn_mxfp8"), "kernel 'cudnn_mxfp8' does not implement scaled attention; it implements: "
                                 "['block_scaled']"),
    (dict(q=_S[0].float()), "quantized q/k must share a dtype in (torch.int8, torch.float8_e4m3fn); got "
                            "torch.float32, torch.int8"),
    (dict(k=_S[2].view(F8)), "quantized q/k must share a dtype in (torch.int8, torch.float8_e4m3fn); got "
                             "torch.int8, torch.float8_e4m3fn"),
    (dict(v=_S[4].float()), "v must be float8_e4m3fn; got torch.float32"),
    (dict(q_scale=_S[1][:, :, :5]), "q_scale must have shape (B, H, >= ceil(S/1)) = (1, 4, >= 33) (each dim may be "
                                    "1); got (1, 4, 5)"),
    (dict(k_block=4), "k_scale must have shape (B, H, >= ceil(S/4)) = (1, 2, >= 12) (each dim may be 1); "
                      "got (1, 2, 4)"),
    (dict(q_scale=_S[1].double()), "q_scale must be float32; got torch.float64"),
    (dict(k_scale=None), "q_scale and k_scale must both be given (quantized Q/K) or both be None (bf16/fp16 Q/K); a "
                         "bf16/fp16 q with int8 k and k_scale asks the kernel to quantize Q"),
    # a bf16 q with int8 k: Q quantized by the kernel, which only kernels that say so (KernelInfo.quantizes_q) do
    (dict(q=_S[0].bfloat16(), q_scale=None), "kernel 'reference' does not quantize a torch.bfloat16 q itself; pass "
                                             "int8 q with q_scale, or use a kernel that does: gluon_sage"),
    (dict(q=_S[0].bfloat16(), q_scale=None, q_block=16, kernel="gluon_sage"),
     "kernel 'gluon_sage' quantizes a torch.bfloat16 q itself only at q_block in (1,); got q_block=16; valid: "
     "q_block in (1,), or int8 q with q_scale"),
    (dict(q=_S[0].bfloat16(), q_scale=None, q_block=0), "q_block=0 is invalid for a torch.bfloat16 q with int8 k (Q "
                                                        "quantized in the kernel); valid: >= 1 (tokens per Q scale)"),
    (dict(q=_S[0].bfloat16(), q_scale=None, kernel="triton_sage"),
     "kernel 'triton_sage' does not quantize a torch.bfloat16 q itself; pass int8 q with q_scale, or use a kernel "
     "that does: gluon_sage"),
    (dict(v_scale=_S[5][..., :3]), "v_scale must have shape (B|1, H|1, Dv|1) (each dim may be 1); got (1, 2, 3)"),
    (dict(v_scale=_S[5].half()), "v_scale must be float32; got torch.float16"),
    (dict(out_dtype=torch.int8), "out_dtype=torch.int8 is invalid; valid: torch.bfloat16, torch.float16, "
                                 "torch.float32"),
    (dict(q_block=-1), "q_block=-1 is invalid; valid: 0 (one scale per head/tensor) or >= 1"),
    (dict(q_block=0), "q_scale must have shape (1, 1|H, 1) (each dim may be 1); got (1, 4, 36)"),
    (dict(k=_S[2][:, :1].expand(1, 3, 45, 64), k_scale=_S[3][:, :1].expand(1, 3, _S[3].shape[-1])),
     "heads must satisfy Hk == Hv and Hq % Hk == 0; got Hq=4, Hk=3, Hv=2"),
    (dict(q=_S[0][:, :3], q_scale=_S[1][:, :3]), "heads must satisfy Hk == Hv and Hq % Hk == 0; got Hq=3, Hk=2, "
                                                 "Hv=2"),
    (dict(k=_S[2][:, :, :0], k_scale=_S[3][:, :, :0], v=_S[4][:, :, :0]),
     "k has zero tokens: attention over an empty key set is undefined"),
    (dict(v=_S[4][:, :, :40]), "v must hold at least 45 tokens (k has 45); got 40"),
    (dict(key_bias=torch.zeros(1, 45, dtype=torch.float64)), "key_bias must be float32; got torch.float64"),
    (dict(key_bias=torch.zeros(1, 44)), "key_bias must have shape (B|1, Skv) = (1|1, 45); got (1, 44)"),
    (dict(key_bias=torch.zeros(45, 2).t()), "key_bias must have shape (B|1, Skv) = (1|1, 45); got (2, 45)"),
    (dict(key_bias=torch.zeros(1, 45), kernel="cudnn_fp8"),
     "kernel 'cudnn_fp8' takes no key_bias (masks); kernels that do: reference, triton_sage, gluon_sage"),
    (dict(runtime_scale=torch.zeros(2)), "runtime_scale must be a 1-element float tensor; got torch.float32 of "
                                         "shape (2,)"),
    (dict(q=_S[0].transpose(-1, -2).contiguous().transpose(-1, -2)),
     "q needs a unit stride on D (the last dim); got strides (8448, 2112, 1, 33)"),
    (dict(q=_S[0][..., :32]), "q and k head dims differ: 32 vs 64"),
    (dict(q=_S[0][0]), "q must be 4-D (B, H, S, D); got shape (4, 33, 64)"),
    (dict(v=_S[4][0]), "v must be 4-D (B, H, S, D); got shape (2, 45, 64)"),
    (dict(q=_S[0][1:]), "batch sizes differ: q 0, k 1, v 1"),
]


@pytest.mark.parametrize("changes, message", SCALED_ERRORS, ids=[str(i) for i in range(len(SCALED_ERRORS))])
def test_scaled_attention_input_errors(changes, message):
    with pytest.raises(ValueError) as e:
        ops.scaled_attention(*_with(_S, **changes))
    assert str(e.value) == message


def test_scaled_attention_accepts_valid_scale_broadcasts():
    q, k, v = torch.randn(2, 4, 9, 32), torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    qd, qs = ops.quantize_per_tensor(q, F8)
    kd, ks = ops.quantize_per_head(k, F8)
    vd, vs = ops.quantize_per_tensor(v, F8)
    assert qs.shape == (1, 1, 1) and ks.shape == (1, 2, 1) and vs.shape == (1, 1, 1)
    out = ops.scaled_attention(qd, qs, kd, ks, vd, vs, 0, 0, 0.2, torch.float16, "reference")
    assert out.shape == (2, 4, 9, 32) and out.dtype == torch.float16
    # bf16 Q/K pass no scales
    out = ops.scaled_attention(q.bfloat16(), None, k.bfloat16(), None, vd, vs, 0, 0, 0.2, torch.float32, "reference")
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"^unquantized q/k must share a float dtype"):
        ops.scaled_attention(q.bfloat16(), None, k.half(), None, vd, vs, 0, 0, 0.2, torch.float32, "reference")


def _block_args(qk="mxfp8", vf="mxfp8"):
    q, k, v = torch.randn(1, 4, 33, 64), torch.randn(1, 2, 45, 64), torch.randn(1, 2, 45, 64)
    if qk == "mxfp8":
        (qd, qsf), (kd, ksf) = ops.quantize_mxfp8(q, -1), ops.quantize_mxfp8(k, -1)
        qg = kg = None
    else:
        (qd, qsf, qg), (kd, ksf, kg) = ops.quantize_nvfp4(q, False), ops.quantize_nvfp4(k, False)
    vg = None
    if vf == "mxfp8":
        vd, vsf = ops.quantize_mxfp8(v, -2)
    elif vf == "nvfp4":
        vd, vsf, vg = ops.quantize_nvfp4(v, True)
    else:
        vd, vsf = ops.quantize_per_channel(v, F8)
    return [qd, qsf, qg, kd, ksf, kg, vd, vsf, vg, qk, vf, 0.125, torch.bfloat16, "reference"]


def _bwith(args, **changes):
    names = ["q", "q_sf", "q_gs", "k", "k_sf", "k_gs", "v", "v_sf", "v_gs", "qk_format", "v_format", "sm_scale",
             "out_dtype", "kernel"]
    args = list(args)
    for key, value in changes.items():
        args[names.index(key)] = value
    return args


_M = _block_args("mxfp8", "mxfp8")
_N = _block_args("nvfp4", "nvfp4")
_MF = _block_args("mxfp8", "fp8")
BLOCK_ERRORS = [
    (_M, dict(kernel="triton_sage"), "kernel 'triton_sage' does not implement block_scaled attention; it "
                                     "implements: ['scaled']"),
    (_M, dict(kernel="cudnn_fp8"), "kernel 'cudnn_fp8' does not implement block_scaled attention; it implements: "
                                   "['scaled']"),
    (_M, dict(kernel="nope"), "kernel='nope' is unknown; valid: reference, triton_sage, gluon_sage, cudnn_fp8, "
                              "cudnn_mxfp8, flashinfer_fa3_fp8, flashinfer_trtllm_sage"),
    (_M, dict(qk_format="int8"), "qk_format='int8' is invalid; valid: mxfp8, nvfp4"),
    (_M, dict(v_format="bf16"), "v_format='bf16' is invalid; valid: fp8, mxfp8, nvfp4"),
    (_M, dict(q_sf=_M[1].view(torch.int8)), "mxfp8 q needs data torch.float8_e4m3fn and scales torch.uint8 or "
                                            "torch.float8_e8m0fnu; got torch.float8_e4m3fn, torch.int8"),
    (_M, dict(q_gs=torch.ones(())), "q_gs (tensor scale) is required for nvfp4 and must be None for mxfp8"),
    (_M, dict(v_sf=_M[7].view(torch.int8)), "mxfp8 v needs data torch.float8_e4m3fn and scales torch.uint8 or "
                                            "torch.float8_e8m0fnu; got torch.float8_e4m3fn, torch.int8"),
    (_M, dict(q_sf=_M[1][..., :1]), "q_sf must have shape (1, 4, 33, 2); got (1, 4, 33, 1)"),
    (_M, dict(k_sf=_M[4][:, :, :3]), "k_sf must have shape (1, 2, 45, 2); got (1, 2, 3, 2)"),
    (_M, dict(v_sf=_M[7][:, :, :1]), "v_sf must have shape (1, 2, >= 2, 64); got (1, 2, 1, 64)"),
    (_M, dict(q=_M[0][..., :32], q_sf=_M[1][..., :1]), "q and k head dims differ: 32 vs 64"),
    (_M, dict(k=_M[3][:, :, :0], k_sf=_M[4][:, :, :0], v=_M[6][:, :, :0]),
     "k has zero tokens: attention over an empty key set is undefined"),
    (_M, dict(q=_M[0][0]), "q must be 4-D (B, H, S, D); got shape (4, 33, 64)"),
    (_N, dict(q_gs=None), "q_gs (tensor scale) is required for nvfp4 and must be None for mxfp8"),
    (_N, dict(k_gs=_N[5].double()), "k_gs must be a float32 scalar tensor; got torch.float64 of shape ()"),
    (_N, dict(v_gs=None), "v_gs (tensor scale) is required for nvfp4 V and must be None otherwise"),
    (_N, dict(v_sf=_N[7][..., :2]), "v_sf must have shape (1, 2, 64, >= 3); got (1, 2, 64, 2)"),
    (_N, dict(q_sf=_N[1][..., :2]), "q_sf must have shape (1, 4, 33, 4); got (1, 4, 33, 2)"),
    (_N, dict(v=_N[6][..., :16], v_sf=_N[7][..., :2]), "nvfp4 v holds 32 padded tokens; expected ceil16(Skv) for "
                                                       "Skv=45"),
    (_N, dict(q=_N[0].view(torch.int8)), "nvfp4 q needs data torch.uint8 and scales torch.float8_e4m3fn; got "
                                         "torch.int8, torch.float8_e4m3fn"),
    (_MF, dict(v_sf=_MF[7][..., :5]), "v_sf must have shape (B|1, H|1, Dv|1) (each dim may be 1); got (1, 2, 5)"),
    (_MF, dict(v_sf=_MF[7].bfloat16()), "fp8 v needs float8_e4m3fn data and float32 scales; got "
                                        "torch.float8_e4m3fn, torch.bfloat16"),
]


@pytest.mark.parametrize("base, changes, message", BLOCK_ERRORS, ids=[str(i) for i in range(len(BLOCK_ERRORS))])
def test_block_scaled_attention_input_errors(base, changes, message):
    ops.block_scaled_attention(*base)  # the unchanged arguments are valid
    with pytest.raises(ValueError) as e:
        ops.block_scaled_attention(*_bwith(base, **changes))
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------------------------
# reference numerics against a hand computation in float64
# ----------------------------------------------------------------------------------------------------------------

E4M3_MIDPOINT_GUARD = 1e-5


def _assert_away_from_e4m3_midpoints(x: torch.Tensor) -> None:
    """The hand computation rounds P (fp64) and the reference rounds P (fp32): identical only away from ties."""
    a = x.abs().double()
    a = a[a > 2.0**-9]
    step = torch.exp2(torch.floor(torch.log2(a.clamp(min=2.0**-6))) - 3)
    frac = (a / step) - torch.floor(a / step)
    assert ((frac - 0.5).abs() > E4M3_MIDPOINT_GUARD).all()


def _hand_attention(qf, kf, vf, sm_scale):
    """softmax with P rounded as e4m3(P·448)/448 for P·V and the row sum taken before rounding, in float64."""
    g = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = qf @ kf.transpose(-1, -2) * sm_scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    _assert_away_from_e4m3_midpoints(p * 448)
    p8 = (p * 448).to(F8).double() / 448
    return (p8 @ vf) / p.sum(-1, keepdim=True)


def test_reference_scaled_matches_hand_computation():
    torch.manual_seed(1)
    b, hq, hk, sq, skv, d, dv = 1, 2, 1, 5, 7, 16, 8
    q_data = torch.randint(-127, 128, (b, hq, sq, d), dtype=I8)
    k_data = torch.randint(-127, 128, (b, hk, skv, d), dtype=I8)
    q_scale = torch.exp2(-torch.randint(5, 8, (b, hq, 3)).float())  # q_block 2: 3 blocks for 5 tokens
    k_scale = torch.exp2(-torch.randint(5, 8, (b, hk, 2)).float())  # k_block 4: 2 blocks for 7 tokens
    v_data = (torch.randn(b, hk, skv, dv) * 100).to(F8)
    v_scale = torch.rand(b, hk, dv) + 0.5
    sm_scale = 0.25
    out = ops.scaled_attention(q_data, q_scale, k_data, k_scale, v_data, v_scale, 2, 4, sm_scale, torch.float32,
                               "reference")
    qf = q_data.double() * q_scale.double().repeat_interleave(2, -1)[..., :sq, None]
    kf = k_data.double() * k_scale.double().repeat_interleave(4, -1)[..., :skv, None]
    vf = v_data.double() * v_scale.double()[:, :, None, :]
    expected = _hand_attention(qf, kf, vf, sm_scale)
    assert out.shape == (b, hq, sq, dv) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_reference_block_scaled_mxfp8_matches_hand_computation():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 40, 64) * 3, torch.randn(1, 2, 40, 24)
    (qd, qsf), (kd, ksf), (vd, vsf) = ops.quantize_mxfp8(q, -1), ops.quantize_mxfp8(k, -1), ops.quantize_mxfp8(v, -2)
    out = ops.block_scaled_attention(qd, qsf, None, kd, ksf, None, vd, vsf, None, "mxfp8", "mxfp8", 0.125,
                                     torch.float32, "reference")

    def deq(data, sf, axis):
        s = torch.exp2(sf.view(torch.uint8).double() - 127).repeat_interleave(32, axis)
        return data.double() * s.narrow(axis, 0, data.shape[axis])

    expected = _hand_attention(deq(qd, qsf, -1), deq(kd, ksf, -1), deq(vd, vsf, -2), 0.125)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    # the op takes the scales' bytes (what quantize_mxfp8 gives) or the same bytes as float8_e8m0fnu
    assert qsf.dtype == torch.uint8
    as_e8m0 = ops.block_scaled_attention(qd, qsf.view(E8M0), None, kd, ksf.view(E8M0), None, vd, vsf.view(E8M0), None,
                                         "mxfp8", "mxfp8", 0.125, torch.float32, "reference")
    assert torch.equal(as_e8m0, out)


def test_reference_gqa_equals_repeated_heads():
    q, k, v = _inputs(hq=6, hk=2)
    for recipe in (RECIPES["int8-1-16-1"], RECIPES["mxfp8-fp8"], RECIPES["nvfp4-nvfp4"]):
        grouped = quantized_attention(q, k, v, recipe, out_dtype=torch.float32)
        repeated = quantized_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), recipe,
                                       out_dtype=torch.float32)
        if recipe.qk_dtype == "nvfp4":  # the tensor scale is per tensor: the same values, the same scale
            torch.testing.assert_close(grouped, repeated, rtol=0, atol=0)
        else:
            assert torch.equal(grouped, repeated)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        assert F.cosine_similarity(grouped.flatten(), ref.flatten(), dim=0) > 0.98


def test_reference_with_bf16_qk_is_sdpa_up_to_p_rounding():
    q, k, v = _inputs(layout="bhsd")
    out = quantized_attention(q, k, v, RECIPES["bf16-pv8"], out_dtype=torch.float32)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    rel = ((out - ref).abs().sum() / ref.abs().sum()).item()
    assert rel < 0.06  # FP8 P and per-channel FP8 V only


# ----------------------------------------------------------------------------------------------------------------
# quantized_attention for every recipe of the table
# ----------------------------------------------------------------------------------------------------------------


def _table_recipes():
    seen = {}
    for row in TABLE:
        for blocks in row.blocks.all():
            r = Recipe(row.qk_dtype, row.v_dtype, *blocks, scale_scope=row.scale_scopes[0])
            key = (r.qk_dtype, r.v_dtype, r.v_block_size, r.scale_scope, r.q_block_size > 0)
            seen.setdefault(key, r)
    return list(seen.values())


@pytest.mark.parametrize("recipe", _table_recipes(), ids=lambda r: r.name)
def test_quantized_attention_every_recipe_family(recipe):
    q, k, v = _inputs(hq=4, hk=2, sq=19, skv=50, d=64, dv=48)
    out = quantized_attention(q, k, v, recipe)
    assert out.shape == (1, 4, 19, 48) and out.dtype == torch.bfloat16
    assert out.stride() == _bshd_strides(out)
    out32 = quantized_attention(q, k, v, recipe, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    assert torch.equal(out32.bfloat16(), out)
    same = quantized_attention(q, k, v, recipe, sm_scale=1 / math.sqrt(64), out_dtype=torch.float32)
    assert torch.equal(same, out32)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    floor = 0.97 if "nvfp4" in (recipe.qk_dtype, recipe.v_dtype) else 0.995
    assert F.cosine_similarity(out32.flatten(), ref.flatten(), dim=0) > floor


def test_quantized_attention_errors():
    q, k, v = _inputs(d=72)
    with pytest.raises(ValueError, match=r"^nvfp4 Q/K needs head_dim % 16 == 0; got head_dim=72$"):
        quantized_attention(q, k, v, RECIPES["nvfp4-fp8"])
    with pytest.raises(ValueError, match=r"^kernel='sage2' is unknown; valid: reference, "):
        quantized_attention(q, k, v, RECIPES["int8-1-16-1"], kernel="sage2")
    # head_dim 72 is fine for the other formats (MXFP8 pads the last block)
    assert quantized_attention(q, k, v, RECIPES["mxfp8-mxfp8"]).shape == (1, 4, 21, 72)


def test_non_finite_inputs_spread_through_the_scales_that_cover_them():
    """The behaviour documented in qattn_fx/ops/quantize.py ("Non-finite inputs"), against SDPA's math kernel."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qattn_fx.spec import DEFAULT_RECIPE

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))

    def rows(out):  # (head, row) of every row with a non-finite entry
        return {tuple(i) for i in (~torch.isfinite(out)).any(-1)[0].nonzero().tolist()}

    def run(recipe, q=q, k=k, v=v, mask=None):
        with sdpa_kernel(SDPBackend.MATH):
            dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return rows(quantized_attention(q, k, v, recipe, attn_mask=mask)), rows(dense)

    q_inf = q.clone()
    q_inf[0, 0, 5, 3] = float("inf")
    assert run(DEFAULT_RECIPE, q=q_inf) == ({(0, 5)}, {(0, 5)})  # per-token Q scales: SDPA's pattern
    assert run(Recipe("int8", "fp8", 16, 16, 1), q=q_inf)[0] == {(0, i) for i in range(16)}  # its Q block
    assert len(run(Recipe("fp8", "fp8", 0, 0, 0), q=q_inf)[0]) == 64  # per-tensor: everything
    assert run(Recipe("mxfp8", "mxfp8"), q=q_inf)[0] == set()  # MXFP8 saturates
    k_inf = k.clone()
    k_inf[0, 0, 7, 3] = float("inf")
    ours, dense = run(DEFAULT_RECIPE, k=k_inf)
    assert ours == {(0, i) for i in range(32)} and dense < ours and dense  # smoothing: the whole head
    v_inf = v.clone()
    v_inf[0, 1, 7, 3] = float("inf")
    out = quantized_attention(q, k, v_inf, DEFAULT_RECIPE)
    assert out[0, 1, :, 3].isnan().all() and torch.isfinite(out[..., [0, 1, 2, 4]]).all()  # SDPA: inf there
    mask = torch.arange(32)[None, None, None, :] < 20
    k_masked, v_masked = k.clone(), v.clone()
    k_masked[0, 0, 25, 3] = v_masked[0, 1, 28, 0] = float("inf")
    ours, dense = run(DEFAULT_RECIPE, k=k_masked, v=v_masked, mask=mask)
    assert ours == set() and dense  # masked keys leave no trace here; SDPA's math gives NaN rows (inf + -inf)
