"""The outputs of the fused quantize kernels: shapes, dtypes and strides, for the real and the fake (meta) calls.

One definition for both, so the kernels write exactly what the ops' fake implementations promise under symbolic
sizes (no branch on a size: the padded lengths are symbolic expressions):

* :func:`per_block`: data like ``x`` (``torch.empty_like``: a permuted ``(B, S, H, D)`` view stays so) in the
  8-bit dtype, scales ``(B, H, NB4)`` fp32 contiguous, ``NB4`` = ``ceil(S / block)`` rounded up to a multiple of 4;
* :func:`per_channel`: data like ``x``, or sequence-major (physically ``(B, H, D, S16)``, ``S16`` = ``S`` rounded up
  to a multiple of 16, viewed ``(B, H, S16, D)``), scales ``(B, H, D)`` fp32 contiguous.

These are the layouts of the aten definitions in :mod:`qattn_fx.ops.quantize`.
"""

from __future__ import annotations

import torch


def padded(n, multiple: int):
    """``n`` rounded up to a multiple of ``multiple`` (symbolic ``n`` stays symbolic, no guard)."""
    return (n + multiple - 1) // multiple * multiple


def blocks(n, block: int):
    """``ceil(n / block)``."""
    return (n + block - 1) // block


def per_block(x: torch.Tensor, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, _ = x.shape
    data = torch.empty_like(x, dtype=dtype)
    scale = x.new_empty((batch, heads, padded(blocks(seq, block), 4)), dtype=torch.float32)
    return data, scale


def per_channel(x: torch.Tensor, dtype: torch.dtype, seq_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, dim = x.shape
    if seq_major:
        s16 = padded(seq, 16)
        data = x.new_empty_strided((batch, heads, s16, dim), (heads * dim * s16, dim * s16, 1, s16), dtype=dtype)
    else:
        data = torch.empty_like(x, dtype=dtype)
    scale = x.new_empty((batch, heads, dim), dtype=torch.float32)
    return data, scale
