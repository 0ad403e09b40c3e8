"""Quantize ops: each one FX node, defined in plain aten (CompositeImplicitAutograd) so Inductor fuses it (all but
``quantize_kv``, the fused K/V quantize of a CUDA Sage site, whose CUDA implementation is a Triton kernel).

All ops live in the ``qattn`` torch.library namespace, take logical ``(B, H, S, D)`` tensors of any strides and
never mutate their inputs. The numerics are those of :mod:`qattn_fx.formats`.

=====================================================  ==========================================================
op                                                     returns
=====================================================  ==========================================================
``smooth_k(k, key_bias=None)``                         ``k - mean_S(k)`` in fp32 (exact under softmax; fp32
                                                       so fp16 K with large channels cannot overflow); with
                                                       ``key_bias``, the mean of the kept keys and masked keys'
                                                       rows 0
``mask_keys(x, key_bias)``                             K or V with masked keys' rows (bias ``-inf``) set to 0
``quantize_per_block(x, block, dtype)``                data like x (int8/e4m3), scale ``(B, H, NB4)``: the
                                                       ``ceil(S/block)`` block scales, zero-padded to a multiple
                                                       of 4 (16 bytes) per head
``quantize_per_head(x, dtype, seq_major)``             data, scale ``(1, H, 1)``
``quantize_per_tensor(x, dtype, seq_major)``           data, scale ``(1, 1, 1)``
``quantize_per_channel(x, dtype, seq_major)``          data, scale ``(B, H, D)`` (V: amax over tokens)
``quantize_mxfp8(x, axis)``                            e4m3 data like x, E8M0 scales (32 along ``axis``) as
                                                       their bytes in uint8 (:mod:`qattn_fx.formats`); V's
                                                       (``axis=-2``) ``(B, H, NB4, D)``: the ``ceil(S/32)``
                                                       token blocks zero-padded to a multiple of 4
``key_bias(mask, k)``                                  a per-key mask as an fp32 logit bias ``(B|1, Skv)``
                                                       (boolean: 0 / ``-inf``)
``as_scalar_tensor(value)``                            a graph's float value as a 0-d float64 CPU tensor
``lse_shift(q, k, sm_scale, runtime_scale,             ``sm_scale · q·mean_S(k)`` fp32 ``(B, Hq, Sq)``: what
key_bias)``                                            smoothing K takes off each row's log-sum-exp
``skip_threshold(k, threshold, per_key, timestep,      Skip-Softmax's λ as an fp32 ``(1,)`` tensor on k's device:
until, timestep_scale)``                               ``threshold + per_key / Skv``, times ``t <= until`` for
                                                       ``t = max(timestep) / timestep_scale`` when a timestep is
                                                       given (:mod:`qattn_fx.skip_softmax`)
``quantize_nvfp4(x, transpose)``                       packed e2m1 ``(..., N/2)`` uint8, E4M3 scales ``(..., N/16)``,
                                                       fp32 tensor scale ``()``; ``transpose`` quantizes
                                                       ``x.transpose(-1, -2)`` (V along the sequence), its
                                                       scales' block count zero-padded to a multiple of 4
``kv_stats(k, v, key_bias=None)``                      fp32 K mean over kept keys ``(B, H, 1, Dk)`` (``smooth_k``'s)
                                                       and V's per-channel e4m3 scale ``(B, H, Dv)`` of the masked
                                                       V (``quantize_per_channel``'s)
``quantize_kv(k, v, k_mean, v_scale, key_bias,         ``(k_data, k_scale, v_data)``: ``smooth_k`` with
k_block, k_dtype, seq_major)``                         ``k_mean`` → ``quantize_per_block``; ``mask_keys`` →
                                                       ``quantize_per_channel`` with ``v_scale`` (an opaque op:
                                                       one Triton launch on CUDA,
                                                       :mod:`qattn_fx.kernels.quantize_kv`; that composition
                                                       elsewhere)
=====================================================  ==========================================================

Masked keys (``key_bias`` ``-inf``: a boolean key-padding mask's ``False``) leave no trace in any scale: the
lowering zeroes their rows of V and K (``mask_keys``; ``smooth_k(k, key_bias)`` takes the mean over the kept keys
and zeroes the masked rows), so per-block, per-channel, per-head and per-tensor scales, MXFP8 scales along tokens and
NVFP4 tensor scales see only kept keys, and the output on kept keys does not depend on what masked keys hold. A
finite bias (an additive float mask such as ``-1e4``) masks nothing: its keys are kept.

Non-finite inputs (``inf``/``nan`` in Q, or in K or V of a kept key) spread through the scales that cover them,
pinned by ``tests/ops/test_attention_ops.py::test_non_finite_inputs_spread_through_the_scales_that_cover_them``. SDPA's
math kernel (and its default CPU kernel in fp32) makes non-finite exactly the rows whose logits or values are: an
``inf`` in Q row ``i`` gives a NaN row ``i`` (torch's default CPU kernel in bf16/fp16 gives that row 0); an ``inf`` in
a key's K gives NaN in the rows whose logit with it is ``+inf`` or NaN; an ``inf`` in V channel ``c`` gives ``inf`` in
column ``c`` of every row. Here a scale of ``inf`` turns its whole block into NaN (``x · (1/inf)`` is NaN for the
``inf`` itself, and the dequantized ``0 · inf`` for the rest): with per-token Q scales (``q_block`` 1, the default
recipe) only row ``i`` is NaN, as in SDPA's math; a Q block of ``n`` tokens makes its ``n`` rows NaN; K smoothing
makes the whole head NaN (its mean is ``inf``), and so do per-block K scales; V per-channel scales make column ``c``
NaN (SDPA: ``inf``); per-head and per-tensor scales make every row of the head or the call NaN. MXFP8 saturates an
``inf`` at the largest exponent (the output stays finite). Masked keys are zeroed before anything reads them, so
even a non-finite value there leaves no trace (SDPA's math kernel gives NaN rows for it: ``inf + -inf``).

The scaled int8/fp8 ops keep the memory order of the input (elementwise ops preserve a permuted BSHD view), so
kernels read diffusers' ``(B, S, H, D)`` buffers through strides without transposing copies; ``seq_major=True``
stores the data with the sequence axis fastest (physically ``(B, H, D, S16)``, each channel's row zero-padded to a
multiple of 16 tokens), the layout an FP8 P·V on Hopper wants for V, viewed as ``(B, H, S16, D)``. Padding is part
of the logical shape and is never sliced away: a view of the first ``S`` of ``S16`` rows is contiguous only when
``S`` is a multiple of 16, and tracing such a view under symbolic lengths specializes the compiled graph on that.
Consumers take the real lengths from Q and K. The MXFP8 and
NVFP4 ops return contiguous data and scales (their kernels re-pack scales into hardware layouts anyway).

Scales per block of tokens (``quantize_per_block``, MXFP8 and NVFP4 V) have their block count zero-padded to a
multiple of 4, which is never 1: under symbolic lengths a tensor with a ``ceil(S/block)`` dim makes the compiler
guard on that dim being 1, and the graph would recompile for the lengths on the other side of ``S = block``
(:mod:`qattn_fx.formats`). The padded scales are never read.
"""

