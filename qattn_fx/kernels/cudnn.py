"""cuDNN frontend kernels: ``cudnn_fp8`` (``sdpa_fp8``, per-tensor FP8) and ``cudnn_mxfp8`` (``sdpa_mxfp8``).

Both build a cuDNN graph per problem (shapes, strides, dtypes, ``sm_scale``, output dtype, architecture path), keep it
in a bounded FIFO cache (:data:`GRAPH_CACHE`, 128 graphs), and execute it with one cuDNN handle per (device, thread) set
to the current torch stream on every call. The workspace comes from torch's caching allocator, and no call on the hot
path synchronises with the host, so a call whose graph is already built can be captured into a CUDA graph. Building a
graph (or creating a handle or the constant scale tensors) is refused during capture with a clear error: run the same
call once eagerly before capturing.

``import cudnn`` happens inside the functions (:mod:`.cudnn_library`: the import, versions, handles): the package
imports on machines without ``nvidia-cudnn-frontend``. MXFP8 scales are re-laid out by :mod:`.cudnn_pack`.
The calls follow the cudnn-frontend 1.32 Python API (``cudnn.pygraph``, ``graph.tensor``, ``graph.sdpa_fp8`` /
``graph.sdpa_mxfp8``, ``graph.build([heur_mode.A, heur_mode.FALLBACK])``, ``graph.execute(variant_pack, workspace,
handle=...)``), as run on an H200 with cuDNN 9.19 (``tests/gpu/test_library_kernels.py``).

Layouts: Q/K/V arrive as logical ``(B, H, S, D)`` of any strides with a unit stride on D (usually BSHD-physical views
of diffusers' ``(B, S, H, D)`` buffers) and are described to cuDNN with their real strides, never copied. Two
exceptions, both logged or documented: an fp8 V stored sequence-fastest (unit stride on S), which cuDNN cannot read (it
needs ``stride[3] == 1``), is copied to BSHD; and when cuDNN has no FP8 engine for the inputs' own strides (cuDNN < 9.21
serves FP8 attention for BSHD/SBHD-like strides only, per Transformer Engine's gate) but has one for BSHD, the graph is
built for BSHD and the inputs are copied on every call (a WARNING is logged once; numerics are identical). The output
is ``(B, Hq, Sq, Dv)`` stored BSHD.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .. import formats
from . import requirements as _kernel_requirements
from ._cuda_utils import (FifoCache, PerDevice, device_index, empty_bshd, format_version, log_once,
                          refuse_during_capture, refuse_empty_keys, require_16bit_output, require_capability,
                          require_cuda)
from .cudnn_library import backend_version, check_cudnn_version, import_cudnn, thread_handle
from .cudnn_pack import pack_f8_128x4, pack_f8_128x4_columnwise
from .op_inputs import check_block_scaled_inputs

logger = logging.getLogger(__name__)

#: Built graphs, keyed by :func:`fp8_graph_key` / :func:`mxfp8_graph_key`; FIFO-bounded.
GRAPH_CACHE = FifoCache(maxsize=128)

#: Fixed softmax-probability scale: P ∈ [0, 1] is stored as e4m3(P · 448) (cuDNN docs, "Amax S" for E4M3).
SCALE_S = formats.P_FP8_SCALE
DESCALE_S = 1.0 / SCALE_S

#: Architectures, library floors and head dims: the kernel registry's declarations
#: (:data:`qattn_fx.kernels.KERNELS`, read here, not restated).
FP8_ARCHS = tuple(cap for req in _kernel_requirements("cudnn_fp8") for cap in req.capabilities)
(_MXFP8,) = _kernel_requirements("cudnn_mxfp8")
MXFP8_ARCHS = _MXFP8.capabilities
#: cuDNN backend floor for FP8 SDPA forward; 9.10.0 is rejected for FP8 forward by cuDNN itself.
FP8_MIN_CUDNN = tuple(int(x) for x in _kernel_requirements("cudnn_fp8")[0].library[1].split("."))
FP8_BAD_CUDNN = ((9, 10, 0),)
#: bf16/fp16 output of ``sdpa_fp8`` exists on Blackwell only, from cuDNN 9.13.0 (``sdpa_support_surface.h``).
FP8_DIRECT_OUT_MIN_CUDNN = (9, 13, 0)
MXFP8_MIN_CUDNN = tuple(int(x) for x in _MXFP8.library[1].split("."))
#: Transformer Engine disables MXFP8 attention on these backends ("known bugs").
MXFP8_BAD_CUDNN = ((9, 23, 0), (9, 23, 1))
MXFP8_HEAD_DIMS = _MXFP8.head_dims.allowed


@dataclass(frozen=True)
class _Constants:
    scale_s: torch.Tensor
    descale_s: torch.Tensor
    one: torch.Tensor


def _make_constants(device: torch.device) -> _Constants:
    def full(value: float) -> torch.Tensor:
        return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)

    return _Constants(scale_s=full(SCALE_S), descale_s=full(DESCALE_S), one=full(1.0))


_CONSTANTS = PerDevice("cuDNN FP8 scale constants", _make_constants)


def _scale4d(scale: torch.Tensor) -> torch.Tensor:
    """A one-element fp32 scale as the ``[1,1,1,1]`` tensor cuDNN declares (a view: no copy, no sync)."""
    return scale.reshape(1, 1, 1, 1)


# ------------------------------------------------------------------------------------------------------------------
# cudnn_fp8: checks and pure helpers
# ------------------------------------------------------------------------------------------------------------------


def check_fp8_head_dims(cap: tuple[int, int], d_qk: int, d_v: int) -> None:
    """cuDNN FP8 SDPA head-dim rules: Hopper d <= 256, multiple of 16; Blackwell d <= 128, multiple of 16."""
    limit = 256 if cap[0] == 9 else 128
    for name, d in (("head_dim (Q/K)", d_qk), ("head_dim (V)", d_v)):
        if d % 16 or d > limit or d <= 0:
            valid = f"multiples of 16 up to {limit} (16, 32, ..., {limit})"
            raise ValueError(f"cudnn_fp8: {name}={d} is not supported on sm_{cap[0]}{cap[1]}; valid: {valid}")


def fp8_path(cap: tuple[int, int], version: tuple[int, int, int], out_dtype: torch.dtype) -> str:
    """Which ``cudnn_fp8`` path serves ``out_dtype`` here: ``direct`` (bf16/fp16 O from cuDNN: Blackwell, cuDNN >=
    9.13) or ``fp8_out`` (e4m3 O with ``scale_o``, dequantised by qattn_fx: Hopper, fp32 output, older cuDNN)."""
    if cap[0] >= 10 and out_dtype in (torch.bfloat16, torch.float16) and tuple(version) >= FP8_DIRECT_OUT_MIN_CUDNN:
        return "direct"
    return "fp8_out"


def fp8_output_margin(skv: int) -> float:
    """Bound on ``max|O| / max|V|`` for FP8 P·V with ``scale_s = 448``, used to pick ``scale_o`` on Hopper.

    O is a convex combination of V rows weighted by P/l, but P is rounded to e4m3 before P·V: a normal e4m3 value is
    off by at most 2^-4 relative, a subnormal one (P·448 < 2^-6) by at most 2^-10/448 absolute. With l >= 1 (the row
    maximum contributes exactly 1, also under online softmax, where earlier tiles are only rescaled down), the weights
    sum to at most ``1 + 2^-4 + Skv · 2^-10 / 448``; a further ``(1 + 2^-8)`` covers fp32 accumulation and exp2
    approximation. Examples: Skv 512 → 1.068, 4608 → 1.077, 75600 → 1.237.
    """
    return (1.0 + 2.0**-4 + skv * 2.0**-10 / SCALE_S) * (1.0 + 2.0**-8)


def fp8_output_descale(v_scale: torch.Tensor, skv: int) -> torch.Tensor:
    """``1 / scale_o`` as a ``[1,1,1,1]`` fp32 device tensor, computed on the device (no host sync).

    V is per-tensor e4m3, so ``max|V| <= 448 · v_scale`` exactly and ``|O| <= 448 · v_scale · margin``; with
    ``scale_o = 1 / (v_scale · margin)`` the e4m3 output never exceeds 448 (never saturates). An all-zero V (scale 0)
    gets descale 1 (O is 0 anyway).
    """
    d = v_scale.reshape(1, 1, 1, 1).float() * fp8_output_margin(skv)
    return torch.where(d > 0, d, torch.ones_like(d))


def fp8_graph_key(index: int, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                  out_dtype: torch.dtype, generate_stats: bool | None = None) -> tuple:
    """Cache key of a ``cudnn_fp8`` graph: device, path, every operand's shape/stride/dtype, ``sm_scale``, output
    dtype. The output layout is always BSHD, so it follows from the shapes. Pure (works on CPU tensors)."""
    return ("sdpa_fp8", index, path,
            tuple(q.shape), tuple(q.stride()), q.dtype,
            tuple(k.shape), tuple(k.stride()), k.dtype,
            tuple(v.shape), tuple(v.stride()), v.dtype,
            float(sm_scale), out_dtype, generate_stats)


def _check_fp8_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype) -> None:
    kernel = "cudnn_fp8"
    if q_scale is None or k_scale is None:
        raise ValueError(f"{kernel} needs quantized float8_e4m3fn Q/K with per-tensor scales; got unquantized "
                         f"{q.dtype} Q/K (use Recipe(qk_dtype='fp8', v_dtype='fp8', scale_scope='tensor'))")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{kernel}: {name} must be float8_e4m3fn; got {t.dtype}; valid: torch.float8_e4m3fn")
    if q_block != 0 or k_block != 0:
        raise ValueError(f"{kernel} takes per-tensor Q/K scales; got q_block={q_block}, k_block={k_block}; "
                         "valid: q_block=0, k_block=0 (Recipe scale_scope='tensor', block sizes 0)")
    for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if s.numel() != 1:
            raise ValueError(f"{kernel} takes one scale per tensor; {name} has shape {tuple(s.shape)}; "
                             "valid: (1, 1, 1) (Recipe scale_scope='tensor', v_block_size=0)")
    # cuDNN's SM90 FP8 forward kernel never finishes when a query tile has no valid key (cudnn-frontend #1069).
    refuse_empty_keys(kernel, k, "refused because cuDNN's Hopper FP8 kernel hangs on it")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{kernel}: out_dtype={out_dtype} is invalid; valid: bfloat16, float16, float32")


# ------------------------------------------------------------------------------------------------------------------
# cudnn_fp8
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class _Graph:
    graph: Any
    tensors: dict
    workspace_size: int
    generate_stats: bool
    path: str
    copy_to_bshd: bool = False  # the inputs' own strides had no engine: they are copied to BSHD on every call


def _cudnn_out_type(cudnn, dtype: torch.dtype):
    return {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF,
            torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3}[dtype]


def is_bshd(x: torch.Tensor) -> bool:
    """Whether logical ``(B, H, S, D)`` ``x`` is stored BSHD (``x.transpose(1, 2)`` contiguous)."""
    return x.transpose(1, 2).is_contiguous()


def bshd_strides(shape) -> tuple[int, int, int, int]:
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def _to_bshd(x: torch.Tensor) -> torch.Tensor:
    return x if is_bshd(x) else x.transpose(1, 2).contiguous().transpose(1, 2)


def _try_fp8_graph(cudnn, handle, operands, o_shape, o_stride, sm_scale, o_dtype, path, errors) -> _Graph | None:
    """Build ``sdpa_fp8`` for ``operands`` (name → (shape, stride)); None when cuDNN has no engine for it."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    for generate_stats in (False, True):  # inference needs no stats; some engines exist only with stats
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        t = {name: g.tensor(name=name, dim=tuple(shape), stride=tuple(stride), data_type=e4m3)
             for name, (shape, stride) in operands.items()}
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[name] = g.tensor(name=name, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
        o, stats, _amax_s, amax_o = g.sdpa_fp8(
            t["q"], t["k"], t["v"], t["descale_q"], t["descale_k"], t["descale_v"],
            t["descale_s"], t["scale_s"], t["scale_o"],
            attn_scale=float(sm_scale), generate_stats=generate_stats, use_causal_mask=False,
        )
        o.set_output(True).set_dim(tuple(o_shape)).set_stride(tuple(o_stride)).set_data_type(
            _cudnn_out_type(cudnn, o_dtype))
        amax_o.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        t["o"], t["amax_o"] = o, amax_o
        if generate_stats:
            stats.set_output(True).set_data_type(f32)
            t["stats"] = stats
        try:
            g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        except cudnn.cudnnGraphNotSupportedError as exc:
            strides = ", ".join(f"{n} {tuple(st)}" for n, (_, st) in operands.items())
            errors.append(f"[strides {strides}; generate_stats={generate_stats}] {exc}")
            continue
        if generate_stats:
            logger.debug("cudnn_fp8: no engine without softmax stats for %s; built with stats", operands)
        return _Graph(g, t, int(g.get_workspace_size()), generate_stats, path)
    return None


def _build_fp8_graph(cudnn, handle, q, k, v, o_shape, o_stride, sm_scale, o_dtype, path) -> _Graph:
    """The graph for the inputs' real strides; if cuDNN has no engine for them and some input is not BSHD (cuDNN
    < 9.21 serves FP8 only for BSHD/SBHD-like strides, per Transformer Engine's gate), the graph for BSHD copies,
    flagged so that every call copies (logged once: the copy costs a pass over Q/K/V, the numerics are identical)."""
    refuse_during_capture("building a cuDNN FP8 SDPA graph")
    errors: list[str] = []
    native = {n: (tuple(x.shape), tuple(x.stride())) for n, x in (("q", q), ("k", k), ("v", v))}
    entry = _try_fp8_graph(cudnn, handle, native, o_shape, o_stride, sm_scale, o_dtype, path, errors)
    if entry is None and not all(is_bshd(x) for x in (q, k, v)):
        bshd = {n: (shape, bshd_strides(shape)) for n, (shape, _) in native.items()}
        entry = _try_fp8_graph(cudnn, handle, bshd, o_shape, o_stride, sm_scale, o_dtype, path, errors)
        if entry is not None:
            entry.copy_to_bshd = True
            log_once(logger, ("cudnn-fp8-bshd-copy", native["q"][1], native["k"][1]), logging.WARNING,
                     "cudnn_fp8: cuDNN %s has no FP8 SDPA engine for Q/K/V strides %s; copying them to BSHD on every "
                     "call (store Q/K/V BSHD, as diffusers does, to avoid the copy)",
                     format_version(backend_version(cudnn)), {n: st for n, (_, st) in native.items()})
    if entry is None:
        raise RuntimeError(
            f"cudnn_fp8: cuDNN {format_version(backend_version(cudnn))} has no FP8 SDPA engine for q{tuple(q.shape)}, "
            f"k{tuple(k.shape)}, v{tuple(v.shape)}, output {o_dtype} ({path}): " + " | ".join(errors)
        )
    return entry


def fp8_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype):
    """``qattn::scaled_attention`` with per-tensor FP8 Q/K/V on cuDNN's ``sdpa_fp8`` (kernel ``cudnn_fp8``).

    Inputs: ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)``, ``v (B, Hkv, Skv, Dv)``, all ``float8_e4m3fn`` with any
    strides and a unit stride on D (V stored sequence-fastest is copied once to BSHD: cuDNN needs ``stride[3] == 1``);
    ``q_scale`` / ``k_scale`` / ``v_scale`` fp32 ``(1, 1, 1)`` device tensors, passed as cuDNN's ``[1,1,1,1]`` descales
    (``q_block = k_block = 0``). GQA needs ``Hq % Hkv == 0``; cross-attention (``Sq != Skv``) and B > 1 are supported.
    Returns ``(B, Hq, Sq, Dv)`` in ``out_dtype`` stored BSHD.

    Numerics: ``S = Q·Kᵀ · descale_q · descale_k · sm_scale`` (fp32), ``P`` stored as e4m3(P·448), ``O = P·V ·
    descale_v / 448 / l`` (cuDNN's online softmax: P is rounded relative to the running row max, the reference relative
    to the final one; the two agree exactly when the row max is reached in the first key tile processed).

    Paths (:func:`fp8_path`):

    * ``direct`` — Blackwell (sm_100/sm_103) with cuDNN >= 9.13 and bf16/fp16 output: cuDNN writes O directly.
    * ``fp8_out`` — Hopper (bf16 output of ``sdpa_fp8`` is Blackwell-only), fp32 output, or older cuDNN: cuDNN writes
      an e4m3 O scaled by ``scale_o = 1 / (v_scale · margin(Skv))`` (:func:`fp8_output_margin`, chosen on the device
      from ``v_scale`` so no host sync), which qattn_fx then dequantises into ``out_dtype``. **Extra error**: one e4m3
      rounding of O, at most 2^-4 relative per element (about 2.5 % RMS), plus values below ``max|V| · margin · 2^-6``
      landing in e4m3's subnormal range (absolute error <= ``max|V| · margin · 2^-10``); it costs two elementwise
      passes over O (copy + scale).

    Strides: described as they are; if cuDNN has no engine for them but has one for BSHD, Q/K/V are copied to BSHD on
    every call (logged once, see the module docstring).

    Head dims: Hopper multiples of 16 up to 256; Blackwell multiples of 16 up to 128 (``ValueError`` otherwise).
    Architectures: sm_90, sm_100, sm_103 (``RuntimeError`` otherwise); cuDNN backend >= 9.1 (not 9.10.0).
    ``Skv == 0`` is refused (cuDNN's Hopper FP8 kernel hangs on key-less rows).
    """
    kernel = "cudnn_fp8"
    _check_fp8_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype)
    device = require_cuda(kernel, q=q, k=k, v=v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    cap = require_capability(kernel, device, FP8_ARCHS,
                             "cuDNN FP8 SDPA forward runs on Hopper and data-center Blackwell")
    b, hq, sq, d = q.shape
    skv, dv = k.shape[2], v.shape[3]
    check_fp8_head_dims(cap, d, dv)
    if b == 0 or sq == 0 or hq == 0:
        return empty_bshd(b, hq, sq, dv, out_dtype, device)
    cudnn = import_cudnn(kernel)
    version = backend_version(cudnn)
    check_cudnn_version(kernel, version, FP8_MIN_CUDNN, FP8_BAD_CUDNN)
    path = fp8_path(cap, version, out_dtype)
    if v.stride(3) != 1:
        # V stored sequence-fastest (for kernels whose P·V wants it); cuDNN requires a unit stride on D for V.
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    o_dtype = torch.float8_e4m3fn if path == "fp8_out" else out_dtype
    o_buf = empty_bshd(b, hq, sq, dv, o_dtype, device)
    handle = thread_handle(cudnn, device)
    key = fp8_graph_key(device_index(device), path, q, k, v, sm_scale, out_dtype)
    entry = GRAPH_CACHE.get_or_build(
        key, lambda: _build_fp8_graph(cudnn, handle, q, k, v, o_buf.shape, o_buf.stride(), sm_scale, o_dtype, path))
    consts = _CONSTANTS.get(device)
    if path == "fp8_out":
        descale_o = fp8_output_descale(v_scale, skv)
        scale_o = torch.reciprocal(descale_o)
    else:
        descale_o, scale_o = None, consts.one
    if entry.copy_to_bshd:
        q, k, v = _to_bshd(q), _to_bshd(k), _to_bshd(v)
    t = entry.tensors
    pack = {
        t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: o_buf,
        t["descale_q"]: _scale4d(q_scale), t["descale_k"]: _scale4d(k_scale), t["descale_v"]: _scale4d(v_scale),
        t["descale_s"]: consts.descale_s, t["scale_s"]: consts.scale_s, t["scale_o"]: scale_o,
        t["amax_o"]: torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device),
    }
    if entry.generate_stats:
        pack[t["stats"]] = torch.empty((b, hq, sq, 1), dtype=torch.float32, device=device)
    workspace = torch.empty(entry.workspace_size, dtype=torch.uint8, device=device)
    entry.graph.execute(pack, workspace, handle=handle)
    if path == "direct":
        return o_buf
    out = empty_bshd(b, hq, sq, dv, out_dtype, device)
    out.copy_(o_buf)  # e4m3 values are exact in bf16/fp16/fp32
    out.mul_(descale_o)  # computed in fp32, rounded once to out_dtype
    return out


