"""FlashInfer kernels: ``flashinfer_fa3_fp8`` (Hopper FA3 FP8, per-head scales) and ``flashinfer_trtllm_sage``
(trtllm-gen SageAttention, Blackwell).

``import flashinfer`` happens inside the functions: the package imports on machines without ``flashinfer-python``.
API names and arguments were checked against the flashinfer-python 0.7.2.post1 wheel sources (``flashinfer/prefill.py``:
``single_prefill_with_kv_cache``, ``BatchPrefillWithRaggedKVCacheWrapper.plan/run``,
``trtllm_ragged_attention_deepseek``; ``csrc/single_prefill_fp8_sm90.cu``, ``csrc/batch_prefill_fp8_sm90.cu`` and
``csrc/trtllm_fmha_kernel_launcher.cu`` for which strides the kernels honour;
``csrc/nv_internal/tensorrt_llm/common/sageQuant.cu`` for the Sage scale layout).

Layouts. FlashInfer works on NHD ``(tokens, heads, D)`` tensors. Our ``(B, H, S, D)`` tensors are usually BSHD-physical
views, for which ``x[b].transpose(0, 1)`` (one sequence) and ``x.transpose(1, 2).reshape(B·S, H, D)`` (the ragged
batch) are views, not copies. Where a copy is unavoidable the code says why. Outputs are written into (or returned as)
the ``(B, Hq, Sq, Dv)`` BSHD layout the op promises.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
from typing import Sequence

import torch

from ..requirements import parse_version
from . import requirements as _kernel_requirements
from ._cuda_utils import (FifoCache, PerDevice, device_index, empty_bshd, log_once, refuse_during_capture,
                          refuse_empty_keys, require_16bit_output, require_capability, require_cuda)

logger = logging.getLogger(__name__)

#: Architectures, head dims and the library floor: the kernel registry's declarations
#: (:data:`qattn_fx.kernels.KERNELS`, read here, not restated).
(_FA3,) = _kernel_requirements("flashinfer_fa3_fp8")
FA3_ARCHS = _FA3.capabilities
FA3_HEAD_DIMS = _FA3.head_dims.allowed
(_SAGE_INT8,) = _kernel_requirements("flashinfer_trtllm_sage", "int8")
(_SAGE_FP8,) = _kernel_requirements("flashinfer_trtllm_sage", "fp8")
SAGE_INT8_ARCHS = _SAGE_INT8.capabilities
SAGE_FP8_ARCHS = _SAGE_FP8.capabilities
SAGE_BLOCKS = (1, 4, 16)
SAGE_HEAD_DIMS = _SAGE_FP8.head_dims.allowed
#: ``sage_attn_sfs`` exists from 0.6.11; the ragged per-sequence scale layout used here is the one of 0.6.16rc1+.
SAGE_MIN_FLASHINFER = _SAGE_FP8.library[1]
#: Float workspace per device, shared by every FlashInfer call on that device (FlashInfer recommends 128 MB).
WORKSPACE_BYTES = 128 * 1024 * 1024

#: Batch-prefill wrappers with their plan, keyed by :func:`fa3_plan_key`.
PLAN_CACHE = FifoCache(maxsize=32)
#: Device ``seq_lens`` / ``cum_seq_lens`` tensors of the ragged Sage call, keyed by (device, B, Sq, Skv).
_RAGGED_META = FifoCache(maxsize=64)


def _import_flashinfer(kernel: str):
    try:
        import flashinfer  # noqa: PLC0415 (lazy on purpose)
    except ImportError as exc:
        raise RuntimeError(f"{kernel} needs flashinfer-python (pip install flashinfer-python); "
                           f"'import flashinfer' failed: {exc}") from exc
    return flashinfer


def flashinfer_version(flashinfer) -> str:
    version = getattr(flashinfer, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def check_flashinfer_version(kernel: str, version: str, minimum: str) -> None:
    """``RuntimeError`` unless ``version >= minimum`` (PEP 440-ish: ``0.6.16rc1 < 0.6.16 < 0.7.2.post1``)."""
    if parse_version(version) < parse_version(minimum):
        raise RuntimeError(f"{kernel} needs flashinfer-python >= {minimum}; found {version}")


def _workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


_WORKSPACES = PerDevice("FlashInfer workspace buffer", _workspace)


def per_head_scale(scale: torch.Tensor, heads: int) -> torch.Tensor:
    """A ``(1, H|1, 1)`` per-head / per-tensor scale as FlashInfer's contiguous fp32 ``[H]`` (a view when already
    per-head; a tiny device copy for a per-tensor scale)."""
    flat = scale.reshape(-1).float()
    if flat.numel() == heads:
        return flat.contiguous()
    if flat.numel() == 1:
        return flat.expand(heads).contiguous()
    raise ValueError(f"scale with shape {tuple(scale.shape)} is neither per-head ({heads} values) nor per-tensor")


def _tokens_major(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, D)`` → ragged NHD ``(B·S, H, D)``: a view for BSHD-physical memory; otherwise ``reshape`` copies,
    because the ragged layout addresses the tokens of all sequences through one token stride (B and S must merge)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _v_nhd(v: torch.Tensor) -> torch.Tensor:
    if v.stride(3) != 1:
        # V stored sequence-fastest (the layout Hopper Sage kernels want): FlashInfer needs a unit stride on D
        # (FA3 transposes V in shared memory itself; trtllm-gen's TMA reads D-contiguous rows). One BSHD copy.
        return v.transpose(1, 2).contiguous().transpose(1, 2)
    return v


# ------------------------------------------------------------------------------------------------------------------
# flashinfer_fa3_fp8
# ------------------------------------------------------------------------------------------------------------------


def _check_fa3_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype) -> None:
    kernel = "flashinfer_fa3_fp8"
    if q_scale is None or k_scale is None:
        raise ValueError(f"{kernel} needs float8_e4m3fn Q/K with per-head scales; got unquantized {q.dtype} Q/K "
                         "(use Recipe(qk_dtype='fp8', v_dtype='fp8', scale_scope='head'))")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{kernel}: {name} must be float8_e4m3fn; got {t.dtype}; valid: torch.float8_e4m3fn")
    if q_block != 0 or k_block != 0:
        raise ValueError(f"{kernel} takes per-head (or per-tensor) Q/K scales; got q_block={q_block}, "
                         f"k_block={k_block}; valid: q_block=0, k_block=0 (Recipe scale_scope='head')")
    b = q.shape[0]
    for name, s, h in (("q_scale", q_scale, q.shape[1]), ("k_scale", k_scale, k.shape[1]),
                       ("v_scale", v_scale, v.shape[1])):
        if s.shape[0] != 1 and b != 1:
            raise ValueError(f"{kernel}: {name} has shape {tuple(s.shape)}; FlashInfer FA3 takes one scale per head "
                             f"shared by the batch; valid: (1, {h}, 1) or (1, 1, 1)")
        if s.shape[-1] != 1 or s.shape[1] not in (1, h):
            raise ValueError(f"{kernel}: {name} has shape {tuple(s.shape)}; valid: (1, {h}, 1) per head or "
                             "(1, 1, 1) per tensor (no per-channel or per-block scales)")
    d, dv = q.shape[3], v.shape[3]
    if d not in FA3_HEAD_DIMS or dv != d:
        raise ValueError(f"{kernel}: head_dim={d} (V {dv}) is not supported; valid: equal Q/K/V head dims in "
                         f"{', '.join(map(str, FA3_HEAD_DIMS))}")
    require_16bit_output(kernel, out_dtype, "FA3 FP8")
    refuse_empty_keys(kernel, k)


def fa3_plan_key(index: int, b: int, sq: int, skv: int, hq: int, hkv: int, d: int, dv: int,
                 out_dtype: torch.dtype, sm_scale: float) -> tuple:
    """Cache key of a planned ``BatchPrefillWithRaggedKVCacheWrapper`` (the plan depends only on these). Pure."""
    return ("fa3_fp8_ragged", index, b, sq, skv, hq, hkv, d, dv, out_dtype, float(sm_scale))


def _log_fa3_jit(d: int, out_dtype: torch.dtype, which: str) -> None:
    log_once(
        logger, ("fa3-jit", d, out_dtype, which), logging.WARNING,
        "flashinfer_fa3_fp8: FlashInfer JIT-compiles its FA3 FP8 %s kernel on the first use of (e4m3, head_dim=%d, "
        "out=%s): about 100 s once per configuration and machine (needs nvcc, CUDA >= 12.3; cached under "
        "~/.cache/flashinfer, FLASHINFER_WORKSPACE_BASE moves it)", which, d, str(out_dtype).replace("torch.", ""),
    )


def _build_fa3_wrapper(flashinfer, device, b, sq, skv, hq, hkv, d, dv, out_dtype, sm_scale):
    refuse_during_capture("planning a FlashInfer batch prefill")
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_WORKSPACES.get(device), "NHD", backend="fa3")
    # Host indptr tensors: plan() reads them on the host anyway and copies them to the device itself.
    qo_indptr = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32)
    kv_indptr = torch.arange(0, (b + 1) * skv, skv, dtype=torch.int32)
    wrapper.plan(qo_indptr, kv_indptr, hq, hkv, d, head_dim_vo=dv, causal=False, sm_scale=float(sm_scale),
                 q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn, o_data_type=out_dtype)
    return wrapper


def fa3_fp8_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype):
    """``qattn::scaled_attention`` with per-head FP8 Q/K/V on FlashInfer's FA3 FP8 prefill (``flashinfer_fa3_fp8``).

    Hopper only (compute capability 9.0; FlashInfer's FA3 kernels are sm_90a). Inputs: ``q (B, Hq, Sq, D)``,
    ``k (B, Hkv, Skv, D)``, ``v (B, Hkv, Skv, D)`` float8_e4m3fn, any strides with a unit stride on D (V stored
    sequence-fastest is copied once); scales fp32 ``(1, H, 1)`` per head or ``(1, 1, 1)`` per tensor (passed as
    FlashInfer's ``scale_q [Hq]``, ``scale_k [Hkv]``, ``scale_v [Hkv]``). D ∈ {64, 128, 256} and equal for Q/K/V;
    ``out_dtype`` bf16 or fp16 (FA3 FP8 writes 16-bit outputs: fp32 raises ``ValueError``). GQA, cross-attention and
    B > 1 are supported. Returns ``(B, Hq, Sq, D)`` stored BSHD.

    B = 1 calls ``single_prefill_with_kv_cache(..., kv_layout="NHD", backend="fa3", o_dtype=out_dtype)`` on
    ``x[0].transpose(0, 1)`` views (the kernel takes token and head strides, so BHSD memory works without copies too);
    its ``(Sq, Hq, D)`` output *is* the BSHD layout. B > 1 runs ``BatchPrefillWithRaggedKVCacheWrapper(workspace,
    "NHD", backend="fa3")`` planned once per shape (:data:`PLAN_CACHE`), writing into the BSHD output buffer.

    Numerics (FlashInfer's ``StandardFP8Attention``): logits scaled by ``q_scale[h]·k_scale[h]·sm_scale``, P stored as
    e4m3(P·448) relative to the running row max, ``O = P·V · v_scale[h] / 448 / l`` in fp32, one rounding to
    ``out_dtype``. The first use of a (head_dim, out_dtype) JIT-compiles the kernel (~100 s; logged once).
    The planned B > 1 path is not CUDA-graph capturable (``plan`` syncs with the host).
    """
    kernel = "flashinfer_fa3_fp8"
    _check_fa3_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype)
    device = require_cuda(kernel, q=q, k=k, v=v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    require_capability(kernel, device, FA3_ARCHS, "FlashInfer's FA3 FP8 kernels are built for sm_90a (Hopper) only")
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    if b == 0 or sq == 0 or hq == 0:
        return empty_bshd(b, hq, sq, dv, out_dtype, device)
    flashinfer = _import_flashinfer(kernel)
    v = _v_nhd(v)
    scale_q, scale_k, scale_v = per_head_scale(q_scale, hq), per_head_scale(k_scale, hkv), per_head_scale(v_scale, hkv)
    if b == 1:
        _log_fa3_jit(d, out_dtype, "single-prefill")
        o = flashinfer.single_prefill_with_kv_cache(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, o_dtype=out_dtype,
            causal=False, kv_layout="NHD", sm_scale=float(sm_scale), backend="fa3",
        )
        return o.unsqueeze(0).transpose(1, 2)  # (Sq, Hq, D) contiguous == BSHD for B = 1
    _log_fa3_jit(d, out_dtype, "batch ragged-prefill")
    key = fa3_plan_key(device_index(device), b, sq, skv, hq, hkv, d, dv, out_dtype, sm_scale)
    wrapper = PLAN_CACHE.get_or_build(
        key, lambda: _build_fa3_wrapper(flashinfer, device, b, sq, skv, hq, hkv, d, dv, out_dtype, sm_scale))
    out = empty_bshd(b, hq, sq, dv, out_dtype, device)
    wrapper.run(_tokens_major(q), _tokens_major(k), _tokens_major(v), scale_q, scale_k, scale_v,
                out=out.transpose(1, 2).view(b * sq, hq, dv))  # a view of the BSHD buffer (view() never copies)
    return out


# ------------------------------------------------------------------------------------------------------------------
# flashinfer_trtllm_sage: the ragged scale layout (pure torch) and the call
# ------------------------------------------------------------------------------------------------------------------


def ragged_scale_slots(seq_lens: Sequence[int], block: int) -> tuple[list[int], int]:
    """FlashInfer's Sage Q/K scale layout for a ragged batch: (first slot of each sequence, slots per head).

    Per head the scales form one flat vector of ``ceil(total / block) + B - 1`` slots; the scale of local token ``t``
    of sequence ``b`` sits at ``cum_seq_lens[b] // block + b + t // block`` (the ``+ b`` keeps a trailing partial
    block from sharing a slot with the next sequence). Source: flashinfer 0.7.x ``sageQuant.cu``.
    """
    if block < 1:
        raise ValueError(f"block={block} is invalid; valid: {', '.join(map(str, SAGE_BLOCKS))}")
    starts, cum = [], 0
    for i, n in enumerate(seq_lens):
        starts.append(cum // block + i)
        cum += int(n)
    return starts, (cum + block - 1) // block + len(starts) - 1


def to_ragged_block_scales(scale: torch.Tensor, seq_len: int, block: int, batch: int, heads: int) -> torch.Tensor:
    """Our per-block Q/K scales ``(B|1, H|1, NB)``, ``NB >= ceil(S/block)`` (B sequences of ``seq_len`` tokens;
    entries past ``ceil(S/block)`` are the quantize node's row padding) → FlashInfer's ragged
    ``(H, ceil(B·S/block) + B - 1)`` fp32 layout (:func:`ragged_scale_slots`); unused slots hold 0."""
    nb = (seq_len + block - 1) // block
    if scale.dim() != 3 or scale.shape[2] < nb or scale.shape[0] not in (1, batch) or scale.shape[1] not in (1, heads):
        raise ValueError(f"scale must have shape (B|1, H|1, >= ceil(S/{block})) = ({batch}|1, {heads}|1, >= {nb}); "
                         f"got {tuple(scale.shape)}")
    _, slots = ragged_scale_slots([seq_len] * batch, block)
    full = scale[..., :nb].float().expand(batch, heads, nb)
    seq = torch.arange(batch, dtype=torch.long, device=scale.device)
    starts = seq * seq_len // block + seq  # cum_seq_lens[b] // block + b, computed on the device (no host copy)
    index = (starts[:, None] + torch.arange(nb, dtype=torch.long, device=scale.device)[None, :]).reshape(-1)
    out = torch.zeros(heads, slots, dtype=torch.float32, device=scale.device)
    out[:, index] = full.permute(1, 0, 2).reshape(heads, batch * nb)
    return out


def to_channel_v_scale(v_scale: torch.Tensor, heads: int, dv: int) -> torch.Tensor:
    """One sequence's (or a batch-shared) V scale ``(1, H|1, Dv|1)`` → FlashInfer's contiguous fp32 ``[H, Dv]``."""
    if (v_scale.dim() != 3 or v_scale.shape[0] != 1 or v_scale.shape[1] not in (1, heads)
            or v_scale.shape[2] not in (1, dv)):
        raise ValueError(f"v_scale must have shape (1, {heads}|1, {dv}|1); got {tuple(v_scale.shape)}")
    return v_scale[0].float().expand(heads, dv).contiguous()


def _check_sage_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype) -> None:
    kernel = "flashinfer_trtllm_sage"
    if q_scale is None or k_scale is None:
        raise ValueError(f"{kernel} needs int8 or float8_e4m3fn Q/K with per-block scales; got unquantized {q.dtype}")
    if q.dtype not in (torch.int8, torch.float8_e4m3fn) or k.dtype != q.dtype:
        raise ValueError(f"{kernel}: Q/K must share a dtype in (torch.int8, torch.float8_e4m3fn); "
                         f"got {q.dtype}, {k.dtype}")
    if v.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{kernel}: v must be float8_e4m3fn; got {v.dtype}")
    for name, block in (("q_block", q_block), ("k_block", k_block)):
        if block not in SAGE_BLOCKS:
            raise ValueError(f"{kernel}: {name}={block} is not supported; valid: {', '.join(map(str, SAGE_BLOCKS))}")
    d, dv = q.shape[3], v.shape[3]
    if d not in SAGE_HEAD_DIMS or dv != d:
        raise ValueError(f"{kernel}: head_dim={d} (V {dv}) is not supported by the trtllm-gen ragged wrapper; "
                         f"valid: {', '.join(map(str, SAGE_HEAD_DIMS))}")
    valid_out = (torch.bfloat16,) if q.dtype == torch.int8 else (torch.bfloat16, torch.float16)
    if out_dtype not in valid_out:
        raise ValueError(f"{kernel}: out_dtype={out_dtype} is not supported with {q.dtype} Q/K; valid: "
                         + ", ".join(str(t).replace("torch.", "") for t in valid_out))
    refuse_empty_keys(kernel, k)


@functools.lru_cache(maxsize=None)
def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def sage_archs(qk_dtype: torch.dtype) -> tuple:
    """Capabilities with trtllm-gen Sage cubins: INT8 Q/K sm_100 only; FP8 Q/K sm_100 and sm_103."""
    return SAGE_INT8_ARCHS if qk_dtype == torch.int8 else SAGE_FP8_ARCHS


def _ragged_meta(device: torch.device, b: int, sq: int, skv: int) -> dict:
    def build():
        refuse_during_capture("creating the ragged sequence-length tensors")
        return {
            "seq_lens": torch.full((b,), skv, dtype=torch.int32, device=device),
            "cum_q": torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device),
            "cum_kv": torch.arange(0, (b + 1) * skv, skv, dtype=torch.int32, device=device),
        }

    return _RAGGED_META.get_or_build((device_index(device), b, sq, skv), build)


def trtllm_sage_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, *,
                          skip_threshold=None, skip_label=""):
    """``qattn::scaled_attention`` as SageAttention on FlashInfer's trtllm-gen FMHA (``flashinfer_trtllm_sage``).

    **Blackwell only**: INT8 Q/K needs compute capability 10.0 (sm_100); FP8 Q/K 10.0 or 10.3 (the trtllm-gen cubins
    exist for nothing else), and flashinfer-python >= 0.6.16rc1 (the cubins are downloaded at first use). It cannot
    run on Hopper (H100/H200): it raises ``RuntimeError`` there. Built to FlashInfer's documented API; not yet run on
    hardware by qattn_fx.

    Inputs: ``q (B, Hq, Sq, 128)``, ``k (B, Hkv, Skv, 128)`` int8 or e4m3 with per-block scales ``(B|1, H|1,
    ceil(S/block))`` for ``q_block, k_block ∈ {1, 4, 16}``; ``v (B, Hkv, Skv, 128)`` e4m3 with ``v_scale (B|1, Hkv|1,
    128|1)`` (per channel, per head or per tensor). ``out_dtype`` bf16 (fp16 also for FP8 Q/K). Returns ``(B, Hq, Sq,
    128)`` stored BSHD.

    The call: ``trtllm_ragged_attention_deepseek(q, k, v, workspace, seq_lens, max_q_len, max_kv_len,
    bmm1_scale=sm_scale, bmm2_scale=1.0, ..., sage_attn_sfs=(q_sf, k_sf, None, v_sf),
    num_elts_per_sage_attn_blk=(q_block, k_block, 0, 1))``, Q as a dense ``(tokens, Hq, 128)`` tensor (the launcher
    passes only Q's pointer, so non-BSHD Q is copied), K/V as strided NHD views, the output written into the BSHD
    buffer. Q/K scales go through :func:`to_ragged_block_scales`.

    Batches: FlashInfer's ``v_sf [Hkv, Dv]`` is global over the ragged batch, while our per-channel V scale is per
    sequence (``(B, Hkv, Dv)``). Re-quantizing V to a shared scale would round V twice, and rescaling O per sequence
    afterwards would add a bf16 rounding, so neither keeps our numerics; instead, when ``v_scale`` differs per sequence
    (B > 1 and ``v_scale.shape[0] == B``) the kernel runs once per sequence (B launches; diffusion batches are 1-2),
    and when V's scale is batch-shared it runs the whole batch as one ragged call. Either way the numbers are those of
    the recipe: ``S = (q·k) · q_sf · k_sf · sm_scale``, P in FP8, ``O = P·v · v_sf / l``.

    ``skip_threshold`` (Skip-Softmax's λ, :mod:`qattn_fx.skip_softmax`) goes to trtllm-gen as
    ``skip_softmax_threshold_scale_factor = λ · Skv`` (its kernels divide by the key length), a Python float: read
    from the tensor on the host (a synchronization; not capturable in a CUDA graph), omitted when λ is 0. A
    FlashInfer without that argument raises. trtllm-gen's tiles need not be qattn_fx's 64 x 128, and it counts no
    skipped tiles (nothing is recorded under ``skip_label``). Not run on hardware.
    """
    kernel = "flashinfer_trtllm_sage"
    _check_sage_inputs(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, out_dtype)
    device = require_cuda(kernel, q=q, k=k, v=v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    require_capability(kernel, device, sage_archs(q.dtype),
                       "FlashInfer's trtllm-gen SageAttention cubins: INT8 Q/K sm_100 only, FP8 Q/K sm_100/sm_103; "
                       "they cannot run on Hopper")
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    if b == 0 or sq == 0 or hq == 0:
        return empty_bshd(b, hq, sq, dv, out_dtype, device)
    flashinfer = _import_flashinfer(kernel)
    check_flashinfer_version(kernel, flashinfer_version(flashinfer), SAGE_MIN_FLASHINFER)
    from flashinfer.prefill import trtllm_ragged_attention_deepseek  # noqa: PLC0415

    accepts_row_check = _accepts(trtllm_ragged_attention_deepseek, "skip_all_rows_active_check")
    skip_factor = None
    if skip_threshold is not None:
        if not _accepts(trtllm_ragged_attention_deepseek, "skip_softmax_threshold_scale_factor"):
            raise RuntimeError(f"{kernel}: this FlashInfer's trtllm_ragged_attention_deepseek takes no "
                               "skip_softmax_threshold_scale_factor; Skip-Softmax needs a FlashInfer that does")
        lam = float(skip_threshold.reshape(-1)[0])
        skip_factor = lam * skv if lam > 0 else None
    v = _v_nhd(v)
    out = empty_bshd(b, hq, sq, dv, out_dtype, device)
    workspace = _WORKSPACES.get(device)
    groups = [slice(0, b)] if (b == 1 or v_scale.shape[0] == 1) else [slice(i, i + 1) for i in range(b)]
    for part in groups:
        nb = part.stop - part.start
        qs = q_scale[part] if q_scale.shape[0] != 1 else q_scale
        ks = k_scale[part] if k_scale.shape[0] != 1 else k_scale
        vs = v_scale[part] if v_scale.shape[0] != 1 else v_scale
        meta = _ragged_meta(device, nb, sq, skv)
        query = _tokens_major(q[part]).contiguous()  # no-op for BSHD memory; the launcher assumes dense Q
        kwargs = dict(
            query=query, key=_tokens_major(k[part]), value=_tokens_major(v[part]), workspace_buffer=workspace,
            seq_lens=meta["seq_lens"], max_q_len=sq, max_kv_len=skv, bmm1_scale=float(sm_scale), bmm2_scale=1.0,
            o_sf_scale=-1.0, batch_size=nb, window_left=-1, cum_seq_lens_q=meta["cum_q"],
            cum_seq_lens_kv=meta["cum_kv"], enable_pdl=False, is_causal=False, return_lse=False,
            out=out[part].transpose(1, 2).view(nb * sq, hq, dv),  # a view of the BSHD buffer (view() never copies)
            sage_attn_sfs=(to_ragged_block_scales(qs, sq, q_block, nb, hq),
                           to_ragged_block_scales(ks, skv, k_block, nb, hkv), None,
                           to_channel_v_scale(vs, hkv, dv)),
            num_elts_per_sage_attn_blk=(q_block, k_block, 0, 1),
            backend="trtllm-gen",
        )
        if accepts_row_check:
            kwargs["skip_all_rows_active_check"] = True  # every sequence has Sq, Skv > 0: no device-side check
        if skip_factor is not None:
            kwargs["skip_softmax_threshold_scale_factor"] = skip_factor
        trtllm_ragged_attention_deepseek(**kwargs)
    return out


__all__ = [
    "fa3_fp8_attention",
    "trtllm_sage_attention",
    "ragged_scale_slots",
    "to_ragged_block_scales",
    "to_channel_v_scale",
    "per_head_scale",
    "fa3_plan_key",
    "check_flashinfer_version",
]
