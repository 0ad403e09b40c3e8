"""The predictor's selection (steps 2-5 of :mod:`.reference`) as one Triton kernel that writes the lists.

:func:`select` takes what :func:`.reference.select` takes and returns the same
:class:`~qattn_fx.block_sparse.Blocks`, in one launch of :func:`._select_kernel._select_rows`: one program per
(batch, query head, :func:`rows_per_program` query tiles) reads those tiles' pooled ``q̄`` and all of the kv
head's ``k̄`` (GQA: kv head ``hq // g``), computes the scores times ``sm_scale`` over the non-empty key tiles, the
softmax, the selection (``cdf`` / ``top_k``, ties to the lower index), the similarity guard, the sinks and the
diagonal, and writes ``block_index`` (the visited key tiles ascending, then ``-1``, as
:func:`~qattn_fx.block_sparse.from_mask`) and ``block_count`` directly: no ``(B, Hq, NQ, NK)`` intermediate, no
sort (the rank threshold is found by bisection over the probabilities' fp32 bits), no scatter.

**keep.** A number or a CPU tensor is read on the host (``keep >= 1``: every non-empty key tile, nothing scored);
a tensor on the device is read by the kernel itself (no host synchronization: a CUDA-graph capture replays it, and
``keep >= 1`` there visits every non-empty tile). ``top_k``'s tile count ``ceil(keep · N − N · 1e-9)`` (at least 1)
is computed in fp64 from the host's double or the device's fp32 keep, as the reference does.

**Numerics.** The lists are the reference's rule applied to this kernel's own fp32 probabilities: the dot products
sum over ``d`` in order, ``exp`` is Triton's, the sums over a row are tree reductions, so probabilities differ from
torch's by a few ulps. The lists equal :func:`.reference.select`'s on the same pooled values except (a) ``cdf``: a
tile whose mass ranked above it is within fp32 rounding (a small tolerance, ~1e-6) of ``keep``; (b) two tiles
whose probabilities lie within fp32 rounding of each other (tied in one, not in the other), where their order decides
(``top_k`` at the ``n_keep`` boundary, ``cdf`` at the mass boundary), probabilities below fp32's normal range
included (the compiled ``exp`` may flush them to 0, which ties them). The guard compares the given similarities with
the same fp32 ``<`` as the reference, so it never differs; sinks, the diagonal and empty tiles are exact. Tests:
``tests/kernels/test_block_select_interpret.py`` (interpreter) and ``tests/gpu/test_block_predictor.py`` check each
differing block against the boundary in fp64.

**Limit.** A program holds a whole row of key tiles: at most :data:`MAX_KEY_TILES` key tiles (``Skv`` up to
``MAX_KEY_TILES · 128`` keys); longer calls are refused with a ``ValueError`` naming the limit (use
``selection="torch"``).

Runs on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from ... import block_sparse
from .._compiled_launch import compiled
from .._cuda_utils import TritonSource, next_power_of_2
from .reference import _CEIL_SLACK, MODES, Pooled, host_keep

#: The selection kernel's source (:mod:`._select_kernel`).
KERNELS = TritonSource(__package__, Path(__file__).with_name("_select_kernel.py"), "_select",
                       "qattn::predict_blocks on CUDA",
                       "the fused selection kernel, qattn_fx.kernels.predict_blocks.triton_select")
#: The most key tiles one call may have (a program holds a row of them).
MAX_KEY_TILES = 4096
#: Elements (query tiles x padded key tiles) a program holds: ``ROWS = TILE_ELEMENTS // BLOCK_N``, at most
#: :data:`MAX_ROWS` (no spills at sm_90 up to :data:`MAX_KEY_TILES`: ``tests/kernels/test_block_select_interpret.py``).
TILE_ELEMENTS = 8192
#: Most query tiles per program (each program reads its kv head's k̄ once for all of them).
MAX_ROWS = 16
#: Warps per program holding :data:`TILE_ELEMENTS` elements (16 a thread); fewer for smaller tiles.
NUM_WARPS = 16
#: Head-dim steps of the score loop whose loads are issued together.
UNROLL_D = 8
#: The bits of fp32 1.0: probabilities lie in [0, 1], so their bits in [0, this].
_ONE_BITS = 0x3F800000


require = KERNELS.require


def _double_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _block_n(nk: int) -> int:
    return max(next_power_of_2(nk), 16)


def rows_per_program(nk: int) -> int:
    """Query tiles per program for ``nk`` key tiles."""
    return max(1, min(MAX_ROWS, TILE_ELEMENTS // _block_n(nk)))


def num_warps(nk: int) -> int:
    """Warps per program for ``nk`` key tiles: 16 elements a thread, 4 to :data:`NUM_WARPS` warps."""
    return max(4, min(NUM_WARPS, rows_per_program(nk) * _block_n(nk) // (32 * 16)))


def dot_scores(rows: int) -> bool:
    """Whether a program of ``rows`` query tiles scores with FMA ``tl.dot`` chunks (``tl.dot`` needs at least 16
    rows: up to 512 key tiles) rather than one scalar load per query tile and ``d`` (longer key sets). Both sum the
    same products in the same order."""
    return rows >= 16


def _launch_args(pooled: Pooled, sq: int, skv: int, sm_scale: float, keep, mode: str, sink_tiles: int,
                 diagonal: bool, similarity: float, index: torch.Tensor, count: torch.Tensor):
    """``(grid, args, meta)`` of the :func:`._select_kernel._select_rows` launch."""
    q_mean, q_sim, k_mean, k_sim, kept = pooled
    b, hq, nq, d = q_mean.shape
    hkv, nk = k_mean.shape[1], k_mean.shape[2]
    held = host_keep(keep)
    on_device = held is None
    everything = not on_device and held >= 1.0
    if on_device:
        keep_arg, keep_f32, keep_bits = keep.reshape(()).float(), 0.0, 0  # a view without a copy for fp32 keep
    else:
        keep_arg, keep_f32, keep_bits = index, held, _double_bits(held)  # keep_arg never read
    kept = kept.contiguous()
    kept_u8 = kept.view(torch.uint8) if kept.dtype == torch.bool else kept.to(torch.uint8)
    rows = rows_per_program(nk)
    row_blocks = -(-nq // rows)
    if not everything:  # (with everything, nothing but kept is read: the placeholders stay as they are)
        q_sim, k_sim = q_sim.contiguous(), k_sim.contiguous()
    args = [q_mean, q_sim, k_mean, k_sim, kept_u8, keep_arg, index, count,
            hq, hq // hkv, nq, nk, sq, skv, row_blocks, *q_mean.stride(), *k_mean.stride(),
            kept_u8.stride(0) if kept_u8.shape[0] > 1 else 0, float(sm_scale), float(keep_f32), keep_bits,
            float(similarity), int(sink_tiles)]
    meta = dict(D=d, ROWS=rows, BLOCK_N=_block_n(nk), TOP_K=mode == "top_k", KEEP_ON_DEVICE=on_device, ALL=everything,
                GUARD=similarity > 0, DIAGONAL=bool(diagonal), SLACK=_CEIL_SLACK, BISECT_HI=_ONE_BITS,
                BISECT_STEPS=_ONE_BITS.bit_length(), TILE_Q=block_sparse.BLOCK_ROWS, TILE_K=block_sparse.BLOCK_KEYS,
                UNROLL_D=min(UNROLL_D, d), DOT=dot_scores(rows))
    return (b * hq * row_blocks,), args, meta


def _check(pooled: Pooled, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    nk = pooled.k_mean.shape[2]
    if nk > MAX_KEY_TILES:
        raise ValueError(f"the fused block selection holds at most {MAX_KEY_TILES} key tiles "
                         f"({MAX_KEY_TILES * block_sparse.BLOCK_KEYS} keys) per call; this call has {nk}: "
                         "use selection='torch'")


def _outputs(pooled: Pooled, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_index, block_count)`` a launch on ``pooled`` writes, after checking the call."""
    _check(pooled, mode)
    b, hq, nq, _ = pooled.q_mean.shape
    nk, device = pooled.k_mean.shape[2], pooled.q_mean.device
    return (torch.empty(b, hq, nq, nk, dtype=torch.int32, device=device),
            torch.empty(b, hq, nq, dtype=torch.int32, device=device))