# ------------------------------------------------------------------------------------------------------------------
# cudnn_mxfp8: the sdpa_mxfp8 graph (scales packed by qattn_fx.kernels.cudnn_pack)
# ------------------------------------------------------------------------------------------------------------------


def mxfp8_graph_key(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                    out_dtype: torch.dtype) -> tuple:
    """Cache key of a ``cudnn_mxfp8`` graph (the scale descriptors follow from the shapes). Pure."""
    return ("sdpa_mxfp8", index,
            tuple(q.shape), tuple(q.stride()), tuple(k.shape), tuple(k.stride()), tuple(v.shape), tuple(v.stride()),
            float(sm_scale), out_dtype)


def _check_mxfp8_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype) -> None:
    """What only this kernel adds (MXFP8 Q/K/V, its head dims, a 16-bit output), then the op boundary's checks
    (:func:`qattn_fx.kernels.op_inputs.check_block_scaled_inputs`: shapes, scales, dtypes), their messages prefixed
    with the kernel's name: a direct call is checked as a call through ``qattn::block_scaled_attention``."""
    kernel = "cudnn_mxfp8"
    if qk_format != "mxfp8" or v_format != "mxfp8":
        raise ValueError(f"{kernel} implements MXFP8 Q/K/V only; got qk_format={qk_format!r}, v_format={v_format!r}; "
                         "valid: qk_format='mxfp8', v_format='mxfp8'")
    d, dv = q.shape[3], v.shape[3]
    for name, value in (("head_dim (Q/K)", d), ("head_dim (V)", dv)):
        if value not in MXFP8_HEAD_DIMS:
            raise ValueError(f"{kernel}: {name}={value} is not supported; "
                             f"valid: {', '.join(map(str, MXFP8_HEAD_DIMS))}")
    require_16bit_output(kernel, out_dtype, "sdpa_mxfp8")
    refuse_empty_keys(kernel, k)
    try:
        check_block_scaled_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype)
    except ValueError as e:
        raise ValueError(f"{kernel}: {e}") from None


