"""Block-sparse triton_sage (``block_index`` / ``block_count``, :mod:`qattn_fx.block_sparse`) on a real sm_89 /
sm_90 GPU.

Run: ``pytest -m gpu tests/gpu/test_block_sparse_kernels.py -v -s`` (``-s`` prints the measured errors).

* Against :func:`qattn_fx.kernels.emulation.emulate` with the same lists at Hopper's FP8-MMA precision
  (``support.assert_fp32_level``, as ``tests/gpu/test_triton_sage.py`` pins the dense kernel): lengths 4096, 4608
  and 32760 (partial last key tile), B=1 with 2-4 query heads (GQA and MHA), random and banded lists per
  (query head, query tile) with empty query tiles, int8 1/16, fp8 1/16 and bf16 Q/K, every config of the device
  (pipelined or not, key tiles of one or two sub-tiles) and the autotuned path, key biases (masks), the LSE. The
  emulation runs on a few query tiles only (rows are independent), so 32760 keys stay cheap.
* Bitwise against the dense kernel: lists of every block; lists of some key tiles == the dense kernel whose key
  bias masks the other tiles' keys.
* Empty lists: zeros and LSE ``-inf``, no NaN. No host synchronization; CUDA-graph capture; the registered op.
"""

from __future__ import annotations

import math

import pytest
import torch

import support
from support import emulate, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

triton = pytest.importorskip("triton")

import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx import block_sparse  # noqa: E402
from qattn_fx.kernels import triton_sage as ts  # noqa: E402

DEV = "cuda"
SM_SCALE = 1 / math.sqrt(128)


needs_sm89_90 = support.needs_capability(*ts.CAPABILITIES, reason="triton_sage needs sm_89 or sm_90")

#: Configs run per device (forced): sm_90's autotuned key tile (128: one sub-tile per listed key tile) plain and
#: pipelined, and 64-key tiles (two sub-tiles per key tile); sm_89 runs 8-warp 64-key tiles without ``pipe``.
CONFIGS = {(9, 0): ["128,128,8,3", "128,128,8,3,pipe", "128,64,8,3,pipe", "64,64,4,3,pipe", "128,64,8,3"],
           (8, 9): ["128,64,8,3", "128,64,8,4"]}
ALL_CONFIGS = sorted({c for cs in CONFIGS.values() for c in cs})


@pytest.fixture(autouse=True)
def _compiled_mode(monkeypatch, qattn_config):
    with support.triton_sage_compiled(monkeypatch, qattn_config, None):
        yield


def config_here(config: str | None) -> ts.KernelConfig | None:
    """``config`` parsed, or a skip when this device does not run it (``None``: autotuned)."""
    here = support.gpu_capability()
    if config is not None and config not in CONFIGS.get(here, []):
        pytest.skip(f"{config} is not run on sm_{here[0]}{here[1]}")
    return None if config is None else ts.KernelConfig.parse(config)


def block_n_of(config: ts.KernelConfig | None) -> int:
    return config.block_n if config is not None else ts.BLOCK_N_BY_CAPABILITY[support.gpu_capability()]


# ------------------------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------------------------


def make_args(qk, blocks, *, hq, hkv, sq, skv, b=1, v_seq_major=True, seed=0):
    dtype = torch.float16 if qk == "fp16" else torch.bfloat16
    qkv = support.make_qkv(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=128, dtype=dtype, device=DEV, seed=seed)
    return quantize(*qkv, qk, *blocks, v_seq_major=v_seq_major)


def make_blocks(kind, b, hq, sq, skv, seed=0) -> block_sparse.Blocks:
    """``random``: each block with probability 0.3; ``band``: a diagonal band of +-2 key tiles plus key tile 0
    (local attention with a sink), the band's centre scaled to the key length; ``all``: every block. Query tile 0 of
    head 0 visits nothing (``random``, ``band``) and the last key tile (partial unless ``skv`` is a multiple of 128)
    is visited by the last query tile of every head."""
    nq, nk = block_sparse.tiles(sq, skv)
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        visit = torch.rand(b, hq, nq, nk, generator=g) < 0.3
    elif kind == "band":
        i = torch.arange(nq)[:, None] * (nk / nq)
        j = torch.arange(nk)[None, :]
        visit = ((j - i).abs() <= 2) | (j == 0)
        visit = visit.expand(b, hq, nq, nk).clone()
    elif kind == "all":
        visit = torch.ones(b, hq, nq, nk, dtype=torch.bool)
    else:
        raise ValueError(kind)
    if kind != "all":
        visit[0, 0, 0] = False
    visit[:, :, -1, -1] = True
    return block_sparse.from_mask(visit.to(DEV))


