"""gluon_sage's host side: TMA descriptors, the launch plan, the tail split's planning, autotuning, launching and
offline compiles."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ... import config as qattn_config
from ... import skip_softmax
from .. import _sage_common as common
from .. import q_quantized_in_kernel
from .._config_tuner import ConfigTuner
from .._cuda_utils import FifoCache, empty_bshd, layout_key
from . import tail_split
from ._gluon import GLUON_ERROR, TensorDescriptor, gl, triton
from .config import (CAPABILITY, DEFAULT_CONFIGS, KEY_ORDER_DEFAULT_CONFIG, KEY_ORDER_TUNED_CONFIGS, PRODUCER_REGS,
                     QUAD_HEAD_DIM, QUAD_TUNED_CONFIGS, REGISTERS, ROWS_PER_CONSUMER, SKIP_KEY_ORDER_TUNED_CONFIGS,
                     SKIP_TUNED_CONFIGS, TRIO_DEFAULT_CONFIG, TUNED_CONFIGS, GluonConfig, check_quad_config,
                     check_skip_config, forced_config, quad_serves)
from .kernel import _sage_fwd_ws

KERNEL = "gluon_sage"


#: This process's latest launch (its config and tail split), for reports and benchmarks.
LAST = common.LastLaunch()


def last_config() -> Optional[GluonConfig]:
    """The config of this process's latest launch (forced, tuned or default), for reports; ``None`` before any."""
    return LAST.config


def last_tail_plan() -> Optional[tail_split.TailPlan]:
    """The tail split of this process's latest launch (:func:`tail_plan`), for reports; ``None``: none."""
    return LAST.tail


def tuning_key(q: torch.Tensor, k: torch.Tensor, q_block: int, k_block: int, return_lse: bool,
                key_bias: bool = False, skip: bool = False) -> tuple:
    """``(head_dim, Q dtype, q_block, k_block, lse, Sq bucket, Skv bucket, B·Hq bucket[, "bias"][, "skip"])``:
    lengths in powers of 4 from 256 (as triton_sage's autotune key), ``B·Hq`` rounded up to a power of 2; key-bias
    calls (masks), Skip-Softmax calls and calls whose Q the kernel quantizes are tuned apart."""
    bsz, hq, sq, d = q.shape
    key = (d, str(q.dtype).removeprefix("torch."), q_block, k_block, bool(return_lse), common.seq_bucket(sq),
           common.seq_bucket(k.shape[2]), 1 << max(bsz * hq - 1, 0).bit_length())
    key += ("q_in_kernel",) if q_quantized_in_kernel(q.dtype, k.dtype) else ()
    return key + (("bias",) if key_bias else ()) + (("skip",) if skip else ())


#: The autotuner of launches that view K through ``permk``: one timing of :data:`TUNED_CONFIGS` per
#: :func:`tuning_key`, cached in memory and on disk (:mod:`.._config_tuner`); untuned (graph capture before any
#: tuning, autotuning off) it uses :data:`TRIO_DEFAULT_CONFIG`.
TUNER = ConfigTuner("gluon_sage", [str(c) for c in TUNED_CONFIGS], default=lambda key: str(TRIO_DEFAULT_CONFIG),
                    numerics=lambda text: GluonConfig.parse(text).numerics)
#: The autotuner of those launches at head_dim 64 without a key bias or Skip-Softmax: :data:`QUAD_TUNED_CONFIGS`,
#: untuned :data:`DEFAULT_CONFIGS` [64].
QUAD_TUNER = ConfigTuner("gluon_sage_quad", [str(c) for c in QUAD_TUNED_CONFIGS],
                         default=lambda key: str(DEFAULT_CONFIGS[QUAD_HEAD_DIM]),
                         numerics=lambda text: GluonConfig.parse(text).numerics)
#: The autotuner of launches that load K in key order (a K the view cannot take):
#: :data:`KEY_ORDER_TUNED_CONFIGS`, untuned :data:`KEY_ORDER_DEFAULT_CONFIG`.
KEY_ORDER_TUNER = ConfigTuner("gluon_sage_key_order", [str(c) for c in KEY_ORDER_TUNED_CONFIGS],
                              default=lambda key: str(KEY_ORDER_DEFAULT_CONFIG),
                              numerics=lambda text: GluonConfig.parse(text).numerics)


