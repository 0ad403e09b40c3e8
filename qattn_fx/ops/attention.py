"""Attention custom ops over quantized tensors. Opaque to the compiler; the ``kernel`` argument picks the kernel.

``qattn::scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, kernel,
key_bias=None, runtime_scale=None, skip_threshold=None, skip_label="", block_index=None, block_count=None)``

* ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)``, any strides with a unit stride on D: int8 or float8_e4m3fn with fp32
  scales of shape ``(B|1, H|1, NB)``: per block of ``q_block`` / ``k_block`` tokens (``NB >= ceil(S/block)``;
  entries past ``ceil(S/block)``, the quantize node's row padding, are never read), or with block 0 a single
  scale per head ``(1, H, 1)`` or per tensor ``(1, 1, 1)``. bf16/fp16 Q/K pass ``None`` scales. A bf16/fp16
  ``q`` with ``q_scale=None`` beside an int8 ``k`` with scales is quantized by the kernel itself, as
  ``qattn::quantize_per_block(q, q_block, int8)`` would (kernels whose ``KernelInfo.quantizes_q`` lists
  ``q_block``).
* ``v (B, Hkv, Sv, Dv)``: float8_e4m3fn, any strides with a unit stride on D or S, ``Sv >= Skv`` (rows past
  ``Skv``, the padding of sequence-major V to 16 tokens, are never read); ``v_scale`` fp32 ``(B|1, Hkv|1, Dv|1)``
  (per channel, per head, per tensor).
* ``key_bias``: optional fp32 ``(B|1, Skv)`` with a unit stride on keys, added to every query's logits
  ``q·kᵀ·sm_scale`` before the softmax (``-inf`` masks a key out; a key-padding mask becomes 0 / ``-inf``). A row
  whose keys are all ``-inf`` gives 0, as ``F.scaled_dot_product_attention`` does. Only kernels whose
  :class:`~qattn_fx.kernels.KernelInfo` says ``key_bias`` take it. The lowering zeroes masked keys' rows of K and V
  before they are smoothed and quantized (``qattn::mask_keys``, ``qattn::smooth_k(k, key_bias)``), so the scales
  and data of kept keys never depend on what masked keys held; a kernel still gives masked keys no weight whatever
  their (finite) data.
* ``runtime_scale``: optional 0-d float tensor on the CPU holding SDPA's ``scale`` when it is a value of the
  compiled graph (a Python float that changes between calls) rather than a constant; it replaces ``sm_scale``.
* ``skip_threshold``: optional one-element float tensor, Skip-Softmax's λ (:mod:`qattn_fx.skip_softmax`: tiles of
  64 query rows x 128 keys whose every row has ``exp(tile max - running max) < λ`` are skipped; 0 skips nothing).
  A tensor, so a step schedule can change it without recompiling; ``skip_label`` names the site in measured
  sparsity (:func:`qattn_fx.skip_softmax.measure`). Only kernels whose :class:`~qattn_fx.kernels.KernelInfo` says
  ``skip_softmax`` take it.
* ``block_index`` / ``block_count``: optional int32 ``(B, Hq, ceil(Sq/128), ceil(Skv/128))`` /
  ``(B, Hq, ceil(Sq/128))``, the key tiles each 128-row query tile visits (:mod:`qattn_fx.block_sparse`; what
  ``qattn::predict_blocks`` returns); the other blocks are skipped as if masked. Only kernels whose
  :class:`~qattn_fx.kernels.KernelInfo` says ``block_sparse`` take them.
* Returns ``(B, Hq, Sq, Dv)`` in ``out_dtype``, stored BSHD (stride ``(Sq·Hq·Dv, Dv, Hq·Dv, 1)``).

``qattn::scaled_attention_lse(...)``, the same arguments, returns ``(out, lse)``: ``out`` as above and ``lse`` the
natural-log log-sum-exp of each query row's logits ``q·kᵀ·sm_scale (+ key_bias)``, fp32 ``(B, Hq, Sq)``
contiguous (``-inf`` for a row whose keys are all masked). Ring attention merges partial results by it. Only
kernels whose :class:`~qattn_fx.kernels.KernelInfo` says ``lse`` implement it. With smoothed K the logits are
those of the smoothed K (shifted by ``q·mean(k)·sm_scale`` per row); the lowering adds the shift back
(``qattn::lse_shift``).

``qattn::block_scaled_attention(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale,
out_dtype, kernel, key_bias=None, runtime_scale=None)``

* ``qk_format`` ``mxfp8``: e4m3 ``(B, H, S, D)`` data with E8M0 scales ``(B, H, S, ceil(D/32))``, as uint8 bytes
  (what ``qattn::quantize_mxfp8`` gives) or ``float8_e8m0fnu``;
  ``nvfp4``: packed e2m1 ``(B, H, S, D/2)`` uint8, E4M3 scales ``(B, H, S, D/16)``, fp32 tensor scale ``()``.
* ``v_format`` ``fp8``: as above; ``mxfp8``: e4m3 ``(B, H, Skv, Dv)`` with E8M0 ``(B, H, NB, Dv)``;
  ``nvfp4``: stored transposed, packed ``(B, H, Dv, Skv16/2)``, scales ``(B, H, Dv, NB)``, tensor scale. ``NB``:
  the token blocks, at least ``ceil(Skv/32)`` (mxfp8) or ``Skv16/16`` (nvfp4); entries past them, the quantize
  node's padding to a multiple of 4 blocks, are never read.
* ``key_bias``, ``runtime_scale``, ``skip_threshold`` and ``skip_label`` as above.

``qattn::skip_softmax_attention(q, k, v, sm_scale, out_dtype, kernel, key_bias=None, runtime_scale=None,
skip_threshold=None, skip_label="")``: dense attention of bf16/fp16/fp32 ``q``, ``k``, ``v`` (``(B, H, S, D)``, any
strides) with Skip-Softmax (a spec's ``recipe: null`` with ``skip_softmax``); the reference kernel only.

Inputs are never mutated. Bad shapes or dtypes raise ``ValueError`` naming the argument (the checks:
:mod:`qattn_fx.kernels.op_inputs`, run here once per input layout).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import block_sparse, kernels
from ..kernels.op_inputs import (check_block_scaled_inputs, check_dense_inputs, check_key_bias, check_scaled_inputs,
                                 fail, v_dims)


def _scale_value(sm_scale: float, runtime_scale: Optional[torch.Tensor]) -> float:
    if runtime_scale is None:
        return sm_scale
    if runtime_scale.numel() != 1 or not runtime_scale.dtype.is_floating_point:
        fail(f"runtime_scale must be a 1-element float tensor; got {runtime_scale.dtype} of shape "
              f"{tuple(runtime_scale.shape)}")
    return float(runtime_scale)


def _kernel_call(kernel: str, family: str, key_bias: Optional[torch.Tensor],
                 skip_threshold: Optional[torch.Tensor] = None, skip_label: str = "",
                 blocks: Optional[block_sparse.Blocks] = None):
    """The kernel function; ``key_bias``, ``skip_threshold`` and the block lists are passed (as keywords) only to
    kernels that declare they take them."""
    fn = kernels.load(kernel, family)
    extra = {}
    if key_bias is not None:
        if not kernels.info(kernel).key_bias:
            fail(f"kernel {kernel!r} takes no key_bias (masks); kernels that do: "
                  f"{kernels.names_with('key_bias')}")
        extra["key_bias"] = key_bias
    if skip_threshold is not None:
        if not kernels.info(kernel).skip_softmax:
            fail(f"kernel {kernel!r} takes no skip_threshold (Skip-Softmax); kernels that do: "
                  f"{kernels.names_with('skip_softmax')}")
        if skip_threshold.numel() != 1 or not skip_threshold.dtype.is_floating_point:
            fail(f"skip_threshold must be a one-element float tensor; got {skip_threshold.dtype} of shape "
                  f"{tuple(skip_threshold.shape)}")
        extra.update(skip_threshold=skip_threshold, skip_label=skip_label)
    if blocks is not None:
        if not kernels.info(kernel).block_sparse:
            fail(f"kernel {kernel!r} takes no block_index (block sparsity); kernels that do: "
                 f"{kernels.names_with('block_sparse')}")
        extra.update(block_index=blocks.index, block_count=blocks.count)
    return functools.partial(fn, **extra) if extra else fn


def _fake_out(q: torch.Tensor, sq: int, dv: int, out_dtype: torch.dtype) -> torch.Tensor:
    return q.new_empty((q.shape[0], sq, q.shape[1], dv), dtype=out_dtype).transpose(1, 2)


#: The arguments every attention op ends with (the module docstring), after its operands, and Skip-Softmax's.
_CALL_ARGS = "float sm_scale, ScalarType out_dtype, str kernel, Tensor? key_bias=None, Tensor? runtime_scale=None"
_SKIP_ARGS = 'Tensor? skip_threshold=None, str skip_label=""'
_BLOCK_ARGS = "Tensor? block_index=None, Tensor? block_count=None"
_SCALED_OPERANDS = ("Tensor q, Tensor? q_scale, Tensor k, Tensor? k_scale, Tensor v, Tensor v_scale, SymInt q_block, "
                    "SymInt k_block")
_BLOCK_SCALED_OPERANDS = ("Tensor q, Tensor q_sf, Tensor? q_gs, Tensor k, Tensor k_sf, Tensor? k_gs, Tensor v, "
                          "Tensor v_sf, Tensor? v_gs, str qk_format, str v_format")


def _define(name: str, schema: str, fn, fake) -> torch.library.CustomOpDef:
    """The opaque op ``qattn::<name>`` with an explicit ``schema`` (arguments ``-> returns``), ``fn`` and its fake."""
    op = torch.library.custom_op(f"qattn::{name}", fn, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


def _scaled(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, kernel, key_bias=None,
            runtime_scale=None, skip_threshold=None, skip_label="", block_index=None, block_count=None, *,
            return_lse=False):
    """Both scaled ops: the output, or with ``return_lse`` ``(output, lse)``."""
    check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel, key_bias)
    if return_lse and not kernels.info(kernel).lse:
        fail(f"kernel {kernel!r} returns no LSE; kernels that do: "
             f"{kernels.names_with('lse')}")
    block_sparse.check(block_index, block_count, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    blocks = None if block_index is None else block_sparse.Blocks(block_index, block_count)
    fn = _kernel_call(kernel, "scaled", key_bias, skip_threshold, skip_label, blocks)
    args = (q, q_scale, k, k_scale, v, v_scale, q_block, k_block, _scale_value(sm_scale, runtime_scale), out_dtype)
    if not return_lse:
        return fn(*args)
    out, lse = fn(*args, return_lse=True)
    return out, lse


def _scaled_fake(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, kernel, key_bias=None,
                 runtime_scale=None, skip_threshold=None, skip_label="", block_index=None, block_count=None, *,
                 return_lse=False):
    out = _fake_out(q, q.shape[2], v.shape[3], out_dtype)
    if not return_lse:
        return out
    return out, q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)


def _block_scaled(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale, out_dtype, kernel,
                  key_bias=None, runtime_scale=None, skip_threshold=None, skip_label=""):
    check_block_scaled_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype)
    check_key_bias(key_bias, k)
    fn = _kernel_call(kernel, "block_scaled", key_bias, skip_threshold, skip_label)
    return fn(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, _scale_value(sm_scale, runtime_scale),
              out_dtype)


def _block_scaled_fake(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale, out_dtype, kernel,
                       key_bias=None, runtime_scale=None, skip_threshold=None, skip_label=""):
    return _fake_out(q, q.shape[2], v_dims(v, v_format)[1], out_dtype)


def _skip_softmax(q, k, v, sm_scale, out_dtype, kernel, key_bias=None, runtime_scale=None, skip_threshold=None,
                  skip_label=""):
    check_dense_inputs(q, k, v, out_dtype, key_bias)
    fn = _kernel_call(kernel, "dense_skip", key_bias, skip_threshold, skip_label)
    return fn(q, k, v, _scale_value(sm_scale, runtime_scale), out_dtype)


def _skip_softmax_fake(q, k, v, sm_scale, out_dtype, kernel, key_bias=None, runtime_scale=None, skip_threshold=None,
                       skip_label=""):
    return _fake_out(q, q.shape[2], v.shape[3], out_dtype)


scaled_attention = _define("scaled_attention",
                           f"({_SCALED_OPERANDS}, {_CALL_ARGS}, {_SKIP_ARGS}, {_BLOCK_ARGS}) -> Tensor",
                           _scaled, _scaled_fake)
scaled_attention_lse = _define("scaled_attention_lse", f"({_SCALED_OPERANDS}, {_CALL_ARGS}) -> (Tensor, Tensor)",
                               functools.partial(_scaled, return_lse=True),
                               functools.partial(_scaled_fake, return_lse=True))
block_scaled_attention = _define("block_scaled_attention",
                                 f"({_BLOCK_SCALED_OPERANDS}, {_CALL_ARGS}, {_SKIP_ARGS}) -> Tensor",
                                 _block_scaled, _block_scaled_fake)
skip_softmax_attention = _define("skip_softmax_attention",
                                 f"(Tensor q, Tensor k, Tensor v, {_CALL_ARGS}, {_SKIP_ARGS}) -> Tensor",
                                 _skip_softmax, _skip_softmax_fake)


ATTENTION_OPS = (torch.ops.qattn.scaled_attention.default, torch.ops.qattn.block_scaled_attention.default,
                 torch.ops.qattn.scaled_attention_lse.default, torch.ops.qattn.skip_softmax_attention.default)
