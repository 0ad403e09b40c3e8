"""The input checks of the attention ops (the layouts :mod:`qattn_fx.ops.attention` documents): one set, run at
the op boundary (``qattn::scaled_attention``, ``scaled_attention_lse``, ``block_scaled_attention``,
``skip_softmax_attention``) and by the kernels' direct entries, which add only what the kernel itself needs (head
dims, alignment, TMA). Below the ops and beside the kernels, so both reach it without importing upwards.

Every failure is a ``ValueError`` naming the argument (:func:`fail`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from ._cuda_utils import FifoCache, layout_key

_QK_8BIT = (torch.int8, torch.float8_e4m3fn)
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fail(message: str) -> None:
    raise ValueError(message)


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        fail(f"out_dtype={out_dtype} is invalid; valid: {', '.join(map(str, OUT_DTYPES))}")


def _check_scale(name: str, scale: torch.Tensor, full: tuple, what: str, *, last_at_least: bool = False) -> None:
    if scale.dtype != torch.float32:
        fail(f"{name} must be float32; got {scale.dtype}")
    dims_ok = scale.dim() == 3 and all(s in (1, f) for s, f in zip(scale.shape[:2], full[:2]))
    last_ok = scale.dim() == 3 and (scale.shape[2] >= full[2] if last_at_least else scale.shape[2] in (1, full[2]))
    if not (dims_ok and last_ok):
        fail(f"{name} must have shape {what} (each dim may be 1); got {tuple(scale.shape)}")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_seq: int, *, padded_v: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            fail(f"{name} must be 4-D (B, H, S, D); got shape {tuple(t.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        fail(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        fail(f"heads must satisfy Hk == Hv and Hq % Hk == 0; got Hq={q.shape[1]}, Hk={k.shape[1]}, Hv={v.shape[1]}")
    if v_seq < k.shape[2] if padded_v else v_seq != k.shape[2]:
        need = f"at least {k.shape[2]}" if padded_v else f"{k.shape[2]}"
        fail(f"v must hold {need} tokens (k has {k.shape[2]}); got {v_seq}")
    if k.shape[2] == 0:
        fail("k has zero tokens: attention over an empty key set is undefined")


def check_key_bias(key_bias: Optional[torch.Tensor], k: torch.Tensor) -> None:
    if key_bias is None:
        return
    b, skv = k.shape[0], k.shape[2]
    if key_bias.dtype != torch.float32:
        fail(f"key_bias must be float32; got {key_bias.dtype}")
    if key_bias.dim() != 2 or key_bias.shape[0] not in (1, b) or key_bias.shape[1] != skv:
        fail(f"key_bias must have shape (B|1, Skv) = ({b}|1, {skv}); got {tuple(key_bias.shape)}")
    if key_bias.stride(-1) != 1 and skv > 1:
        fail(f"key_bias needs a unit stride on keys; got strides {key_bias.stride()}")
    if key_bias.device != k.device:
        fail(f"key_bias is on {key_bias.device}, k on {k.device}")


#: The keys (kernel, blocks, input layouts, devices) whose inputs :func:`check_scaled_inputs` passed.
_CHECKED = FifoCache(maxsize=256)


def check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel,
                        key_bias=None) -> None:
    """``ValueError`` naming the argument for inputs ``qattn::scaled_attention`` cannot take on ``kernel`` (a bf16/fp16
    ``q`` beside an int8 ``k``: only kernels whose :class:`~qattn_fx.kernels.KernelInfo` lists ``q_block`` in
    ``quantizes_q``). The checks read shapes, strides, dtypes and whether the key bias is on ``k``'s device, so they
    run once per such key (:data:`_CHECKED`). ``out_dtype=None``: not checked (a direct kernel call, which writes
    the dtype it is given).

    The op boundary runs it for every ``qattn::scaled_attention`` call; a kernel's direct entry (the Sage kernels'
    ``attention``: :func:`qattn_fx.kernels._sage_common.validate`) runs the same function, then only what that
    kernel adds."""
    key = (kernel, out_dtype, q_block, k_block, *map(layout_key, (q, q_scale, k, k_scale, v, v_scale, key_bias)),
           key_bias is None or key_bias.device == k.device)
    if key not in _CHECKED:
        _CHECKED.get_or_build(key, lambda: _check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block,
                                                                out_dtype, kernel, key_bias))


def _check_scaled_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype, kernel, key_bias) -> bool:
    """:func:`check_scaled_inputs`' checks; ``True`` when they pass."""
    check_4d(q, k, v)
    _check_heads(q, k, v, v.shape[2], padded_v=True)
    check_key_bias(key_bias, k)
    if out_dtype is not None:
        _check_out_dtype(out_dtype)
    if q.shape[-1] != k.shape[-1]:
        fail(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            fail(f"{name} needs a unit stride on D (the last dim); got strides {t.stride()}")
    scaled = (("q", q, q_scale, q_block), ("k", k, k_scale, k_block))
    q_in_kernel = q_scale is None and k_scale is not None and kernels.q_quantized_in_kernel(q.dtype, k.dtype)
    if q_in_kernel:
        if q_block < 1:
            fail(f"q_block={q_block} is invalid for a {q.dtype} q with int8 k (Q quantized in the kernel); "
                  "valid: >= 1 (tokens per Q scale)")
        scaled = scaled[1:]
    elif (q_scale is None) != (k_scale is None):
        fail("q_scale and k_scale must both be given (quantized Q/K) or both be None (bf16/fp16 Q/K); a bf16/fp16 q "
              "with int8 k and k_scale asks the kernel to quantize Q")
    elif q_scale is None:
        if q.dtype not in _FLOAT or k.dtype != q.dtype:
            fail(f"unquantized q/k must share a float dtype in {_FLOAT}; got {q.dtype}, {k.dtype}")
        scaled = ()
    elif q.dtype not in _QK_8BIT or k.dtype != q.dtype:
        fail(f"quantized q/k must share a dtype in {_QK_8BIT}; got {q.dtype}, {k.dtype}")
    for name, x, s, block in scaled:
        if block < 0:
            fail(f"{name}_block={block} is invalid; valid: 0 (one scale per head/tensor) or >= 1")
        nb = 1 if block == 0 else (x.shape[2] + block - 1) // block
        what = ("(1, 1|H, 1)" if block == 0
                else f"(B, H, >= ceil(S/{block})) = ({x.shape[0]}, {x.shape[1]}, >= {nb})")
        _check_scale(f"{name}_scale", s, (x.shape[0], x.shape[1], nb), what, last_at_least=block > 0)
        if block == 0 and s.shape[0] != 1:
            fail(f"{name}_scale with {name}_block=0 must have shape (1, 1|H, 1); got {tuple(s.shape)}")
    if v.dtype != torch.float8_e4m3fn:
        fail(f"v must be float8_e4m3fn; got {v.dtype}")
    _check_scale("v_scale", v_scale, (v.shape[0], v.shape[1], v.shape[3]), "(B|1, H|1, Dv|1)")
    if v.stride(-1) != 1 and v.stride(-2) != 1:
        fail(f"v needs a unit stride on D or on S; got strides {v.stride()}")
    blocks = kernels.info(kernel).quantizes_q if q_in_kernel else ()
    if q_in_kernel and blocks and q_block not in blocks:
        fail(f"kernel {kernel!r} quantizes a {q.dtype} q itself only at q_block in {blocks}; got "
              f"q_block={q_block}; valid: q_block in {blocks}, or int8 q with q_scale")
    if q_in_kernel and not blocks:
        fail(f"kernel {kernel!r} does not quantize a {q.dtype} q itself; pass int8 q with q_scale, or use a kernel "
              f"that does: {kernels.names_with('quantizes_q')}")
    return True


QK_FORMATS = ("mxfp8", "nvfp4")
V_FORMATS = ("fp8", "mxfp8", "nvfp4")


def v_dims(v: torch.Tensor, v_format: str) -> tuple[int, int]:
    """(Skv, Dv) of a V operand (``nvfp4`` V is stored transposed and packed along S)."""
    if v_format == "nvfp4":
        return v.shape[3] * 2, v.shape[2]
    return v.shape[2], v.shape[3]


def check_block_scaled_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype) -> None:
    if qk_format not in QK_FORMATS:
        fail(f"qk_format={qk_format!r} is invalid; valid: {', '.join(QK_FORMATS)}")
    if v_format not in V_FORMATS:
        fail(f"v_format={v_format!r} is invalid; valid: {', '.join(V_FORMATS)}")
    _check_out_dtype(out_dtype)
    check_4d(q, k, v)
    skv, _ = v_dims(v, v_format)
    if v_format == "nvfp4":
        if skv < k.shape[2] or skv - k.shape[2] >= 16:
            fail(f"nvfp4 v holds {skv} padded tokens; expected ceil16(Skv) for Skv={k.shape[2]}")
        skv = k.shape[2]
    _check_heads(q, k, v, skv)
    # E8M0 scales as their bytes (uint8, what qattn::quantize_mxfp8 gives: Inductor's C++ backend has no
    # float8_e8m0fnu) or as the dtype itself
    expect = {"mxfp8": (torch.float8_e4m3fn, (torch.uint8, torch.float8_e8m0fnu)),
              "nvfp4": (torch.uint8, (torch.float8_e4m3fn,))}
    for name, x, sf, gs in (("q", q, q_sf, q_gs), ("k", k, k_sf, k_gs)):
        data_dtype, sf_dtypes = expect[qk_format]
        if x.dtype != data_dtype or sf.dtype not in sf_dtypes:
            fail(f"{qk_format} {name} needs data {data_dtype} and scales {' or '.join(map(str, sf_dtypes))}; got "
                  f"{x.dtype}, {sf.dtype}")
        if (qk_format == "nvfp4") != (gs is not None):
            fail(f"{name}_gs (tensor scale) is required for nvfp4 and must be None for mxfp8")
    if v_format != "fp8":
        data_dtype, sf_dtypes = expect[v_format]
        if v.dtype != data_dtype or v_sf.dtype not in sf_dtypes:
            fail(f"{v_format} v needs data {data_dtype} and scales {' or '.join(map(str, sf_dtypes))}; got "
                  f"{v.dtype}, {v_sf.dtype}")
    elif v.dtype != torch.float8_e4m3fn or v_sf.dtype != torch.float32:
        fail(f"fp8 v needs float8_e4m3fn data and float32 scales; got {v.dtype}, {v_sf.dtype}")
    if (v_format == "nvfp4") != (v_gs is not None):
        fail("v_gs (tensor scale) is required for nvfp4 V and must be None otherwise")
    if q.shape[-1] != k.shape[-1]:
        fail(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
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
    elif v_format == "mxfp8":  # token blocks: at least ceil(S/32) (the quantize op pads them to a multiple of 4)
        _check_sf_shape("v_sf", v_sf, (b, h, -(-v.shape[2] // 32), v.shape[3]), blocks_dim=2)
    else:
        _check_sf_shape("v_sf", v_sf, (b, h, v.shape[2], v.shape[3] * 2 // 16), blocks_dim=3)
        _check_tensor_scale("v_gs", v_gs)


def check_4d(*tensors: torch.Tensor) -> None:
    for name, t in zip(("q", "k", "v"), tensors):
        if t.dim() != 4:
            fail(f"{name} must be 4-D (B, H, S, D); got shape {tuple(t.shape)}")


def _check_sf_shape(name: str, sf: torch.Tensor, shape: tuple, blocks_dim: int | None = None) -> None:
    """``sf`` has ``shape``; with ``blocks_dim``, that dim (a count of token blocks) may be larger (padded blocks,
    never read)."""
    ok = sf.dim() == len(shape) and all(
        n >= want if i == blocks_dim else n == want for i, (n, want) in enumerate(zip(sf.shape, shape)))
    if not ok:
        want = ", ".join(f">= {n}" if i == blocks_dim else str(n) for i, n in enumerate(shape))
        fail(f"{name} must have shape ({want}); got {tuple(sf.shape)}")


def _check_tensor_scale(name: str, gs: torch.Tensor) -> None:
    if gs.dtype != torch.float32 or gs.numel() != 1:
        fail(f"{name} must be a float32 scalar tensor; got {gs.dtype} of shape {tuple(gs.shape)}")


def check_dense_inputs(q, k, v, out_dtype, key_bias=None) -> None:
    """``ValueError`` naming the argument for inputs ``qattn::skip_softmax_attention`` cannot take."""
    check_4d(q, k, v)
    _check_heads(q, k, v, v.shape[2])
    check_key_bias(key_bias, k)
    _check_out_dtype(out_dtype)
    if q.dtype not in _FLOAT or k.dtype != q.dtype or v.dtype != q.dtype:
        fail(f"q, k, v must share a float dtype in {_FLOAT}; got {q.dtype}, {k.dtype}, {v.dtype}")
