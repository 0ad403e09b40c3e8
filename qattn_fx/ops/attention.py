"""Attention custom ops over quantized tensors. Opaque to the compiler; the ``kernel`` argument picks the kernel.

``qattn::scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, kernel,
key_bias=None, runtime_scale=None, skip_threshold=None, skip_label="")``

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
* ``v_format`` ``fp8``: as above; ``mxfp8``: e4m3 ``(B, H, Skv, Dv)`` with E8M0 ``(B, H, ceil(Skv/32), Dv)``;
  ``nvfp4``: stored transposed, packed ``(B, H, Dv, Skv16/2)``, scales ``(B, H, Dv, Skv16/16)``, tensor scale.
* ``key_bias``, ``runtime_scale``, ``skip_threshold`` and ``skip_label`` as above.

``qattn::skip_softmax_attention(q, k, v, sm_scale, out_dtype, kernel, key_bias=None, runtime_scale=None,
skip_threshold=None, skip_label="")``: dense attention of bf16/fp16/fp32 ``q``, ``k``, ``v`` (``(B, H, S, D)``, any
strides) with Skip-Softmax (a spec's ``recipe: null`` with ``skip_softmax``); the reference kernel only.

Inputs are never mutated. Bad shapes or dtypes raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import kernels
from ..kernels._cuda_utils import FifoCache, layout_key

_QK_8BIT = (torch.int8, torch.float8_e4m3fn)
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        _fail(f"out_dtype={out_dtype} is invalid; valid: {', '.join(map(str, OUT_DTYPES))}")


def _check_scale(name: str, scale: torch.Tensor, full: tuple, what: str, *, last_at_least: bool = False) -> None:
    if scale.dtype != torch.float32:
        _fail(f"{name} must be float32; got {scale.dtype}")
    dims_ok = scale.dim() == 3 and all(s in (1, f) for s, f in zip(scale.shape[:2], full[:2]))
    last_ok = scale.dim() == 3 and (scale.shape[2] >= full[2] if last_at_least else scale.shape[2] in (1, full[2]))
    if not (dims_ok and last_ok):
        _fail(f"{name} must have shape {what} (each dim may be 1); got {tuple(scale.shape)}")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_seq: int, *, padded_v: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (B, H, S, D); got shape {tuple(t.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        _fail(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] != 0:
        _fail(f"heads must satisfy Hk == Hv and Hq % Hk == 0; got Hq={q.shape[1]}, Hk={k.shape[1]}, Hv={v.shape[1]}")
    if v_seq < k.shape[2] if padded_v else v_seq != k.shape[2]:
        need = f"at least {k.shape[2]}" if padded_v else f"{k.shape[2]}"
        _fail(f"v must hold {need} tokens (k has {k.shape[2]}); got {v_seq}")
    if k.shape[2] == 0:
        _fail("k has zero tokens: attention over an empty key set is undefined")


def check_key_bias(key_bias: Optional[torch.Tensor], k: torch.Tensor) -> None:
    if key_bias is None:
        return
    b, skv = k.shape[0], k.shape[2]
    if key_bias.dtype != torch.float32:
        _fail(f"key_bias must be float32; got {key_bias.dtype}")
    if key_bias.dim() != 2 or key_bias.shape[0] not in (1, b) or key_bias.shape[1] != skv:
        _fail(f"key_bias must have shape (B|1, Skv) = ({b}|1, {skv}); got {tuple(key_bias.shape)}")
    if key_bias.stride(-1) != 1 and skv > 1:
        _fail(f"key_bias needs a unit stride on keys; got strides {key_bias.stride()}")
    if key_bias.device != k.device:
        _fail(f"key_bias is on {key_bias.device}, k on {k.device}")


def _scale_value(sm_scale: float, runtime_scale: Optional[torch.Tensor]) -> float:
    if runtime_scale is None:
        return sm_scale
    if runtime_scale.numel() != 1 or not runtime_scale.dtype.is_floating_point:
        _fail(f"runtime_scale must be a 1-element float tensor; got {runtime_scale.dtype} of shape "
              f"{tuple(runtime_scale.shape)}")
    return float(runtime_scale)


def _kernel_call(kernel: str, family: str, key_bias: Optional[torch.Tensor],
                 skip_threshold: Optional[torch.Tensor] = None, skip_label: str = ""):
    """The kernel function; ``key_bias`` and ``skip_threshold`` are passed (as keywords) only to kernels that declare
    they take them."""
    fn = kernels.load(kernel, family)
    extra = {}
    if key_bias is not None:
        if not kernels.info(kernel).key_bias:
            _fail(f"kernel {kernel!r} takes no key_bias (masks); kernels that do: "
                  f"{kernels.names_with('key_bias')}")
        extra["key_bias"] = key_bias
    if skip_threshold is not None:
        if not kernels.info(kernel).skip_softmax:
            _fail(f"kernel {kernel!r} takes no skip_threshold (Skip-Softmax); kernels that do: "
                  f"{kernels.names_with('skip_softmax')}")
        if skip_threshold.numel() != 1 or not skip_threshold.dtype.is_floating_point:
            _fail(f"skip_threshold must be a one-element float tensor; got {skip_threshold.dtype} of shape "
                  f"{tuple(skip_threshold.shape)}")
        extra.update(skip_threshold=skip_threshold, skip_label=skip_label)
    return functools.partial(fn, **extra) if extra else fn


#: The keys (kernel, blocks, input layouts, devices) whose inputs :func:`check_scaled_inputs` passed.
_CHECKED = FifoCache(maxsize=256)


def check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel,
                        key_bias=None) -> None:
    """``ValueError`` naming the argument for inputs ``qattn::scaled_attention`` cannot take on ``kernel`` (a bf16/fp16
    ``q`` beside an int8 ``k``: only kernels whose :class:`~qattn_fx.kernels.KernelInfo` lists ``q_block`` in
    ``quantizes_q``). The checks read shapes, strides, dtypes and whether the key bias is on ``k``'s device, so they
    run once per such key (:data:`_CHECKED`)."""
    key = (kernel, out_dtype, q_block, k_block, *map(layout_key, (q, q_scale, k, k_scale, v, v_scale, key_bias)),
           key_bias is None or key_bias.device == k.device)
    if key not in _CHECKED:
        _CHECKED.get_or_build(key, lambda: _check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block,
                                                                out_dtype, kernel, key_bias))


def _check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel, key_bias) -> bool:
    """:func:`check_scaled_inputs`' checks; ``True`` when they pass."""
    _check_4d(q, k, v)
    _check_heads(q, k, v, v.shape[2], padded_v=True)
    check_key_bias(key_bias, k)
    _check_out_dtype(out_dtype)
    if q.shape[-1] != k.shape[-1]:
        _fail(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            _fail(f"{name} needs a unit stride on D (the last dim); got strides {t.stride()}")
    scaled = (("q", q, q_scale, q_block), ("k", k, k_scale, k_block))
    q_in_kernel = q_scale is None and k_scale is not None and kernels.q_quantized_in_kernel(q.dtype, k.dtype)
    if q_in_kernel:
        if q_block < 1:
            _fail(f"q_block={q_block} is invalid for a {q.dtype} q with int8 k (Q quantized in the kernel); "
                  "valid: >= 1 (tokens per Q scale)")
        scaled = scaled[1:]
    elif (q_scale is None) != (k_scale is None):
        _fail("q_scale and k_scale must both be given (quantized Q/K) or both be None (bf16/fp16 Q/K); a bf16/fp16 q "
              "with int8 k and k_scale asks the kernel to quantize Q")
    elif q_scale is None:
        if q.dtype not in _FLOAT or k.dtype != q.dtype:
            _fail(f"unquantized q/k must share a float dtype in {_FLOAT}; got {q.dtype}, {k.dtype}")
        scaled = ()
    elif q.dtype not in _QK_8BIT or k.dtype != q.dtype:
        _fail(f"quantized q/k must share a dtype in {_QK_8BIT}; got {q.dtype}, {k.dtype}")
    for name, x, s, block in scaled:
        if block < 0:
            _fail(f"{name}_block={block} is invalid; valid: 0 (one scale per head/tensor) or >= 1")
        nb = 1 if block == 0 else (x.shape[2] + block - 1) // block
        what = ("(1, 1|H, 1)" if block == 0
                else f"(B, H, >= ceil(S/{block})) = ({x.shape[0]}, {x.shape[1]}, >= {nb})")
        _check_scale(f"{name}_scale", s, (x.shape[0], x.shape[1], nb), what, last_at_least=block > 0)
        if block == 0 and s.shape[0] != 1:
            _fail(f"{name}_scale with {name}_block=0 must have shape (1, 1|H, 1); got {tuple(s.shape)}")
    if v.dtype != torch.float8_e4m3fn:
        _fail(f"v must be float8_e4m3fn; got {v.dtype}")
    _check_scale("v_scale", v_scale, (v.shape[0], v.shape[1], v.shape[3]), "(B|1, H|1, Dv|1)")
    if v.stride(-1) != 1 and v.stride(-2) != 1:
        _fail(f"v needs a unit stride on D or on S; got strides {v.stride()}")
    blocks = kernels.info(kernel).quantizes_q if q_in_kernel else ()
    if q_in_kernel and q_block not in blocks:
        _fail(f"kernel {kernel!r} does not quantize a {q.dtype} q itself at q_block={q_block} "
              f"({'q_block in ' + str(blocks) if blocks else 'no q_block'}); pass int8 q with q_scale, or use "
              f"a kernel that does: {kernels.names_with('quantizes_q')}")
    return True


def _fake_out(q: torch.Tensor, sq: int, dv: int, out_dtype: torch.dtype) -> torch.Tensor:
    return q.new_empty((q.shape[0], sq, q.shape[1], dv), dtype=out_dtype).transpose(1, 2)


@torch.library.custom_op("qattn::scaled_attention", mutates_args=())
def scaled_attention(
    q: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    k: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    v: torch.Tensor,
    v_scale: torch.Tensor,
    q_block: int,
    k_block: int,
    sm_scale: float,
    out_dtype: torch.dtype,
    kernel: str,
    key_bias: Optional[torch.Tensor] = None,
    runtime_scale: Optional[torch.Tensor] = None,
    skip_threshold: Optional[torch.Tensor] = None,
    skip_label: str = "",
) -> torch.Tensor:
    check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel, key_bias)
    fn = _kernel_call(kernel, "scaled", key_bias, skip_threshold, skip_label)
    return fn(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, _scale_value(sm_scale, runtime_scale), out_dtype)


