"""Predicted speed of a candidate at one site, from the per-(kernel, arch) cost data that ``auto``'s cost rule uses.

A block-sparse candidate's speed is its recipe's (the same candidate without ``block_sparse``) over the measured
time of block-sparse calls at the blocks it visits (:mod:`qattn_fx.sparse_cost`).

A speed source is a callable ``(kernel, arch, *, q_len, kv_len, head_dim, batch_heads)`` returning the predicted
(dense torch SDPA time) / (the kernel's time including its quantize passes) for one call as a
:class:`qattn_fx.cost.Prediction` or a plain number, or ``None`` without data. The default, :func:`cost_data`, is
:func:`qattn_fx.cost.predict`: the same numbers :func:`qattn_fx.cost_rule.cost_rule` compares with
:data:`qattn_fx.cost_rule.MIN_PREDICTED_SPEEDUP`, so a plan never quantizes a site that ``auto`` would keep dense.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

from .. import cost
from ..cost import Prediction


class SpeedSource(Protocol):
    def __call__(self, kernel: str, arch: str, *, q_len: int, kv_len: int, head_dim: int,
                 batch_heads: int) -> Prediction | float | None: ...


#: What the calibration table says for a site whose candidates are ranked without cost data.
NO_COST_DATA = "no cost data: table order"


def cost_data(kernel: str, arch: str, *, q_len: int, kv_len: int, head_dim: int,
              batch_heads: int, gpu: str | None = None) -> Prediction | None:
    """:func:`qattn_fx.cost.predict` for one call (``gpu``: that GPU's points first): None where (kernel, arch) has
    no cost data."""
    return cost.predict(kernel, arch, q_len=q_len, kv_len=kv_len, head_dim=head_dim, batch_heads=batch_heads,
                        gpu=gpu)


def cost_data_on(gpu: str | None) -> SpeedSource:
    """:func:`cost_data` with the points of ``gpu`` (a :attr:`~qattn_fx.hardware.Hardware.gpu`) first: the default
    speed source of a calibration whose candidates deploy on that GPU."""
    return functools.partial(cost_data, gpu=gpu)


def predicted(source: SpeedSource, kernel: str, arch: str, *, q_len: int, kv_len: int, head_dim: int,
              batch_heads: int) -> Prediction | None:
    """``source``'s answer as a :class:`~qattn_fx.cost.Prediction` (a plain number is an exact prediction labelled
    ``speed source``); raises when it is not a positive finite number."""
    value = source(kernel, arch, q_len=q_len, kv_len=kv_len, head_dim=head_dim, batch_heads=batch_heads)
    if value is None or isinstance(value, Prediction):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"the speed source gave {value!r} for {kernel} on {arch}; valid: a positive finite speedup, "
                         "a qattn_fx.cost.Prediction, or None (no data)")
    return Prediction(float(value), False, "speed source")