#: The autotuners of Skip-Softmax launches (serial schedules, no tail split): :data:`SKIP_TUNED_CONFIGS` where K is
#: viewed through ``permk`` (untuned: :data:`TRIO_DEFAULT_CONFIG`), else :data:`SKIP_KEY_ORDER_TUNED_CONFIGS`.
SKIP_TUNER = ConfigTuner("gluon_sage_skip", [str(c) for c in SKIP_TUNED_CONFIGS],
                         default=lambda key: str(TRIO_DEFAULT_CONFIG),
                         numerics=lambda text: GluonConfig.parse(text).numerics)
SKIP_KEY_ORDER_TUNER = ConfigTuner("gluon_sage_skip_key_order", [str(c) for c in SKIP_KEY_ORDER_TUNED_CONFIGS],
                                   default=lambda key: str(SKIP_KEY_ORDER_TUNED_CONFIGS[0]),
                                   numerics=lambda text: GluonConfig.parse(text).numerics)
#: Every autotuner of this kernel, one per launch class (:func:`tuner_for` picks among them).
TUNERS = (TUNER, QUAD_TUNER, KEY_ORDER_TUNER, SKIP_TUNER, SKIP_KEY_ORDER_TUNER)


def tuner_for(k: torch.Tensor, k_scale: Optional[torch.Tensor], k_block: int,
              key_bias: Optional[torch.Tensor] = None, skip: bool = False) -> ConfigTuner:
    """The autotuner of this launch's class, decided by the inputs alone: :data:`TUNER` where K can be viewed
    through ``permk`` at the class's key tile (:func:`permuted_k`; :data:`QUAD_TUNER` at head_dim 64 without a key
    bias), else :data:`KEY_ORDER_TUNER`; Skip-Softmax launches (``skip``), whose serial schedules it needs:
    :data:`SKIP_TUNER` where K can be viewed and there is no key bias (``trio`` spills over 1.4 KB with both), else
    :data:`SKIP_KEY_ORDER_TUNER`. Each tuner's candidates share their numerics (:attr:`GluonConfig.numerics`)."""
    view = _permuted_k_view(k.shape, k.stride(), k.element_size(), k_block if k_scale is not None else 0,
                            TUNED_CONFIGS[0].block_n)
    if view is not None and not (skip and key_bias is not None):
        if skip:
            return SKIP_TUNER
        return QUAD_TUNER if quad_serves(k.shape[-1], key_bias is not None) else TUNER
    return SKIP_KEY_ORDER_TUNER if skip else KEY_ORDER_TUNER


def ineligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why this kernel cannot take these (already validated) inputs, or ``None``."""
    reason = device_reason(q.device)
    if reason is not None:
        return reason
    if not common.seq_major(v):
        return f"needs sequence-major fp8 V (stride(-2) == 1); got strides {tuple(v.stride())}"
    for name, x, dims in (("q", q, (0, 1, 2)), ("k", k, (0, 1, 2)), ("v", v, (0, 1, 3))):
        if not tma_aligned(x, dims):
            return (f"{name} needs a 16-byte aligned base and strides for TMA; got strides {tuple(x.stride())} "
                    f"of {x.dtype}")
    return None


@functools.lru_cache(maxsize=16)
def device_reason(device: torch.device) -> Optional[str]:
    """Why the kernel cannot run on ``device`` (no Gluon-capable Triton, not an sm_90 GPU), or ``None``; asked once
    per device."""
    if GLUON_ERROR is not None:
        return f"triton with Gluon (Hopper) is not importable: {GLUON_ERROR}"
    if device.type != "cuda" or tuple(torch.cuda.get_device_capability(device)) != CAPABILITY:
        return f"needs an sm_90 (Hopper) GPU; got {device}"
    return None


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
                key_bias=None, skip: Optional[tuple] = None, key_range=None) -> LaunchPlan:
    """The :class:`LaunchPlan` of one call (shared by :func:`attention` and :func:`compile_for`). ``tail``: split the
    last wave (:mod:`.tail_split`), its pieces writing to ``workspace = (o_ws, lse_ws)``. ``key_bias``: fp32
    ``(B|1, Skv)``, with ``key_range`` its :func:`~.._sage_common.bias_range` (required with it). A bf16/fp16 ``q`` with
    int8 ``k`` (``q_scale=None``, ``q_block`` 1): the kernel quantizes Q (``QS`` is then Q itself). ``skip``:
    ``(log2_threshold, count)``, Skip-Softmax's ``log2 λ`` (fp32, one element, on the device) and an int32 counter of
    skipped tiles or ``None`` (:func:`check_skip_config`: serial configs with 128-key tiles, no tail split).

    What follows from plain values (:class:`LaunchGeometry`) is computed once per key (:data:`GEOMETRIES`); each call
    builds the descriptors over its own tensors from it and places the tensors among the arguments.
    """
    check_quad_config(config, q.shape[-1], key_bias is not None)
    if skip is not None:
        check_skip_config(config)
        if tail is not None:
            raise ValueError("gluon_sage: Skip-Softmax launches run without the tail split (its pieces would test "
                             "tiles against their own running max, not the row's); got a tail plan")
    common.check_key_range(KERNEL, key_bias, key_range)
    key = _geometry_key(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out, return_lse, config, tail,
                        key_bias, skip)
    geo = GEOMETRIES.get_or_build(key, lambda: launch_geometry(q, q_scale, k, k_scale, v, v_scale, q_block, k_block,
                                                               out, return_lse, config, tail, key_bias, skip))
    args = [
        *geo.descriptors(q, k, k_scale, v),
        q if geo.quant_q else q_scale if q_scale is not None else v_scale,  # dummies for bf16/fp16 Q/K and no bias
        k_scale if k_scale is not None else v_scale, v_scale, key_bias if key_bias is not None else v_scale,
        key_range if key_range is not None else v_scale, out, lse, float(sm_scale) * common.LOG2E, *geo.scalars,
        *(workspace if tail else (out, lse)),
        *((skip[0], skip[1] if skip[1] is not None else skip[0]) if skip is not None else (v_scale, v_scale)),
    ]
    return LaunchPlan(config, geo.grid, args, dict(geo.meta), geo.k_scale_box, geo.k_view is not None, tail,
                      geo.q_blocks)


@dataclass(frozen=True)
class LaunchGeometry:
    """What a :class:`LaunchPlan` takes from plain values (shapes, strides, dtypes, 16-byte alignment of the bases,
    config, tail split, flags) and not from the tensors themselves: the TMA descriptors of Q, K, Vᵀ, the K scales'
    flat view and K's permuting view (``None``: not used), whether Q is quantized in the kernel (``quant_q``), the
    ``scalars`` from the Q scale strides to ``kv_split``, ``meta``, ``grid``, ``k_scale_box`` and ``q_blocks``."""

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
                    tail: Optional[tail_split.TailPlan], key_bias, skip) -> LaunchGeometry:
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
               common.bias_stride(key_bias),
               out.stride(0), out.stride(1), out.stride(2),
               hq, hq // hkv, sq, skv, kp_xh, kp_gb, kp_gh,
               n_m, tail.main if tail else 0, tail.splits if tail else 1, tail.kv_split if tail else 0)
    meta = dict(QK_KIND=common.QK_KIND[k.dtype], Q_BLOCK=q_block if q_scale is not None or quant_q else 0,
                K_BLOCK=k_block if k_scale is not None else 0, RETURN_LSE=return_lse,
                BLOCK_N=config.block_n, STAGES=config.stages,
                CONSUMER_NREG=config.registers[1],
                PRODUCER_NREG=PRODUCER_REGS,
                AHEAD=config.ahead, KS_TMA=int(ks_box is not None),
                PERMK=int(permuted is not None), CONSUMERS=config.consumers, TARRIVE=config.tarrive,
                MMASUM=config.mmasum, SPLIT_TAIL=int(tail is not None), HAS_BIAS=int(key_bias is not None),
                SKIP=0 if skip is None else (2 if skip[1] is not None else 1))
    grid = (tail.grid,) if tail else (n_m, bsz * hq)
    spec = DescriptorSpec.of
    return LaunchGeometry(
        spec(descriptor(q, [1, 1, ROWS_PER_CONSUMER, d])), spec(descriptor(k, [1, 1, config.block_n, d])),
        spec(descriptor(v.transpose(2, 3), [1, 1, dv, config.block_n])),
        spec(k_scale_descriptor(k_scale, ks_box)) if ks_box else None, spec(kp_desc) if kp_desc else None,
        quant_q, scalars, meta, grid, ks_box, n_m)


def q_blocks(sq: int, config: GluonConfig) -> int:
    """CTAs per (batch, head): query rows in blocks of :attr:`GluonConfig.rows`."""
    return -(-sq // config.rows)




@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tail_plan(q: torch.Tensor, k: torch.Tensor, k_block: int, config: GluonConfig) -> Optional[tail_split.TailPlan]:
    """The split of this call's last partial wave (:func:`.tail_split.plan`; ``None``: none, or turned off by
    ``qattn_fx.config.gluon_tail_split``, ``$QATTN_GLUON_TAIL_SPLIT=0``). Slots: the device's SMs, two CTAs each
    under ``solo``. ``k_block``: 0 when K has no per-block scales."""
    if not qattn_config.flag("gluon_tail_split"):
        return None
    bsz, hq, sq, _ = q.shape
    slots = sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return tail_split.plan(bsz * hq * q_blocks(sq, config), slots * (2 if config.solo else 1), k.shape[2],
                            config.block_n, k_block)


def _launch_maxnreg(meta: dict) -> int:
    return REGISTERS[meta["CONSUMERS"]][0]


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when TMA can address it (:func:`tma_aligned` on its batch, head and token strides), else a
    contiguous copy (a bf16 Q/K straight from the model at an odd offset; the quantize nodes' outputs always are)."""
    return x if tma_aligned(x, (0, 1, 2)) else x.clone(memory_format=torch.contiguous_format)


