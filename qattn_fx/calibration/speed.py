"""Predicted speed of a kernel at one site: the per-(kernel, arch) cost data that ``auto`` uses.

A speed source is any callable with :func:`cost_data`'s signature, returning (dense torch SDPA time) / (the
kernel's time including its quantize passes) for one call, or ``None`` without data. :func:`cost_data` asks
``qattn_fx.cost.predicted_speedup``; where that module is not installed it has no data.
"""

from __future__ import annotations

import importlib
from typing import Protocol


class SpeedSource(Protocol):
    def __call__(self, kernel: str, arch: str, *, q_len: int, kv_len: int, head_dim: int,
                 batch_heads: int) -> float | None: ...


#: What the calibration table says for a site whose candidates are ranked without cost data.
NO_COST_DATA = "no cost data: table order"


def cost_data(kernel: str, arch: str, *, q_len: int, kv_len: int, head_dim: int, batch_heads: int) -> float | None:
    """``qattn_fx.cost.predicted_speedup`` for one call, or None when that module is absent or has no data."""
    try:
        cost = importlib.import_module("qattn_fx.cost")
    except ModuleNotFoundError as e:
        if e.name != "qattn_fx.cost":  # a dependency of the cost module is missing: that is an error
            raise
        return None
    return cost.predicted_speedup(kernel, arch, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                                  batch_heads=batch_heads)
