"""gluon_sage's TMA descriptors on the host: the alignment rule, Gluon descriptors and their reusable specs
(:class:`DescriptorSpec`), the K scales' 1-D box (:func:`k_scale_box`) and K's permuting view (:func:`permuted_k`,
``permk``)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _sage_common as common
from ._gluon import TensorDescriptor, gl


def tma_aligned(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """TMA's addressing rule: a 16-byte aligned base and 16-byte multiple strides on ``dims`` (the non-unit ones)."""
    return x.data_ptr() % 16 == 0 and _strides_aligned(x.stride(), x.element_size(), dims)


@functools.lru_cache(maxsize=256)
def _strides_aligned(strides: tuple[int, ...], size: int, dims: tuple[int, ...]) -> bool:
    """The strides on ``dims`` are multiples of 16 bytes (elements of ``size`` bytes)."""
    return all((strides[d] * size) % 16 == 0 for d in dims)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA box (computed once per box and dtype: part of the launch cost)."""
    gl_dtype = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
                torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def descriptor(x: torch.Tensor, block: list[int]):
    """The TMA descriptor of all of ``x`` with box ``block`` (Gluon checks base, strides and box)."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, _shared_layout(tuple(block), x.dtype))


#: Gluon's ``TensorDescriptor`` fields, in order: where Triton's are these (a plain dataclass),
#: :meth:`DescriptorSpec.build` sets them itself; else it calls the constructor.
_DESCRIPTOR_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")
_SET_FIELDS = (dataclasses.is_dataclass(TensorDescriptor) and not TensorDescriptor.__dataclass_params__.frozen
               and tuple(f.name for f in dataclasses.fields(TensorDescriptor)) == _DESCRIPTOR_FIELDS)


@dataclass(frozen=True)
class DescriptorSpec:
    """A TMA descriptor without its base tensor: ``shape`` and ``strides`` (elements, as the base tensor's), the box
    ``block`` and the shared ``layout``. Taken from a descriptor Gluon built (:meth:`of`, which checked them), so
    :meth:`build` over another base of that layout, dtype and alignment skips Gluon's checks."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block: tuple[int, ...]
    layout: object

    @staticmethod
    def of(desc) -> "DescriptorSpec":
        return DescriptorSpec(tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape), desc.layout)

    def build(self, base: torch.Tensor):
        """The descriptor over ``base``: fields equal to ``TensorDescriptor(base, shape, strides, block, layout)``."""
        if not _SET_FIELDS:
            return TensorDescriptor(base, list(self.shape), list(self.strides), list(self.block), self.layout)
        desc = object.__new__(TensorDescriptor)
        desc.base, desc.shape, desc.strides = base, list(self.shape), list(self.strides)
        desc.block_shape, desc.layout, desc.padding = list(self.block), self.layout, "zero"
        return desc


def k_scale_box(k_scale: Optional[torch.Tensor], k_block: int, block_n: int) -> Optional[int]:
    """Elements per K tile of the K scales when they can ride on the K tile's TMA (one scale per column or per
    group dividing the tile, at least 4 groups; unit stride on tokens; 16-byte aligned base and batch/head strides,
    e.g. ``Skv`` a multiple of ``64 · k_block / 16``), padded to 128 bytes (TMA writes shared
    memory at 128-byte aligned addresses: each slot of the ring is one box); else ``None``."""
    if k_scale is None or not (k_block == 1 or (1 < k_block < block_n and block_n % k_block == 0)):
        return None
    if (k_scale.shape[-1] > 1 and k_scale.stride(-1) != 1) or k_scale.data_ptr() % 16:
        return None
    # every box starts at b·s_b + h·s_h + j·G elements, which TMA needs 16-byte aligned (4 fp32)
    if any(st % 4 for st in common.scale_strides(k_scale)[:2]) or (block_n // k_block) % 4:
        return None
    return max(block_n // k_block, 32)


def k_scale_descriptor(k_scale: torch.Tensor, box: int):
    """1-D TMA descriptor over every element a (broadcast-aware) offset ``b·s_b + h·s_h + n`` can reach."""
    extent = 1 + sum((n - 1) * st for n, st in zip(k_scale.shape, common.scale_strides(k_scale)))
    return descriptor(k_scale.as_strided((extent,), (1,)), [box])


def permuted_k(k: torch.Tensor, k_block: int, block_n: int):
    """A 5-D view of K for TMA whose box, read in order, is a ``(block_n, D)`` tile with row ``16g + 8i + 2c + e``
    holding key ``16g + 4c + 2i + e``: the wgmma accumulator then holds P in the FP8 A-operand order, with V as
    stored. Returns ``(descriptor, x_per_head, g_per_batch, g_per_head)`` (the producer's box coordinates are
    ``x = hk·x_per_head`` on the innermost dim, ``g = b·g_per_batch + hk·g_per_head`` on the 16-key groups), or
    ``None`` where the view cannot be built: K not 8-bit; K scales per 1 or 4 keys (the permutation crosses them;
    per 16, 32, ... keys, per head or per tensor are kept); heads neither interleaved (BSHD) nor stacked (BHSD)
    with contiguous batches; several batches or heads folded into the groups but ``Skv`` not a multiple of 16."""
    view = _permuted_k_view(k.shape, k.stride(), k.element_size(), k_block, block_n)
    if view is None:
        return None
    size, stride, x_per_head, g_per_batch, g_per_head = view
    desc = descriptor(k.as_strided(size, stride), [block_n // 16, 2, 4, 2, k.shape[-1]])
    return desc, x_per_head, g_per_batch, g_per_head


@functools.lru_cache(maxsize=256)
def _permuted_k_view(shape: tuple[int, ...], strides: tuple[int, ...], element_size: int, k_block: int,
                     block_n: int) -> Optional[tuple]:
    """:func:`permuted_k`'s view of a K of this shape, strides and element size: ``(size, stride, x_per_head,
    g_per_batch, g_per_head)`` (``size``/``stride`` of the 5-D ``as_strided`` view), or ``None``."""
    if element_size != 1 or k_block % 16:
        return None
    bsz, hkv, skv, d = shape
    sb, sh, ss, _ = strides
    if (ss % 16) or (ss == 0):
        return None
    if sh == d and (hkv == 1 or ss == hkv * d):  # BSHD: the heads side by side in one token row
        inner, x_per_head, g_per_head = hkv * d, d, 0
        if bsz > 1 and (skv % 16 or sb != skv * ss):
            return None
        g_per_batch = skv // 16 if bsz > 1 else 0
        groups = (bsz * skv) // 16 if bsz > 1 else skv // 16
    elif ss == d and (hkv == 1 or sh == skv * d) and (bsz == 1 or sb == hkv * skv * d):  # BHSD, contiguous
        if (bsz * hkv > 1) and skv % 16:
            return None
        inner, x_per_head, g_per_head, g_per_batch = d, 0, skv // 16, hkv * skv // 16
        groups = (bsz * hkv * skv) // 16
    else:
        return None
    if groups == 0:
        return None
    return (groups, 2, 4, 2, inner), (16 * ss, 2 * ss, 4 * ss, ss, 1), x_per_head, g_per_batch, g_per_head
