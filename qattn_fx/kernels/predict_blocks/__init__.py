"""The block predictor: which blocks of a call to visit (:mod:`qattn_fx.block_sparse`), chosen from Q and K before
any Q·Kᵀ. :mod:`.reference` defines it in torch (any device); :mod:`.triton` pools Q and K in one Triton kernel per
operand (reading each once) and shares the reference's selection. :func:`predict` runs the Triton pooling on CUDA
and the torch one on CPU; the op ``qattn::predict_blocks`` (:mod:`qattn_fx.ops.predict`) calls it."""

from __future__ import annotations

import torch

from ... import block_sparse
from . import reference
from .reference import MODES, Pooled, pool, select

#: Implementations of the pooling step.
POOLINGS = ("torch", "triton")


def _unpooled(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None) -> Pooled:
    """What :func:`select` reads when ``keep >= 1``: the non-empty key tiles; the means and similarities are
    zero-stride placeholders of the right shapes (nothing is read from Q or K)."""
    b, hq, sq, _ = q.shape
    nq, nk = block_sparse.tiles(sq, k.shape[2])
    zero = torch.zeros((), device=q.device)
    kept = reference.tile_counts(reference.kept_keys(key_bias, k.shape[2], k.device), block_sparse.BLOCK_KEYS) > 0
    return Pooled(zero.expand(b, hq, nq, 1), zero.expand(b, hq, nq), zero.expand(b, k.shape[1], nk, 1),
                  zero.expand(b, k.shape[1], nk), kept)


def predict(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None, sm_scale: float,
            keep: float | torch.Tensor, mode: str = "cdf", sink_tiles: int = 0, diagonal: bool = False,
            similarity: float = 0.0, *, pooling: str | None = None) -> block_sparse.Blocks:
    """The blocks to visit (:mod:`.reference`'s rule). ``pooling``: ``"triton"`` (the default on CUDA: a
    ``RuntimeError`` naming triton when it does not import; there is no fallback) or ``"torch"`` (the default
    elsewhere). With ``keep >= 1`` nothing is pooled (every non-empty key tile is visited)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    pooling = pooling or ("triton" if q.is_cuda else "torch")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is invalid; valid: {', '.join(POOLINGS)}")
    if pooling == "triton":
        from . import triton as fused  # noqa: PLC0415  (imports triton)

        fused.require()  # also on dense steps: a missing triton shows on the first call
        pool_fn = fused.pool
    else:
        pool_fn = pool
    held = reference.host_keep(keep)  # keep >= 1 on the host: every non-empty key tile, nothing to pool
    pooled = _unpooled(q, k, key_bias) if held is not None and held >= 1.0 else pool_fn(q, k, key_bias)
    return select(pooled, q.shape[2], k.shape[2], sm_scale, keep, mode, sink_tiles, diagonal, similarity)


__all__ = ["MODES", "POOLINGS", "Pooled", "pool", "predict", "reference", "select"]
