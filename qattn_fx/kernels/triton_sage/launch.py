"""triton_sage's host side: loading the kernel (compiled or interpreted), autotuning, launching, offline compiles."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ... import block_sparse
from .. import _sage_common as common
from .. import requirements as kernel_requirements
from .._cuda_utils import bias_stride, empty_bshd
from .._cuda_utils import triton_interpreting as interpreter_active
from . import source
from .config import BLOCK_N_BY_CAPABILITY, CONFIGS, INTERPRET_CONFIG, KernelConfig, forced_config

try:  # GPU libraries are optional at import time; the kernel raises a clear error without them.
    import triton

    _TRITON_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only without triton
    triton = None
    _TRITON_ERROR = exc

KERNEL = "triton_sage"
#: Head dims the kernel is compiled for (Q/K and V) and the compute capabilities with FP8 MMAs it targets: read
#: from the kernel registry (:data:`qattn_fx.kernels.KERNELS`), where they are declared once.
(_REQUIREMENTS,) = kernel_requirements(KERNEL)
HEAD_DIMS = _REQUIREMENTS.head_dims.allowed
CAPABILITIES = _REQUIREMENTS.capabilities

_AUTOTUNE_KEY = ["HEAD_DIM", "HEAD_DIM_V", "QK_KIND", "Q_BLOCK", "K_BLOCK", "V_SEQ_MAJOR", "RETURN_LSE",
                 "PV_SPLIT", "HAS_BIAS", "SPARSE", "SQ_BUCKET", "SKV_BUCKET"]
_TUNED: dict[str, object] = {}  # the autotuned wrapper of the compiled kernel


def kernel_module(interpret: bool):
    """:mod:`.kernel` loaded with ``@triton.jit`` in interpreter (``interpret``) or compiled mode, once each
    (:mod:`.source`)."""
    if triton is None:
        raise RuntimeError(f"triton_sage needs triton: {_TRITON_ERROR}")
    return source.load("kernel", interpret)


def sparse_config_error(config: KernelConfig) -> Optional[str]:
    """Why ``config`` cannot run a block-sparse call (``None`` if it can): a program's rows must lie in one query
    tile and a key tile must be whole sub-tiles, so BLOCK_M and BLOCK_N must divide 128
    (:data:`~qattn_fx.block_sparse.BLOCK_ROWS`, :data:`~qattn_fx.block_sparse.BLOCK_KEYS`)."""
    if block_sparse.BLOCK_ROWS % config.block_m or block_sparse.BLOCK_KEYS % config.block_n:
        return (f"triton_sage: config {config} is invalid for block-sparse calls (block_index/block_count); valid: "
                f"BLOCK_M dividing {block_sparse.BLOCK_ROWS} and BLOCK_N dividing {block_sparse.BLOCK_KEYS} (a "
                "block's query rows and keys)")
    return None


def prune_configs(configs, named_args, **kwargs):
    """The configs the autotuner times for a call: those with the device's key tile
    (:data:`BLOCK_N_BY_CAPABILITY`, so that every candidate gives the same output), on sm_89 (``PV_SPLIT``: Ada's
    mma.sync path) only 8-warp ones without ``pipe``, for block-sparse calls (``SPARSE``) only those whose
    BLOCK_M and BLOCK_N divide 128 (:func:`sparse_config_error`), and for short query sequences only row blocks the
    sequence fills (where any remain)."""
    sq = named_args.get("SEQ_Q", 1 << 30)
    ada = kwargs.get("PV_SPLIT", named_args.get("PV_SPLIT", False))
    sparse = kwargs.get("SPARSE", named_args.get("SPARSE", False))
    block_n = BLOCK_N_BY_CAPABILITY[(8, 9) if ada else (9, 0)]
    same = [c for c in configs if c.kwargs["BLOCK_N"] == block_n
            and not (ada and (c.num_warps < 8 or c.kwargs.get("PIPE", 0)))
            and not (sparse and sparse_config_error(KernelConfig.from_triton(c)))]
    if not same:
        raise ValueError(f"triton_sage: no autotuned config has BLOCK_N={block_n} for "
                         f"{'sm_89' if ada else 'sm_90'}{' and block-sparse calls' if sparse else ''}; "
                         f"configs: {[str(KernelConfig.from_triton(c)) for c in configs]}")
    fills = [c for c in same if c.kwargs["BLOCK_M"] <= max(64, triton.next_power_of_2(sq))]
    return fills or same


def tuned_candidates(capability: tuple[int, int], sq: int, sparse: bool = False) -> list[KernelConfig]:
    """The configs the autotuner times for a call with ``sq`` query rows on ``capability`` (``sparse``: a
    block-sparse call; :func:`prune_configs` on :data:`CONFIGS`); they share :attr:`KernelConfig.numerics`."""
    kept = prune_configs([c.to_triton() for c in CONFIGS], {"SEQ_Q": sq}, PV_SPLIT=tuple(capability) != (9, 0),
                         SPARSE=sparse)
    return [KernelConfig.from_triton(c) for c in kept]


def _tuned():
    """The compiled kernel under ``triton.autotune`` over :data:`CONFIGS`."""
    if "kernel" not in _TUNED:
        _TUNED["kernel"] = triton.autotune(configs=[c.to_triton() for c in CONFIGS], key=_AUTOTUNE_KEY,
                                           prune_configs_by={"early_config_prune": prune_configs})(
            kernel_module(False)._sage_fwd)
    return _TUNED["kernel"]


def best_config() -> Optional[KernelConfig]:
    """The autotuner's most recent choice (for reports); ``None`` before any tuning."""
    cfg = getattr(_TUNED.get("kernel"), "best_config", None)
    return None if cfg is None else KernelConfig.from_triton(cfg)