@scaled_attention.register_fake
def _(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, kernel, key_bias=None,
      runtime_scale=None, skip_threshold=None, skip_label=""):
    return _fake_out(q, q.shape[2], v.shape[3], out_dtype)


@torch.library.custom_op("qattn::scaled_attention_lse", mutates_args=())
def scaled_attention_lse(
    q: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    k: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    v: torch.Tensor,
    v_scale: torch.Tensor,
    q_block: int,
    k_block: int,
    sm_scale: float,
    out_dtype: torch.dtype,
    kernel: str,
    key_bias: Optional[torch.Tensor] = None,
    runtime_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel, key_bias)
    if not kernels.info(kernel).lse:
        _fail(f"kernel {kernel!r} returns no LSE; kernels that do: "
              f"{kernels.names_with('lse')}")
    fn = _kernel_call(kernel, "scaled", key_bias)
    out, lse = fn(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, _scale_value(sm_scale, runtime_scale),
                  out_dtype, return_lse=True)
    return out, lse


@scaled_attention_lse.register_fake
def _(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, kernel, key_bias=None,
      runtime_scale=None):
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)
    return _fake_out(q, q.shape[2], v.shape[3], out_dtype), lse


QK_FORMATS = ("mxfp8", "nvfp4")
V_FORMATS = ("fp8", "mxfp8", "nvfp4")


