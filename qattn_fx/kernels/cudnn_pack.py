"""MXFP8 scale packing for cuDNN's ``sdpa_mxfp8`` (pure torch, any device): E8M0 scales in cuDNN's ``F8_128x4``
layout, rowwise for Q/K (:func:`pack_f8_128x4`) and columnwise for V (:func:`pack_f8_128x4_columnwise`).
"""

from __future__ import annotations

import torch

SF_ROWS = 128  # F8_128x4 atom: 128 rows ...
SF_COLS = 4  # ... by 4 scale columns (512 bytes)


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _as_bytes(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.uint8:
        return scales
    if scales.element_size() != 1:
        raise ValueError(f"scale factors must be one byte each (E8M0 / uint8); got {scales.dtype}")
    return scales.view(torch.uint8)


def pack_f8_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Rowwise F8_128x4 layout of one-byte scales ``(..., R, C)`` → uint8 ``(..., ceil128(R), ceil4(C))``.

    Rows (tokens of Q/K) are zero-padded to a multiple of 128 and scale columns (32-element blocks of D) to a multiple
    of 4; the result is contiguous and its *memory* holds cuDNN's order: atoms of 128 rows × 4 columns (512 bytes)
    laid out row-major (row tile outer, column tile inner, leading dims outermost), and inside an atom scale ``(r, c)``
    at byte ``(r % 32)·16 + ((r % 128) // 32)·4 + c % 4``. Its logical indices mean nothing; hand it to cuDNN as
    ``(..., ceil128(R), ceil4(C))`` row-major with reordering ``F8_128x4``. Padding bytes are 0 (E8M0 2^-127), never
    NaN. Accepts ``float8_e8m0fnu`` or ``uint8`` scales on any device.
    """
    raw = _as_bytes(scales)
    if raw.dim() < 2:
        raise ValueError(f"pack_f8_128x4 needs scales of shape (..., R, C); got {tuple(raw.shape)}")
    *lead, rows, cols = raw.shape
    rp, cp = _ceil_to(rows, SF_ROWS), _ceil_to(cols, SF_COLS)
    padded = raw.new_zeros(*lead, rp, cp)
    padded[..., :rows, :cols] = raw
    atoms = padded.reshape(*lead, rp // SF_ROWS, 4, 32, cp // SF_COLS, SF_COLS)
    n = len(lead)
    order = list(range(n)) + [n, n + 3, n + 2, n + 1, n + 4]  # (row tile, col tile, r % 32, r // 32, c)
    return atoms.permute(order).contiguous().view(*lead, rp, cp)


def pack_f8_128x4_columnwise(v_scales: torch.Tensor) -> torch.Tensor:
    """F8_128x4 layout of V's scales ``(B, H, ceil(S/32), Dv)`` (blocks of 32 tokens per channel) for ``sdpa_mxfp8``.

    The rule of :func:`pack_f8_128x4` is applied to the *transposed* scale matrix ``[ceil128(Dv), B·H·ceil4(S/32)]``
    (rows = channels, columns = (b, h, token block)), so atoms are D-plane-major: byte of scale ``(b, h, j, d)`` =
    ``(d // 128) · (B·H·S4/4) · 512 + ((b·H + h)·S4/4 + j // 4) · 512 + (d % 32)·16 +
    ((d % 128) // 32)·4 + j % 4`` with ``S4 = ceil4(ceil(S/32))``. For ``Dv <= 128`` (one plane) this equals packing
    each (b, h) slab separately.
    Returns a uint8 view of shape ``(B, H, S4, ceil128(Dv))`` with strides ``(H·S4·Dp, S4·Dp, 1, S4)`` — the
    descriptor cuDNN documents for ``descale_v`` (only the memory order matters to cuDNN). Padding bytes are 0.
    """
    raw = _as_bytes(v_scales)
    if raw.dim() != 4:
        raise ValueError(f"pack_f8_128x4_columnwise needs V scales (B, H, ceil(S/32), Dv); got {tuple(raw.shape)}")
    b, h, nblocks, dv = raw.shape
    s4, dp = _ceil_to(nblocks, SF_COLS), _ceil_to(dv, SF_ROWS)
    t = raw.new_zeros(b, h, dp, s4)
    t[:, :, :dv, :nblocks] = raw.transpose(-1, -2)
    matrix = t.permute(2, 0, 1, 3).reshape(dp, b * h * s4)
    flat = pack_f8_128x4(matrix).reshape(-1)
    return flat.as_strided((b, h, s4, dp), (h * s4 * dp, s4 * dp, 1, s4))
