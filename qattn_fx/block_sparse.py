"""Block sparsity: which (query tile, key tile) pairs of a call a kernel visits, chosen before Q·Kᵀ.

**Tiles.** A *block* is :data:`BLOCK_ROWS` query rows against :data:`BLOCK_KEYS` keys of one (batch, query head):
query tile ``i`` holds rows ``[128 i, 128 i + 128)``, key tile ``j`` keys ``[128 j, 128 j + 128)`` (the last ones
partial). The geometry is the kernels' (gluon_sage's two-consumer CTA and key tile, triton_sage's programs of 64
or 128 rows) and does not depend on the launch config, so tuning never changes which blocks run.

**Lists** (:class:`Blocks`, what the attention ops take as ``block_index`` / ``block_count``):

* ``index``: int32 ``(B, Hq, NQ, NK)`` (``NQ = ceil(Sq / 128)``, ``NK = ceil(Skv / 128)``), contiguous; its first
  ``count[b, h, i]`` entries are the key tiles query tile ``i`` visits, ascending, each once; the entries past the
  count are ``-1`` and no kernel reads them.
* ``count``: int32 ``(B, Hq, NQ)``, contiguous, in ``[0, NK]``.

**Numerics.** A block not visited contributes nothing: the result is exactly that of the same kernel with that
block's logits at ``-inf`` (masked), so a skipped block leaves the running max, the denominator and the output of
its rows as they were. The reference kernel applies it to the full logits, the emulation tile by tile; a query tile
that visits nothing (``count = 0``) gives output 0 and LSE ``-inf``, as a row whose keys are all masked does.
Skip-Softmax's online test (:mod:`qattn_fx.skip_softmax`) runs on the blocks that are visited.

**Measured sparsity** is the fraction of blocks *not* visited, ``1 - Σ count / (B · Hq · NQ · NK)``, recorded per
site label by the predictor inside :func:`measure` (``Report.with_sparsity`` shows it beside Skip-Softmax's).

Which blocks are visited is decided by the predictor (:mod:`qattn_fx.ops.predict`); this module is the format
both sides share and imports no kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch

from .recording import Collectors, Measurement

#: Query rows per block: one gluon_sage CTA of two consumer warpgroups; triton_sage's BLOCK_M divides it.
BLOCK_ROWS = 128
#: Keys per block: the kernels' key tile.
BLOCK_KEYS = 128
class Blocks(NamedTuple):
    """The key tiles each query tile visits (the module docstring): ``index`` int32 ``(B, Hq, NQ, NK)``,
    ``count`` int32 ``(B, Hq, NQ)``."""

    index: torch.Tensor
    count: torch.Tensor

    @property
    def visited(self) -> int:
        """Blocks visited over the whole call (synchronizes on a GPU)."""
        return int(self.count.sum())

    @property
    def total(self) -> int:
        """Blocks of the call, visited or not."""
        return self.index.numel()

    def sparsity(self) -> float:
        """The fraction of blocks not visited."""
        return 1.0 - self.visited / self.total if self.total else 0.0


def tiles(sq: int, skv: int) -> tuple[int, int]:
    """(query tiles, key tiles) of one (batch, head)."""
    return -(-sq // BLOCK_ROWS), -(-skv // BLOCK_KEYS)


def from_mask(visit: torch.Tensor) -> Blocks:
    """Lists from a per-block mask: ``visit`` bool ``(B, H, NQ, NK)``, True where the block runs."""
    if visit.dim() != 4 or visit.dtype != torch.bool:
        raise ValueError(f"visit must be a bool (B, H, NQ, NK) tensor; got {visit.dtype} of shape {tuple(visit.shape)}")
    nk = visit.shape[-1]
    cols = torch.arange(nk, device=visit.device, dtype=torch.int32).expand(visit.shape)
    # a visited tile goes to its rank among the visited ones; the others to a spare column, cut off after
    slot = torch.where(visit, visit.cumsum(-1) - 1, nk)
    index = torch.full((*visit.shape[:-1], nk + 1), -1, dtype=torch.int32, device=visit.device)
    index = index.scatter(-1, slot, cols)[..., :nk].contiguous()
    return Blocks(index, visit.sum(-1, dtype=torch.int32).contiguous())


def to_mask(blocks: Blocks) -> torch.Tensor:
    """The per-block mask of ``blocks``: bool ``(B, H, NQ, NK)``, True where the block runs."""
    index, count = blocks
    nk = index.shape[-1]
    listed = torch.arange(nk, device=index.device) < count[..., None].long()
    hits = torch.zeros(*index.shape[:-1], nk + 1, dtype=torch.bool, device=index.device)
    safe = torch.where(listed, index.long(), torch.full_like(index, nk, dtype=torch.long))
    return hits.scatter(-1, safe, listed)[..., :nk]


def dense(b: int, h: int, sq: int, skv: int, device: torch.device | str = "cpu") -> Blocks:
    """Lists that visit every block."""
    nq, nk = tiles(sq, skv)
    return from_mask(torch.ones(b, h, nq, nk, dtype=torch.bool, device=device))


def expand(visit: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    """A per-block mask ``(B, H, NQ, NK)`` as a per-logit mask ``(B, H, Sq, Skv)``."""
    return visit.repeat_interleave(BLOCK_ROWS, 2)[:, :, :sq].repeat_interleave(BLOCK_KEYS, 3)[..., :skv]


def row_mask(visit: torch.Tensor, sq: int) -> torch.Tensor:
    """A per-block mask ``(B, H, NQ, NK)`` per query row: ``(B, H, Sq, NK)``."""
    return visit.repeat_interleave(BLOCK_ROWS, 2)[:, :, :sq]


def check(index: torch.Tensor | None, count: torch.Tensor | None, b: int, hq: int, sq: int, skv: int,
          device: torch.device | None = None) -> None:
    """``ValueError`` unless ``(index, count)`` are lists for a call of ``b`` batches, ``hq`` query heads, ``sq``
    queries and ``skv`` keys (shapes, dtypes, contiguity, one device: ``device``, Q's, when given; values are the
    predictor's contract). The attention ops run it at their boundary; the Sage kernels' direct entries run it too
    (:func:`qattn_fx.kernels._sage_common.validate`)."""
    if index is None and count is None:
        return
    if index is None or count is None:
        raise ValueError("block_index and block_count go together; got only "
                         + ("block_count" if index is None else "block_index"))
    nq, nk = tiles(sq, skv)
    for name, t, shape in (("block_index", index, (b, hq, nq, nk)), ("block_count", count, (b, hq, nq))):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32; got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (B, Hq, ceil(Sq/{BLOCK_ROWS})"
                             + (f", ceil(Skv/{BLOCK_KEYS}))" if name == "block_index" else ")")
                             + f" for this call; got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")
    if index.device != count.device:
        raise ValueError(f"block_index is on {index.device} and block_count on {count.device}; they must share one")
    if device is not None and index.device != device:
        raise ValueError(f"block_index and block_count are on {index.device}; they must be on Q's device {device}")


_ACTIVE = Collectors()


def active() -> Measurement | None:
    """The measurement being collected (innermost :func:`measure`), or None."""
    return _ACTIVE.innermost()


@contextlib.contextmanager
def measure() -> Iterator[Measurement]:
    """Collect, per site label, the blocks each block-sparse call skipped (``skipped``) of all its blocks
    (``tiles``); the predictor records every call it makes inside the block (one synchronization per call: for
    measuring, not for timing)."""
    with _ACTIVE.pushed(Measurement()) as measurement:
        yield measurement


def record(label: str, blocks: Blocks) -> None:
    """Add one call's counts to the active measurement (no-op outside :func:`measure`)."""
    measurement = active()
    if measurement is not None:
        measurement.add(label or "unlabeled", blocks.total - blocks.visited, blocks.total)


__all__ = ["BLOCK_KEYS", "BLOCK_ROWS", "Blocks", "active", "check", "dense", "expand", "from_mask", "measure",
           "record", "row_mask", "tiles", "to_mask"]
