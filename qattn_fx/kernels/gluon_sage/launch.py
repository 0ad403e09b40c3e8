"""gluon_sage's host side: eligibility, autotuning (one tuner per launch class), the tail split's planning,
launching and offline compiles; the descriptors are built in :mod:`.descriptors`, the launch plan in :mod:`.plan`."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ... import config as qattn_config
from ... import block_sparse, skip_softmax
from .. import _sage_common as common
from .. import q_quantized_in_kernel
from .._compiled_launch import compiled
from .._config_tuner import ConfigTuner
from .._cuda_utils import empty_bshd, next_power_of_2
from . import tail_split
from ._gluon import GLUON_ERROR
from .config import (CAPABILITY, DEFAULT_CONFIGS, KEY_ORDER_DEFAULT_CONFIG, KEY_ORDER_TUNED_CONFIGS, QUAD_HEAD_DIM,
                     QUAD_TUNED_CONFIGS, SKIP_KEY_ORDER_TUNED_CONFIGS, SKIP_TUNED_CONFIGS,
                     SPARSE_KEY_ORDER_TUNED_CONFIGS, SPARSE_SKIP_TUNED_CONFIGS, SPARSE_TUNED_CONFIGS,
                     TRIO_DEFAULT_CONFIG, TUNED_CONFIGS, GluonConfig, forced_config, quad_serves)
from .descriptors import _permuted_k_view, tma_aligned
from .kernel import _sage_fwd_ws
from .plan import KERNEL, launch_maxnreg, plan_launch, q_blocks, sm_count


#: This process's latest launch (its config and tail split), for reports and benchmarks.
LAST = common.LastLaunch()


def last_config() -> Optional[GluonConfig]:
    """The config of this process's latest launch (forced, tuned or default), for reports; ``None`` before any."""
    return LAST.config


def last_tail_plan() -> Optional[tail_split.TailPlan]:
    """The tail split of this process's latest launch (:func:`tail_plan`), for reports; ``None``: none."""
    return LAST.tail


def tuning_key(q: torch.Tensor, k: torch.Tensor, q_block: int, k_block: int, return_lse: bool,
                key_bias: bool = False, skip: bool = False, sparse: bool = False) -> tuple:
    """``(head_dim, Q dtype, q_block, k_block, lse, Sq bucket, Skv bucket, B·Hq bucket[, "bias"][, "skip"]
    [, "sparse"])``: lengths in powers of 4 from 256 (as triton_sage's autotune key), ``B·Hq`` rounded up to a power
    of 2; key-bias calls (masks), Skip-Softmax calls, block-sparse calls and calls whose Q the kernel quantizes are
    tuned apart."""
    bsz, hq, sq, d = q.shape
    key = (d, str(q.dtype).removeprefix("torch."), q_block, k_block, bool(return_lse), common.seq_bucket(sq),
           common.seq_bucket(k.shape[2]), next_power_of_2(bsz * hq))
    key += ("q_in_kernel",) if q_quantized_in_kernel(q.dtype, k.dtype) else ()
    return key + (("bias",) if key_bias else ()) + (("skip",) if skip else ()) + (("sparse",) if sparse else ())


def _tuner(name: str, configs, default) -> ConfigTuner:
    """The autotuner ``name`` over ``configs`` (untuned: ``default``); configs of one numerics class only."""
    return ConfigTuner(name, [str(c) for c in configs], default=lambda key: str(default),
                       numerics=lambda text: GluonConfig.parse(text).numerics)


#: The autotuner of launches that view K through ``permk``: one timing of :data:`TUNED_CONFIGS` per
#: :func:`tuning_key`, cached in memory and on disk (:mod:`.._config_tuner`); untuned (graph capture before any
#: tuning, autotuning off) it uses :data:`TRIO_DEFAULT_CONFIG`.
TUNER = _tuner("gluon_sage", TUNED_CONFIGS, TRIO_DEFAULT_CONFIG)
#: The autotuner of those launches at head_dim 64 without a key bias or Skip-Softmax: :data:`QUAD_TUNED_CONFIGS`,
#: untuned :data:`DEFAULT_CONFIGS` [64].
QUAD_TUNER = _tuner("gluon_sage_quad", QUAD_TUNED_CONFIGS, DEFAULT_CONFIGS[QUAD_HEAD_DIM])
#: The autotuner of launches that load K in key order (a K the view cannot take):
#: :data:`KEY_ORDER_TUNED_CONFIGS`, untuned :data:`KEY_ORDER_DEFAULT_CONFIG`.
KEY_ORDER_TUNER = _tuner("gluon_sage_key_order", KEY_ORDER_TUNED_CONFIGS, KEY_ORDER_DEFAULT_CONFIG)


