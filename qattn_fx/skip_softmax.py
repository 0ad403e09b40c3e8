"""Skip-Softmax (BLASST): the contract qattn_fx implements, its tile test, and measured sparsity.

**The contract** is vLLM-Omni's ``TRTLLM_ATTN`` Skip-Softmax (its design page "design/feature/skip_softmax"), which
implements BLASST (Dynamic BLocked Attention Sparsity via Softmax Thresholding, arXiv 2512.12087) as TensorRT-LLM's
trtllm-gen kernels run it:

* The online-softmax pass keeps, per query row, the running maximum ``m`` of the logits seen so far. A *tile* is
  :data:`TILE_ROWS` query rows against :data:`TILE_KEYS` keys (one gluon_sage consumer warpgroup against one key
  tile; the rows are ``[64 g, 64 g + 64)`` of each (batch, head), whatever CTA holds them). Once a tile's logits
  are known, with ``tile_max[i]`` the largest logit of row ``i`` in the tile and ``m[i]`` the running max *before*
  the tile, the tile is skipped when, for **every** row ``i`` of the tile (rows past ``Sq`` do not vote)::

      exp(tile_max[i] - m[i]) < λ        i.e. in the kernels' log2 units:  tile_max2[i] - m2[i] < log2(λ)

  Skipped means: no exponentials, no P·V, and ``m``, ``l``, ``O`` stay as they were (its contribution is omitted;
  Q·Kᵀ always runs, the test needs it, so at most about half the arithmetic goes). A row's first tile is never
  skipped (``m = -inf``); a tile that raises any row's max is never skipped for ``λ <= 1``; ``λ = 0`` skips
  nothing (``log2 0 = -inf``) and gives the bits of the kernel without skipping. With a key bias the logits are
  ``q·kᵀ·scale + bias`` and a row whose keys so far are all masked (``m = -inf``) never votes to skip.
* ``threshold`` **is λ** (vLLM-Omni's meaning: independent of sequence length; meaningful in ``(0, 1)``).
  TensorRT-LLM's ``SkipSoftmaxAttentionConfig.threshold_scale_factor`` is ``λ · Skv`` (the trtllm-gen kernels
  divide it by the key length); NVIDIA Model-Optimizer calibrates ``scale_factor = a · exp(b · target_sparsity)``
  and ``λ = scale_factor / Skv``.
* ``target_sparsity`` is served through a calibration on the user's own calls: :func:`qattn_fx.calibrate_skip_softmax`
  measures the skipped-tile fraction per site at candidate thresholds (the reference's exact tile test) and
  returns a spec with a ``threshold`` per site (or one for the model). A spec that asks for ``target_sparsity``
  without a calibration is refused with that advice, as vLLM-Omni refuses one without checkpoint coefficients.
* ``disabled_until_timestep`` ``D``: while the normalized timestep ``t`` (scheduler timestep / num_train_timesteps,
  or the sigma of rectified-flow pipelines, in ``[0, 1]``, decreasing) is above ``D`` nothing is skipped; ``D = 0``
  (the default) is off. qattn_fx applies it *as data*: the compiled graph computes ``λ_eff = λ if t <= D else 0``
  from a tensor (:mod:`qattn_fx.schedule`), so no step recompiles.

**Sparsity** is the fraction of tiles skipped: ``skipped / (B · Hq · ceil(Sq / 64) · ceil(Skv / 128))``. The
reference kernel (CPU users' way to measure a threshold's quality) and the emulated tile loop count it exactly;
gluon_sage counts it when asked (``skip_count=``). :func:`measure` collects the counts of every skip-softmax call
per site label (the compile pass labels a site with its node prefix, e.g. ``blocks_0_attn1``);
``Report.with_sparsity`` puts them in the site table and debug dumps.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .recording import Collectors, Measurement, SiteSparsity

LOG2E = 1.4426950408889634

#: Query rows per skip tile: one gluon_sage consumer warpgroup (a wgmma M).
TILE_ROWS = 64
#: Keys per skip tile: the kernels' key tile (gluon_sage's block_n; the published kernels' 128).
TILE_KEYS = 128


def tiles(sq: int, skv: int) -> tuple[int, int]:
    """(row tiles, key tiles) of one (batch, head)."""
    return -(-sq // TILE_ROWS), -(-skv // TILE_KEYS)


def log2_threshold(threshold: torch.Tensor) -> torch.Tensor:
    """``log2(λ)`` as the kernels compare it: fp32, on ``threshold``'s device (``-inf`` for λ = 0)."""
    return torch.log2(threshold.detach().float().reshape(()))