def check_device(x: torch.Tensor) -> Optional[tuple[int, int]]:
    """Capability of ``x``'s GPU (``None`` under the interpreter); raises where the kernel cannot run."""
    if interpreter_active():
        return None
    if x.device.type != "cuda":
        raise RuntimeError(
            f"triton_sage runs on CUDA tensors (sm_89 / sm_90); got device {x.device}. "
            "Set TRITON_INTERPRET=1 to run it under the Triton interpreter on CPU.")
    cap = tuple(torch.cuda.get_device_capability(x.device))
    if cap not in CAPABILITIES:
        valid = ", ".join(f"sm_{a}{b}" for a, b in CAPABILITIES)
        raise RuntimeError(f"triton_sage needs an FP8-capable Ada/Hopper GPU; got compute capability "
                           f"sm_{cap[0]}{cap[1]} {cap}; valid: {valid}")
    return cap


def _launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, return_lse, cap, interpret,
            key_bias=None, out=None, lse=None, key_range=None, block_index=None, block_count=None):
    """Output tensors, positional kernel args and constexpr meta for one call (shared by the launch and AOT);
    ``out``/``lse`` given: write into them (a batch chunk of a larger call); ``key_range``: ``key_bias``'s
    :func:`~.._sage_common.bias_range` (required with it: the caller takes it once per call); ``block_index`` /
    ``block_count``: the block lists of these batch elements (checked by the caller)."""
    common.check_key_range(KERNEL, key_bias, key_range)
    bsz, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if out is None:
        out = empty_bshd(bsz, hq, sq, dv, out_dtype, q.device)
    if lse is None:
        lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    v_seq_major = common.seq_major(v)
    qs = q_scale if q_scale is not None else v_scale  # dummies for bf16/fp16 Q/K and no bias (never read)
    ks = k_scale if k_scale is not None else v_scale
    kb = key_bias if key_bias is not None else v_scale
    kbr = key_range if key_bias is not None else v_scale
    sparse = block_index is not None
    bi, bc = (block_index, block_count) if sparse else (v_scale, v_scale)
    args = [
        q, k, v, qs, ks, v_scale, kb, kbr, bi, bc, out, lse,
        float(sm_scale) * common.LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        *common.scale_strides(q_scale), *common.scale_strides(k_scale), *common.scale_strides(v_scale),
        bias_stride(key_bias),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, sq, skv,
        common.seq_bucket(sq), common.seq_bucket(skv),
    ]
    meta = dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, QK_KIND=common.QK_KIND[q.dtype],
        Q_BLOCK=q_block if q_scale is not None else 0, K_BLOCK=k_block if k_scale is not None else 0,
        V_SEQ_MAJOR=v_seq_major, RETURN_LSE=return_lse,
        # sm_90 FP8 dots default to max_num_imprecise_acc = 2^30, which keeps Triton from folding `acc + dot` into
        # the MMA; elsewhere the default is 0, so the kernel passes BLOCK_N to keep the per-tile accumulator apart.
        PV_SPLIT=cap is not None and cap != (9, 0),
        INTERPRET=interpret,
        V_ALIGN=common.pow2_divisor(v.stride(-1), 16) if v_seq_major else 16,
        HAS_BIAS=key_bias is not None,
        SPARSE=sparse,
    )
    return out, lse, args, meta


