"""gluon_sage's launch plan: what the host computes for one launch of :func:`.kernel._sage_fwd_ws` (grid,
positional arguments, constexprs), the part that depends on plain values only computed once per layout
(:class:`LaunchGeometry`, :data:`GEOMETRIES`), and the constexprs from the config and the inputs in one place
(:func:`kernel_meta`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from .. import _sage_common as common
from .. import q_quantized_in_kernel
from .._cuda_utils import FifoCache, bias_stride, layout_key
from . import tail_split
from .config import (PRODUCER_REGS, REGISTERS, ROWS_PER_CONSUMER, GluonConfig, check_pair_config, check_quad_config,
                     check_skip_config, check_sparse_config)
from .descriptors import DescriptorSpec, descriptor, k_scale_box, k_scale_descriptor, permuted_k
from .kernel import _sage_fwd_ws

KERNEL = "gluon_sage"
#: The kernel's constexpr parameters, in its order.
_KERNEL_CONSTEXPRS = tuple(p.name for p in getattr(_sage_fwd_ws, "params", ()) if p.is_constexpr)


def kernel_meta(config: GluonConfig, **inputs) -> dict:
    """Every constexpr of :func:`.kernel._sage_fwd_ws` for one launch: those the ``config`` decides (``BLOCK_N``,
    ``STAGES``, each of :attr:`GluonConfig.KERNEL_FLAGS` by its upper-case name, ``CONSUMERS`` and the register
    split of its CTA shape) and those the ``inputs`` decide, given by name (``QK_KIND``, ``Q_BLOCK``, ``K_BLOCK``,
    ``RETURN_LSE``, ``KS_TMA``, ``PERMK``, ``SPLIT_TAIL``, ``HAS_BIAS``, ``SKIP``, ``SPARSE``). The kernel builds its
    :class:`~.state.KernelFlags` from the same names; a new schedule flag is a :class:`GluonConfig` field (named in
    its ``FLAGS`` and ``KERNEL_FLAGS``) and a constexpr of the kernel (and a ``KernelFlags`` field where the
    partitions read it), nothing here."""
    meta = dict(inputs, BLOCK_N=config.block_n, STAGES=config.stages, CONSUMERS=config.consumers,
                CONSUMER_NREG=config.registers[1], PRODUCER_NREG=PRODUCER_REGS)
    meta.update((flag.upper(), getattr(config, flag)) for flag in config.KERNEL_FLAGS)
    return {name: meta[name] for name in _KERNEL_CONSTEXPRS}  # (in the kernel's order; a missing one raises)


def launch_maxnreg(meta: dict) -> int:
    """Registers per thread at launch of the CTA shape in ``meta`` (``maxnreg``; ``setmaxnreg`` rebalances them)."""
    return REGISTERS[meta["CONSUMERS"]][0]


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of the kernel as the host builds it: ``grid``, the positional ``args`` and constexpr ``meta`` of
    :func:`~.kernel._sage_fwd_ws`, and what they were derived from: the ``config``, the K-scale TMA box
    (``k_scale_box``: scales per box, ``None`` when they are loaded from global memory), whether full K tiles load
    through the permuting view (``permuted_k``), the ``tail`` split, and the CTAs per (batch, head) (``q_blocks``).
    """

    config: GluonConfig
    grid: tuple
    args: list
    meta: dict
    k_scale_box: Optional[int]
    permuted_k: bool
    tail: Optional[tail_split.TailPlan]
    q_blocks: int