def tiles_checked(sq: int) -> list[int]:
    """The query tiles the emulation runs: the first, one in the middle, the last (partial unless 128 | sq)."""
    nq = block_sparse.tiles(sq, 1)[0]
    return sorted({0, nq // 2, nq - 1})


def emulate_tiles(args, blocks, block_n, tiles, key_bias=None):
    """:func:`emulate` of query tiles ``tiles`` only (each row's output depends on its own row and lists):
    ``(out, lse)`` of those rows, in tile order."""
    q, qs, k, ks, v, vs, qb, kb = args
    sq = q.shape[2]
    outs, lses = [], []
    for i in tiles:
        lo, hi = i * block_sparse.BLOCK_ROWS, min((i + 1) * block_sparse.BLOCK_ROWS, sq)
        qs_i = qs if qs is None or qb == 0 else qs[..., lo // qb:-(-hi // qb)]
        out, lse = emulate(q[:, :, lo:hi], qs_i, k, ks, v, vs, qb, kb, SM_SCALE, block_n, return_lse=True,
                           key_bias=key_bias, block_index=blocks.index[:, :, i:i + 1].contiguous(),
                           block_count=blocks.count[:, :, i:i + 1].contiguous())
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def rows_of(tiles, sq):
    return torch.cat([torch.arange(i * block_sparse.BLOCK_ROWS, min((i + 1) * block_sparse.BLOCK_ROWS, sq))
                      for i in tiles]).to(DEV)


def run(args, blocks, config, key_bias=None):
    with ts.use_config(config):
        return ts.attention(*args, SM_SCALE, torch.float32, return_lse=True, key_bias=key_bias,
                            block_index=None if blocks is None else blocks.index,
                            block_count=None if blocks is None else blocks.count)


def check_against_emulation(args, blocks, config, what, qk, key_bias=None):
    """The kernel's rows of :func:`tiles_checked` against the emulation: fp32 level for the output, LSE ``-inf``
    exactly where the emulation's is and within 1e-3 elsewhere (1e-2 for FP8 Q/K); empty query tiles exactly 0;
    nothing NaN."""
    out, lse = run(args, blocks, config, key_bias)
    assert not out.isnan().any() and not lse.isnan().any(), what
    sq = args[0].shape[2]
    tiles = tiles_checked(sq)
    want, want_lse = emulate_tiles(args, blocks, block_n_of(config), tiles, key_bias)
    rows = rows_of(tiles, sq)
    got, got_lse = out[:, :, rows], lse[:, :, rows]
    support.assert_fp32_level(got, want.float(), what, fp8_qk=qk == "fp8", name="triton_sage sparse")
    empty = want_lse == -math.inf
    assert torch.equal(got_lse == -math.inf, empty), what
    assert torch.equal(got[empty], torch.zeros_like(got[empty])), what
    lse_err = (got_lse[~empty].double() - want_lse[~empty].double()).abs().max().item()
    print(f"[triton_sage sparse LSE] {what}: max |diff| {lse_err:.2e}")
    # int8 Q·Kᵀ is exact and bf16 sums fp32 products; FP8 wgmma sums the logits with ~22 bits (relative ~6e-5)
    assert lse_err < (1e-2 if qk == "fp8" else 1e-3), what
    return out, lse


# ------------------------------------------------------------------------------------------------------------------
# Against the emulation
# ------------------------------------------------------------------------------------------------------------------

RECIPES = [("int8", (1, 16)), ("fp8", (1, 16)), ("bf16", (0, 0))]
LENGTHS = [4096, 4608, 32760]


@needs_sm89_90
@pytest.mark.parametrize("kind", ["random", "band"])
@pytest.mark.parametrize("qk,blocks", RECIPES, ids=[f"{q}-q{b[0]}k{b[1]}" for q, b in RECIPES])
@pytest.mark.parametrize("length", LENGTHS)
def test_lengths_and_recipes_match_emulation(length, qk, blocks, kind):
    """Autotuned config; GQA 4/2; Sq = Skv = ``length``."""
    args = make_args(qk, blocks, hq=4, hkv=2, sq=length, skv=length)
    lists = make_blocks(kind, 1, 4, length, length, seed=length)
    check_against_emulation(args, lists, None, f"S={length} {qk} {blocks} {kind} autotuned", qk)
    print("[triton_sage sparse] autotuned config:", ts.best_config())


@needs_sm89_90
@pytest.mark.parametrize("config", ALL_CONFIGS)
@pytest.mark.parametrize("qk,blocks", [("int8", (1, 16)), ("fp8", (1, 16))], ids=["int8-q1k16", "fp8-q1k16"])
def test_every_config_matches_emulation(config, qk, blocks):
    """Every config of this device, MHA (H=2), Sq = 4000 != Skv = 4685 (the last key tile holds 77 keys)."""
    cfg = config_here(config)
    args = make_args(qk, blocks, hq=2, hkv=2, sq=4000, skv=4685)
    lists = make_blocks("random", 1, 2, 4000, 4685, seed=7)
    check_against_emulation(args, lists, cfg, f"{config} {qk}", qk)


@needs_sm89_90
@pytest.mark.parametrize("pattern", ["tail", "scattered", "all"])
@pytest.mark.parametrize("length", [4608, 32760])
def test_key_bias_matches_emulation(length, pattern):
    """Masks with lists (int8 1/16, H=3 MHA): ``tail`` pads the last fifth of the keys, ``scattered`` masks 40 %
    of them, ``all`` masks every key (output 0, LSE -inf)."""
    args = make_args("int8", (1, 16), hq=3, hkv=3, sq=length, skv=length)
    bias = torch.zeros(1, length)
    if pattern == "tail":
        bias[:, length - length // 5:] = -math.inf
    elif pattern == "scattered":
        bias[torch.rand(1, length, generator=torch.Generator().manual_seed(1)) < 0.4] = -math.inf
    else:
        bias[:] = -math.inf
    bias = bias.to(DEV)
    lists = make_blocks("band", 1, 3, length, length)
    if pattern == "all":
        out, lse = run(args, lists, None, bias)
        assert torch.equal(out, torch.zeros_like(out)) and (lse == -math.inf).all()
        return
    check_against_emulation(args, lists, None, f"S={length} mask {pattern}", "int8", key_bias=bias)


@needs_sm89_90
@pytest.mark.parametrize("config", [None, "128,128,8,3,pipe", "128,64,8,3"])
def test_d_major_v_matches_emulation(config):
    cfg = config_here(config)
    args = make_args("int8", (1, 16), hq=2, hkv=1, sq=4608, skv=4608, v_seq_major=False)
    assert args[4].stride(-1) == 1
    check_against_emulation(args, make_blocks("random", 1, 2, 4608, 4608, seed=3), cfg, f"D-major V {config}", "int8")


# ------------------------------------------------------------------------------------------------------------------
# Bitwise against the dense kernel; empty lists
# ------------------------------------------------------------------------------------------------------------------


def spanning_bias(skv: int) -> torch.Tensor:
    """A key bias whose nonzero span is every key (-0.5 on the first and the last): the dense kernel then adds it
    in every tile, as the sparse walk does in every visited one. (Outside that span the dense kernel runs its
    bias-free softmax, whose ``t·rs - m`` the compiler may fuse into one fma where the biased ``t·rs + bias`` is
    fused instead: the same values to fp32 rounding, not the same bits.)"""
    bias = torch.zeros(1, skv)
    bias[:, 0] = bias[:, -1] = -0.5
    return bias.to(DEV)


@needs_sm89_90
@pytest.mark.parametrize("config", ALL_CONFIGS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_every_block_listed_is_the_dense_kernel(config, bias):
    """Lists of every block walk the dense kernel's tiles in its order with its arithmetic: the same bits."""
    cfg = config_here(config)
    args = make_args("int8", (1, 16), hq=4, hkv=2, sq=4608, skv=4685)
    key_bias = spanning_bias(4685) if bias else None
    if bias:
        key_bias[:, 1000:1100] = -math.inf
    out, lse = run(args, make_blocks("all", 1, 4, 4608, 4685), cfg, key_bias)
    dense, dense_lse = run(args, None, cfg, key_bias)
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse), (out - dense).abs().max().item()


@needs_sm89_90
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_skipped_key_tiles_are_masked_keys(config):
    """Lists of some key tiles (the same for every query tile and head) == the dense kernel with the other tiles'
    keys masked by its key bias, bit for bit (a skipped block is a block at -inf); both calls add
    :func:`spanning_bias`, so both run the biased softmax in every tile."""
    cfg = config_here(config)
    skv = 4685
    args = make_args("int8", (1, 16), hq=2, hkv=1, sq=2048, skv=skv)
    nq, nk = block_sparse.tiles(2048, skv)
    keys = torch.rand(1, 1, 1, nk, generator=torch.Generator().manual_seed(5)) < 0.4
    keys[..., -1] = True
    lists = block_sparse.from_mask(keys.expand(1, 2, nq, nk).contiguous().to(DEV))
    masked = torch.where(block_sparse.expand(keys, 1, skv)[:, 0, 0], 0.0, -math.inf).to(DEV)
    own = spanning_bias(skv)
    out, lse = run(args, lists, cfg, own)
    dense, dense_lse = run(args, None, cfg, own + masked)
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse), (out - dense).abs().max().item()


@needs_sm89_90
@pytest.mark.parametrize("config", [None, *ALL_CONFIGS])
def test_visiting_nothing_gives_zeros(config):
    """Every count 0 (K scales per 64 and 128 keys: one per sub-tile for some configs, read unmasked): zeros and
    LSE -inf, with and without a key bias, also for all-zero query rows and keys (scales 0)."""
    cfg = config_here(config)
    nq, nk = block_sparse.tiles(1000, 4685)
    lists = block_sparse.from_mask(torch.zeros(1, 2, nq, nk, dtype=torch.bool, device=DEV))
    q, k, v = support.make_qkv(b=1, hq=2, hkv=2, sq=1000, skv=4685, d=128, device=DEV)
    q, k = q.clone(), k.clone()
    q[:, :, :40] = 0
    k[:, :, :128] = 0
    for k_block in (64, 128):
        args = quantize(q, k, v, "int8", 1, k_block, smooth=False)
        for bias in (None, torch.zeros(1, 4685, device=DEV)):
            out, lse = run(args, lists, cfg, bias)
            assert torch.equal(out, torch.zeros_like(out)) and (lse == -math.inf).all(), (k_block, bias is None)


# ------------------------------------------------------------------------------------------------------------------
# Launch: no synchronization, CUDA graphs, the registered op
# ------------------------------------------------------------------------------------------------------------------


@needs_sm89_90
def test_no_host_sync_and_cuda_graph():
    args = make_args("int8", (1, 16), hq=4, hkv=4, sq=1024, skv=1024)
    lists = make_blocks("random", 1, 4, 1024, 1024)
    full = (*args, SM_SCALE, torch.bfloat16)
    kw = dict(block_index=lists.index, block_count=lists.count)
    expected = ts.scaled_attention(*full, **kw)  # autotunes and compiles outside the checks
    assert torch.equal(support.without_host_sync(lambda: ts.scaled_attention(*full, **kw)), expected)
    graph, captured = support.capture_graph(lambda: ts.scaled_attention(*full, **kw))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


@needs_sm89_90
def test_through_the_registered_op():
    args = make_args("int8", (1, 16), hq=4, hkv=2, sq=4608, skv=4608)
    lists = make_blocks("band", 1, 4, 4608, 4608)
    out = torch.ops.qattn.scaled_attention(*args, SM_SCALE, torch.bfloat16, "triton_sage", block_index=lists.index,
                                           block_count=lists.count)
    direct = ts.scaled_attention(*args, SM_SCALE, torch.bfloat16, block_index=lists.index, block_count=lists.count)
    assert torch.equal(out, direct)
