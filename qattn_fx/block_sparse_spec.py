"""The spec key ``block_sparse`` (:class:`BlockSparse`, re-exported as ``qattn_fx.recipes.BlockSparse``): block
sparsity chosen before Q·Kᵀ on top of a recipe of the ``scaled`` family. The tiles, the lists and the measured
sparsity: :mod:`qattn_fx.block_sparse`; the predictor's rule: :mod:`qattn_fx.kernels.predict_blocks.reference`.

A leaf module (it imports only :mod:`qattn_fx.validate` and :mod:`qattn_fx.sparsity_key`), so the recipes, the spec
and the lowering share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sparsity_key import SparsityKey
from .validate import check_bool, check_int, check_range, path_at, show

#: The self-similarity guard's default (SpargeAttn's ``simthreshd1``): a query or key tile whose tokens' mean
#: pairwise cosine is below it is not summarized by its mean, so it visits (is visited by) every tile.
DEFAULT_SIMILARITY = 0.6


@dataclass(frozen=True)
class BlockSparse(SparsityKey, key="block_sparse", short="bs", controls=("cdf", "top_k", "target_sparsity")):
    """Block sparsity on top of a recipe: which blocks of 128 query rows x 128 keys a site visits, predicted from
    the unquantized Q and K before the attention op (``qattn::predict_blocks``, :mod:`qattn_fx.block_sparse`).

    Exactly one of:

    * ``cdf``: per query tile, keep the fewest key tiles (by descending pooled score) whose predicted attention
      mass reaches ``cdf``, in (0, 1];
    * ``top_k``: per query tile, keep the ``ceil(top_k · N)`` highest scored of its ``N`` key tiles, in (0, 1];
    * ``target_sparsity``: the fraction of blocks to skip, in [0, 1): served only through a calibration that turns
      it into a ``cdf`` or ``top_k`` per site (the policy refuses it as it stands).

    Also: ``sink_tiles`` (int >= 0, default 1): the first key tiles, always visited (attention sinks);
    ``diagonal`` (default true): each query tile visits the key tile at its own position; ``similarity`` (in
    [0, 1], default :data:`DEFAULT_SIMILARITY` = 0.6; 0 turns the guard off): a tile whose tokens' mean pairwise
    cosine is below it is not trusted to its mean, so every block of its row (query tile) or column (key tile) is
    visited; ``disabled_until_timestep`` D (in [0, 1]; 0 or unset: off): every block visited while the normalized
    timestep is above D (the early, noisy steps), as data in the graph (a denoising loop compiles once).

    ``where`` (keyword only, not a field, :class:`~qattn_fx.validate.Checked`): its place in a spec, for error
    messages (default ``block_sparse``).
    """

    cdf: float | None = None
    top_k: float | None = None
    target_sparsity: float | None = None
    sink_tiles: int = 1
    diagonal: bool = True
    similarity: float = DEFAULT_SIMILARITY
    disabled_until_timestep: float | None = None

    def _check(self, where: str) -> None:
        self._check_one_control(where)
        for name in ("cdf", "top_k"):
            path, value = path_at(where, name), getattr(self, name)
            check_range(path, value, 0.0, 1.0)
            if value is not None and value <= 0:
                raise ValueError(f"{path}={show(value)} is out of range; valid: finite, (0.0, 1.0]")
        check_range(path_at(where, "target_sparsity"), self.target_sparsity, 0.0, 1.0)
        if self.target_sparsity is not None and self.target_sparsity >= 1:
            raise ValueError(f"{path_at(where, 'target_sparsity')}={show(self.target_sparsity)} is out of range; "
                             "valid: finite, [0.0, 1.0) (1 would skip every block)")
        check_int(path_at(where, "sink_tiles"), self.sink_tiles, 0)
        check_bool(path_at(where, "diagonal"), self.diagonal)
        check_range(path_at(where, "similarity"), self.similarity, 0.0, 1.0)
        check_range(path_at(where, "disabled_until_timestep"), self.disabled_until_timestep, 0.0, 1.0)

    # -- what the predictor takes --------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """The predictor's ``mode``: ``cdf`` or ``top_k`` (``target_sparsity`` has none until calibrated)."""
        return "cdf" if self.cdf is not None else "top_k" if self.top_k is not None else "target_sparsity"

    @property
    def keep(self) -> float | None:
        """The predictor's ``keep``: the ``cdf`` mass or the ``top_k`` fraction (None for ``target_sparsity``)."""
        return self.cdf if self.cdf is not None else self.top_k

    # -- names (short_name: SparsityKey's, ``bs cdf 0.9``, ``bs top_k 0.5``, ``bs target 0.5``) ------------------
    def _short_setting(self) -> str:
        if self.cdf is not None:
            return f"cdf {self.cdf:g}"
        if self.top_k is not None:
            return f"top_k {self.top_k:g}"
        return f"target {self.target_sparsity:g}"

    def describe(self) -> str:
        """``block-sparse cdf 0.9, sinks 1, diag, sim 0.6``; ``no diag``, ``no sim guard`` when off; ``, dense while
        t > 0.9`` with a gate."""
        parts = [f"block-sparse {self._short_setting()}", f"sinks {self.sink_tiles}",
                 "diag" if self.diagonal else "no diag", f"sim {self.similarity:g}" if self.similarity else "no sim guard"]
        return ", ".join(parts) + self._gate()


__all__ = ["BlockSparse", "DEFAULT_SIMILARITY"]