def plan_launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out, lse, return_lse,
                config: GluonConfig, tail: Optional[tail_split.TailPlan] = None, workspace=None,
                key_bias=None, skip: Optional[tuple] = None, key_range=None, blocks=None) -> LaunchPlan:
    """The :class:`LaunchPlan` of one call (shared by :func:`attention` and :func:`compile_for`). ``tail``: split the
    last wave (:mod:`.tail_split`), its pieces writing to ``workspace = (o_ws, lse_ws)``. ``key_bias``: fp32
    ``(B|1, Skv)``, with ``key_range`` its :func:`~.._sage_common.bias_range` (required with it). A bf16/fp16 ``q`` with
    int8 ``k`` (``q_scale=None``, ``q_block`` 1): the kernel quantizes Q (``QS`` is then Q itself). ``skip``:
    ``(log2_threshold, count)``, Skip-Softmax's ``log2 λ`` (fp32, one element, on the device) and an int32 counter of
    skipped tiles or ``None`` (:func:`check_skip_config`: serial configs with 128-key tiles, no tail split).
    ``blocks``: ``(block_index, block_count, bounds)``, the key tiles each 128-row query tile visits
    (:mod:`qattn_fx.block_sparse`; :func:`check_sparse_config`: two-consumer configs) and, with a ``tail`` split or
    a ``key_bias``, their list positions bounding its pieces and the bias's span (:func:`.launch.visit_bounds`;
    else ``None``); a ``tail`` split must then cut the keys at multiples of 128 (:func:`.launch.tail_plan` plans it
    so).

    What follows from plain values (:class:`LaunchGeometry`) is computed once per key (:data:`GEOMETRIES`); each call
    builds the descriptors over its own tensors from it and places the tensors among the arguments.
    """
    if blocks is not None:
        check_sparse_config(config)
        if tail is not None and tail.kv_split % 128:
            raise ValueError(f"gluon_sage: a block-sparse launch splits the tail at multiples of 128 keys (the "
                             f"lists' key tiles); got kv_split={tail.kv_split}")
        bounds = (tail.splits + 1 if tail is not None else 0) + (2 if key_bias is not None else 0)
        if (blocks[2] is None) != (bounds == 0) or (bounds and blocks[2].shape[-1] != bounds):
            raise ValueError(f"gluon_sage: a block-sparse launch with {'a tail split' if tail else 'no tail split'} "
                             f"and {'a' if key_bias is not None else 'no'} key bias takes {bounds} visit bounds per "
                             "query tile (launch.visit_bounds); got "
                             f"{None if blocks[2] is None else tuple(blocks[2].shape)}")
    check_quad_config(config, q.shape[-1], key_bias is not None)
    check_pair_config(config, key_bias is not None, skip is not None)
    if skip is not None:
        check_skip_config(config)
        if tail is not None:
            raise ValueError("gluon_sage: Skip-Softmax launches run without the tail split (its pieces would test "
                             "tiles against their own running max, not the row's); got a tail plan")
    common.check_key_range(KERNEL, key_bias, key_range)
    key = _geometry_key(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out, return_lse, config, tail,
                        key_bias, skip) + (blocks is not None,)
    geo = GEOMETRIES.get_or_build(key, lambda: launch_geometry(q, q_scale, k, k_scale, v, v_scale, q_block, k_block,
                                                               out, return_lse, config, tail, key_bias, skip,
                                                               blocks is not None))
    args = [
        *geo.descriptors(q, k, k_scale, v),
        q if geo.quant_q else q_scale if q_scale is not None else v_scale,  # dummies for bf16/fp16 Q/K and no bias
        k_scale if k_scale is not None else v_scale, v_scale, key_bias if key_bias is not None else v_scale,
        key_range if key_range is not None else v_scale, out, lse, float(sm_scale) * common.LOG2E, *geo.scalars,
        *(workspace if tail else (out, lse)),
        *((skip[0], skip[1] if skip[1] is not None else skip[0]) if skip is not None else (v_scale, v_scale)),
        geo.items if config.persist else None,  # (None: a constexpr, no kernel argument)
        *(blocks if blocks is not None else (None, None, None)),
    ]
    return LaunchPlan(config, geo.grid, args, dict(geo.meta), geo.k_scale_box, geo.k_view is not None, tail,
                      geo.q_blocks)


@dataclass(frozen=True)
class LaunchGeometry:
    """What a :class:`LaunchPlan` takes from plain values (shapes, strides, dtypes, 16-byte alignment of the bases,
    config, tail split, flags) and not from the tensors themselves: the TMA descriptors of Q, K, Vᵀ, the K scales'
    flat view and K's permuting view (``None``: not used), whether Q is quantized in the kernel (``quant_q``), the
    ``scalars`` from the Q scale strides to ``kv_split``, ``meta``, ``grid``, ``k_scale_box``, ``q_blocks`` and the
    work ``items`` (:mod:`.schedule`: one per CTA of the non-persistent grid; a persistent grid has one CTA per SM, at
    most one per item)."""

    q: DescriptorSpec
    k: DescriptorSpec
    v: DescriptorSpec
    k_scale: Optional[DescriptorSpec]
    k_view: Optional[DescriptorSpec]
    quant_q: bool
    scalars: tuple[int, ...]
    meta: dict
    grid: tuple
    k_scale_box: Optional[int]
    q_blocks: int
    items: int

    def descriptors(self, q, k, k_scale, v) -> list:
        """The five descriptor arguments over these tensors: Q, K, Vᵀ, the K scales' and K's views (or ``None``)."""
        ks, kv = self.k_scale, self.k_view
        return [self.q.build(q), self.k.build(k), self.v.build(v.transpose(2, 3)),
                ks.build(k_scale.as_strided(ks.shape, ks.strides)) if ks else None,
                kv.build(k.as_strided(kv.shape, kv.strides)) if kv else None]


