"""CPU tests of the library-kernel adapters: scale layouts, gates, caches (no GPU, no cudnn/flashinfer needed).

* MXFP8 F8_128x4 packing (cuDNN) against :func:`qattn_fx.formats.quantize_mxfp8` outputs, hand-checked byte positions,
  zero padding, non-divisible lengths, the D-plane-major V layout.
* FlashInfer Sage ragged scale slots against ``torch.ops.qattn.quantize_per_block``.
* Architecture / version gates on faked hardware, input validation, graph/plan cache keys and the FIFO cache.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest
import torch

import qattn_fx.ops  # noqa: F401  (registers the ops)
from qattn_fx import kernels
from qattn_fx.kernels import _cuda_utils as cu
from qattn_fx.kernels import cudnn as kc
from qattn_fx.kernels import flashinfer as kf
from qattn_fx import formats

ops = torch.ops.qattn


# ------------------------------------------------------------------------------------------------------------------
# F8_128x4 packing
# ------------------------------------------------------------------------------------------------------------------


def _rowwise_byte(lead_index: torch.Tensor, r: torch.Tensor, c: torch.Tensor, rows_pad: int, cols_pad: int):
    """Independent statement of the layout: atoms of 128x4, row tile outer, column tile inner, leading dims outermost;
    inside an atom (r % 32)·16 + ((r % 128) // 32)·4 + c % 4."""
    col_tiles = cols_pad // 4
    atom = (lead_index * (rows_pad // 128) + r // 128) * col_tiles + c // 4
    return atom * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("shape", [(2, 3, 150, 64), (1, 2, 33, 96), (1, 1, 256, 128), (2, 1, 130, 256)])
def test_pack_rowwise_matches_quantize_mxfp8(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 0.1
    data, scales = ops.quantize_mxfp8(x, -1)
    assert scales.dtype == torch.uint8  # E8M0 bytes
    b, h, s, d = shape
    nblk = (d + 31) // 32
    assert scales.shape == (b, h, s, nblk)
    packed = kc.pack_f8_128x4(scales)
    rp, cp = (s + 127) // 128 * 128, (nblk + 3) // 4 * 4
    assert packed.shape == (b, h, rp, cp) and packed.dtype == torch.uint8 and packed.is_contiguous()
    raw = scales.view(torch.uint8)
    assert bool((raw > 0).all())  # so zero bytes below can only be padding
    bb, hh, rr, cc = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(s), torch.arange(nblk),
                                    indexing="ij")
    pos = _rowwise_byte(bb * h + hh, rr, cc, rp, cp)
    flat = packed.reshape(-1)
    assert torch.equal(flat[pos.reshape(-1)], raw.reshape(-1))
    written = torch.zeros(flat.numel(), dtype=torch.bool)
    written[pos.reshape(-1)] = True
    assert int(written.sum()) == raw.numel()  # a bijection onto the written bytes
    assert bool((flat[~written] == 0).all())  # padding rows / blocks are zero bytes, never NaN (0xFF)


def test_pack_rowwise_hand_checked_positions():
    rows, cols = 130, 5  # 2 row tiles, 2 column tiles after padding to (256, 8)
    sf = torch.zeros(1, 1, rows, cols, dtype=torch.uint8)
    for r, c in [(0, 0), (1, 0), (32, 0), (33, 0), (127, 0), (0, 3), (0, 4), (128, 0), (129, 0), (31, 2), (129, 4)]:
        sf[0, 0, r, c] = (r * 7 + c) % 250 + 1
    flat = kc.pack_f8_128x4(sf).reshape(-1)
    assert flat.numel() == 256 * 8
    expect = {(0, 0): 0, (1, 0): 16, (32, 0): 4, (33, 0): 20, (127, 0): 31 * 16 + 3 * 4, (0, 3): 3,
              (31, 2): 31 * 16 + 2, (0, 4): 512, (128, 0): 1024, (129, 0): 1024 + 16, (129, 4): 1536 + 16}
    for (r, c), byte in expect.items():
        assert int(flat[byte]) == int(sf[0, 0, r, c]), (r, c, byte)
    assert int((flat != 0).sum()) == len(expect)


def test_pack_rowwise_accepts_uint8_and_rejects_wide_dtypes():
    a = torch.randint(1, 255, (3, 7), dtype=torch.uint8)
    assert torch.equal(kc.pack_f8_128x4(a), kc.pack_f8_128x4(a.view(torch.float8_e8m0fnu)))
    with pytest.raises(ValueError, match="one byte"):
        kc.pack_f8_128x4(torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"\(\.\.\., R, C\)"):
        kc.pack_f8_128x4(torch.ones(4, dtype=torch.uint8))


def _columnwise_byte(b, h, j, d, heads, s4, batch):
    plane, dm = d // 128, d % 128
    groups = batch * heads * (s4 // 4)
    tile = (b * heads + h) * (s4 // 4) + j // 4
    return plane * groups * 512 + tile * 512 + (dm % 32) * 16 + (dm // 32) * 4 + j % 4


@pytest.mark.parametrize("shape", [(2, 2, 100, 64), (1, 3, 300, 128), (2, 1, 64, 256), (1, 1, 31, 64)])
def test_pack_columnwise_v_matches_quantize_mxfp8(shape):
    torch.manual_seed(1)
    v = torch.randn(shape) + 0.05
    data, scales = ops.quantize_mxfp8(v, -2)
    b, h, s, d = shape
    nblk = (s + 31) // 32
    s4, dp = (nblk + 3) // 4 * 4, (d + 127) // 128 * 128
    # the op pads the token blocks to a multiple of 4 with zero bytes: packed, that is the layout's own padding
    assert scales.shape == (b, h, s4, d) and bool((scales[:, :, nblk:] == 0).all())
    padded, scales = scales, scales[:, :, :nblk]
    packed = kc.pack_f8_128x4_columnwise(scales)
    assert torch.equal(kc.pack_f8_128x4_columnwise(padded), packed)
    assert packed.shape == (b, h, s4, dp)
    assert packed.stride() == (h * s4 * dp, s4 * dp, 1, s4)  # the descriptor cuDNN documents for descale_v
    raw = scales.view(torch.uint8)
    assert bool((raw > 0).all())
    flat = torch.as_strided(packed, (b * h * s4 * dp,), (1,))
    bb, hh, jj, dd = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(nblk), torch.arange(d),
                                    indexing="ij")
    pos = _columnwise_byte(bb, hh, jj, dd, h, s4, b).reshape(-1)
    assert torch.equal(flat[pos], raw.reshape(-1))
    written = torch.zeros(flat.numel(), dtype=torch.bool)
    written[pos] = True
    assert int(written.sum()) == raw.numel()
    assert bool((flat[~written] == 0).all())
    if d <= 128:  # one D plane: identical to packing each (b, h) slab's transposed scales on its own
        per_slab = kc.pack_f8_128x4(raw.transpose(-1, -2))
        assert torch.equal(flat, per_slab.reshape(-1))


def test_mxfp8_roundtrip_through_layout_dequantizes_like_the_reference():
    """Reading scales back from the packed layout reproduces formats.dequantize_mxfp8 exactly."""
    torch.manual_seed(2)
    x = torch.randn(1, 2, 140, 64)
    data, scales = ops.quantize_mxfp8(x, -1)
    packed = kc.pack_f8_128x4(scales).reshape(-1)
    rr, cc = torch.meshgrid(torch.arange(140), torch.arange(2), indexing="ij")
    back = torch.stack([packed[_rowwise_byte(torch.tensor(hh), rr, cc, 256, 4)] for hh in range(2)])[None]
    recon = formats.dequantize_mxfp8(data, back.view(torch.float8_e8m0fnu), -1)
    assert torch.equal(recon, formats.dequantize_mxfp8(data, scales, -1))


# ------------------------------------------------------------------------------------------------------------------
# FlashInfer Sage ragged scale layout
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens, block, starts, slots", [
    ([20, 20, 20], 16, [0, 2, 4], 6),  # 20 // 16 + 1 = 2, 40 // 16 + 2 = 4; ceil(60/16) + 2 = 6
    ([5, 5], 4, [0, 2], 4),
    ([3, 3], 1, [0, 4], 7),  # block 1: one slot per token plus one spare slot between sequences
    ([37], 16, [0], 3),
    ([16, 16], 16, [0, 2], 3),  # divisible lengths: slot 1 stays unused, sequence 1 starts at 16 // 16 + 1
    ([7, 9, 2], 4, [0, 2, 6], 7),  # ragged lengths: 7 // 4 + 1, 16 // 4 + 2; ceil(18/4) + 2
])
def test_ragged_scale_slots_hand_checked(lens, block, starts, slots):
    assert kf.ragged_scale_slots(lens, block) == (starts, slots)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("batch, seq", [(1, 37), (3, 37), (2, 32), (2, 1)])
def test_ragged_block_scales_match_quantize_per_block(dtype, block, batch, seq):
    torch.manual_seed(3)
    heads, d = 2, 16
    x = torch.randn(batch, heads, seq, d) * torch.linspace(0.5, 2.0, seq)[:, None]
    data, scale = ops.quantize_per_block(x, block, dtype)
    nb = (seq + block - 1) // block
    assert scale.shape == (batch, heads, -(-nb // 4) * 4)  # rows padded to 16 bytes
    ragged = kf.to_ragged_block_scales(scale, seq, block, batch, heads)
    starts, slots = kf.ragged_scale_slots([seq] * batch, block)
    assert ragged.shape == (heads, slots) and ragged.dtype == torch.float32
    used = torch.zeros(slots, dtype=torch.bool)
    for b in range(batch):
        for t in range(seq):
            slot = (b * seq) // block + b + t // block  # the formula in sageQuant.cu
            used[slot] = True
            assert torch.equal(ragged[:, slot], scale[b, :, t // block])
    assert bool((ragged[:, ~used] == 0).all())
    # Dequantizing the ragged (tokens, H, D) data with per-token scales gathered from the ragged layout is the
    # reference.
    tok_b = torch.arange(batch).repeat_interleave(seq)
    tok_t = torch.arange(seq).repeat(batch)
    slot_of_token = (tok_b * seq) // block + tok_b + tok_t // block
    per_token = ragged[:, slot_of_token].T  # (B·S, H)
    ragged_data = data.transpose(1, 2).reshape(batch * seq, heads, d).float()
    deq = (ragged_data * per_token[:, :, None]).reshape(batch, seq, heads, d).transpose(1, 2)
    assert torch.equal(deq, formats.dequantize_scaled(data, scale, block))


def test_ragged_block_scales_broadcast_and_errors():
    scale = torch.rand(1, 1, 3)
    out = kf.to_ragged_block_scales(scale, 40, 16, 2, 4)
    assert out.shape == (4, 6)  # ceil(2·40/16) + 2 - 1
    with pytest.raises(ValueError, match=r"\(B\|1, H\|1, >= ceil\(S/16\)\)"):
        kf.to_ragged_block_scales(torch.rand(2, 4, 2), 40, 16, 2, 4)
    with pytest.raises(ValueError, match="valid: 1, 4, 16"):
        kf.ragged_scale_slots([4], 0)


def test_channel_v_scale_matches_quantize_per_channel():
    torch.manual_seed(4)
    v = torch.randn(1, 3, 50, 128)
    _, scale = ops.quantize_per_channel(v, torch.float8_e4m3fn)
    assert scale.shape == (1, 3, 128)
    sf = kf.to_channel_v_scale(scale, 3, 128)
    assert sf.shape == (3, 128) and sf.is_contiguous() and torch.equal(sf, scale[0])
    _, tensor_scale = ops.quantize_per_tensor(v, torch.float8_e4m3fn)
    assert torch.equal(kf.to_channel_v_scale(tensor_scale, 3, 128), tensor_scale.reshape(()).expand(3, 128))
    with pytest.raises(ValueError, match=r"\(1, 3\|1, 128\|1\)"):
        kf.to_channel_v_scale(torch.rand(2, 3, 128), 3, 128)


def test_per_head_scale():
    h = torch.rand(1, 5, 1)
    assert torch.equal(kf.per_head_scale(h, 5), h.reshape(5))
    t = torch.rand(1, 1, 1)
    assert torch.equal(kf.per_head_scale(t, 5), t.reshape(1).expand(5))
    with pytest.raises(ValueError, match="per-head"):
        kf.per_head_scale(torch.rand(1, 3, 1), 5)


# ------------------------------------------------------------------------------------------------------------------
# Gates on faked hardware
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend there is a CUDA device of a chosen capability; the kernels' own device check is bypassed."""
    state = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["cap"])
    fake = lambda kernel, **tensors: torch.device("cuda", 0)  # noqa: E731
    monkeypatch.setattr(kc, "require_cuda", fake)
    monkeypatch.setattr(kf, "require_cuda", fake)
    return state


def _fp8(shape):
    return torch.randn(shape).to(torch.float8_e4m3fn)


def _scaled_args(b=1, h=2, s=8, d=128, qk_dtype=torch.float8_e4m3fn, block=0, per="tensor"):
    q = (torch.randn(b, h, s, d).to(qk_dtype) if qk_dtype == torch.float8_e4m3fn
         else torch.randint(-5, 5, (b, h, s, d), dtype=torch.int8))
    k = q.clone()
    v = _fp8((b, h, s, d))
    if block:
        nb = (s + block - 1) // block
        qs, ks = torch.rand(b, h, nb), torch.rand(b, h, nb)
        vs = torch.rand(b, h, d)
    elif per == "head":
        qs, ks, vs = torch.rand(1, h, 1), torch.rand(1, h, 1), torch.rand(1, h, 1)
    else:
        qs, ks, vs = torch.rand(1, 1, 1), torch.rand(1, 1, 1), torch.rand(1, 1, 1)
    return q, qs, k, ks, v, vs, block, block, 0.125, torch.bfloat16


def test_mxfp8_gate_names_capability_and_valid_ones(fake_gpu):
    fake_gpu["cap"] = (9, 0)
    x = torch.randn(1, 2, 64, 128)
    q, q_sf = ops.quantize_mxfp8(x, -1)
    v, v_sf = ops.quantize_mxfp8(x, -2)
    with pytest.raises(RuntimeError) as err:
        kc.mxfp8_attention(q, q_sf, None, q, q_sf, None, v, v_sf, None, "mxfp8", "mxfp8", 0.1, torch.bfloat16)
    msg = str(err.value)
    assert "9.0 (sm_90)" in msg and "10.0 (sm_100)" in msg and "10.3 (sm_103)" in msg and "Hopper" in msg


def test_trtllm_sage_int8_gate_is_sm100_only(fake_gpu):
    fake_gpu["cap"] = (10, 3)
    args = _scaled_args(qk_dtype=torch.int8, block=16)
    with pytest.raises(RuntimeError) as err:
        kf.trtllm_sage_attention(*args)
    assert str(err.value).startswith("flashinfer_trtllm_sage needs compute capability 10.0 (sm_100) (")
    assert "has compute capability 10.3 (sm_103)" in str(err.value)
    fake_gpu["cap"] = (9, 0)
    with pytest.raises(RuntimeError,
                       match=r"needs compute capability 10\.0 \(sm_100\), 10\.3 \(sm_103\).*9\.0 \(sm_90\)"):
        kf.trtllm_sage_attention(*_scaled_args(block=4))


def test_fa3_gate_is_sm90_only(fake_gpu):
    fake_gpu["cap"] = (10, 0)
    with pytest.raises(RuntimeError) as err:
        kf.fa3_fp8_attention(*_scaled_args(per="head"))
    assert "9.0 (sm_90)" in str(err.value) and "10.0 (sm_100)" in str(err.value)


def test_cudnn_fp8_gate(fake_gpu):
    fake_gpu["cap"] = (8, 9)
    with pytest.raises(RuntimeError) as err:
        kc.fp8_attention(*_scaled_args())
    msg = str(err.value)
    assert "8.9 (sm_89)" in msg and "9.0 (sm_90)" in msg and "10.0 (sm_100)" in msg and "10.3 (sm_103)" in msg


def test_cudnn_fp8_head_dims_per_arch(fake_gpu):
    kc.check_fp8_head_dims((9, 0), 256, 256)
    kc.check_fp8_head_dims((10, 0), 128, 64)
    with pytest.raises(ValueError, match="up to 256"):
        kc.check_fp8_head_dims((9, 0), 272, 272)
    with pytest.raises(ValueError, match="up to 128"):
        kc.check_fp8_head_dims((10, 0), 256, 256)
    with pytest.raises(ValueError, match="head_dim \\(Q/K\\)=100"):
        kc.check_fp8_head_dims((9, 0), 100, 128)
    fake_gpu["cap"] = (10, 0)
    with pytest.raises(ValueError, match="up to 128"):
        kc.fp8_attention(*_scaled_args(d=256))


def test_version_gates():
    kc.check_cudnn_version("k", (9, 19, 0), kc.FP8_MIN_CUDNN, kc.FP8_BAD_CUDNN)
    with pytest.raises(RuntimeError, match=r">= 9\.21\.0.*loaded 9\.19\.0"):
        kc.check_cudnn_version("cudnn_mxfp8", (9, 19, 0), kc.MXFP8_MIN_CUDNN, kc.MXFP8_BAD_CUDNN)
    with pytest.raises(RuntimeError, match="known bugs"):
        kc.check_cudnn_version("cudnn_mxfp8", (9, 23, 1), kc.MXFP8_MIN_CUDNN, kc.MXFP8_BAD_CUDNN)
    with pytest.raises(RuntimeError, match="known bugs"):
        kc.check_cudnn_version("cudnn_fp8", (9, 10, 0), kc.FP8_MIN_CUDNN, kc.FP8_BAD_CUDNN)
    assert cu.cudnn_version_tuple(91900) == (9, 19, 0) and cu.cudnn_version_tuple(8907) == (8, 9, 7)
    kf.check_flashinfer_version("k", "0.7.2.post1", kf.SAGE_MIN_FLASHINFER)
    kf.check_flashinfer_version("k", "0.6.16rc1", kf.SAGE_MIN_FLASHINFER)
    for old in ("0.6.13", "0.6.16rc0"):
        with pytest.raises(RuntimeError, match=r">= 0\.6\.16rc1; found " + old.replace(".", r"\.")):
            kf.check_flashinfer_version("flashinfer_trtllm_sage", old, kf.SAGE_MIN_FLASHINFER)


def test_fp8_path_choice():
    assert kc.fp8_path((9, 0), (9, 19, 0), torch.bfloat16) == "fp8_out"  # bf16 O is Blackwell-only
    assert kc.fp8_path((10, 0), (9, 19, 0), torch.bfloat16) == "direct"
    assert kc.fp8_path((10, 3), (9, 19, 0), torch.float16) == "direct"
    assert kc.fp8_path((10, 0), (9, 19, 0), torch.float32) == "fp8_out"
    assert kc.fp8_path((10, 0), (9, 12, 0), torch.bfloat16) == "fp8_out"


def test_fp8_output_scale_bounds_o():
    assert kc.fp8_output_margin(0) == pytest.approx((1 + 1 / 16) * (1 + 2**-8))
    assert 1.06 < kc.fp8_output_margin(4608) < 1.08 and 1.2 < kc.fp8_output_margin(75600) < 1.25
    d = kc.fp8_output_descale(torch.tensor([[[0.5]]]), 4608)
    assert d.shape == (1, 1, 1, 1) and float(d) == pytest.approx(0.5 * kc.fp8_output_margin(4608))
    assert float(kc.fp8_output_descale(torch.zeros(1, 1, 1), 10)) == 1.0  # all-zero V: no inf/NaN scale
    # worst case the bound is meant for: every weight rounded up by the maximal e4m3 error, V at its maximum.
    p = torch.rand(5000) * 0.02
    p[0] = 1.0
    rounded = formats.round_p_fp8(p)
    assert float(rounded.sum() / p.sum()) <= kc.fp8_output_margin(5000)


@pytest.mark.parametrize("kernel, fn, args, match", [
    ("cudnn_fp8", kc.fp8_attention, _scaled_args(per="head"), r"one scale per tensor.*\(1, 2, 1\)"),
    ("cudnn_fp8", kc.fp8_attention, _scaled_args(block=4), "q_block=4"),
    ("cudnn_fp8", kc.fp8_attention, _scaled_args(qk_dtype=torch.int8), "float8_e4m3fn; got torch.int8"),
    ("fa3", kf.fa3_fp8_attention, _scaled_args(block=16), "q_block=16"),
    ("fa3", kf.fa3_fp8_attention, _scaled_args(d=96, per="head"), "valid: equal Q/K/V head dims in 64, 128, 256"),
    ("fa3", kf.fa3_fp8_attention, _scaled_args(per="head")[:-1] + (torch.float32,), "valid: bfloat16, float16"),
    ("sage", kf.trtllm_sage_attention, _scaled_args(block=8), "valid: 1, 4, 16"),
    ("sage", kf.trtllm_sage_attention, _scaled_args(block=4, d=64), "valid: 128"),
    ("sage", kf.trtllm_sage_attention, _scaled_args(qk_dtype=torch.int8, block=4)[:-1] + (torch.float16,),
     "valid: bfloat16"),
])
def test_input_validation_names_value_and_choices(kernel, fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_zero_length_keys_refused_by_the_kernels():
    q, qs, k, ks, v, vs, *rest = _scaled_args(s=8)
    k0, v0 = k[:, :, :0], v[:, :, :0]
    with pytest.raises(ValueError, match="hangs"):
        kc.fp8_attention(q, qs, k0, ks, v0, vs, *rest)
    q, qs, k, ks, v, vs, *rest = _scaled_args(s=8, per="head")
    with pytest.raises(ValueError, match="zero tokens"):
        kf.fa3_fp8_attention(q, qs, k[:, :, :0], ks, v[:, :, :0], vs, *rest)


def test_cpu_tensors_get_a_clear_error_through_the_op():
    q, qs, k, ks, v, vs, qb, kb, sm, out = _scaled_args()
    with pytest.raises(RuntimeError, match="runs on CUDA tensors only; q is on cpu"):
        ops.scaled_attention(q, qs, k, ks, v, vs, qb, kb, sm, out, "cudnn_fp8")


# ------------------------------------------------------------------------------------------------------------------
# Cache keys, caches, lazy imports
# ------------------------------------------------------------------------------------------------------------------


def test_fp8_graph_key():
    b, h, s, d = 2, 4, 16, 64
    bshd = _fp8((b, s, h, d)).transpose(1, 2)
    bhsd = _fp8((b, h, s, d))
    key = kc.fp8_graph_key(0, "fp8_out", bshd, bshd, bshd, 0.125, torch.bfloat16)
    other = _fp8((b, s, h, d)).transpose(1, 2)  # another tensor of the same shape, strides and dtype
    assert key == kc.fp8_graph_key(0, "fp8_out", other, bshd, bshd, 0.125, torch.bfloat16)
    assert key != kc.fp8_graph_key(0, "fp8_out", bhsd, bshd, bshd, 0.125, torch.bfloat16)  # strides differ
    assert key != kc.fp8_graph_key(1, "fp8_out", bshd, bshd, bshd, 0.125, torch.bfloat16)  # device differs
    assert key != kc.fp8_graph_key(0, "direct", bshd, bshd, bshd, 0.125, torch.bfloat16)  # arch path differs
    assert key != kc.fp8_graph_key(0, "fp8_out", bshd, bshd, bshd, 0.1, torch.bfloat16)  # sm_scale baked in
    assert key != kc.fp8_graph_key(0, "fp8_out", bshd, bshd, bshd, 0.125, torch.float16)
    cross = _fp8((b, 8, h, d)).transpose(1, 2)
    assert key != kc.fp8_graph_key(0, "fp8_out", bshd, cross, cross, 0.125, torch.bfloat16)
    hash(key)
    assert kc.mxfp8_graph_key(0, bshd, bshd, bshd, 0.1, torch.bfloat16) != kc.mxfp8_graph_key(
        0, bhsd, bhsd, bhsd, 0.1, torch.bfloat16)
    assert kf.fa3_plan_key(0, 2, 16, 8, 4, 4, 128, 128, torch.bfloat16, 0.1) != kf.fa3_plan_key(
        0, 2, 16, 16, 4, 4, 128, 128, torch.bfloat16, 0.1)


class _FakeNotSupported(Exception):
    pass


class _FakeTensor:
    def __init__(self, name="", stride=None):
        self.name, self.stride = name, stride

    def set_output(self, value):
        return self

    def set_dim(self, value):
        return self

    def set_stride(self, value):
        return self

    def set_data_type(self, value):
        return self


def _fake_cudnn(accept):
    """A stand-in for the cudnn module: ``accept(strides_by_name, generate_stats)`` decides what builds."""
    from types import SimpleNamespace

    class Graph:
        def __init__(self, **kwargs):
            self.inputs = {}
            self.generate_stats = None

        def tensor(self, name, dim, stride, data_type, reordering_type=None):
            self.inputs[name] = tuple(stride)
            return _FakeTensor(name, stride)

        def sdpa_fp8(self, *args, attn_scale, generate_stats, use_causal_mask):
            self.generate_stats = generate_stats
            return [_FakeTensor("o"), _FakeTensor("stats"), _FakeTensor("amax_s"), _FakeTensor("amax_o")]

        def build(self, modes):
            if not accept({n: self.inputs[n] for n in ("q", "k", "v")}, self.generate_stats):
                raise _FakeNotSupported("no engine")

        def get_workspace_size(self):
            return 256

    types = SimpleNamespace(FP8_E4M3="e4m3", FLOAT="f32", BFLOAT16="bf16", HALF="f16")
    return SimpleNamespace(data_type=types, pygraph=Graph, cudnnGraphNotSupportedError=_FakeNotSupported,
                           heur_mode=SimpleNamespace(A="A", FALLBACK="FALLBACK"), backend_version=lambda: 91900)


def test_fp8_graph_build_retries_bshd_and_stats():
    b, h, s, d = 1, 2, 64, 64
    bshd = _fp8((b, s, h, d)).transpose(1, 2)
    bhsd = _fp8((b, h, s, d))
    o_shape, o_stride = (b, h, s, d), kc.bshd_strides((b, h, s, d))
    bshd_only = _fake_cudnn(lambda strides, stats: all(st == kc.bshd_strides((b, h, s, d)) for st in strides.values()))
    entry = kc._build_fp8_graph(bshd_only, None, bshd, bshd, bshd, o_shape, o_stride, 0.1, FP8_OUT, "fp8_out")
    assert not entry.copy_to_bshd and not entry.generate_stats and entry.workspace_size == 256
    entry = kc._build_fp8_graph(bshd_only, None, bhsd, bhsd, bhsd, o_shape, o_stride, 0.1, FP8_OUT, "fp8_out")
    assert entry.copy_to_bshd  # BHSD had no engine: built for BSHD copies
    stats_only = _fake_cudnn(lambda strides, stats: stats)
    entry = kc._build_fp8_graph(stats_only, None, bshd, bshd, bshd, o_shape, o_stride, 0.1, FP8_OUT, "fp8_out")
    assert entry.generate_stats and "stats" in entry.tensors
    nothing = _fake_cudnn(lambda strides, stats: False)
    with pytest.raises(RuntimeError, match=r"cuDNN 9\.19\.0 has no FP8 SDPA engine.*generate_stats=True"):
        kc._build_fp8_graph(nothing, None, bhsd, bhsd, bhsd, o_shape, o_stride, 0.1, FP8_OUT, "fp8_out")
    assert kc.is_bshd(bshd) and not kc.is_bshd(bhsd)


FP8_OUT = torch.float8_e4m3fn


def test_fifo_cache_builds_once_counts_and_evicts():
    cache = cu.FifoCache(maxsize=3)
    builds = []
    for key in ["a", "b", "a", "c", "d", "a"]:
        cache.get_or_build(key, lambda key=key: builds.append(key) or key.upper())
    assert builds == ["a", "b", "c", "d", "a"]  # "a" was evicted first (FIFO) and rebuilt
    assert cache.hits == 1 and cache.misses == 5 and len(cache) == 3
    assert cache.keys() == ["c", "d", "a"]
    with pytest.raises(ValueError, match="maxsize"):
        cu.FifoCache(0)


def test_fifo_cache_thread_safe_single_build():
    cache = cu.FifoCache(maxsize=8)
    count = []
    barrier = threading.Barrier(8)

    def build():
        count.append(1)
        return object()

    results = []

    def worker():
        barrier.wait()
        results.append(cache.get_or_build("k", build))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(count) == 1 and len({id(r) for r in results}) == 1


def test_builds_are_refused_during_capture(monkeypatch):
    monkeypatch.setattr(cu, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        cu.PerDevice("thing", lambda device: 1).get(torch.device("cuda", 0))


def test_empty_bshd_layout():
    out = cu.empty_bshd(2, 3, 5, 8, torch.bfloat16, torch.device("cpu"))
    assert out.shape == (2, 3, 5, 8) and out.stride() == (5 * 3 * 8, 8, 3 * 8, 1)


def test_package_and_registry_import_without_gpu_libraries():
    assert kernels.load("cudnn_fp8", "scaled") is kc.fp8_attention
    assert kernels.load("cudnn_mxfp8", "block_scaled") is kc.mxfp8_attention
    assert kernels.load("flashinfer_fa3_fp8", "scaled") is kf.fa3_fp8_attention
    assert kernels.load("flashinfer_trtllm_sage", "scaled") is kf.trtllm_sage_attention
    if importlib.util.find_spec("cudnn") is None:
        assert "cudnn" not in sys.modules
        with pytest.raises(RuntimeError, match="nvidia-cudnn-frontend"):
            kc.import_cudnn("cudnn_fp8")
    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer" not in sys.modules
        with pytest.raises(RuntimeError, match="flashinfer-python"):
            kf._import_flashinfer("flashinfer_fa3_fp8")