def select(pooled: Pooled, sq: int, skv: int, sm_scale: float, keep: float | torch.Tensor, mode: str = "cdf",
           sink_tiles: int = 0, diagonal: bool = False, similarity: float = 0.0) -> block_sparse.Blocks:
    """Steps 2-5 in one Triton kernel (the module docstring); the arguments of :func:`.reference.select`."""
    require()
    index, count = _outputs(pooled, mode)
    nk = index.shape[3]
    if nk == 0 or count.numel() == 0:
        return block_sparse.Blocks(index, count.zero_())
    grid, args, meta = _launch_args(pooled, sq, skv, sm_scale, keep, mode, sink_tiles, diagonal, similarity,
                                    index, count)
    compiled(KERNELS.module()._select_rows)[grid](*args, **meta, num_warps=num_warps(nk))
    return block_sparse.Blocks(index, count)


def compile_for(capability: tuple[int, int], pooled: Pooled, sq: int, skv: int, keep: float | torch.Tensor = 0.5,
                mode: str = "cdf", sink_tiles: int = 1, diagonal: bool = True, similarity: float = 0.6):
    """Compile (not run) the selection kernel a CUDA launch on ``pooled`` would use, for ``capability`` (inputs may
    be on the ``meta`` device; needs Triton's bundled ptxas, not a GPU). Returns Triton's compiled kernel
    (``.asm["ptx"]``, ``.metadata``)."""
    from .._offline import compile_offline  # noqa: PLC0415

    index, count = _outputs(pooled, mode)
    _, args, meta = _launch_args(pooled, sq, skv, sm_scale=0.088, keep=keep, mode=mode, sink_tiles=sink_tiles,
                                 diagonal=diagonal, similarity=similarity, index=index, count=count)
    return compile_offline(KERNELS.module(False)._select_rows, args, meta, capability,
                           {"num_warps": num_warps(index.shape[3])})


__all__ = ["KERNELS", "MAX_KEY_TILES", "NUM_WARPS", "compile_for", "num_warps", "require", "rows_per_program",
           "select"]
