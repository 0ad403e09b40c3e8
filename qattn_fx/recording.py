"""Per-site counts collected inside a ``with`` block: the mechanism that Skip-Softmax's and block sparsity's
``measure()`` (:mod:`qattn_fx.skip_softmax`, :mod:`qattn_fx.block_sparse`) and Skip-Softmax's margin collector share.

* :class:`Collectors`: a per-thread stack of collectors; :meth:`~Collectors.pushed` puts one on top for a ``with``
  block, :meth:`~Collectors.innermost` is the top (``None`` outside every block). Blocks nest: the innermost one
  collects.
* :class:`Measurement`: per site label, a :class:`SiteSparsity` (what was skipped of what was counted, and how many
  calls).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator


class Collectors:
    """A per-thread stack of collectors: each thread sees only the blocks it entered."""

    def __init__(self) -> None:
        self._local = threading.local()

    def innermost(self) -> Any:
        """The top of this thread's stack (:meth:`pushed`), or None."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def pushed(self, item: Any) -> Iterator[Any]:
        """``item`` on top of this thread's stack for the block; yields it."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(item)
        try:
            yield item
        finally:
            stack.pop()


@dataclass
class SiteSparsity:
    """Tiles skipped and tiles tested at one site, over every call recorded."""

    skipped: int = 0
    tiles: int = 0
    calls: int = 0

    @property
    def sparsity(self) -> float:
        return self.skipped / self.tiles if self.tiles else 0.0


@dataclass
class Measurement:
    """Per-site skip counts (site label → :class:`SiteSparsity`), filled inside a ``measure()`` block."""

    sites: dict[str, SiteSparsity] = field(default_factory=dict)

    def add(self, label: str, skipped: int, tiles: int) -> None:
        entry = self.sites.setdefault(label, SiteSparsity())
        entry.skipped += int(skipped)
        entry.tiles += int(tiles)
        entry.calls += 1

    def sparsity(self) -> dict[str, float]:
        return {label: s.sparsity for label, s in self.sites.items()}

    def overall(self) -> float:
        tiles = sum(s.tiles for s in self.sites.values())
        return sum(s.skipped for s in self.sites.values()) / tiles if tiles else 0.0


__all__ = ["Collectors", "Measurement", "SiteSparsity"]
