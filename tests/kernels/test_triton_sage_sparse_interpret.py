"""triton_sage's block-sparse walk (``block_index`` / ``block_count``, :mod:`qattn_fx.block_sparse`) under the
Triton interpreter (CPU).

Three kinds of check pin it:

* Against :func:`qattn_fx.kernels.emulation.emulate` with the same lists, at the precision the dense path is
  pinned to (``assert_matches_emulation`` of ``test_triton_sage_interpret.py``: the emulation sums in fp64 and in
  torch's order, so fp32 agreement, not bits): random lists per (batch, query head, query tile), GQA, every K
  scale layout, bf16/int8/fp8 Q/K, the plain and the ``pipe`` schedule, key tiles of 1, 2 and 4 sub-tiles, query
  and key lengths that are not multiples of 128 or of the tile.
* Bitwise against the dense kernel: lists that visit every block give the dense kernel's bits (output and LSE);
  lists that depend on the key tile only give the bits of the dense kernel whose key bias masks the keys of the
  tiles left out (a skipped block is exactly a block at ``-inf``), with and without a key bias of its own.
* Edge cases: a query tile that visits nothing gives 0 and LSE ``-inf`` (no NaN); entries past a count are never
  read (they are poisoned here); batch chunks; the registered op; invalid lists and configs are refused.

Shapes are small (the interpreter runs each program in numpy). An offline group compiles the sparse variant for
sm_90 with Triton's bundled ptxas (no GPU) and checks that it builds with both dots on wgmma and without spills.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from qattn_fx import block_sparse  # noqa: E402
from qattn_fx.kernels import _sage_common  # noqa: E402
from qattn_fx.kernels import reference  # noqa: E402
from qattn_fx.kernels import triton_sage as ts  # noqa: E402
from support import emulate, make_qkv, quantize  # noqa: E402
from tests.kernels.test_triton_sage_interpret import (  # noqa: E402
    _meta_inputs, _ptxas_available, assert_matches_emulation, key_bias)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch, qattn_config):
    """Every test of this file runs under the Triton interpreter (as in test_triton_sage_interpret.py)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qattn_config(triton_sage_config=None)
    ts.set_config(None)
    yield
    ts.set_config(None)


# ------------------------------------------------------------------------------------------------------------------
# Lists
# ------------------------------------------------------------------------------------------------------------------

#: Default shape: one batch element, GQA 4/2, 200 queries (two query tiles, the second partial) and 300 keys (three
#: key tiles, the last of 44 keys: partial sub-tiles for every BLOCK_N below 128).
SHAPE = dict(b=1, hq=4, hkv=2, sq=200, skv=300)


def random_blocks(b, hq, sq, skv, *, density=0.5, seed=0) -> block_sparse.Blocks:
    """Random lists: each block visited with probability ``density``; query tile 0 of (0, 0) visits nothing and
    the last block (partial in both directions) is visited, so every run has an empty tile and a masked tail."""
    nq, nk = block_sparse.tiles(sq, skv)
    g = torch.Generator().manual_seed(seed)
    visit = torch.rand(b, hq, nq, nk, generator=g) < density
    visit[0, 0, 0] = False
    visit[-1, -1, -1, -1] = True
    return block_sparse.from_mask(visit)


def poisoned(blocks: block_sparse.Blocks) -> block_sparse.Blocks:
    """The same lists with every entry past its count pointing far outside K (a kernel that read one would load
    out of bounds or change the output)."""
    index, count = blocks
    past = torch.arange(index.shape[-1]) >= count[..., None]
    return block_sparse.Blocks(torch.where(past, torch.full_like(index, 1 << 20), index).contiguous(), count)


def run(args, blocks, config, *, bias=None, lse=True):
    """triton_sage with ``blocks`` under ``config`` (sm_scale 1/8, fp32 out): ``(out, lse)``."""
    with ts.use_config(ts.KernelConfig.parse(config)):
        return ts.attention(*args, 0.125, torch.float32, return_lse=lse, key_bias=bias,
                            block_index=None if blocks is None else blocks.index,
                            block_count=None if blocks is None else blocks.count)


def emulated(args, blocks, config, *, bias=None):
    block_n = ts.KernelConfig.parse(config).block_n
    return emulate(*args, 0.125, block_n, return_lse=True, key_bias=bias, block_index=blocks.index,
                   block_count=blocks.count)


def assert_lse_matches(lse, emu_lse):
    """Rows that visit nothing are ``-inf`` in both; the others agree to fp32 rounding of the sums' order."""
    empty = emu_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty)
    assert (lse[~empty].double() - emu_lse[~empty].double()).abs().max().item() < 1e-5