#: The autotuners of Skip-Softmax launches (serial schedules, no tail split): :data:`SKIP_TUNED_CONFIGS` where K is
#: viewed through ``permk`` (untuned: :data:`TRIO_DEFAULT_CONFIG`), else :data:`SKIP_KEY_ORDER_TUNED_CONFIGS`.
SKIP_TUNER = _tuner("gluon_sage_skip", SKIP_TUNED_CONFIGS, TRIO_DEFAULT_CONFIG)
SKIP_KEY_ORDER_TUNER = _tuner("gluon_sage_skip_key_order", SKIP_KEY_ORDER_TUNED_CONFIGS,
                              SKIP_KEY_ORDER_TUNED_CONFIGS[0])
#: The autotuners of block-sparse launches that view K through ``permk`` (two consumers:
#: :data:`SPARSE_TUNED_CONFIGS`; with Skip-Softmax :data:`SPARSE_SKIP_TUNED_CONFIGS`); block-sparse key-order launches
#: use :data:`SPARSE_KEY_ORDER_TUNER` (the key-order configs without ``persist``) / :data:`SKIP_KEY_ORDER_TUNER`.
SPARSE_TUNER = _tuner("gluon_sage_sparse", SPARSE_TUNED_CONFIGS, SPARSE_TUNED_CONFIGS[0])
SPARSE_SKIP_TUNER = _tuner("gluon_sage_sparse_skip", SPARSE_SKIP_TUNED_CONFIGS, SPARSE_SKIP_TUNED_CONFIGS[0])
SPARSE_KEY_ORDER_TUNER = _tuner("gluon_sage_sparse_key_order", SPARSE_KEY_ORDER_TUNED_CONFIGS,
                                KEY_ORDER_DEFAULT_CONFIG)
#: Every autotuner of this kernel, one per launch class (:func:`tuner_for` picks among them).
TUNERS = (TUNER, QUAD_TUNER, KEY_ORDER_TUNER, SKIP_TUNER, SKIP_KEY_ORDER_TUNER, SPARSE_TUNER, SPARSE_SKIP_TUNER,
          SPARSE_KEY_ORDER_TUNER)


def tuner_for(k: torch.Tensor, k_scale: Optional[torch.Tensor], k_block: int,
              key_bias: Optional[torch.Tensor] = None, skip: bool = False, sparse: bool = False) -> ConfigTuner:
    """The autotuner of this launch's class, decided by the inputs alone: :data:`TUNER` where K can be viewed
    through ``permk`` at the class's key tile (:func:`permuted_k`; :data:`QUAD_TUNER` at head_dim 64 without a key
    bias), else :data:`KEY_ORDER_TUNER`; Skip-Softmax launches (``skip``), whose serial schedules it needs:
    :data:`SKIP_TUNER` where K can be viewed and there is no key bias (``trio`` spills over 1.4 KB with both), else
    :data:`SKIP_KEY_ORDER_TUNER`. Block-sparse launches (``sparse``) take two-consumer configs: where the others
    would get :data:`TUNER`, :data:`QUAD_TUNER` or :data:`SKIP_TUNER`, they get :data:`SPARSE_TUNER` or
    :data:`SPARSE_SKIP_TUNER`; where they would get :data:`KEY_ORDER_TUNER`, :data:`SPARSE_KEY_ORDER_TUNER` (no
    ``persist``). Each tuner's candidates share their numerics (:attr:`GluonConfig.numerics`)."""
    view = _permuted_k_view(k.shape, k.stride(), k.element_size(), k_block if k_scale is not None else 0,
                            TUNED_CONFIGS[0].block_n)
    if view is not None and not (skip and key_bias is not None):
        if sparse:
            return SPARSE_SKIP_TUNER if skip else SPARSE_TUNER
        if skip:
            return SKIP_TUNER
        return QUAD_TUNER if quad_serves(k.shape[-1], key_bias is not None) else TUNER
    if skip:
        return SKIP_KEY_ORDER_TUNER
    return SPARSE_KEY_ORDER_TUNER if sparse else KEY_ORDER_TUNER


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