from __future__ import annotations

import torch

from .. import formats
from ..kernels import quantize_kv as _fused_kv

lib = torch.library.Library("qattn", "DEF")


#: The ops :func:`_define` registered, in order (:data:`QUANTIZE_OPS`).
_DEFINED: list = []


def _define(schema: str, fn) -> None:
    name = schema.split("(")[0]
    lib.define(schema)
    lib.impl(name, fn, "CompositeImplicitAutograd")
    _DEFINED.append(getattr(torch.ops.qattn, name).default)


def _check_4d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} expects a (B, H, S, D) tensor; got shape {tuple(x.shape)}")


def _check_8bit(dtype: torch.dtype) -> None:
    formats.qmax(dtype)  # raises with the valid choices


def _rows_padded(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` contiguous with its last dim zero-padded to a multiple of ``multiple`` (the padding is part of the
    logical shape: a slice back to the original width would be a view whose contiguity depends on the length,
    which makes the compiler specialize symbolic lengths)."""
    return formats.pad_to_multiple(x, -1, multiple).contiguous()


def _layout(data: torch.Tensor, seq_major: bool) -> torch.Tensor:
    """Data keeps the input's memory order (a BSHD view stays BSHD) unless ``seq_major`` asks for S fastest.

    Sequence-major data is stored ``(B, H, D, S16)``, each channel's row zero-padded to a multiple of 16 tokens
    (16 bytes of fp8, what vectorized/asynchronous copies and TMA need), and viewed as ``(B, H, S16, D)``: the
    padding tokens are part of the logical shape (kernels read only the first ``Skv`` = K's length).
    """
    if not seq_major:
        return data
    return _rows_padded(data.transpose(-1, -2), 16).transpose(-1, -2)


def _valid_keys(key_bias: torch.Tensor) -> torch.Tensor:
    """The keys a key bias ``(B|1, Skv)`` keeps (bias not ``-inf``), as a boolean ``(B|1, 1, Skv, 1)``."""
    return (key_bias != float("-inf")).unsqueeze(1).unsqueeze(-1)


def _key_mean(k: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``(B, H, 1, D)`` mean of ``k`` over its tokens; with ``key_bias``, over the keys it keeps (0 where it
    keeps none), whatever the masked keys hold. Written without an fp32 copy of ``k`` (see :func:`smooth_k`)."""
    if key_bias is None:
        return k.mean(dim=-2, keepdim=True, dtype=torch.float32)
    valid = _valid_keys(key_bias)
    total = torch.where(valid, k, 0).sum(dim=-2, keepdim=True, dtype=torch.float32)
    return total / valid.sum(dim=-2, keepdim=True).clamp(min=1)


def mask_keys(x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
    """``x (B, H, Skv, D)`` (K or V) with the rows of the keys ``key_bias`` masks (``-inf``) set to 0, in ``x``'s
    dtype and memory order: what masked keys hold (any values) then reaches no scale or mean."""
    _check_4d("mask_keys", x)
    return torch.where(_valid_keys(key_bias), x, 0)


def _smoothed(k: torch.Tensor, mean: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
    """``k - mean`` in fp32 (``mean``: :func:`_key_mean`'s ``(B, H, 1, D)``); with ``key_bias``, masked keys' rows
    0, whatever they held."""
    if key_bias is not None:
        return torch.where(_valid_keys(key_bias), k - mean, 0.0)
    # = k.float() - k.float().mean(...), written without an fp32 copy of k (the subtraction promotes exactly):
    # given that copy, Inductor stores it as K's buffer in fp32 (twice the bytes of K, read by the mean, the block
    # amax and the cast); this way K stays in its own dtype and the kernels upcast as they read it
    return k - mean


def smooth_k(k: torch.Tensor, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_4d("smooth_k", k)
    return _smoothed(k, _key_mean(k, key_bias), key_bias)  # with key_bias: the mean of the kept keys


def quantize_per_block(x: torch.Tensor, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check_4d("quantize_per_block", x)
    _check_8bit(dtype)
    if block < 1:
        raise ValueError(f"quantize_per_block: block={block} is invalid; valid: an int >= 1 (tokens per scale)")
    # each head's row padded to 4 fp32 (16 bytes), so every head's scales start where a TMA load can (75600 tokens
    # in groups of 16 give 4725 scales per head; the row holds 4728, the last 3 zero and never read); padded as the
    # blocks are made, so that no tensor has ceil(S/block) as a dim (the module docstring)
    scale = formats.seq_block_amax(x, block, formats.inv_qmax(dtype), blocks_multiple=4)
    data = formats.cast_scaled(x, formats.expand_seq_scale(scale, block, x.shape[-2]), dtype)
    return data, scale.contiguous()


def quantize_per_head(x: torch.Tensor, dtype: torch.dtype, seq_major: bool = False):
    _check_4d("quantize_per_head", x)
    _check_8bit(dtype)
    scale = formats.amax_to_scale(x.abs().float().amax(dim=(0, 2, 3)).reshape(1, -1, 1), dtype)
    data = formats.cast_scaled(x, scale.unsqueeze(-1), dtype)
    return _layout(data, seq_major), scale


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype, seq_major: bool = False):
    _check_4d("quantize_per_tensor", x)
    _check_8bit(dtype)
    scale = formats.amax_to_scale(x.abs().float().amax().reshape(1, 1, 1), dtype)
    data = formats.cast_scaled(x, scale.unsqueeze(-1), dtype)
    return _layout(data, seq_major), scale


def _channel_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 ``(B, H, D)`` per-channel scale of ``x (B, H, S, D)``: its amax over tokens, as a scale."""
    return formats.amax_to_scale(x.abs().float().amax(dim=-2), dtype)


def _cast_channels(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, seq_major: bool) -> torch.Tensor:
    """``x`` cast with its per-channel ``scale (B, H, D)``, in :func:`_layout`'s layout."""
    return _layout(formats.cast_scaled(x, scale.unsqueeze(-2), dtype), seq_major)


def quantize_per_channel(x: torch.Tensor, dtype: torch.dtype, seq_major: bool = False):
    _check_4d("quantize_per_channel", x)
    _check_8bit(dtype)
    scale = _channel_scale(x, dtype)
    return _cast_channels(x, scale, dtype, seq_major), scale


def kv_stats(k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None = None):
    """What a Sage site's K and V quantization needs from the whole sequence, for :func:`quantize_kv`: K's mean over
    the kept keys ``(B, H, 1, Dk)`` (:func:`smooth_k`'s) and V's per-channel e4m3 scales ``(B, H, Dv)`` of the
    masked V (:func:`quantize_per_channel` of :func:`mask_keys`'), fp32; reductions Inductor fuses."""
    _check_4d("kv_stats", k)
    _check_4d("kv_stats", v)
    v_kept = v if key_bias is None else mask_keys(v, key_bias)
    return _key_mean(k, key_bias), _channel_scale(v_kept, torch.float8_e4m3fn)


def _quantize_kv_composed(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major):
    """:func:`quantize_kv`'s definition: the unfused ops given the statistics (``smooth_k`` with ``k_mean``, then
    ``quantize_per_block``; ``mask_keys`` of V, then ``quantize_per_channel``'s cast with ``v_scale``)."""
    k_data, k_scale = quantize_per_block(_smoothed(k, k_mean, key_bias), k_block, k_dtype)
    v_kept = v if key_bias is None else mask_keys(v, key_bias)
    return k_data, k_scale, _cast_channels(v_kept, v_scale, torch.float8_e4m3fn, seq_major)


def _quantize_kv_cpu(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major):
    _fused_kv.check(k, v, k_mean, v_scale, key_bias, k_block, k_dtype)
    composed = _quantize_kv_composed(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major)
    out = _fused_kv.outputs(k, v, k_block, k_dtype, seq_major)  # the layouts the fake promises
    return tuple(c if c.stride() == o.stride() else o.copy_(c) for c, o in zip(composed, out))


def _quantize_kv_cuda(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major):
    _fused_kv.check(k, v, k_mean, v_scale, key_bias, k_block, k_dtype)
    out = _fused_kv.outputs(k, v, k_block, k_dtype, seq_major)
    _fused_kv.launch(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, *out)
    return out


def _quantize_kv_fake(k, v, k_mean, v_scale, key_bias, k_block, k_dtype, seq_major):
    _fused_kv.check(k, v, k_mean, v_scale, key_bias, k_block, k_dtype)
    return _fused_kv.outputs(k, v, k_block, k_dtype, seq_major)


def quantize_mxfp8(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_4d("quantize_mxfp8", x)
    if axis not in (-1, -2, 2, 3):
        raise ValueError(f"quantize_mxfp8: axis={axis} is invalid; valid: -1 (channels, Q/K), -2 (tokens, V)")
    return formats.quantize_mxfp8(x, axis, scale_multiple=1 if axis in (-1, 3) else 4)


def quantize_nvfp4(x: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_4d("quantize_nvfp4", x)
    return formats.quantize_nvfp4(x.transpose(-1, -2) if transpose else x, scale_multiple=4 if transpose else 1)


def key_bias(mask: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A per-key mask as the fp32 logit bias ``(Bm, Skv)`` the attention ops take (``Bm``: the mask's batch, 1 or
    B): boolean ``True`` (attend) → 0, ``False`` → ``-inf``; a float mask as is, in fp32. ``mask`` broadcasts to
    ``(B, 1, 1, Skv)`` (every dim but batch and keys is 1: :func:`qattn_fx.ops.canonical.mask_kind`); ``k`` is
    the canonical ``(B, H, Skv, D)`` key, for ``Skv``."""
    if mask.dim() > 4 or any(d != 1 for d in mask.shape[-3:-1]):
        raise ValueError(f"key_bias: mask of shape {tuple(mask.shape)} is not per-key; valid: broadcastable to "
                         "(B, 1, 1, Skv)")
    batch = mask.shape[0] if mask.dim() == 4 else 1
    m = mask.reshape(batch, mask.shape[-1]) if mask.dim() else mask.reshape(1, 1)
    if m.dtype == torch.bool:
        bias = torch.where(m, 0.0, float("-inf"))
    else:
        bias = m.float()
    return bias.new_zeros(batch, k.shape[-2]) + bias


def lse_shift(q: torch.Tensor, k: torch.Tensor, sm_scale: float, runtime_scale: torch.Tensor | None = None,
              key_bias: torch.Tensor | None = None):
    """``sm_scale · (q · mean_S(k))`` per query row, fp32 ``(B, Hq, Sq)``, for canonical ``q (B, Hq, Sq, D)`` and
    ``k (B, Hkv, Skv, D)`` (``Hq`` a multiple of ``Hkv``); ``runtime_scale`` (a 0-d tensor) replaces ``sm_scale``;
    ``key_bias``: the mean is over the keys it keeps, as :func:`smooth_k` takes it.

    Smoothing K (:func:`smooth_k`) shifts every logit of a row by this amount, which the softmax cancels but the
    row's log-sum-exp keeps: the LSE of the smoothed logits plus this shift is the LSE of the call's own logits,
    which is what a merge of partial results over different key chunks (ring attention) needs.
    """
    _check_4d("lse_shift", q)
    _check_4d("lse_shift", k)
    mean = _key_mean(k, key_bias).squeeze(-2)  # (as smooth_k: no fp32 copy of k for Inductor to store)
    if q.shape[1] != k.shape[1]:
        mean = mean.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    shift = (q.float() * mean.unsqueeze(-2)).sum(dim=-1)
    return shift * (runtime_scale.float() if runtime_scale is not None else sm_scale)


def as_scalar_tensor(value) -> torch.Tensor:
    """A graph's float value (a SymFloat) as a 0-d float64 CPU tensor (custom ops' ``float`` args take no SymFloat)."""
    return torch.scalar_tensor(value, dtype=torch.float64)


def skip_threshold(k: torch.Tensor, threshold: float, per_key: float, timestep: torch.Tensor | None, until: float,
                   timestep_scale: float) -> torch.Tensor:
    """Skip-Softmax's λ for one call, as data (a schedule changes it without recompiling): ``threshold`` (λ) plus
    ``per_key / Skv`` (TensorRT-LLM's ``threshold_scale_factor``), fp32 ``(1,)`` on ``k``'s device; with a
    ``timestep`` (the model's own, any shape: its max is taken), 0 while ``t = timestep / timestep_scale`` is above
    ``until`` (vLLM-Omni's ``disabled_until_timestep``: nothing skipped on the early, noisy steps)."""
    lam = torch.full((1,), float(threshold), dtype=torch.float32, device=k.device)
    if per_key:
        lam = lam + float(per_key) / k.shape[-2]
    if timestep is not None:
        t = timestep.to(device=k.device, dtype=torch.float32).reshape(-1).amax() / timestep_scale
        lam = lam * (t <= until).to(torch.float32)
    return lam


_define("smooth_k(Tensor k, Tensor? key_bias=None) -> Tensor", smooth_k)
_define("mask_keys(Tensor x, Tensor key_bias) -> Tensor", mask_keys)
_define("skip_threshold(Tensor k, float threshold, float per_key, Tensor? timestep, float until, "
        "float timestep_scale) -> Tensor", skip_threshold)
_define("key_bias(Tensor mask, Tensor k) -> Tensor", key_bias)
_define("as_scalar_tensor(Scalar value) -> Tensor", as_scalar_tensor)
_define("lse_shift(Tensor q, Tensor k, float sm_scale, Tensor? runtime_scale=None, Tensor? key_bias=None) -> Tensor",
        lse_shift)
_define("quantize_per_block(Tensor x, int block, ScalarType dtype) -> (Tensor, Tensor)", quantize_per_block)
_define("quantize_per_head(Tensor x, ScalarType dtype, bool seq_major=False) -> (Tensor, Tensor)", quantize_per_head)
_define(
    "quantize_per_tensor(Tensor x, ScalarType dtype, bool seq_major=False) -> (Tensor, Tensor)", quantize_per_tensor
)
_define(
    "quantize_per_channel(Tensor x, ScalarType dtype, bool seq_major=False) -> (Tensor, Tensor)", quantize_per_channel
)
_define("kv_stats(Tensor k, Tensor v, Tensor? key_bias=None) -> (Tensor, Tensor)", kv_stats)
_define("quantize_mxfp8(Tensor x, int axis) -> (Tensor, Tensor)", quantize_mxfp8)
_define("quantize_nvfp4(Tensor x, bool transpose) -> (Tensor, Tensor, Tensor)", quantize_nvfp4)

# the fused K/V quantize: an opaque op (one Triton launch on CUDA, the unfused ops' composition elsewhere)
lib.define("quantize_kv(Tensor k, Tensor v, Tensor k_mean, Tensor v_scale, Tensor? key_bias, int k_block, "
           "ScalarType k_dtype, bool seq_major) -> (Tensor, Tensor, Tensor)")
lib.impl("quantize_kv", _quantize_kv_cpu, "CPU")
lib.impl("quantize_kv", _quantize_kv_cuda, "CUDA")
torch.library.register_fake("qattn::quantize_kv", _quantize_kv_fake, lib=lib)
_DEFINED.append(torch.ops.qattn.quantize_kv.default)

#: Every op defined here (the quantize nodes the pass inserts and their helpers).
QUANTIZE_OPS = tuple(_DEFINED)