def threshold_from_scale_factor(scale_factor: float, kv_len: int) -> float:
    """TensorRT-LLM's ``threshold_scale_factor`` (or Model-Optimizer's calibrated ``a · exp(b · s)``) as λ."""
    return scale_factor / kv_len


def skip_mask(logits: torch.Tensor, log2_thr: torch.Tensor, row_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The tiles the contract skips, from the full logits in **log2 units**.

    ``logits`` ``(B, H, Sq, Skv)`` fp32 (``-inf`` for masked keys); ``log2_thr`` 0-d. Returns bool
    ``(B, H, ceil(Sq/64), ceil(Skv/128))``. The running max before tile ``j`` is the max of the tile maxima before
    it, since a skipped tile never raises a row's max for λ <= 1; for λ > 1 a skipped tile may, and its max is then
    left out of ``m`` as the kernels leave it out (computed tile by tile below).
    """
    b, h, sq, skv = logits.shape
    n_rows, n_keys = tiles(sq, skv)
    pad = n_keys * TILE_KEYS - skv
    z = torch.nn.functional.pad(logits, (0, pad), value=-math.inf) if pad else logits
    tile_max = z.reshape(b, h, sq, n_keys, TILE_KEYS).amax(-1)  # (B, H, Sq, n_keys)
    thr = log2_thr.to(logits.device).float()
    m = torch.full((b, h, sq), -math.inf, device=logits.device)
    skipped = torch.zeros(b, h, n_rows, n_keys, dtype=torch.bool, device=logits.device)
    row_pad = n_rows * TILE_ROWS - sq
    for j in range(n_keys):
        vote = (tile_max[..., j] - m) < thr  # NaN (both -inf) votes no
        vote = torch.nn.functional.pad(vote, (0, row_pad), value=True)
        skip = vote.reshape(b, h, n_rows, TILE_ROWS).all(-1)
        skipped[..., j] = skip
        keep = ~skip.repeat_interleave(TILE_ROWS, -1)[..., :sq]
        m = torch.where(keep, torch.maximum(m, tile_max[..., j]), m)
    return skipped


def tile_margins(logits: torch.Tensor) -> torch.Tensor:
    """Per tile, the largest ``tile_max[i] - m[i]`` over its rows (log2 units; ``logits`` as :func:`skip_mask`'s):
    the contract skips the tile exactly when this margin is below ``log2 λ``, for every λ <= 1 (a skipped tile then
    never raises a row's max, so ``m`` is the running max of the tile maxima whatever λ is). ``+inf`` for tiles
    that can never be skipped (a row's first tile; NaN margins of rows whose keys are all masked so far). Returns
    fp32 ``(B, H, ceil(Sq/64), ceil(Skv/128))``: one pass gives the sparsity of every λ (the calibration's input)."""
    b, h, sq, skv = logits.shape
    n_rows, n_keys = tiles(sq, skv)
    pad = n_keys * TILE_KEYS - skv
    z = torch.nn.functional.pad(logits, (0, pad), value=-math.inf) if pad else logits
    tile_max = z.reshape(b, h, sq, n_keys, TILE_KEYS).amax(-1)
    before = torch.cat([torch.full_like(tile_max[..., :1], -math.inf), tile_max[..., :-1].cummax(-1).values], -1)
    margin = torch.nan_to_num(tile_max - before, nan=math.inf)
    row_pad = n_rows * TILE_ROWS - sq
    margin = torch.nn.functional.pad(margin, (0, 0, 0, row_pad), value=-math.inf)  # rows past Sq do not vote
    return margin.reshape(b, h, n_rows, TILE_ROWS, n_keys).amax(3)


def expand_mask(skipped: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    """A per-tile mask ``(B, H, n_rows, n_keys)`` as a per-logit mask ``(B, H, Sq, Skv)``."""
    return skipped.repeat_interleave(TILE_ROWS, 2)[:, :, :sq].repeat_interleave(TILE_KEYS, 3)[..., :skv]


# ------------------------------------------------------------------------------------------------------------------
# Measured sparsity (the collectors and the per-site counts are :mod:`qattn_fx.recording`'s)
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Margins:
    """Tile margins (:func:`tile_margins`) per site label, collected inside :func:`collect_margins`: the sparsity of
    any λ <= 1 without running again."""

    sites: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, label: str, margins: torch.Tensor) -> None:
        self.sites.setdefault(label or "unlabeled", []).append(margins.detach().reshape(-1).float().cpu())

    def of(self, label: str) -> torch.Tensor:
        """Every margin recorded for ``label``, one fp32 vector."""
        return torch.cat(self.sites[label])

    @staticmethod
    def sparsity(margins: torch.Tensor, threshold: float) -> float:
        """The fraction of these tiles the contract skips at λ = ``threshold`` (<= 1)."""
        if margins.numel() == 0 or threshold <= 0:
            return 0.0
        return float((margins < math.log2(threshold)).float().mean())

    @staticmethod
    def threshold_for(margins: torch.Tensor, target: float) -> float:
        """The smallest λ in [0, 1] whose sparsity on these tiles reaches ``target`` (1.0 when none does: the
        sparsity of λ = 1 is then the most these calls allow)."""
        finite = margins[margins < 0].sort().values  # λ <= 1: only negative margins can be skipped
        need = math.ceil(target * margins.numel() - 1e-9)
        if need <= 0:
            return 0.0
        if need > finite.numel():
            return 1.0
        return min(1.0, float(torch.nextafter(finite[need - 1], torch.tensor(math.inf)).exp2()))


_ACTIVE = Collectors()
_MARGINS = Collectors()


def margins_collector() -> Margins | None:
    """The innermost :func:`collect_margins` collector, or None."""
    return _MARGINS.innermost()


@contextlib.contextmanager
def collect_margins() -> Iterator[Margins]:
    """Collect the tile margins of every Skip-Softmax call of the reference kernel inside the block, per site
    label (:func:`qattn_fx.calibrate_skip_softmax` runs the user's calls in emulation inside one)."""
    with _MARGINS.pushed(Margins()) as collector:
        yield collector


def active() -> Measurement | None:
    """The measurement being collected (innermost :func:`measure`), or None."""
    return _ACTIVE.innermost()


@contextlib.contextmanager
def measure() -> Iterator[Measurement]:
    """Collect the skipped-tile counts of every skip-softmax attention call inside the block, per site label.

    The reference kernel counts exactly; gluon_sage counts on the GPU (an atomic per skipped tile and a
    synchronization per call to read it: for measuring, not for timing). Calls of other kernels record nothing.
    """
    with _ACTIVE.pushed(Measurement()) as measurement:
        yield measurement


def record(label: str, skipped: int | torch.Tensor, tiles: int) -> None:
    """Add one call's counts to the active measurement (no-op outside :func:`measure`)."""
    measurement = active()
    if measurement is not None:
        measurement.add(label or "unlabeled", int(skipped), tiles)


__all__ = ["TILE_ROWS", "TILE_KEYS", "Margins", "Measurement", "SiteSparsity", "collect_margins", "expand_mask",
           "log2_threshold", "margins_collector", "measure", "record", "skip_mask", "threshold_from_scale_factor",
           "tile_margins", "tiles"]