def _loop_end(config: KernelConfig, skv: int, interpret: bool, sparse: bool = False) -> int:
    """The main loop's end (a constexpr only under the interpreter; compiled kernels compute it themselves); block-
    sparse calls: the most sub-tiles a list can name (every key tile's ``128 / BLOCK_N``)."""
    if not interpret:
        return 0
    if sparse:
        return block_sparse.tiles(1, skv)[1] * (block_sparse.BLOCK_KEYS // config.block_n)
    if config.pipe:
        return ((skv - 1) // config.block_n) * config.block_n
    return (skv // config.block_n) * config.block_n


def attention(q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int, sm_scale: float,
              out_dtype: torch.dtype, *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None,
              block_index: Optional[torch.Tensor] = None, block_count: Optional[torch.Tensor] = None):
    """``qattn::scaled_attention`` on this kernel; with ``return_lse`` also the LSE ``(B, Hq, Sq)`` fp32.

    Layouts and dtypes: see the package docstring. ``key_bias``: fp32 ``(B|1, Skv)`` added to the logits (masked
    keys ``-inf``; a row with every key masked gives 0 and LSE ``-inf``). The LSE is ``ln Σ_j exp(s_ij)`` of the
    dequantized, scaled (and biased) logits ``s = q·kᵀ·sm_scale + bias`` (natural log). ``block_index`` /
    ``block_count``: block lists (:mod:`qattn_fx.block_sparse`, int32 ``(B, Hq, ceil(Sq/128), ceil(Skv/128))`` /
    ``(B, Hq, ceil(Sq/128))``): each program visits only the key tiles its query tile's list names; a query tile
    that visits nothing gives 0 and LSE ``-inf``. Launches on the current stream, never synchronizes. Calls of
    more than :data:`~qattn_fx.kernels._sage_common.MAX_GRID_Y` (batch, head) pairs run in batch chunks (the lists
    too).
    """
    common.validate(KERNEL, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias, block_index, block_count)
    sparse = block_index is not None
    cap = check_device(q)
    interpret = interpreter_active()
    config = forced_config() or (INTERPRET_CONFIG if interpret else None)
    if sparse and config is not None and sparse_config_error(config):
        raise ValueError(sparse_config_error(config))
    key_range = None if key_bias is None else common.bias_range(key_bias)  # once per call, chunked with the bias
    out, lse, args, meta = _launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype,
                                   return_lse, cap, interpret, key_bias, key_range=key_range,
                                   block_index=block_index, block_count=block_count)
    bsz, hq, sq = q.shape[0], q.shape[1], q.shape[2]
    if sq == 0 or bsz == 0 or hq == 0:
        return (out, lse) if return_lse else out
    for lo, hi in common.batch_chunks(bsz, hq):
        if (lo, hi) != (0, bsz):
            chunk = [common.batch_chunk(t, lo, hi) for t in (q, q_scale, k, k_scale, v, v_scale, key_bias, key_range,
                                                             block_index, block_count)]
            _, _, args, meta = _launch(*chunk[:6], q_block, k_block, sm_scale, out_dtype, return_lse, cap,
                                       interpret, chunk[6], out[lo:hi], lse[lo:hi] if return_lse else None,
                                       chunk[7], chunk[8], chunk[9])
        _run(interpret, config, args, meta, hi - lo, hq, sq, k.shape[2], q.device)
    return (out, lse) if return_lse else out


def _run(interpret, config, args, meta, bsz, hq, sq, skv, device) -> None:
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if config is not None:
            grid = (triton.cdiv(sq, config.block_m), bsz * hq)
            kernel_module(interpret)._sage_fwd[grid](
                *args, **meta, **config.meta(), INTERP_LOOP_END=_loop_end(config, skv, interpret, meta["SPARSE"]),
                num_warps=config.num_warps, num_stages=config.num_stages)
        else:
            grid = lambda meta_: (triton.cdiv(sq, meta_["BLOCK_M"]), bsz * hq)  # noqa: E731
            _tuned()[grid](*args, **meta, INTERP_LOOP_END=0)


def scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, *, key_bias=None,
                     return_lse=False, block_index=None, block_count=None):
    """Kernel entry for ``qattn::scaled_attention`` (``kernel="triton_sage"``); ``return_lse``: also the LSE
    (``qattn::scaled_attention_lse``); ``block_index`` / ``block_count``: block lists (:func:`attention`)."""
    return attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, key_bias=key_bias,
                     return_lse=return_lse, block_index=block_index, block_count=block_count)


# ------------------------------------------------------------------------------------------------------------------
# Offline compilation (no GPU needed): what a launch would compile, for CI checks and register/spill reports
# ------------------------------------------------------------------------------------------------------------------


def compile_for(capability: tuple[int, int], config: KernelConfig, q, q_scale, k, k_scale, v, v_scale,
                q_block: int, k_block: int, sm_scale: float = 0.125, out_dtype: torch.dtype = torch.bfloat16,
                *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None,
                block_index: Optional[torch.Tensor] = None, block_count: Optional[torch.Tensor] = None):
    """Compile (not run) the kernel a CUDA launch with these inputs would use, for ``capability`` and ``config``
    (``block_index`` / ``block_count``: the block-sparse variant; meta tensors suffice).

    Inputs may live on the ``meta`` device (only dtypes, shapes and strides are read); data pointers are assumed
    16-byte aligned and ints are specialized like a real launch (== 1 → constant, % 16 == 0 → divisibility).
    Returns Triton's compiled kernel (``.asm["ttgir" | "ptx" | "cubin"]``, ``.metadata.shared``). Needs only
    Triton's bundled ptxas, not a GPU.
    """
    from .._offline import compile_offline

    kernel = kernel_module(False)._sage_fwd
    common.validate(KERNEL, q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias, block_index, block_count)
    if block_index is not None and sparse_config_error(config):
        raise ValueError(sparse_config_error(config))
    _, _, args, meta = _launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype,
                               return_lse, tuple(capability), False, key_bias,
                               key_range=None if key_bias is None else common.bias_range(key_bias),
                               block_index=block_index, block_count=block_count)
    meta.update(INTERP_LOOP_END=0, **config.meta())
    return compile_offline(kernel, args, meta, capability,
                           {"num_warps": config.num_warps, "num_stages": config.num_stages})
