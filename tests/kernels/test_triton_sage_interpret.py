"""qattn_fx.kernels.triton_sage under the Triton interpreter (CPU), against the reference kernel.

Every comparison feeds the *same* quantized tensors (made by the registered ``qattn::quantize_*`` ops) to the
kernel and to :func:`qattn_fx.kernels.reference.scaled_attention`, so the only differences are the kernel's
documented ones:

* P rounding point. The reference rounds ``e4m3(448 · exp(s - rowmax))`` with the *global* row max; a flash
  kernel rounds ``e4m3(448 · exp2(z - m_j))`` against the running max ``m_j`` of the K tiles seen so far. Where the
  row max is not in the first tile, earlier tiles' P land on a different e4m3 grid (3 mantissa bits, relative
  spacing 1/8..1/16), so individual P differ by up to one e4m3 step, independently in each implementation. For
  random V the output's relative error is then about the rms relative P difference over the regridded tiles —
  the same order as the reference's own FP8-P error against fp32 attention. On these short sequences (77 keys)
  that is ~1 % of an output element (it grows to ~2.5 % at 4k keys, see the GPU tests); the bounds below are the
  measured worst case over seeds 0-4 with ~1.7x margin (see ``_TOL``).
* INT8 with per-token K scales (``k_block`` < tile) folds the exact int32→fp32 magic-number conversion and the K
  scale into one fma, so a logit can move by up to ~1 unit of the int32 accumulator (1e-2 of int8 quantization
  noise); that only flips rare P roundings, covered by the same bounds.

Two tighter checks pin the algorithm itself: (1) a torch emulation of the kernel's tile algorithm in the kernel's
own fp32 operation order must match to ~1e-6; (2) inputs whose row max sits in the first K tile (so both
implementations round P on the same grid) must match the reference to ~1e-5 on the exactly-converted paths.

Shapes are small (the interpreter runs each program in numpy); the file runs in ~30 s on 2 CPU cores. A
separate group compiles the kernel for sm_90 / sm_89 with Triton's bundled ptxas (no GPU) and checks that both
dots are tensor-core MMAs, that P·V uses a fresh accumulator (two-level accumulation) and that nothing spills.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import types

import pytest
import torch

triton = pytest.importorskip("triton")

import qattn_fx  # noqa: E402
import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx.kernels import reference  # noqa: E402
from qattn_fx.kernels import _sage_common  # noqa: E402
from qattn_fx.kernels import triton_sage as ts  # noqa: E402
from qattn_fx import formats  # noqa: E402
import support  # noqa: E402
from support import emulate, errors, make_qkv, quantize  # noqa: E402

ops = torch.ops.qattn
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def interpreter(monkeypatch, qattn_config):
    """Run every test of this file under the Triton interpreter (the kernel source is loaded per Triton mode at its
    first call in that mode, so this suffices)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qattn_config(triton_sage_config=None)
    ts.set_config(None)
    yield
    ts.set_config(None)


# ------------------------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------------------------