def assert_empty_rows(out, lse, blocks, sq):
    """The rows of query tiles whose count is 0 are exactly 0 with LSE ``-inf``; nothing is NaN."""
    empty = (blocks.count == 0).repeat_interleave(block_sparse.BLOCK_ROWS, -1)[..., :sq]
    assert empty.any()
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (lse[empty] == -math.inf).all()


# ------------------------------------------------------------------------------------------------------------------
# Against the emulation
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "qk,blocks,config",
    [
        ("int8", (1, 16), "32,32,4,1"),  # K scales per 16 columns; 4 sub-tiles per key tile
        ("int8", (1, 1), "64,64,4,1,pipe"),  # per-column K scale; pipelined
        ("int8", (0, 0), "64,128,4,1"),  # per-tensor scales folded into the row scale; one sub-tile per key tile
        ("int8", (16, 64), "32,64,4,1,pipe"),  # K scale uniform per sub-tile
        ("fp8", (1, 4), "64,64,4,1"),
        ("fp8", (2, 48), "32,32,4,1,pipe"),  # K scale block neither divides nor is a multiple of the tile
        ("bf16", (0, 0), "64,32,4,1,pipe"),
    ],
)
def test_matches_emulation(qk, blocks, config):
    """Random lists per query head (GQA), odd lengths: the kernel runs the emulated walk; empty tiles are 0."""
    args = quantize(*make_qkv(**SHAPE), qk, *blocks)
    lists = poisoned(random_blocks(1, 4, 200, 300, seed=sum(config.encode())))
    out, lse = run(args, lists, config)
    emu, emu_lse = emulated(args, lists, config)
    assert_matches_emulation(out, emu, qk)
    assert_lse_matches(lse, emu_lse)
    assert_empty_rows(out, lse, lists, 200)


@pytest.mark.parametrize("config", ["64,32,4,1", "64,64,4,1,pipe"])
@pytest.mark.parametrize("pattern", ["scattered", "all"])
def test_key_bias_matches_emulation(pattern, config):
    """Lists with a key bias: the bias of every visited tile is added; a row whose visited keys are all masked,
    or that visits nothing, is 0 (``all``: batch element 1 masks every key)."""
    args = quantize(*make_qkv(b=2, hq=1, hkv=1, sq=200, skv=300), "int8", 1, 16)
    bias = key_bias(2, 300, pattern)
    lists = random_blocks(2, 1, 200, 300, density=0.6, seed=3)
    out, lse = run(args, lists, config, bias=bias)
    emu, emu_lse = emulated(args, lists, config, bias=bias)
    assert_matches_emulation(out, emu, "int8")
    assert_lse_matches(lse, emu_lse)
    assert not out.isnan().any()
    if pattern == "all":
        assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == -math.inf).all()


@pytest.mark.parametrize(
    "case,config",
    [
        (dict(sq=100, skv=77), "32,32,4,1,pipe"),  # one partial key tile (no full sub-tile in the last tile's walk)
        (dict(sq=130, skv=256), "64,64,4,1"),  # key tiles full: no tail; one query row in the second tile
        (dict(sq=1, skv=129), "16,32,4,1,pipe"),  # a single query; the last key tile holds one key
        (dict(sq=129, skv=129), "32,128,4,1"),  # BLOCK_N 128: the last key tile is its own masked sub-tile
    ],
    ids=["skv77", "skv256", "sq1-skv129", "bn128-skv129"],
)
def test_lengths(case, config):
    shape = dict(b=1, hq=2, hkv=2, **case)
    args = quantize(*make_qkv(**shape), "int8", 1, 16)
    lists = random_blocks(1, 2, case["sq"], case["skv"], density=0.7, seed=5)
    out, lse = run(args, lists, config)
    emu, emu_lse = emulated(args, lists, config)
    assert_matches_emulation(out, emu, "int8")
    assert_lse_matches(lse, emu_lse)


@pytest.mark.parametrize("config", ["64,64,4,1", "64,64,4,1,pipe"])
def test_d_major_v_and_head_scopes(config):
    """D-major V (the fp16 P·V path), per-head scales, head_dim 128, contiguous BHSD."""
    args = quantize(*make_qkv(b=1, hq=2, hkv=2, sq=150, skv=200, d=128, bshd=False), "int8", 0, 0, scope="head",
                    v_scale="head", v_seq_major=False)
    assert args[4].stride(-1) == 1
    lists = random_blocks(1, 2, 150, 200, density=0.6, seed=1)
    out, lse = run(args, lists, config)
    emu, emu_lse = emulated(args, lists, config)
    assert_matches_emulation(out, emu, "int8")
    assert_lse_matches(lse, emu_lse)


@pytest.mark.parametrize("qk,blocks,config", [("fp8", (1, 16), "64,64,4,1"), ("int8", (1, 64), "32,64,4,1,pipe"),
                                              ("int8", (1, 1), "64,32,4,1,pipe"), ("fp8", (1, 16), "64,64,4,1,pipe"),
                                              ("bf16", (0, 0), "64,64,4,1,pipe")])
