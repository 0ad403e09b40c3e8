"""Quantize ops: each one FX node, defined in plain aten (CompositeImplicitAutograd) so Inductor fuses it.

All ops live in the ``qattn`` torch.library namespace, take logical ``(B, H, S, D)`` tensors of any strides and
never mutate their inputs. The numerics are those of :mod:`qattn_fx.ops.formats`.

=====================================================  ==========================================================
op                                                     returns
=====================================================  ==========================================================
``smooth_k(k)``                                        ``k - mean_S(k)`` in k's dtype (exact under softmax)
``quantize_per_block(x, block, dtype)``                data like x (int8/e4m3), scale ``(B, H, ceil(S/block))``
                                                       (each head's row stored padded to 16 bytes)
``quantize_per_head(x, dtype, seq_major)``             data, scale ``(1, H, 1)``
``quantize_per_tensor(x, dtype, seq_major)``           data, scale ``(1, 1, 1)``
``quantize_per_channel(x, dtype, seq_major)``          data, scale ``(B, H, D)`` (V: amax over tokens)
``quantize_mxfp8(x, axis)``                            e4m3 data like x, E8M0 scales (32 along ``axis``)
``quantize_nvfp4(x, transpose)``                       packed e2m1 ``(..., N/2)`` uint8, E4M3 scales ``(..., N/16)``,
                                                       fp32 tensor scale ``()``; ``transpose`` quantizes
                                                       ``x.transpose(-1, -2)`` (V along the sequence)
=====================================================  ==========================================================

The scaled int8/fp8 ops keep the memory order of the input (elementwise ops preserve a permuted BSHD view), so
kernels read diffusers' ``(B, S, H, D)`` buffers through strides without transposing copies; ``seq_major=True``
stores the data with the sequence axis fastest (physically ``(B, H, D, S16)``, each channel's row padded to 16
bytes), the layout an FP8 P·V on Hopper wants for V; the logical shape stays ``(B, H, S, D)``. The MXFP8 and
NVFP4 ops return contiguous data and scales (their kernels re-pack scales into hardware layouts anyway).
"""

from __future__ import annotations

import torch

from . import formats

lib = torch.library.Library("qattn", "DEF")


def _define(schema: str, fn) -> None:
    lib.define(schema)
    lib.impl(schema.split("(")[0], fn, "CompositeImplicitAutograd")


def _check_4d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} expects a (B, H, S, D) tensor; got shape {tuple(x.shape)}")


def _check_8bit(dtype: torch.dtype) -> None:
    formats.qmax(dtype)  # raises with the valid choices


def _rows_padded(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` stored contiguously with its last-dim rows padded to a multiple of ``multiple`` elements (zeros),
    viewed back as ``x``'s shape: every row then starts on that many elements' alignment."""
    n = x.shape[-1]
    pad = (-n) % multiple
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.contiguous()[..., :n]


def _layout(data: torch.Tensor, seq_major: bool) -> torch.Tensor:
    """Data keeps the input's memory order (a BSHD view stays BSHD) unless ``seq_major`` asks for S fastest.

    Sequence-major data is stored ``(B, H, D, S16)`` with the row length padded to a multiple of 16 elements
    (16 bytes of fp8, what vectorized/asynchronous copies and TMA need) and viewed back as ``(B, H, S, D)``.
    """
    if not seq_major:
        return data
    return _rows_padded(data.transpose(-1, -2), 16).transpose(-1, -2)


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    _check_4d("smooth_k", k)
    return (k.float() - k.float().mean(dim=-2, keepdim=True)).to(k.dtype)


def quantize_per_block(x: torch.Tensor, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check_4d("quantize_per_block", x)
    _check_8bit(dtype)
    if block < 1:
        raise ValueError(f"quantize_per_block: block={block} is invalid; valid: an int >= 1 (tokens per scale)")
    scale = formats.seq_block_amax(x, block) / formats.qmax(dtype)
    data = formats.cast_scaled(x, formats.expand_seq_scale(scale, block, x.shape[-2]), dtype)
    # each head's row padded to 4 fp32 (16 bytes), so every head's scales start where a TMA load can (75600 tokens
    # in groups of 16 give 4725 scales per head; the row is stored as 4728)
    return data, _rows_padded(scale, 4)


def quantize_per_head(x: torch.Tensor, dtype: torch.dtype, seq_major: bool = False):
    _check_4d("quantize_per_head", x)
    _check_8bit(dtype)
    scale = x.abs().float().amax(dim=(0, 2, 3)).reshape(1, -1, 1) / formats.qmax(dtype)
    data = formats.cast_scaled(x, scale.unsqueeze(-1), dtype)
    return _layout(data, seq_major), scale


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype, seq_major: bool = False):
    _check_4d("quantize_per_tensor", x)
    _check_8bit(dtype)
    scale = x.abs().float().amax().reshape(1, 1, 1) / formats.qmax(dtype)
    data = formats.cast_scaled(x, scale.unsqueeze(-1), dtype)
    return _layout(data, seq_major), scale


def quantize_per_channel(x: torch.Tensor, dtype: torch.dtype, seq_major: bool = False):
    _check_4d("quantize_per_channel", x)
    _check_8bit(dtype)
    scale = x.abs().float().amax(dim=-2) / formats.qmax(dtype)
    data = formats.cast_scaled(x, scale.unsqueeze(-2), dtype)
    return _layout(data, seq_major), scale


def quantize_mxfp8(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_4d("quantize_mxfp8", x)
    if axis not in (-1, -2, 2, 3):
        raise ValueError(f"quantize_mxfp8: axis={axis} is invalid; valid: -1 (channels, Q/K), -2 (tokens, V)")
    return formats.quantize_mxfp8(x, axis)


def quantize_nvfp4(x: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_4d("quantize_nvfp4", x)
    return formats.quantize_nvfp4(x.transpose(-1, -2) if transpose else x)


_define("smooth_k(Tensor k) -> Tensor", smooth_k)
_define("quantize_per_block(Tensor x, int block, ScalarType dtype) -> (Tensor, Tensor)", quantize_per_block)
_define("quantize_per_head(Tensor x, ScalarType dtype, bool seq_major=False) -> (Tensor, Tensor)", quantize_per_head)
_define(
    "quantize_per_tensor(Tensor x, ScalarType dtype, bool seq_major=False) -> (Tensor, Tensor)", quantize_per_tensor
)
_define(
    "quantize_per_channel(Tensor x, ScalarType dtype, bool seq_major=False) -> (Tensor, Tensor)", quantize_per_channel
)
_define("quantize_mxfp8(Tensor x, int axis) -> (Tensor, Tensor)", quantize_mxfp8)
_define("quantize_nvfp4(Tensor x, bool transpose) -> (Tensor, Tensor, Tensor)", quantize_nvfp4)

QUANTIZE_OPS = (
    torch.ops.qattn.smooth_k.default,
    torch.ops.qattn.quantize_per_block.default,
    torch.ops.qattn.quantize_per_head.default,
    torch.ops.qattn.quantize_per_tensor.default,
    torch.ops.qattn.quantize_per_channel.default,
    torch.ops.qattn.quantize_mxfp8.default,
    torch.ops.qattn.quantize_nvfp4.default,
)
