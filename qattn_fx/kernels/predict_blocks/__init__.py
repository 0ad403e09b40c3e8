"""The block predictor: which blocks of a call to visit (:mod:`qattn_fx.block_sparse`), chosen from Q and K before
any Q·Kᵀ. :mod:`.reference` defines it in torch (any device); :mod:`.triton` pools Q and K in one Triton kernel per
operand (reading each once); :mod:`.triton_select` runs the selection (scores, softmax, cdf / top_k, guard, sinks,
diagonal, the lists) in one Triton kernel. :func:`predict` runs both Triton steps on CUDA and the torch ones on CPU
(``pooling`` / ``selection`` pick either per step); the op ``qattn::predict_blocks`` (:mod:`qattn_fx.ops.predict`)
calls it.

What holds between them: equal pooled values give equal lists through :func:`.reference.select` (the torch
selection is one code for every pooling); the fused selection gives the reference's lists except where a choice
sits on a rounding boundary (``cdf``: a tile whose mass ranked above it is within fp32 rounding of ``keep``; either
mode: probabilities tied or within fp32 rounding of each other where their order decides): :mod:`.triton_select`.
"""

from __future__ import annotations

import torch

from ... import block_sparse
from . import reference
from .reference import MODES, Pooled, pool, select

#: Implementations of the pooling step.
POOLINGS = ("torch", "triton")
#: Implementations of the selection (steps 2-5).
SELECTIONS = ("torch", "triton")


def _unpooled(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None) -> Pooled:
    """What :func:`select` reads when ``keep >= 1``: the non-empty key tiles; the means and similarities are
    zero-stride placeholders of the right shapes (nothing is read from Q or K)."""
    b, hq, sq, _ = q.shape
    nq, nk = block_sparse.tiles(sq, k.shape[2])
    zero = torch.zeros((), device=q.device)
    kept = reference.kept_tiles(reference.kept_keys(key_bias), k.shape[2], k.device)
    return Pooled(zero.expand(b, hq, nq, 1), zero.expand(b, hq, nq), zero.expand(b, k.shape[1], nk, 1),
                  zero.expand(b, k.shape[1], nk), kept)


def predict(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None, sm_scale: float,
            keep: float | torch.Tensor, mode: str = "cdf", sink_tiles: int = 0, diagonal: bool = False,
            similarity: float = 0.0, *, pooling: str | None = None,
            selection: str | None = None) -> block_sparse.Blocks:
    """The blocks to visit (:mod:`.reference`'s rule). ``pooling`` and ``selection``: ``"triton"`` (the default on
    CUDA: a ``RuntimeError`` naming triton when it does not import; there is no fallback) or ``"torch"`` (the
    default elsewhere), each step on its own. With a host ``keep >= 1`` nothing is pooled (every non-empty key tile
    is visited)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    pooling = pooling or ("triton" if q.is_cuda else "torch")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is invalid; valid: {', '.join(POOLINGS)}")
    selection = selection or ("triton" if q.is_cuda else "torch")
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r} is invalid; valid: {', '.join(SELECTIONS)}")
    if pooling == "triton":
        from . import triton as fused  # noqa: PLC0415  (imports triton)

        fused.require()  # also on dense steps: a missing triton shows on the first call
        pool_fn = fused.pool
    else:
        pool_fn = pool
    if selection == "triton":
        from . import triton_select  # noqa: PLC0415  (imports triton)

        triton_select.require()
        select_fn = triton_select.select
    else:
        select_fn = select
    held = reference.host_keep(keep)  # keep >= 1 on the host: every non-empty key tile, nothing to pool
    pooled = _unpooled(q, k, key_bias) if held is not None and held >= 1.0 else pool_fn(q, k, key_bias)
    return select_fn(pooled, q.shape[2], k.shape[2], sm_scale, keep, mode, sink_tiles, diagonal, similarity)


__all__ = ["MODES", "POOLINGS", "SELECTIONS", "Pooled", "pool", "predict", "reference", "select"]