def test_visiting_nothing_gives_zeros(qk, blocks, config):
    """Every count 0: output 0 and LSE -inf everywhere, no NaN (with and without a key bias; the pipelined walk
    finishes an empty walk on a masked tile, whatever the K scales' layout, even where a row's or the first keys'
    scale is 0: all-zero query rows and keys)."""
    q, k, v = make_qkv(b=1, hq=2, hkv=1, sq=130, skv=200)
    q, k = q.clone(), k.clone()
    q[:, :, :40] = 0
    k[:, :, :64] = 0
    args = quantize(q, k, v, qk, *blocks, smooth=False)
    if qk != "bf16":
        assert (args[1] == 0).any() and (args[3] == 0).any()
    nq, nk = block_sparse.tiles(130, 200)
    lists = poisoned(block_sparse.from_mask(torch.zeros(1, 2, nq, nk, dtype=torch.bool)))
    for bias in (None, torch.zeros(1, 200)):
        out, lse = run(args, lists, config, bias=bias)
        assert torch.equal(out, torch.zeros_like(out)) and (lse == -math.inf).all()


# ------------------------------------------------------------------------------------------------------------------
# Bitwise against the dense kernel
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk,blocks", [("int8", (1, 16)), ("fp8", (1, 4)), ("bf16", (0, 0))])
@pytest.mark.parametrize("config", ["64,32,4,1", "64,64,4,1,pipe"])
def test_every_block_listed_is_the_dense_kernel(qk, blocks, config):
    """Lists that visit every block walk the dense kernel's tiles in its order: the same bits, output and LSE."""
    args = quantize(*make_qkv(b=1, hq=2, hkv=1, sq=200, skv=300), qk, *blocks)
    lists = block_sparse.dense(1, 2, 200, 300)
    out, lse = run(args, lists, config)
    dense, dense_lse = run(args, None, config)
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse)


@pytest.mark.parametrize("qk,blocks", [("int8", (1, 16)), ("bf16", (0, 0))])
@pytest.mark.parametrize("config", ["64,32,4,1", "32,64,4,1,pipe"])
def test_skipped_key_tiles_are_masked_keys(qk, blocks, config):
    """Lists that depend on the key tile only (per batch element) are the dense kernel with those tiles' keys
    masked by its key bias, bit for bit: a skipped block is a block at ``-inf``. Batch element 1 visits nothing (the
    dense kernel: every key masked). With a key bias of the lists' own (``scattered``), the dense kernel's bias is
    the sum."""
    args = quantize(*make_qkv(b=2, hq=1, hkv=1, sq=200, skv=300), qk, *blocks)
    nq, nk = block_sparse.tiles(200, 300)
    keys = torch.tensor([[True, False, True], [False, False, False]])[:, None, None, :]  # (B, 1, 1, NK)
    lists = block_sparse.from_mask(keys.expand(2, 1, nq, nk).contiguous())
    skipped = torch.where(block_sparse.expand(keys, 1, 300)[:, 0, 0], 0.0, -math.inf)  # (B, Skv)
    for own in (None, key_bias(2, 300, "scattered")):
        out, lse = run(args, lists, config, bias=own)
        dense, dense_lse = run(args, None, config, bias=skipped if own is None else skipped + own)
        assert torch.equal(out, dense) and torch.equal(lse, dense_lse)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


# ------------------------------------------------------------------------------------------------------------------
# Launch: batch chunks, the registered op, errors, autotuning
# ------------------------------------------------------------------------------------------------------------------