def _build_mxfp8_graph(cudnn, handle, q, k, v, descales, o_shape, o_stride, sm_scale, out_dtype) -> _Graph:
    refuse_during_capture("building a cuDNN MXFP8 SDPA graph")
    e4m3, e8m0, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FP8_E8M0, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    t = {name: g.tensor(name=name, dim=tuple(x.shape), stride=tuple(x.stride()), data_type=e4m3)
         for name, x in (("q", q), ("k", k), ("v", v))}
    for name, sf in descales.items():
        t[name] = g.tensor(name=name, dim=tuple(sf.shape), stride=tuple(sf.stride()), data_type=e8m0,
                           reordering_type=cudnn.tensor_reordering.F8_128x4)
    o, _stats, amax_o = g.sdpa_mxfp8(t["q"], t["k"], t["v"], t["descale_q"], t["descale_k"], t["descale_v"],
                                     attn_scale=float(sm_scale), generate_stats=False)
    o.set_output(True).set_dim(tuple(o_shape)).set_stride(tuple(o_stride)).set_data_type(
        _cudnn_out_type(cudnn, out_dtype))
    amax_o.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    t["o"], t["amax_o"] = o, amax_o
    try:
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    except cudnn.cudnnGraphNotSupportedError as exc:
        raise RuntimeError(
            f"cudnn_mxfp8: cuDNN {format_version(backend_version(cudnn))} has no MXFP8 SDPA engine for "
            f"q{tuple(q.shape)}"
            f", k{tuple(k.shape)}, v{tuple(v.shape)}, output {out_dtype}: {exc}"
        ) from exc
    return _Graph(g, t, int(g.get_workspace_size()), False, "mxfp8")