def run_both(args, sm_scale=None, out_dtype=torch.float32):
    d = args[0].shape[-1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    full = (*args, sm_scale, out_dtype)
    return ts.scaled_attention(*full), reference.scaled_attention(*full)


#: Measured worst case over seeds 0-4 of (max-rel, mean-rel) against the reference on these shapes:
#: (2.03e-2, 1.13e-2); bounds ~1.7x that.
#: max-rel: largest element error over the largest output element; mean-rel: mean error over mean |output|.
_TOL = dict(max_rel=3.5e-2, mean_rel=2.0e-2)


assert_close_to_reference = functools.partial(support.assert_close_to_reference, tol=_TOL,
                                              name="triton_sage (interpreter)")


# ------------------------------------------------------------------------------------------------------------------
# Against the reference
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk", ["int8", "fp8"])
@pytest.mark.parametrize("blocks", [(1, 16), (4, 4), (16, 1), (0, 0), (1, 64)], ids=lambda b: f"q{b[0]}k{b[1]}")
def test_quantized_qk_matches_reference(qk, blocks):
    """B=2, GQA 4/2, Sq=45 ≠ Skv=77 (tails on both), BSHD-strided Q/K/V, per-channel seq-major V, d=64."""
    args = quantize(*make_qkv(), qk, *blocks)
    out, ref = run_both(args)
    assert out.shape == ref.shape == (2, 4, 45, 64)
    assert_close_to_reference(out, ref)


@pytest.mark.parametrize("scope", ["tensor", "head"])
def test_block0_scopes(scope):
    """Block 0: one scale per tensor (1,1,1) or per head (1,H,1), broadcast through zero strides."""
    args = quantize(*make_qkv(hkv=4), "int8", 0, 0, scope=scope, v_scale="head" if scope == "head" else "tensor")
    assert args[1].shape == ((1, 4, 1) if scope == "head" else (1, 1, 1))
    assert_close_to_reference(*run_both(args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_unquantized_qk(dtype):
    """QK16PV8: bf16/fp16 Q/K without scales, fp8 V."""
    args = quantize(*make_qkv(dtype=dtype), "bf16")
    assert args[1] is None and args[3] is None
    assert_close_to_reference(*run_both(args))


@pytest.mark.parametrize(
    "case",
    [
        dict(d=128, bshd=False),  # head_dim 128, contiguous BHSD
        dict(v_seq_major=False),  # D-major V (fp16 P·V path)
        dict(v_scale="tensor"),  # per-tensor V scale
        dict(sq=70, skv=20),  # q_len > kv_len, Skv < one tile (tail only)
        dict(sq=32, skv=64, b=1, hq=2, hkv=2),  # exact multiples of the tile: no tails
        dict(hq=6, hkv=2, b=1),  # GQA group of 3
        dict(sq=1, skv=5, b=1),  # single query, few keys
    ],
    ids=["d128-bhsd", "v-dmajor", "v-tensor", "sq>skv", "no-tails", "gqa3", "tiny"],
)
def test_shapes_and_layouts(case):
    case = dict(case)
    quant_kw = {k: case.pop(k) for k in ("v_seq_major", "v_scale") if k in case}
    args = quantize(*make_qkv(**case), "int8", 1, 16, **quant_kw)
    if quant_kw.get("v_seq_major") is False:
        assert args[4].stride(-1) == 1
    else:
        assert args[4].stride(-2) == 1
    assert_close_to_reference(*run_both(args))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_dtype_and_layout(out_dtype):
    """Output is (B, Hq, Sq, Dv) stored BSHD: strides (Sq·Hq·Dv, Dv, Hq·Dv, 1), as the op's fake kernel promises."""
    args = quantize(*make_qkv(), "fp8", 1, 16)
    out, ref = run_both(args, out_dtype=out_dtype)
    b, h, s, d = out.shape
    assert out.dtype == out_dtype
    assert out.stride() == (s * h * d, d, h * d, 1)
    assert_close_to_reference(out.float(), ref.float())


def test_sm_scale_is_applied():
    args = quantize(*make_qkv(), "int8", 1, 16)
    out, ref = run_both(args, sm_scale=0.37)
    assert_close_to_reference(out, ref)


def test_inputs_not_mutated():
    args = quantize(*make_qkv(), "int8", 1, 16)
    with support.inputs_unchanged(args):
        run_both(args)


def test_through_the_registered_op():
    """``qattn::scaled_attention(..., kernel="triton_sage")`` dispatches here and returns the promised layout."""
    args = quantize(*make_qkv(), "int8", 1, 16)
    out = torch.ops.qattn.scaled_attention(*args, 0.125, torch.bfloat16, "triton_sage")
    ref = reference.scaled_attention(*args, 0.125, torch.bfloat16)
    assert out.stride() == ref.stride()
    assert_close_to_reference(out.float(), ref.float())


# ------------------------------------------------------------------------------------------------------------------
# The algorithm itself, tightly
# ------------------------------------------------------------------------------------------------------------------

def assert_matches_emulation(out: torch.Tensor, emu: torch.Tensor, qk: str) -> None:
    """The kernel's output is its emulated algorithm's: int8 and bf16 Q·Kᵀ sum exactly (1e-5 of the largest
    output). FP8 Q·Kᵀ sums D products in fp32 in the interpreter's order (the emulation in fp64, rounded once), so
    logits differ by fp32 rounding, and a logit on an e4m3 rounding boundary of P moves that P by one e4m3 step: its
    whole output row then differs by up to ~1e-3. So for fp8 at most 1 % of the rows may hold such a step (one or
    two of 360 on these inputs), every other row within 1e-4."""
    if qk == "fp8":
        off = ((out.double() - emu.double()).abs() > 1e-4 * emu.abs().max()).any(-1)
        assert off.double().mean() <= 0.01, f"{int(off.sum())} of {off.numel()} rows differ by more than 1e-4"
        out, emu = out[~off], emu[~off]
    max_rel, mean_rel = errors(out, emu)
    assert max_rel < (1e-4 if qk == "fp8" else 1e-5) and mean_rel < 1e-6, (max_rel, mean_rel)


@pytest.mark.parametrize(
    "qk,blocks,config",
    [
        ("int8", (1, 16), "32,32,4,1"),  # K scale per group of 16 columns (k_block divides the tile)
        ("int8", (4, 4), "16,16,4,1"),
        ("int8", (1, 1), "32,32,4,1"),  # per-column K scale (k_block = 1)
        ("int8", (1, 24), "32,32,4,1"),  # per-column K scale (k_block neither divides nor is a multiple of the tile)
        ("fp8", (2, 48), "16,32,4,1,pipe"),
        ("int8", (16, 32), "32,32,4,1"),  # K scale uniform per tile (k_block == tile)
        ("int8", (1, 64), "16,32,4,1"),  # K scale uniform per tile (k_block multiple of tile)
        ("int8", (0, 0), "32,64,4,1"),  # per tensor: folded into the row scale
        ("fp8", (1, 16), "32,16,4,1"),  # k_block == tile
        ("fp8", (1, 4), "32,32,4,1"),
        ("bf16", (0, 0), "32,32,4,1"),
        # software-pipelined Q·Kᵀ (next tile's S issued before this tile's softmax)
        ("int8", (1, 16), "32,32,4,1,pipe"),
        ("int8", (1, 64), "16,32,4,1,pipe"),
        ("fp8", (4, 4), "32,16,4,1,pipe"),
        ("bf16", (0, 0), "16,64,4,1,pipe"),
    ],
)
def test_matches_emulation(qk, blocks, config):
    """The kernel computes exactly its documented algorithm (fp32 rounding order included): 1e-5, not 1e-2."""
    cfg = ts.KernelConfig.parse(config)
    args = quantize(*make_qkv(), qk, *blocks)
    with ts.use_config(cfg):
        out = ts.scaled_attention(*args, 0.125, torch.float32)
    emu = emulate(*args, 0.125, cfg.block_n)
    assert_matches_emulation(out, emu, qk)


def _first_tile_max_inputs(qk, q_block, k_block):
    """Inputs whose row max logit is key 0 (first K tile) for every query, with the other P still non-negligible.

    Queries are ``u + 0.3·noise`` for one random direction ``u``; key 0 is ``0.6·u`` (logit ≈ 4.8 at d=64,
    sm_scale 1/8) while the other keys are N(0, 1) (logits ≈ N(0, 1.1), max over 76 keys ≈ 2.7).
    """
    g = torch.Generator().manual_seed(7)
    q, k, v = make_qkv(k_bias=0.0, q_bias=0.0, dtype=torch.float32)
    u = torch.randn(q.shape[-1], generator=g)
    q = u + 0.3 * q
    k = k.clone()
    k[:, :, 0] = 0.6 * u
    to = torch.bfloat16
    return quantize(q.to(to), k.to(to), v.to(to), qk, q_block, k_block, smooth=False)


@pytest.mark.parametrize("qk,blocks", [("fp8", (1, 16)), ("fp8", (4, 4)), ("int8", (1, 16)), ("int8", (1, 32)),
                                       ("int8", (0, 0)), ("bf16", (0, 0))])
def test_exact_when_row_max_is_in_first_tile(qk, blocks):
    """With the global row max in tile 0 both implementations round P on the same grid: fp32-level agreement.

    Measured: max error ~1e-6 of max|ref| in every case except where an fp32-level difference in a logit lands on
    an e4m3 rounding boundary (fp8 1/16 here: one P flips, moving part of one output row by ~6e-4; up to ~6e-3
    seen on longer rows). So: mean error < 1e-5 (the general case is ~1e-2), at most 1 % of elements above 1e-5,
    and max < 2e-2 (a few flips).
    """
    args = _first_tile_max_inputs(qk, *blocks)
    out, ref = run_both(args)
    err = (out.double() - ref.double()).abs() / ref.double().abs().max()
    assert err.mean().item() < 1e-5, err.mean().item()
    assert (err > 1e-5).double().mean().item() < 0.01
    assert err.max().item() < 2e-2


def test_lse():
    """``return_lse``: natural-log logsumexp of the dequantized scaled logits, (B, Hq, Sq) fp32."""
    args = quantize(*make_qkv(), "int8", 1, 16)
    out, lse = ts.attention(*args, 0.125, torch.float32, return_lse=True)
    q, qs, k, ks, _, _, qb, kb = args
    qf = formats.dequantize_scaled(q, qs, qb).double()
    kf = formats.dequantize_scaled(k, ks, kb).double().repeat_interleave(2, 1)
    expect = torch.logsumexp(qf @ kf.transpose(-1, -2) * 0.125, dim=-1)
    assert lse.shape == (2, 4, 45) and lse.dtype == torch.float32
    # fp32 logits and exp2/log2: a few ulps of |lse| ~ 10
    assert (lse.double() - expect).abs().max().item() < 1e-4
    assert_close_to_reference(out, reference.scaled_attention(*args, 0.125, torch.float32))


# ------------------------------------------------------------------------------------------------------------------
# Key bias (per-key masks)
# ------------------------------------------------------------------------------------------------------------------


def key_bias(b, skv, pattern, seed=0):
    """fp32 (b, skv) logit biases: ``tail`` masks the last keys of batch element 0, ``scattered`` ~40 % of keys
    anywhere, ``finite`` adds -10000 / small biases, ``all`` masks every key of batch element 1."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(b, skv)
    if pattern == "tail":
        bias[0, skv // 2:] = float("-inf")
    elif pattern == "scattered":
        bias[torch.rand(b, skv, generator=g) < 0.4] = float("-inf")
    elif pattern == "finite":
        bias = torch.randn(b, skv, generator=g)
        bias[:, ::3] = -10000.0
    elif pattern == "all":
        bias[1] = float("-inf")
    return bias


@pytest.mark.parametrize("config", ["32,32,4,1", "16,32,4,1,pipe"])
@pytest.mark.parametrize("pattern", ["tail", "scattered", "finite", "all"])
@pytest.mark.parametrize("qk, blocks", [("int8", (1, 16)), ("bf16", (0, 0)), ("fp8", (1, 4))])
def test_key_bias_matches_emulation(qk, blocks, pattern, config):
    """With a key bias the kernel runs exactly the emulated tile loop (max over ``t·rs + bias``, ``-inf`` rows
    as 0) and stays close to the reference; a row with every key masked is 0."""
    cfg = ts.KernelConfig.parse(config)
    args = quantize(*make_qkv(), qk, *blocks)
    bias = key_bias(2, args[2].shape[2], pattern)
    with ts.use_config(cfg):
        out = ts.scaled_attention(*args, 0.125, torch.float32, key_bias=bias)
    emu = emulate(*args, 0.125, cfg.block_n, key_bias=bias)
    assert_matches_emulation(out, emu, qk)
    ref = reference.scaled_attention(*args, 0.125, torch.float32, key_bias=bias)
    if pattern == "all":
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(ref[1], out[1])
        out, ref = out[:1], ref[:1]
    assert_close_to_reference(out, ref)


def test_key_bias_broadcast_over_the_batch_and_lse():
    args = quantize(*make_qkv(), "int8", 1, 16)
    bias = key_bias(1, args[2].shape[2], "scattered")
    out, lse = ts.attention(*args, 0.125, torch.float32, return_lse=True, key_bias=bias)
    full, full_lse = ts.attention(*args, 0.125, torch.float32, return_lse=True, key_bias=bias.expand(2, -1))
    assert torch.equal(out, full) and torch.equal(lse, full_lse)
    q, qs, k, ks, _, _, qb, kb = args
    qf = formats.dequantize_scaled(q, qs, qb).double()
    kf = formats.dequantize_scaled(k, ks, kb).double().repeat_interleave(2, 1)
    expect = torch.logsumexp(qf @ kf.transpose(-1, -2) * 0.125 + bias.double()[:, None, None, :], dim=-1)
    assert (lse.double() - expect).abs().max().item() < 1e-4


def test_a_key_bias_without_its_range_is_refused():
    """The launch takes a key bias's span from its caller (once per call); without it, it says so."""
    from qattn_fx.kernels.triton_sage import launch

    args = quantize(*make_qkv(), "int8", 1, 16)
    bias = key_bias(1, args[2].shape[2], "scattered")
    with pytest.raises(ValueError, match=r"^triton_sage: key_bias and key_range \(its bias_range\) go together; "
                                         r"got key_bias given, key_range None$"):
        launch._launch(*args, 0.125, torch.float32, False, (9, 0), True, bias)


def test_calls_past_the_grid_limit_run_in_batch_chunks(monkeypatch):
    args = quantize(*make_qkv(b=5), "int8", 1, 16)
    bias = key_bias(5, args[2].shape[2], "scattered")
    whole = ts.attention(*args, 0.125, torch.float32, key_bias=bias)
    monkeypatch.setattr(_sage_common, "MAX_GRID_Y", 8)  # 4 heads: two batch elements per launch
    chunked = ts.attention(*args, 0.125, torch.float32, key_bias=bias)
    assert torch.equal(whole, chunked)


# ------------------------------------------------------------------------------------------------------------------
# Errors and configuration
# ------------------------------------------------------------------------------------------------------------------


def test_head_dim_96_is_refused():
    args = quantize(*make_qkv(d=96), "int8", 1, 16)
    with pytest.raises(ValueError, match=r"head_dim=96.*valid: 64, 128"):
        ts.scaled_attention(*args, 0.125, torch.float32)


def test_wrong_capability_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fake = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"sm_80.*valid: sm_89, sm_90"):
        ts.check_device(fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert ts.check_device(fake) == (9, 0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    args = quantize(*make_qkv(), "int8", 1, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ts.scaled_attention(*args, 0.125, torch.float32)


def test_config_forcing(qattn_config):
    assert ts.KernelConfig.parse("128,64,8,3") == ts.KernelConfig(128, 64, 8, 3)
    assert ts.KernelConfig.parse("BM128_BN64_w8_s3") == ts.KernelConfig(128, 64, 8, 3)
    assert ts.KernelConfig.parse("128,64,8,3,pipe") == ts.KernelConfig(128, 64, 8, 3, 1)
    for c in ts.CONFIGS:
        assert ts.KernelConfig.parse(str(c)) == c
    with pytest.raises(ValueError, match="pipe"):
        ts.KernelConfig(128, 64, 8, 3, 2)
    with pytest.raises(ValueError, match="BLOCK_M,BLOCK_N,num_warps,num_stages"):
        ts.KernelConfig.parse("128,64")
    with pytest.raises(ValueError, match=r"config '128,64,8,3,v16' is invalid"):  # removed flags are unknown words
        ts.KernelConfig.parse("128,64,8,3,v16")
    assert ts.forced_config() is None
    qattn_config(triton_sage_config="64,32,4,2")  # default: $QATTN_TRITON_SAGE_CONFIG
    assert ts.forced_config() == ts.KernelConfig(64, 32, 4, 2)
    with ts.use_config("16,16,4,1"):
        assert ts.forced_config() == ts.KernelConfig(16, 16, 4, 1)
    assert ts.forced_config() == ts.KernelConfig(64, 32, 4, 2)
    # a forced config drives the launch (tiles of 16: many tiles and tails)
    args = quantize(*make_qkv(), "int8", 1, 16)
    with ts.use_config(ts.KernelConfig(16, 16, 4, 1)):
        assert_close_to_reference(*run_both(args))


def test_autotune_pruning_keeps_one_key_tile_per_device():
    """The autotuner times only configs of the device's key tile, so its choice never changes the output."""
    configs = [c.to_triton() for c in ts.CONFIGS]
    hopper = ts.prune_configs(configs, {"SEQ_Q": 32760}, PV_SPLIT=False, HEAD_DIM=128)
    assert hopper and {c.kwargs["BLOCK_N"] for c in hopper} == {ts.BLOCK_N_BY_CAPABILITY[(9, 0)]} == {128}
    ada = ts.prune_configs(configs, {"SEQ_Q": 32760}, PV_SPLIT=True, HEAD_DIM=128)
    assert ada and all(c.kwargs["BLOCK_N"] == 64 and c.num_warps == 8 and not c.kwargs["PIPE"] for c in ada)
    short = ts.prune_configs(configs, {"SEQ_Q": 40}, PV_SPLIT=False, HEAD_DIM=128)
    assert short and {c.kwargs["BLOCK_N"] for c in short} == {128}  # no 64-row config of that tile: all of them
    for cap in ((9, 0), (8, 9)):
        for sq in (40, 4096, 75600):
            candidates = ts.tuned_candidates(cap, sq)
            assert candidates and len({c.numerics for c in candidates}) == 1, (cap, sq, candidates)
    with pytest.raises(ValueError, match="no autotuned config has BLOCK_N=128 for sm_90"):
        ts.prune_configs([c for c in configs if c.kwargs["BLOCK_N"] == 64], {"SEQ_Q": 100}, PV_SPLIT=False)


# ------------------------------------------------------------------------------------------------------------------
# Offline compilation for Hopper / Ada (Triton's bundled ptxas; no GPU)
# ------------------------------------------------------------------------------------------------------------------


def _ptxas_available() -> bool:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(path) or shutil.which("ptxas") is not None


def _meta_inputs(qk=torch.int8, q_block=1, k_block=16, s=32760, h=12, d=128, v_seq_major=True):
    """wan-1.3b-like meta tensors: BSHD Q/K, seq-major V whose row stride (32760) is only 8-byte aligned."""
    meta = torch.device("meta")
    q = torch.empty(1, s, h, d, dtype=qk, device=meta).transpose(1, 2)
    k = torch.empty(1, s, h, d, dtype=qk, device=meta).transpose(1, 2)
    if v_seq_major:
        v = torch.empty(1, h, d, s, dtype=FP8, device=meta).transpose(-1, -2)
    else:
        v = torch.empty(1, s, h, d, dtype=FP8, device=meta).transpose(1, 2)
    if qk in (torch.bfloat16, torch.float16):
        return q, None, k, None, v, torch.empty(1, h, d, device=meta), 0, 0
    nb = lambda blk: 1 if blk == 0 else -(-s // blk)  # noqa: E731
    qs = torch.empty(1, 1 if q_block == 0 else h, nb(q_block), device=meta)
    ks = torch.empty(1, 1 if k_block == 0 else h, nb(k_block), device=meta)
    return q, qs, k, ks, v, torch.empty(1, h, d, device=meta), q_block, k_block


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's ptxas is not installed")
@pytest.mark.parametrize(
    "cap,qk,blocks,config",
    [
        ((9, 0), torch.int8, (1, 16), "128,128,8,3"),
        ((9, 0), torch.int8, (1, 16), "128,64,8,3"),
        ((9, 0), torch.float8_e4m3fn, (0, 0), "64,64,4,3"),
        ((9, 0), torch.bfloat16, (0, 0), "128,64,8,3"),
        ((9, 0), torch.int8, (1, 16), "128,64,8,3,pipe"),
        ((8, 9), torch.int8, (1, 16), "128,64,8,3"),
    ],
    ids=["sm90-int8-128x128", "sm90-int8-128x64", "sm90-fp8-64x64", "sm90-bf16", "sm90-int8-pipe", "sm89-int8-128x64"],
)
def test_compiles_for_gpu(monkeypatch, cap, qk, blocks, config):
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = ts.compile_for(cap, ts.KernelConfig.parse(config), *_meta_inputs(qk, *blocks))
    ttgir = compiled.asm["ttgir"]
    report = ts.ptxas_report(compiled, cap)
    assert report["ptxas_ok"], report
    assert report["spill_stores"] == 0, report
    if cap == (9, 0):
        # both dots are Hopper wgmma; P·V starts from a zero accumulator (two-level accumulation) and is then
        # added in fp32 (not folded into the running accumulator)
        assert ttgir.count("ttng.warp_group_dot ") >= 2
        pv = [ln for ln in ttgir.splitlines() if "ttng.warp_group_dot " in ln and "f8E4M3FN" in ln.split("*")[0]]
        assert pv and all("maxNumImpreciseAcc = 1073741824" in ln for ln in pv)
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async.sync.aligned" in ptx and ".e4m3.e4m3" in ptx
    else:
        assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in compiled.asm["ptx"]
    # V (8-byte aligned rows) and K are copied asynchronously into shared memory
    assert ttgir.count("ttg.async_copy_global_to_local") >= 2
