"""The block predictor's definition in torch (any device): pooled scores, a self-similarity guard, and a selection
per query tile.

For one call with ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)`` (any float dtype, any strides) and an optional
``key_bias (B|1, Skv)`` (``-inf``: masked key):

1. **Pool.** Per query tile of :data:`~qattn_fx.block_sparse.BLOCK_ROWS` rows, the mean of its rows ``q̄``; per key
   tile of :data:`~qattn_fx.block_sparse.BLOCK_KEYS` keys, the mean of its *kept* keys ``k̄`` (a key tile whose
   keys are all masked is *empty*). In fp32.
2. **Score.** ``P̄ = softmax_j(q̄_i · k̄_j · sm_scale)`` over the non-empty key tiles (GQA: K heads repeated).
3. **Guard.** A tile is *self-similar* when ``‖mean(x · (1 / ‖x‖))‖²`` over its tokens (the mean pairwise cosine of
   its tokens, self-pairs included) is at least ``similarity``; the pooled score stands for a tile only then. A query
   tile that is not self-similar visits every non-empty key tile; a key tile that is not is visited by every query
   tile. ``similarity = 0`` turns the guard off.
4. **Select**, per query tile: ``mode="cdf"``: the smallest set of key tiles, by descending ``P̄``, whose mass
   reaches ``keep``; ``mode="top_k"``: the ``ceil(keep · N)`` largest of its ``N`` non-empty key tiles (at least
   one; the product less a relative 1e-9, so that ``0.15 · 100`` gives 15 although binary 0.15 times 100 rounds
   above 15). Ties go to the lower index. ``keep >= 1`` visits every non-empty key tile (how a step schedule runs a
   step dense without recompiling: ``keep`` is a tensor).
5. **Always kept**: the first ``sink_tiles`` key tiles (attention sinks) and, with ``diagonal``, the key tile
   holding the query tile's middle row scaled to the keys (``⌊(128 i + 64) · Skv / Sq / 128⌋``: tile ``i`` when
   ``Sq = Skv``). Empty key tiles are never visited (they would contribute nothing).

Returns :class:`~qattn_fx.block_sparse.Blocks` (int32 lists, the format the attention kernels read).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ... import block_sparse

#: ``top_k`` takes ``ceil(keep · N)`` of the product less this fraction of N: the rounding of a decimal ``keep``
#: (0.15 is 0.1499999999999999944 in binary, and 0.15 · 100 rounds to 15.000000000000002) does not add a tile.
_CEIL_SLACK = 1e-9

#: Selection modes: the mass the kept key tiles cover, or the fraction of key tiles kept.
MODES = ("cdf", "top_k")


class Pooled(NamedTuple):
    """Step 1's output, all fp32 on the inputs' device: ``q_mean (B, Hq, NQ, D)``, ``q_sim (B, Hq, NQ)``,
    ``k_mean (B, Hkv, NK, D)``, ``k_sim (B, Hkv, NK)``, ``k_kept`` bool ``(B|1, NK)`` (the key tile holds a kept
    key; ``B|1`` as ``key_bias``, 1 without one). Empty key tiles have mean 0 and similarity 0."""

    q_mean: torch.Tensor
    q_sim: torch.Tensor
    k_mean: torch.Tensor
    k_sim: torch.Tensor
    k_kept: torch.Tensor


def kept_keys(key_bias: torch.Tensor | None) -> torch.Tensor | None:
    """0/1 fp32 ``(B|1, Skv)``: the keys ``key_bias`` keeps; ``None`` without one (every key)."""
    if key_bias is None:
        return None
    return (key_bias.float() > -math.inf).float()


def tile_counts(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """Kept tokens per tile: fp32 ``(B|1, N)`` from the 0/1 ``weight (B|1, S)``."""
    s = weight.shape[-1]
    n = -(-s // tile)
    return torch.nn.functional.pad(weight, (0, n * tile - s)).reshape(weight.shape[0], n, tile).sum(-1)


def kept_tiles(weight: torch.Tensor | None, skv: int, device) -> torch.Tensor:
    """:attr:`Pooled.k_kept`: bool ``(B|1, NK)``, whether each key tile holds a kept key, from :func:`kept_keys`'
    ``weight`` (``None``: every tile does, one fill)."""
    if weight is None:
        return torch.ones(1, -(-skv // block_sparse.BLOCK_KEYS), dtype=torch.bool, device=device)
    return tile_counts(weight, block_sparse.BLOCK_KEYS) > 0


def _pool(x: torch.Tensor, tile: int, weight: torch.Tensor | None = None):
    """Per tile of ``tile`` tokens along dim 2: the mean of the (kept) tokens and the self-similarity. ``x (B, H, S,
    D)`` float; ``weight (B|1, S)`` 0/1 or None. Tokens of weight 0 take no part (whatever their data)."""
    b, h, s, d = x.shape
    n = -(-s // tile)
    xf = x.float()
    w = torch.ones(1, s, device=x.device) if weight is None else weight
    kept = (w > 0)[:, None, :, None]
    pad = n * tile - s
    xw = torch.nn.functional.pad(torch.where(kept, xf, 0.0), (0, 0, 0, pad))
    inverse = xf.norm(dim=-1, keepdim=True).clamp_min(1e-20).reciprocal()  # one per token, as the kernel
    unit = torch.nn.functional.pad(torch.where(kept, xf * inverse, 0.0), (0, 0, 0, pad))
    denom = tile_counts(w, tile).clamp_min(1)[:, None, :, None]
    mean = xw.reshape(b, h, n, tile, d).sum(3) / denom
    sim = (unit.reshape(b, h, n, tile, d).sum(3) / denom).square().sum(-1)
    return mean, sim


def pool(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None) -> Pooled:
    """Step 1 in torch (the module docstring)."""
    weight = kept_keys(key_bias)
    q_mean, q_sim = _pool(q, block_sparse.BLOCK_ROWS)
    k_mean, k_sim = _pool(k, block_sparse.BLOCK_KEYS, weight)
    return Pooled(q_mean, q_sim, k_mean, k_sim, kept_tiles(weight, k.shape[2], k.device))


def host_keep(keep: float | torch.Tensor) -> float | None:
    """``keep`` as a number where the host holds it (a number, or a CPU tensor: a constant), else None (a tensor on
    the device, a step schedule's from the timestep: the selection uses it there, neither synchronizing nor breaking
    a CUDA-graph capture)."""
    if isinstance(keep, torch.Tensor) and keep.device.type != "cpu":
        return None
    return float(keep)


def select(pooled: Pooled, sq: int, skv: int, sm_scale: float, keep: float | torch.Tensor, mode: str = "cdf",
           sink_tiles: int = 0, diagonal: bool = False, similarity: float = 0.0) -> block_sparse.Blocks:
    """Steps 2-5 from the pooled tiles of a call of ``sq`` queries and ``skv`` keys (any implementation of step 1
    feeds it, so equal pooled values give equal lists)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    b, hq, nq, _ = pooled.q_mean.shape
    hkv, nk = pooled.k_mean.shape[1], pooled.k_mean.shape[2]
    device = pooled.q_mean.device
    held = host_keep(keep)
    on_host = held is not None
    keep = held if on_host else keep.reshape(()).float()  # a device tensor stays there (no host sync)
    g = hq // hkv
    k_mean, k_sim = (t.repeat_interleave(g, 1) for t in (pooled.k_mean, pooled.k_sim))
    nonempty = pooled.k_kept[:, None, None, :].expand(b, hq, nq, nk)
    if on_host and keep >= 1.0:
        visit = nonempty.clone()
    else:
        scores = (pooled.q_mean @ k_mean.transpose(-1, -2)) * sm_scale
        scores = scores.masked_fill(~nonempty, -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        # descending by probability, ties to the lower index (stable sort of the negated probabilities)
        order = torch.sort(-probs, dim=-1, stable=True).indices
        ranked = probs.gather(-1, order)
        if mode == "cdf":
            before = ranked.cumsum(-1) - ranked  # mass of the tiles ranked above
            chosen = before < keep
        else:
            n = nonempty.sum(-1, keepdim=True).double()
            n_keep = torch.ceil(n * keep - n * _CEIL_SLACK).clamp_min(1)  # 0.15 · 100 = 15, not 16
            chosen = torch.arange(nk, device=device) < n_keep
        visit = torch.zeros_like(nonempty).scatter(-1, order, chosen) & nonempty
        if not on_host:  # keep >= 1 (a dense step of a schedule): every non-empty tile, decided on the device
            visit = torch.where(keep >= 1.0, nonempty, visit)
        if similarity > 0:
            visit |= (pooled.q_sim < similarity)[..., None] & nonempty
            visit |= (k_sim < similarity)[:, :, None, :] & nonempty
    if sink_tiles > 0:
        visit[..., :sink_tiles] = True
    if diagonal:
        middle = torch.arange(nq, device=device) * block_sparse.BLOCK_ROWS + block_sparse.BLOCK_ROWS // 2
        col = (torch.clamp(middle, max=sq - 1) * skv // sq) // block_sparse.BLOCK_KEYS
        visit |= torch.arange(nk, device=device) == col[:, None]  # (an OR, not an index_put: CUDA-graph safe)
    return block_sparse.from_mask(visit & nonempty)


def predict(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor | None, sm_scale: float, keep: float | torch.Tensor,
            mode: str = "cdf", sink_tiles: int = 0, diagonal: bool = False,
            similarity: float = 0.0) -> block_sparse.Blocks:
    """The blocks to visit (the module docstring), pooled in torch."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; valid: {', '.join(MODES)}")
    return select(pool(q, k, key_bias), q.shape[2], k.shape[2], sm_scale, keep, mode, sink_tiles, diagonal,
                  similarity)


__all__ = ["MODES", "Pooled", "host_keep", "kept_keys", "kept_tiles", "pool", "predict", "select", "tile_counts"]