def tail_plan(q: torch.Tensor, k: torch.Tensor, k_block: int, config: GluonConfig,
              sparse: bool = False) -> Optional[tail_split.TailPlan]:
    """The split of this call's last partial wave (:func:`.tail_split.plan`; ``None``: none, or turned off by
    ``qattn_fx.config.gluon_tail_split``, ``$QATTN_GLUON_TAIL_SPLIT=0``). Slots: the device's SMs. ``k_block``: 0
    when K has no per-block scales. ``sparse`` (block lists): pieces start on multiples of the lists' 128-key tiles
    too, so each piece visits whole listed tiles of its key range (:mod:`.sparse`)."""
    if not qattn_config.flag("gluon_tail_split"):
        return None
    bsz, hq, sq, _ = q.shape
    slots = sm_count(q.device.index)
    if sparse:
        k_block = math.lcm(k_block, block_sparse.BLOCK_KEYS) if k_block else block_sparse.BLOCK_KEYS
    return tail_split.plan(bsz * hq * q_blocks(sq, config), slots, k.shape[2],
                            config.block_n, k_block)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when TMA can address it (:func:`tma_aligned` on its batch, head and token strides), else a
    contiguous copy (a bf16 Q/K straight from the model at an odd offset; the quantize nodes' outputs always are)."""
    return x if tma_aligned(x, (0, 1, 2)) else x.clone(memory_format=torch.contiguous_format)


def attention(q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int, sm_scale: float,
              out_dtype: torch.dtype, *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None,
              skip_threshold: Optional[torch.Tensor] = None, skip_count: Optional[torch.Tensor] = None,
              block_index: Optional[torch.Tensor] = None, block_count: Optional[torch.Tensor] = None):
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

    ``block_index`` / ``block_count``: the key tiles each 128-row query tile visits (:mod:`qattn_fx.block_sparse`,
    checked by :func:`~qattn_fx.kernels._sage_common.validate`, on ``q``'s device); such launches run two-consumer configs
    (:func:`tuner_for`; a forced ``trio`` or ``quad`` config raises ``ValueError``), their tail split cut at
    multiples of 128 keys (:func:`tail_plan`).
    """
    common.validate(KERNEL, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias, block_index, block_count)
    blocks = None if block_index is None else (block_index, block_count)
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
            tail = None if skip else tail_plan(part[0], part[2], k_block if k_scale is not None else 0, config,
                                               blocks is not None)
            ws = tail_split.workspace(tail, config.rows, dv, q.device) if tail else None
            lists = None
            if blocks is not None:
                lists = tuple(common.batch_chunk(t, lo, hi) for t in blocks)
                lists += (visit_bounds(*lists, tail, part[7]),)
            plan = plan_launch(*part[:6], q_block, k_block, sm_scale, o, ls, return_lse, config, tail, ws, part[6],
                               skip, part[7], lists)
            compiled(_sage_fwd_ws)[plan.grid](*plan.args, **plan.meta, num_warps=4,
                                              maxnreg=launch_maxnreg(plan.meta))
            if tail:
                tail_split.merge(tail, *ws, o, ls if return_lse else None, plan.q_blocks)
        LAST.tail = tail

    with torch.cuda.device(q.device):
        config = forced_config()
        if config is None:
            tuner = tuner_for(k, k_scale, k_block, key_bias, skip is not None, blocks is not None)
            timing_skip = None if skip is None else (skip[0], None)  # the tuner's launches count nothing
            name = tuner.choose(tuning_key(q, k, q_block, k_block, return_lse, key_bias is not None, skip is not None,
                                           blocks is not None),
                                lambda text: launch(common.parse_config(GluonConfig, text), timing_skip))
            config = common.parse_config(GluonConfig, name)
        launch(config)
    LAST.config = config
    return (out, lse) if return_lse else out


def visit_bounds(block_index: torch.Tensor, block_count: torch.Tensor, tail: Optional[tail_split.TailPlan],
                 key_range: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The list positions a block-sparse launch reads instead of searching its lists: int32 ``(B, Hq, NQ, NB)``,
    per query tile the number of its listed key tiles below each bound: with a ``tail`` split, the ``splits + 1``
    piece boundaries (piece ``s`` visits list positions ``[bounds[s], bounds[s + 1])``), then with a key bias
    (``key_range``, :func:`~.._sage_common.bias_range`, ``(B|1, 2)``) the first 128-key tile its span meets and one
    past the last (the visits that add the bias). ``None`` with neither. A few small device ops, no
    synchronization."""
    if tail is None and key_range is None:
        return None
    nk = block_index.shape[-1]
    keys = block_sparse.BLOCK_KEYS
    listed = torch.arange(nk, device=block_index.device, dtype=torch.int32) < block_count[..., None]
    entries = torch.where(listed, block_index, nk)  # ascending, the unlisted past every bound
    bounds = []
    if tail is not None:
        cuts = torch.arange(tail.splits + 1, device=block_index.device, dtype=torch.int32) * (tail.kv_split // keys)
        bounds.append(cuts.clamp(max=nk).expand(*entries.shape[:-1], -1))
    if key_range is not None:
        span = torch.stack([key_range[:, 0] // keys, (key_range[:, 1] + keys - 1) // keys], -1).to(torch.int32)
        bounds.append(span[:, None, None, :].expand(*entries.shape[:-1], 2))
    return torch.searchsorted(entries, torch.cat(bounds, -1).contiguous(), out_int32=True)


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
                     return_lse=False, skip_threshold=None, skip_label="", block_index=None, block_count=None):
    """Kernel entry for ``qattn::scaled_attention``; ``return_lse``: also the LSE (``qattn::scaled_attention_lse``).
    With ``skip_threshold`` inside :func:`qattn_fx.skip_softmax.measure`, the skipped tiles are counted and recorded
    under ``skip_label`` (a synchronization per call). ``block_index`` / ``block_count``: block sparsity
    (:func:`attention`)."""
    count = None
    if skip_threshold is not None and skip_softmax.active() is not None:
        count = torch.zeros(1, dtype=torch.int32, device=q.device)
    out = attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, key_bias=key_bias,
                    return_lse=return_lse, skip_threshold=skip_threshold, skip_count=count, block_index=block_index,
                    block_count=block_count)
    if count is not None:
        rows, keys = skip_softmax.tiles(q.shape[2], k.shape[2])
        skip_softmax.record(skip_label, int(count.item()), q.shape[0] * q.shape[1] * rows * keys)
    return out


def compile_for(config: GluonConfig, q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int,
                sm_scale: float = 0.125, out_dtype: torch.dtype = torch.bfloat16, *, return_lse: bool = False,
                tail: Optional[tail_split.TailPlan] = None, key_bias: Optional[torch.Tensor] = None,
                skip: int = 0, sparse: bool = False):
    """Compile (not run) the kernel for sm_90 with these inputs' dtypes, shapes and strides (``meta`` tensors are
    fine: data pointers are taken as 16-byte aligned), with the tail split ``tail`` if given, with Skip-Softmax's
    test if ``skip`` (2: counting skipped tiles), with block lists if ``sparse``. Returns Triton's
    compiled kernel (``.asm["ptx"|"cubin"]``); needs only Triton's bundled ptxas, no GPU."""
    from .._offline import compile_offline

    common.validate(KERNEL, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    bsz, hq, sq, _ = q.shape
    out = empty_bshd(bsz, hq, sq, v.shape[-1], out_dtype, q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    ws = tail_split.workspace(tail, config.rows, v.shape[-1], q.device) if tail else None
    count = torch.empty(1, dtype=torch.int32, device=q.device) if skip == 2 else None
    skip_args = (torch.empty(1, device=q.device), count) if skip else None
    blocks = None
    if sparse:
        nq, nk = block_sparse.tiles(sq, k.shape[2])
        bounds = (tail.splits + 1 if tail else 0) + (2 if key_bias is not None else 0)
        blocks = (torch.empty(bsz, hq, nq, nk, dtype=torch.int32, device=q.device),
                  torch.empty(bsz, hq, nq, dtype=torch.int32, device=q.device),
                  torch.empty(bsz, hq, nq, bounds, dtype=torch.int32, device=q.device) if bounds else None)
    plan = plan_launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out, lse, return_lse, config,
                       tail, ws, key_bias, skip_args, None if key_bias is None else common.bias_range(key_bias),
                       blocks)
    return compile_offline(_sage_fwd_ws, plan.args, plan.meta, CAPABILITY,
                           {"num_warps": 4, "maxnreg": launch_maxnreg(plan.meta)}, gluon=True)
