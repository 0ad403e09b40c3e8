"""``qattn::predict_blocks``: the blocks a block-sparse site visits, computed in the graph from the unquantized Q
and K before the attention op (:mod:`qattn_fx.block_sparse`; the rule: :mod:`qattn_fx.kernels.predict_blocks`).

``qattn::predict_blocks(q, k, key_bias, sm_scale, runtime_scale, keep, mode, sink_tiles, diagonal, similarity,
label="") -> (block_index, block_count)``

* ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)``: bf16/fp16/fp32, any strides; ``key_bias`` ``(B|1, Skv)`` fp32 or
  None (``-inf``: masked key); ``sm_scale`` (or the 0-d CPU ``runtime_scale`` that replaces it).
* ``keep``: a one-element float tensor, the ``cdf`` mass or the ``top_k`` fraction (a tensor so that a step
  schedule can make it 1, every block, without recompiling; on the device it is used there, without a host sync:
  :func:`~qattn_fx.kernels.predict_blocks.reference.host_keep`); ``mode`` ``cdf`` / ``top_k``; ``sink_tiles`` and
  ``diagonal``: key tiles always visited; ``similarity``: the self-similarity guard (0: off).
* Returns int32 ``block_index (B, Hq, ceil(Sq/128), ceil(Skv/128))`` and ``block_count (B, Hq, ceil(Sq/128))``,
  contiguous, on q's device.
* Runs :func:`qattn_fx.kernels.predict_blocks.predict`: on CUDA the fused Triton pooling and the fused Triton
  selection (one kernel from the pooled tiles to the lists; triton required there: no fallback; at most
  ``triton_select.MAX_KEY_TILES`` key tiles, a ``ValueError`` naming the limit beyond), the torch reference on CPU.
  The two give the same lists except where a choice sits on an fp32 rounding boundary (a ``cdf`` tile whose mass
  ranked above it is within rounding of ``keep``, or probabilities tied or within rounding of each other where their
  order decides: :mod:`qattn_fx.kernels.predict_blocks.triton_select`).
* ``label`` names the site: inside :func:`qattn_fx.block_sparse.measure` each call's skipped blocks are recorded
  under it.

``qattn::block_keep(k, keep, timestep, until, timestep_scale) -> Tensor``: the ``keep`` a block-sparse site passes
the predictor, fp32 ``(1,)`` on k's device; with a ``timestep``, 1 (every block) while ``timestep /
timestep_scale > until`` (``block_sparse.disabled_until_timestep``), so a step schedule is data, not a recompile.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import block_sparse
from ..kernels import predict_blocks as predictor
from ..kernels.op_inputs import fail


def _check(q, k, key_bias, keep, mode, sink_tiles, similarity) -> None:
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or not t.dtype.is_floating_point:
            fail(f"{name} must be a 4-D (B, H, S, D) float tensor; got {t.dtype} of shape {tuple(t.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        fail(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B and D with Hq a multiple of Hk")
    if key_bias is not None and (key_bias.dim() != 2 or key_bias.shape[1] != k.shape[2]
                                 or key_bias.shape[0] not in (1, k.shape[0])):
        fail(f"key_bias must have shape (B|1, Skv) = ({k.shape[0]}|1, {k.shape[2]}); got {tuple(key_bias.shape)}")
    if keep.numel() != 1 or not keep.dtype.is_floating_point:
        fail(f"keep must be a one-element float tensor; got {keep.dtype} of shape {tuple(keep.shape)}")
    if mode not in predictor.MODES:
        fail(f"mode={mode!r} is invalid; valid: {', '.join(predictor.MODES)}")
    if sink_tiles < 0:
        fail(f"sink_tiles={sink_tiles} is invalid; valid: an integer >= 0")
    if not 0.0 <= similarity <= 1.0:
        fail(f"similarity={similarity} is invalid; valid: a number in [0, 1]")


@torch.library.custom_op("qattn::predict_blocks", mutates_args=())
def predict_blocks_op(q: torch.Tensor, k: torch.Tensor, key_bias: Optional[torch.Tensor], sm_scale: float,
                      runtime_scale: Optional[torch.Tensor], keep: torch.Tensor, mode: str, sink_tiles: int,
                      diagonal: bool, similarity: float, label: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, key_bias, keep, mode, sink_tiles, similarity)
    scale = sm_scale if runtime_scale is None else float(runtime_scale)
    blocks = predictor.predict(q, k, key_bias, scale, keep, mode, sink_tiles, diagonal, similarity)
    block_sparse.record(label, blocks)
    return blocks.index, blocks.count


@predict_blocks_op.register_fake
def _(q, k, key_bias, sm_scale, runtime_scale, keep, mode, sink_tiles, diagonal, similarity, label=""):
    nq = (q.shape[2] + block_sparse.BLOCK_ROWS - 1) // block_sparse.BLOCK_ROWS
    nk = (k.shape[2] + block_sparse.BLOCK_KEYS - 1) // block_sparse.BLOCK_KEYS
    return (q.new_empty((q.shape[0], q.shape[1], nq, nk), dtype=torch.int32),
            q.new_empty((q.shape[0], q.shape[1], nq), dtype=torch.int32))


predict_blocks = torch.ops.qattn.predict_blocks


@torch.library.custom_op("qattn::block_keep", mutates_args=())
def block_keep_op(k: torch.Tensor, keep: float, timestep: Optional[torch.Tensor], until: float,
                  timestep_scale: float) -> torch.Tensor:
    """A block-sparse site's ``keep`` for one call, as data (a schedule changes it without recompiling): ``keep``
    as an fp32 ``(1,)`` tensor on ``k``'s device; with a ``timestep`` (the model's own, any shape: its max is
    taken), 1 (every block visited) while ``t = timestep / timestep_scale`` is above ``until``
    (``block_sparse.disabled_until_timestep``: dense on the early, noisy steps)."""
    value = torch.full((1,), float(keep), dtype=torch.float32, device=k.device)
    if timestep is None:
        return value
    t = timestep.to(device=k.device, dtype=torch.float32).reshape(-1).amax() / timestep_scale
    return torch.where(t > until, torch.ones_like(value), value)


@block_keep_op.register_fake
def _(k, keep, timestep, until, timestep_scale):
    return k.new_empty((1,), dtype=torch.float32)


block_keep = torch.ops.qattn.block_keep
