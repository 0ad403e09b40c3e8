"""What a calibration measured of one (site, candidate) (:class:`Record`), and a site's unit of planning."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sparse_cost import SparseTime, sparse_speedup
from .capture import SiteKey

#: The unit a plan decides per: (module path, layer).
Unit = tuple[str, "int | None"]


@dataclass
class Record:
    """One (site, candidate): errors per call, and what served it."""

    per_call: list
    served: bool = True
    why: str = ""
    kernel: str | None = None
    deploy: str | None = None
    speedup: float | None = None
    speed_known: bool = True
    upper_bound: bool = False
    speed_data: str = ""
    deploy_note: str = ""
    #: Block-sparse candidates: (blocks skipped, blocks) per call, summed over the site's runs in that call
    #: (``speedup`` is then the recipe's, without block sparsity: :meth:`sparse_speedup` scales it by
    #: ``sparse_time``, the deployed kernel's at the site's key length, :mod:`qattn_fx.sparse_cost`).
    blocks: list = field(default_factory=list)
    sparse_time: SparseTime | None = None

    def sparsity(self) -> list[float | None]:
        """The measured fraction of blocks skipped per call (None: not block-sparse, or not run in that call)."""
        return [None if b is None or not b[1] else b[0] / b[1] for b in self.blocks]

    def mean_sparsity(self) -> float | None:
        """The mean over the calls of :meth:`sparsity` (None: not block-sparse or never run)."""
        found = [x for x in self.sparsity() if x is not None]
        return sum(found) / len(found) if found else None

    def sparse_speedup(self) -> float | None:
        """The predicted speedup: the recipe's (its slowest call) over the block-sparse time at the mean fraction of
        blocks visited (:func:`~qattn_fx.sparse_cost.sparse_speedup`): the time of the calls together, were their
        dense times equal."""
        if not self.speed_known or self.speedup is None:
            return None
        mean = self.mean_sparsity()
        return self.speedup if mean is None or self.sparse_time is None else sparse_speedup(self.speedup, mean,
                                                                                              self.sparse_time)

    def speed_upper_bound(self) -> bool:
        """Whether :meth:`sparse_speedup` is at most that fast: the recipe's prediction is (a site smaller than the
        measured calls), or the block-sparse time held below the measured key lengths is."""
        return self.upper_bound or (self.sparse_time is not None and self.mean_sparsity() is not None
                                    and self.sparse_time.lower_bound)


def unit_of(key: SiteKey) -> Unit:
    return (key.module, key.layer)