def mxfp8_attention(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale, out_dtype):
    """``qattn::block_scaled_attention`` for MXFP8 Q/K/V on cuDNN's ``sdpa_mxfp8`` (kernel ``cudnn_mxfp8``).

    **Blackwell only**: compute capability 10.0 (sm_100) or 10.3 (sm_103) with a cuDNN backend >= 9.21 (not 9.23.0/
    9.23.1); it cannot run on Hopper (H100/H200), where it raises ``RuntimeError``. Built to the documented
    cudnn-frontend 1.32 API; not yet run on hardware by qattn_fx.

    Inputs (the op's layouts): ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)`` e4m3 with E8M0 scales ``(B, H, S, D/32)``
    (32 channels per scale); ``v (B, Hkv, Skv, Dv)`` e4m3 with E8M0 scales ``(B, Hkv, >= ceil(Skv/32), Dv)`` (32 tokens
    per scale; blocks past ``ceil(Skv/32)``, the quantize op's padding, are dropped before packing); any data strides
    with a unit stride on D (V sequence-fastest is copied to BSHD). D, Dv ∈ {64, 128}; ``out_dtype`` bf16/fp16. The
    scales are re-laid out on every call by :func:`pack_f8_128x4` (Q/K, rowwise) and
    :func:`pack_f8_128x4_columnwise` (V) — two small gathers over ``B·H·S·D/32`` bytes. Returns ``(B, Hq, Sq, Dv)``
    stored BSHD.
    """
    kernel = "cudnn_mxfp8"
    _check_mxfp8_inputs(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, out_dtype)
    device = require_cuda(kernel, q=q, k=k, v=v, q_sf=q_sf, k_sf=k_sf, v_sf=v_sf)
    require_capability(kernel, device, MXFP8_ARCHS,
                       "cuDNN sdpa_mxfp8 runs on data-center Blackwell only; it cannot run on Hopper")
    b, hq, sq, _ = q.shape
    dv = v.shape[3]
    if b == 0 or sq == 0 or hq == 0:
        return empty_bshd(b, hq, sq, dv, out_dtype, device)
    cudnn = import_cudnn(kernel)
    check_cudnn_version(kernel, backend_version(cudnn), MXFP8_MIN_CUDNN, MXFP8_BAD_CUDNN)
    if v.stride(3) != 1:
        v = v.transpose(1, 2).contiguous().transpose(1, 2)  # cuDNN needs a unit stride on D
    e8m0 = torch.float8_e8m0fnu
    descales = {
        "descale_q": pack_f8_128x4(q_sf).view(e8m0),
        "descale_k": pack_f8_128x4(k_sf).view(e8m0),
        "descale_v": pack_f8_128x4_columnwise(v_sf[:, :, : (v.shape[2] + 31) // 32]).view(e8m0),
    }
    o_buf = empty_bshd(b, hq, sq, dv, out_dtype, device)
    handle = thread_handle(cudnn, device)
    key = mxfp8_graph_key(device_index(device), q, k, v, sm_scale, out_dtype)
    entry = GRAPH_CACHE.get_or_build(
        key, lambda: _build_mxfp8_graph(cudnn, handle, q, k, v, descales, o_buf.shape, o_buf.stride(), sm_scale,
                                        out_dtype))
    t = entry.tensors
    pack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: o_buf,
            t["amax_o"]: torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)}
    for name, sf in descales.items():
        pack[t[name]] = sf
    workspace = torch.empty(entry.workspace_size, dtype=torch.uint8, device=device)
    entry.graph.execute(pack, workspace, handle=handle)
    return o_buf