def test_batch_chunks_take_their_lists(monkeypatch):
    """Calls past the grid limit run in batch chunks, each with its batch elements' lists."""
    args = quantize(*make_qkv(b=3, hq=2, hkv=1, sq=130, skv=200), "int8", 1, 16)
    lists = random_blocks(3, 2, 130, 200, density=0.5, seed=11)
    whole = run(args, lists, "64,64,4,1")
    monkeypatch.setattr(_sage_common, "MAX_GRID_Y", 2)  # 2 heads: one batch element per launch
    chunked = run(args, lists, "64,64,4,1")
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_through_the_registered_op():
    """``qattn::scaled_attention(..., kernel="triton_sage", block_index=, block_count=)`` runs the sparse walk."""
    args = quantize(*make_qkv(b=1, hq=2, hkv=1, sq=130, skv=200), "int8", 1, 16)
    lists = random_blocks(1, 2, 130, 200, seed=2)
    with ts.use_config("64,64,4,1"):
        out = torch.ops.qattn.scaled_attention(*args, 0.125, torch.bfloat16, "triton_sage", block_index=lists.index,
                                               block_count=lists.count)
        direct = ts.scaled_attention(*args, 0.125, torch.bfloat16, block_index=lists.index, block_count=lists.count)
    assert torch.equal(out, direct)
    ref = reference.scaled_attention(*args, 0.125, torch.float32, block_index=lists.index, block_count=lists.count)
    assert (out.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_invalid_lists_and_configs_are_refused():
    args = quantize(*make_qkv(b=1, hq=2, hkv=1, sq=130, skv=200), "int8", 1, 16)
    lists = random_blocks(1, 2, 130, 200)
    with pytest.raises(ValueError, match=r"block_index must have shape \(1, 2, 2, 2\)"):
        ts.attention(*args, 0.125, torch.float32, block_index=lists.index[..., :1].contiguous(),
                     block_count=lists.count)
    with pytest.raises(ValueError, match="block_index and block_count go together"):
        ts.attention(*args, 0.125, torch.float32, block_index=lists.index)
    with pytest.raises(ValueError, match="block_count must be int32"):
        ts.attention(*args, 0.125, torch.float32, block_index=lists.index, block_count=lists.count.long())
    with pytest.raises(ValueError, match="^triton_sage: block_index and block_count are on meta; they must be on Q's "
                       "device cpu$"):
        ts.attention(*args, 0.125, torch.float32, block_index=lists.index.to("meta"), block_count=lists.count.to("meta"))
    with ts.use_config("256,64,8,1"), pytest.raises(
            ValueError, match=r"config BM256_BN64_w8_s1 is invalid for block-sparse calls .*BLOCK_M dividing 128"):
        ts.attention(*args, 0.125, torch.float32, block_index=lists.index, block_count=lists.count)


def test_autotuned_candidates_of_sparse_calls():
    """Block-sparse calls are tuned apart from dense ones (``SPARSE`` in the key) among configs whose tiles divide
    a block; an impossible set says so."""
    from qattn_fx.kernels.triton_sage import launch

    assert "SPARSE" in launch._AUTOTUNE_KEY
    for cap in ((9, 0), (8, 9)):
        for sq in (40, 4096):
            candidates = ts.tuned_candidates(cap, sq, sparse=True)
            assert candidates and all(launch.sparse_config_error(c) is None for c in candidates)
            assert len({c.numerics for c in candidates}) == 1
    wide = [ts.KernelConfig(256, 128, 8, 3).to_triton()]
    with pytest.raises(ValueError, match="no autotuned config has BLOCK_N=128 for sm_90 and block-sparse calls"):
        launch.prune_configs(wide, {"SEQ_Q": 4096}, PV_SPLIT=False, SPARSE=True)
    assert launch.prune_configs(wide, {"SEQ_Q": 4096}, PV_SPLIT=False, SPARSE=False) == wide


# ------------------------------------------------------------------------------------------------------------------
# Offline compilation for Hopper (Triton's bundled ptxas; no GPU)
# ------------------------------------------------------------------------------------------------------------------


def _meta_blocks(args):
    b, h, sq = args[0].shape[:3]
    nq, nk = block_sparse.tiles(sq, args[2].shape[2])
    meta = torch.device("meta")
    return dict(block_index=torch.empty(b, h, nq, nk, dtype=torch.int32, device=meta),
                block_count=torch.empty(b, h, nq, dtype=torch.int32, device=meta))


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's ptxas is not installed")
@pytest.mark.parametrize(
    "qk,blocks,config,bias,v_seq_major",
    [
        (torch.int8, (1, 16), "128,128,8,3", False, True),
        (torch.int8, (1, 16), "128,64,8,3,pipe", True, True),
        (torch.float8_e4m3fn, (0, 0), "64,64,4,3,pipe", False, True),
        (torch.bfloat16, (0, 0), "128,64,8,3", True, True),
        (torch.int8, (1, 16), "128,64,8,3", False, False),
    ],
    ids=["int8-128x128", "int8-pipe-bias", "fp8-64x64-pipe", "bf16-bias", "int8-vdmajor"],
)
def test_sparse_variant_compiles_for_sm90(monkeypatch, qk, blocks, config, bias, v_seq_major):
    monkeypatch.delenv("TRITON_INTERPRET")
    args = _meta_inputs(qk, *blocks, v_seq_major=v_seq_major)
    extra = _meta_blocks(args)
    if bias:
        extra["key_bias"] = torch.empty(1, args[2].shape[2], device="meta")
    compiled = ts.compile_for((9, 0), ts.KernelConfig.parse(config), *args, **extra)
    report = ts.ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"], report
    assert report["spill_stores"] == 0, report
    assert compiled.asm["ttgir"].count("ttng.warp_group_dot ") >= 2
    assert "wgmma.mma_async.sync.aligned" in compiled.asm["ptx"]