def attention(q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int, sm_scale: float,
              out_dtype: torch.dtype, *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None,
              skip_threshold: Optional[torch.Tensor] = None, skip_count: Optional[torch.Tensor] = None):
    """``qattn::scaled_attention`` on the warp-specialized sm_90 kernel (layouts/dtypes: the package docstring).

    Raises ``ValueError`` for bad inputs (triton_sage's checks) and ``RuntimeError`` naming what
    :func:`ineligible` found (a Q or K whose base or strides TMA cannot address is copied instead). Launches on the
    current stream; the config is the forced one (:func:`forced_config`), else the choice of the tuner of the
    launch's class (:func:`tuner_for`) for this problem key; the candidates of a class give identical outputs.
    The first call of a key not in the tuning cache times every candidate on these inputs (and synchronizes to do
    so); later calls never synchronize. Where the grid's last wave is partial
    (:func:`tail_plan`), that wave runs split over the keys into an fp32 workspace and a second, small kernel
    merges it (:mod:`.tail_split`). ``key_bias``: fp32 ``(B|1, Skv)`` added to the logits (masked keys
    ``-inf``; a row with every key masked gives 0 and LSE ``-inf``). Calls of more than 65,535 (batch, head) pairs
    run in batch chunks (the grid limit).

    ``skip_threshold``: Skip-Softmax's λ (:mod:`qattn_fx.skip_softmax`), a one-element float tensor on the device
    (0: nothing skipped, the bits of the launch without it and without the tail split); such launches run serial
    configs without the tail split. ``skip_count``: an int32 one-element tensor on the device to which the number
    of skipped tiles is added.
    """
    common.validate(KERNEL, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    skip = _skip_args(q, skip_threshold, skip_count)
    q, k = _aligned(q), _aligned(k)
    reason = ineligible(q, k, v)
    if reason is not None:
        raise RuntimeError(f"gluon_sage: {reason}")
    bsz, hq, sq, _ = q.shape
    dv = v.shape[-1]
    out = empty_bshd(bsz, hq, sq, dv, out_dtype, q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    if sq == 0 or bsz == 0 or hq == 0:
        return (out, lse) if return_lse else out
    chunks = common.batch_chunks(bsz, hq)
    key_range = None if key_bias is None else common.bias_range(key_bias)  # once per call, chunked with the bias

    def launch(config: GluonConfig, skip=skip) -> None:
        for lo, hi in chunks:
            part = [common.batch_chunk(t, lo, hi) for t in (q, q_scale, k, k_scale, v, v_scale, key_bias, key_range)]
            o = common.batch_chunk(out, lo, hi)
            ls = common.batch_chunk(lse, lo, hi) if return_lse else o
            tail = None if skip else tail_plan(part[0], part[2], k_block if k_scale is not None else 0, config)
            ws = tail_split.workspace(tail, config.rows, dv, q.device) if tail else None
            plan = plan_launch(*part[:6], q_block, k_block, sm_scale, o, ls, return_lse, config, tail, ws, part[6],
                               skip, part[7])
            _sage_fwd_ws[plan.grid](*plan.args, **plan.meta, num_warps=4, maxnreg=_launch_maxnreg(plan.meta))
            if tail:
                tail_split.merge(tail, *ws, o, ls if return_lse else None, plan.q_blocks)
        LAST.tail = tail

    with torch.cuda.device(q.device):
        config = forced_config()
        if config is None:
            tuner = tuner_for(k, k_scale, k_block, key_bias, skip is not None)
            timing_skip = None if skip is None else (skip[0], None)  # the tuner's launches count nothing
            name = tuner.choose(tuning_key(q, k, q_block, k_block, return_lse, key_bias is not None, skip is not None),
                                lambda text: launch(common.parse_config(GluonConfig, text), timing_skip))
            config = common.parse_config(GluonConfig, name)
        launch(config)
    LAST.config = config
    return (out, lse) if return_lse else out


def _skip_args(q, skip_threshold, skip_count) -> Optional[tuple]:
    """``(log2 λ, count)`` for the kernel, or ``None`` without Skip-Softmax."""
    if skip_threshold is None:
        if skip_count is not None:
            raise ValueError("gluon_sage: skip_count without skip_threshold; give both or neither")
        return None
    if skip_threshold.numel() != 1 or not skip_threshold.dtype.is_floating_point:
        raise ValueError(f"gluon_sage: skip_threshold must be a one-element float tensor; got {skip_threshold.dtype} "
                         f"of shape {tuple(skip_threshold.shape)}")
    if skip_count is not None and (skip_count.dtype != torch.int32 or skip_count.numel() != 1
                                   or skip_count.device != q.device):
        raise ValueError(f"gluon_sage: skip_count must be a one-element int32 tensor on {q.device}; got "
                         f"{skip_count.dtype} of shape {tuple(skip_count.shape)} on {skip_count.device}")
    return skip_softmax.log2_threshold(skip_threshold.to(q.device)).reshape(1), skip_count


def scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, *, key_bias=None,
                     return_lse=False, skip_threshold=None, skip_label=""):
    """Kernel entry for ``qattn::scaled_attention``; ``return_lse``: also the LSE (``qattn::scaled_attention_lse``).
    With ``skip_threshold`` inside :func:`qattn_fx.skip_softmax.measure`, the skipped tiles are counted and recorded
    under ``skip_label`` (a synchronization per call)."""
    count = None
    if skip_threshold is not None and skip_softmax.active() is not None:
        count = torch.zeros(1, dtype=torch.int32, device=q.device)
    out = attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, key_bias=key_bias,
                    return_lse=return_lse, skip_threshold=skip_threshold, skip_count=count)
    if count is not None:
        rows, keys = skip_softmax.tiles(q.shape[2], k.shape[2])
        skip_softmax.record(skip_label, int(count.item()), q.shape[0] * q.shape[1] * rows * keys)
    return out


