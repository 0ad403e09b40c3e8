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


def predict(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None, sm_scale: float,
            keep: float | torch.Tensor, mode: str = "cdf", sink_tiles: int = 0, diagonal: bool = False,
            similarity: float = 0.0, *, pooling: str | None = None) -> block_sparse.Blocks:
    """The blocks to visit (:mod:`.reference`'s rule). ``pooling``: ``"triton"`` (the default on CUDA: a
    ``RuntimeError`` naming triton when it does not import; there is no fallback) or ``"torch"`` (the default
    elsewhere)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    pooling = pooling or ("triton" if q.is_cuda else "torch")
    if pooling == "triton":
        from . import triton as fused  # noqa: PLC0415  (imports triton)

        pooled = fused.pool(q, k, key_bias)
    elif pooling == "torch":
        pooled = pool(q, k, key_bias)
    else:
        raise ValueError(f"pooling={pooling!r} is invalid; valid: {', '.join(POOLINGS)}")
    return select(pooled, q.shape[2], k.shape[2], sm_scale, keep, mode, sink_tiles, diagonal, similarity)


__all__ = ["MODES", "POOLINGS", "Pooled", "pool", "predict", "reference", "select"]