#: Launch geometries by :func:`_geometry_key` (a few per model: one per attention shape and launch class).
GEOMETRIES = FifoCache(maxsize=256)


def _geometry_key(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out, return_lse, config, tail, key_bias,
                  skip) -> tuple:
    """Every plain value :func:`launch_geometry` reads: layouts, base alignments (Gluon's descriptor check,
    :func:`k_scale_box`), the output's strides, blocks, flags, config and tail split."""
    aligned = tuple(t is None or t.data_ptr() % 16 == 0 for t in (q, k, v, k_scale))
    return (*map(layout_key, (q, q_scale, k, k_scale, v, v_scale, key_bias)), aligned, out.stride(), q_block,
            k_block, return_lse, config, tail, None if skip is None else skip[1] is not None)


def launch_geometry(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out, return_lse, config: GluonConfig,
                    tail: Optional[tail_split.TailPlan], key_bias, skip, sparse: bool = False) -> LaunchGeometry:
    """The :class:`LaunchGeometry` of :func:`plan_launch`'s arguments (its descriptors built, and so checked, by
    Gluon on these tensors)."""
    bsz, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    quant_q = q_quantized_in_kernel(q.dtype, k.dtype)  # the consumers read Q itself through QS and quantize it
    q_strides = q.stride()[:3] if quant_q else common.scale_strides(q_scale)
    ks_box = k_scale_box(k_scale, k_block, config.block_n)
    permuted = (permuted_k(k, k_block if k_scale is not None else 0, config.block_n)
                if config.permk else None)
    kp_desc, kp_xh, kp_gb, kp_gh = permuted if permuted else (None, 0, 0, 0)
    n_m = q_blocks(sq, config)
    scalars = (*q_strides, *common.scale_strides(k_scale), *common.scale_strides(v_scale),
               bias_stride(key_bias),
               out.stride(0), out.stride(1), out.stride(2),
               hq, hq // hkv, sq, skv, kp_xh, kp_gb, kp_gh,
               n_m, tail.main if tail else 0, tail.splits if tail else 1, tail.kv_split if tail else 0)
    meta = kernel_meta(config, QK_KIND=common.QK_KIND[k.dtype],
                       Q_BLOCK=q_block if q_scale is not None or quant_q else 0,
                       K_BLOCK=k_block if k_scale is not None else 0, RETURN_LSE=return_lse,
                       KS_TMA=int(ks_box is not None), PERMK=int(permuted is not None),
                       SPLIT_TAIL=int(tail is not None), HAS_BIAS=int(key_bias is not None),
                       SKIP=0 if skip is None else (2 if skip[1] is not None else 1), SPARSE=int(sparse))
    items = tail.grid if tail else n_m * bsz * hq
    if config.persist:  # (meta tensors, an offline compile: no SMs to count, one CTA per item)
        grid = (min(items, sm_count(q.device.index)) if q.is_cuda else items,)
    else:
        grid = (tail.grid,) if tail else (n_m, bsz * hq)
    spec = DescriptorSpec.of
    return LaunchGeometry(
        spec(descriptor(q, [1, 1, ROWS_PER_CONSUMER, d])), spec(descriptor(k, [1, 1, config.block_n, d])),
        spec(descriptor(v.transpose(2, 3), [1, 1, dv, config.block_n])),
        spec(k_scale_descriptor(k_scale, ks_box)) if ks_box else None, spec(kp_desc) if kp_desc else None,
        quant_q, scalars, meta, grid, ks_box, n_m, items)


def sm_count(device_index: Optional[int]) -> int:
    """SMs of CUDA device ``device_index`` (``None``: the current one, resolved on each call): the slots of the tail
    split's waves and the CTAs of a persistent grid (one per SM: a CTA takes an SM's registers)."""
    import torch

    return _sm_count(torch.cuda.current_device() if device_index is None else device_index)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def q_blocks(sq: int, config: GluonConfig) -> int:
    """CTAs per (batch, head): query rows in blocks of :attr:`GluonConfig.rows`."""
    return -(-sq // config.rows)