def compile_for(config: GluonConfig, q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int,
                sm_scale: float = 0.125, out_dtype: torch.dtype = torch.bfloat16, *, return_lse: bool = False,
                tail: Optional[tail_split.TailPlan] = None, key_bias: Optional[torch.Tensor] = None,
                skip: int = 0):
    """Compile (not run) the kernel for sm_90 with these inputs' dtypes, shapes and strides (``meta`` tensors are
    fine: data pointers are taken as 16-byte aligned), with the tail split ``tail`` if given, with Skip-Softmax's
    test if ``skip`` (2: counting skipped tiles). Returns Triton's
    compiled kernel (``.asm["ptx"|"cubin"]``); needs only Triton's bundled ptxas, no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .._offline import launch_signature

    common.validate(KERNEL, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    bsz, hq, sq, _ = q.shape
    out = empty_bshd(bsz, hq, sq, v.shape[-1], out_dtype, q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    ws = tail_split.workspace(tail, config.rows, v.shape[-1], q.device) if tail else None
    count = torch.empty(1, dtype=torch.int32, device=q.device) if skip == 2 else None
    skip_args = (torch.empty(1, device=q.device), count) if skip else None
    plan = plan_launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out, lse, return_lse, config,
                       tail, ws, key_bias, skip_args, None if key_bias is None else common.bias_range(key_bias))
    kernel = _sage_fwd_ws
    meta = plan.meta
    signature, constexprs, attrs = launch_signature(kernel, plan.args, meta)
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": _launch_maxnreg(meta)})
