"""The predictor's pooling (step 1 of :mod:`.reference`) as one Triton kernel that reads Q and K once.

:func:`pool` launches :func:`._pool_kernel._pool_tiles` twice, once over Q's tiles of
:data:`~qattn_fx.block_sparse.BLOCK_ROWS` rows and once over K's tiles of :data:`~qattn_fx.block_sparse.BLOCK_KEYS`
keys (kept keys only, by ``key_bias``): one program per (batch, head, tile) reads its tile once (bf16/fp16/fp32, any
strides) and writes the tile's fp32 mean ``(D,)`` and self-similarity (a scalar); over K with a key bias, the
programs of head 0 also write whether their tile holds a kept key (:attr:`.reference.Pooled.k_kept`). K's means are
a ``(B, Hkv, NK, D)`` view of ``(B, Hkv, D, NK)`` storage, the order in which the fused selection
(:mod:`.triton_select`) reads them. The pooled values differ from torch's only by fp32 summation order (sums over a
tile in another order; the reciprocals, divisions and square roots correctly rounded in both);
:func:`.reference.select` or :func:`.triton_select.select` turns them into lists.

Inputs as :func:`.reference.pool`: ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)``, ``key_bias (B|1, Skv)`` or None,
on one CUDA device (or CPU tensors under ``TRITON_INTERPRET=1``). Returns :class:`.reference.Pooled`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import block_sparse
from .._compiled_launch import compiled
from .._cuda_utils import TritonSource, bias_args, next_power_of_2
from .reference import Pooled, kept_keys, kept_tiles

#: The pooling kernel's source (:mod:`._pool_kernel`).
KERNELS = TritonSource(__package__, Path(__file__).with_name("_pool_kernel.py"), "_pool",
                       "qattn::predict_blocks on CUDA",
                       "the fused pooling kernel, qattn_fx.kernels.predict_blocks.triton")
#: Tokens a program reads per step of its tile (at most the tile: a launch clamps it).
ROWS = 32
#: Warps per program: few, so that more programs, and their loads, are in flight (docs/block-sparsity.md,
#: "Where its time goes").
NUM_WARPS = 2
require = KERNELS.require


def _launch_args(x: torch.Tensor, tile: int, bias: torch.Tensor | None, mean: torch.Tensor, sim: torch.Tensor,
                 kept: torch.Tensor | None):
    """``(grid, args, meta)`` of one :func:`._pool_kernel._pool_tiles` launch over ``x``'s tiles (``kept``: the
    ``(B|1, N)`` uint8 flags it writes with a bias, else None)."""
    b, h, s, d = x.shape
    n = -(-s // tile)
    bias_ptr, stride_bias_b, stride_bias_s = bias_args(bias, x)
    args = [x, bias_ptr, mean, sim, sim if kept is None else kept, h, s, d, n, *x.stride(), stride_bias_b,
            stride_bias_s, *mean.stride()[2:], 0 if kept is None else kept.shape[0]]
    meta = dict(TILE=tile, ROWS=min(ROWS, tile), BLOCK_D=next_power_of_2(d), HAS_BIAS=bias is not None)
    return (b * h * n,), args, meta


def _means(b: int, h: int, n: int, d: int, device, by_column: bool) -> torch.Tensor:
    """``(B, H, N, D)`` fp32, stored ``(B, H, D, N)`` when ``by_column`` (K's means: the selection kernel reads
    them one ``d`` at a time over all key tiles)."""
    if by_column:
        return torch.empty(b, h, d, n, dtype=torch.float32, device=device).transpose(2, 3)
    return torch.empty(b, h, n, d, dtype=torch.float32, device=device)


def _outputs(x: torch.Tensor, tile: int, bias: torch.Tensor | None,
             by_column: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-tile means, similarities and (with a bias) kept flags a launch over ``x``'s tiles of ``tile`` tokens
    writes."""
    b, h, s, d = x.shape
    n = -(-s // tile)
    kept = None if bias is None else torch.empty(bias.shape[0], n, dtype=torch.uint8, device=x.device)
    return (_means(b, h, n, d, x.device, by_column), torch.empty(b, h, n, dtype=torch.float32, device=x.device),
            kept)


def _pool(x: torch.Tensor, tile: int, bias: torch.Tensor | None,
          by_column: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    mean, sim, kept = _outputs(x, tile, bias, by_column)
    if mean.numel() == 0:  # no program to run; the kept flags (if any) still follow the bias
        if kept is not None:
            kept.copy_(kept_tiles(kept_keys(bias), x.shape[2], x.device))
        return mean, sim, kept
    grid, args, meta = _launch_args(x, tile, bias, mean, sim, kept)
    compiled(KERNELS.module()._pool_tiles)[grid](*args, **meta, num_warps=NUM_WARPS)
    return mean, sim, kept


def compile_for(capability: tuple[int, int], x: torch.Tensor, tile: int, key_bias: torch.Tensor | None = None,
                by_column: bool = False):
    """Compile (not run) the pooling kernel a CUDA launch over ``x``'s tiles of ``tile`` tokens would use, for
    ``capability`` (inputs may be on the ``meta`` device; needs Triton's bundled ptxas, not a GPU). Returns Triton's
    compiled kernel (``.asm["ptx"]``, ``.metadata``)."""
    from .._offline import compile_offline  # noqa: PLC0415

    bias = None if key_bias is None else key_bias.float()
    mean, sim, kept = _outputs(x, tile, bias, by_column)
    _, args, meta = _launch_args(x, tile, bias, mean, sim, kept)
    return compile_offline(KERNELS.module(False)._pool_tiles, args, meta, capability, {"num_warps": NUM_WARPS})


def pool(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None) -> Pooled:
    """Step 1 of the predictor in Triton (the module docstring)."""
    require()
    bias = None if key_bias is None else key_bias.float()
    q_mean, q_sim, _ = _pool(q, block_sparse.BLOCK_ROWS, None)
    k_mean, k_sim, k_kept = _pool(k, block_sparse.BLOCK_KEYS, bias, by_column=True)
    # without a bias every key tile holds a kept key (one fill); with one, K's launch wrote the flags
    k_kept = kept_tiles(None, k.shape[2], k.device) if k_kept is None else k_kept.view(torch.bool)
    return Pooled(q_mean, q_sim, k_mean, k_sim, k_kept)


__all__ = ["KERNELS", "NUM_WARPS", "ROWS", "compile_for", "pool", "require"]