def _v_dims(v: torch.Tensor, v_format: str) -> tuple[int, int]:
    """(Skv, Dv) of a V operand (``nvfp4`` V is stored transposed and packed along S)."""
    if v_format == "nvfp4":
        return v.shape[3] * 2, v.shape[2]
    return v.shape[2], v.shape[3]


def check_block_scaled_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype) -> None:
    if qk_format not in QK_FORMATS:
        _fail(f"qk_format={qk_format!r} is invalid; valid: {', '.join(QK_FORMATS)}")
    if v_format not in V_FORMATS:
        _fail(f"v_format={v_format!r} is invalid; valid: {', '.join(V_FORMATS)}")
    _check_out_dtype(out_dtype)
    _check_4d(q, k, v)
    skv, _ = _v_dims(v, v_format)
    if v_format == "nvfp4":
        if skv < k.shape[2] or skv - k.shape[2] >= 16:
            _fail(f"nvfp4 v holds {skv} padded tokens; expected ceil16(Skv) for Skv={k.shape[2]}")
        skv = k.shape[2]
    _check_heads(q, k, v, skv)
    # E8M0 scales as their bytes (uint8, what qattn::quantize_mxfp8 gives: Inductor's C++ backend has no
    # float8_e8m0fnu) or as the dtype itself
    expect = {"mxfp8": (torch.float8_e4m3fn, (torch.uint8, torch.float8_e8m0fnu)),
              "nvfp4": (torch.uint8, (torch.float8_e4m3fn,))}
    for name, x, sf, gs in (("q", q, q_sf, q_gs), ("k", k, k_sf, k_gs)):
        data_dtype, sf_dtypes = expect[qk_format]
        if x.dtype != data_dtype or sf.dtype not in sf_dtypes:
            _fail(f"{qk_format} {name} needs data {data_dtype} and scales {' or '.join(map(str, sf_dtypes))}; got "
                  f"{x.dtype}, {sf.dtype}")
        if (qk_format == "nvfp4") != (gs is not None):
            _fail(f"{name}_gs (tensor scale) is required for nvfp4 and must be None for mxfp8")
    if v_format != "fp8":
        data_dtype, sf_dtypes = expect[v_format]
        if v.dtype != data_dtype or v_sf.dtype not in sf_dtypes:
            _fail(f"{v_format} v needs data {data_dtype} and scales {' or '.join(map(str, sf_dtypes))}; got "
                  f"{v.dtype}, {v_sf.dtype}")
    elif v.dtype != torch.float8_e4m3fn or v_sf.dtype != torch.float32:
        _fail(f"fp8 v needs float8_e4m3fn data and float32 scales; got {v.dtype}, {v_sf.dtype}")
    if (v_format == "nvfp4") != (v_gs is not None):
        _fail("v_gs (tensor scale) is required for nvfp4 V and must be None otherwise")
    if q.shape[-1] != k.shape[-1]:
        _fail(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    # scale shapes (see the module docstring); a wrong one would otherwise fail deep inside a kernel, or broadcast
    for name, x, sf, gs in (("q", q, q_sf, q_gs), ("k", k, k_sf, k_gs)):
        d = x.shape[-1] * (2 if qk_format == "nvfp4" else 1)
        block = 32 if qk_format == "mxfp8" else 16
        _check_sf_shape(f"{name}_sf", sf, (*x.shape[:3], -(-d // block)))
        if gs is not None:
            _check_tensor_scale(f"{name}_gs", gs)
    b, h = v.shape[0], v.shape[1]
    if v_format == "fp8":
        _check_scale("v_sf", v_sf, (b, h, v.shape[3]), "(B|1, H|1, Dv|1)")
    elif v_format == "mxfp8":
        _check_sf_shape("v_sf", v_sf, (b, h, -(-v.shape[2] // 32), v.shape[3]))
    else:
        _check_sf_shape("v_sf", v_sf, (b, h, v.shape[2], v.shape[3] * 2 // 16))
        _check_tensor_scale("v_gs", v_gs)


def _check_4d(*tensors: torch.Tensor) -> None:
    for name, t in zip(("q", "k", "v"), tensors):
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (B, H, S, D); got shape {tuple(t.shape)}")


def _check_sf_shape(name: str, sf: torch.Tensor, shape: tuple) -> None:
    if tuple(sf.shape) != tuple(shape):
        _fail(f"{name} must have shape {tuple(shape)}; got {tuple(sf.shape)}")


def _check_tensor_scale(name: str, gs: torch.Tensor) -> None:
    if gs.dtype != torch.float32 or gs.numel() != 1:
        _fail(f"{name} must be a float32 scalar tensor; got {gs.dtype} of shape {tuple(gs.shape)}")


@torch.library.custom_op("qattn::block_scaled_attention", mutates_args=())
def block_scaled_attention(
    q: torch.Tensor,
    q_sf: torch.Tensor,
    q_gs: Optional[torch.Tensor],
    k: torch.Tensor,
    k_sf: torch.Tensor,
    k_gs: Optional[torch.Tensor],
    v: torch.Tensor,
    v_sf: torch.Tensor,
    v_gs: Optional[torch.Tensor],
    qk_format: str,
    v_format: str,
    sm_scale: float,
    out_dtype: torch.dtype,
    kernel: str,
    key_bias: Optional[torch.Tensor] = None,
    runtime_scale: Optional[torch.Tensor] = None,
    skip_threshold: Optional[torch.Tensor] = None,
    skip_label: str = "",
) -> torch.Tensor:
    check_block_scaled_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype)
    check_key_bias(key_bias, k)
    fn = _kernel_call(kernel, "block_scaled", key_bias, skip_threshold, skip_label)
    return fn(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, _scale_value(sm_scale, runtime_scale),
              out_dtype)


@block_scaled_attention.register_fake
def _(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale, out_dtype, kernel, key_bias=None,
      runtime_scale=None, skip_threshold=None, skip_label=""):
    return _fake_out(q, q.shape[2], _v_dims(v, v_format)[1], out_dtype)


@torch.library.custom_op("qattn::skip_softmax_attention", mutates_args=())
def skip_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    out_dtype: torch.dtype,
    kernel: str,
    key_bias: Optional[torch.Tensor] = None,
    runtime_scale: Optional[torch.Tensor] = None,
    skip_threshold: Optional[torch.Tensor] = None,
    skip_label: str = "",
) -> torch.Tensor:
    _check_4d(q, k, v)
    _check_heads(q, k, v, v.shape[2])
    check_key_bias(key_bias, k)
    _check_out_dtype(out_dtype)
    if q.dtype not in _FLOAT or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k, v must share a float dtype in {_FLOAT}; got {q.dtype}, {k.dtype}, {v.dtype}")
    fn = _kernel_call(kernel, "dense_skip", key_bias, skip_threshold, skip_label)
    return fn(q, k, v, _scale_value(sm_scale, runtime_scale), out_dtype)


@skip_softmax_attention.register_fake
def _(q, k, v, sm_scale, out_dtype, kernel, key_bias=None, runtime_scale=None, skip_threshold=None, skip_label=""):
    return _fake_out(q, q.shape[2], v.shape[3], out_dtype)


ATTENTION_OPS = (torch.ops.qattn.scaled_attention.default, torch.ops.qattn.block_scaled_attention.default,
                 torch.ops.qattn.scaled_attention_lse.default, torch.ops.qattn.skip_softmax_attention.default)
