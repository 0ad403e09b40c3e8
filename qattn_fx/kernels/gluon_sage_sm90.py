"""Hopper (sm_90) SageAttention kernel in Gluon: explicit async wgmma, TMA and mbarriers.

Same numerics as :mod:`qattn_fx.kernels.triton_sage` (the recipe's definition is
:func:`qattn_fx.kernels.reference.scaled_attention`; see triton_sage's docstring for the algorithm: exact
int32→fp32 with the 1.5·2^23 magic number, K scales per column/group/tile, exp2 online softmax on ``448·P``,
e4m3 P, two-level P·V accumulation, ``O = acc · v_scale / l``). What differs is the schedule, which plain
Triton 3.6 cannot express because it waits on every wgmma whose result is not a loop-carried accumulator:

* one warpgroup (4 warps) owns ``BLOCK_M = 64`` query rows; two CTAs share an SM;
* Q is loaded once by TMA; K and V stream through ``STAGES``-deep TMA rings (mbarrier per slot; out-of-range
  rows of tails are zero-filled by the TMA unit, so no pointer math or masks on the loads);
* iteration ``j`` issues ``S_j = Q·K_jᵀ`` and ``PV_{j-1} = P_{j-1}·V_{j-1}`` (fresh fp32 accumulator) back to
  back, waits only for ``S_j``, runs tile ``j``'s softmax while ``PV_{j-1}`` is still on the tensor cores,
  then waits for it and adds it to the running output (``acc = acc · alpha_{j-1} + PV_{j-1}``).

Inputs (checked by :func:`qattn_fx.kernels.triton_sage._validate` plus :func:`eligible`): int8/e4m3/bf16/fp16
Q ``(B, Hq, Sq, D)`` and K ``(B, Hkv, Skv, D)`` with unit stride on D and 16-byte aligned base and strides (BSHD
and BHSD views both); V e4m3 ``(B, Hkv, Skv, Dv)`` sequence-major (``stride(-2) == 1``, the quantize node's
layout, rows 16-byte aligned); head_dim 64/128; fp32 scales as for triton_sage.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only without a Gluon-capable triton
    triton = gluon = gl = None
    _GLUON_ERROR = exc


def _jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


def _constexpr_function(fn):
    return gluon.constexpr_function(fn) if gluon is not None else fn


BLOCK_M = 64
NUM_WARPS = 4


@_constexpr_function
def _mma_layout(num_warps, n, k_bits):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 256 // k_bits])


@_jit
def _col_scales(KS, stride_ksn, start_n, SEQ_KV, L: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr,
                MASK: gl.constexpr):
    """Per-column K scales of the tile at ``start_n`` in layout ``L`` (a slice of S's layout), 22-bit mantissa."""
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=L)
    if MASK:
        ks = gl.load(KS + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
    else:
        ks = gl.load(KS + (offs_n // K_BLOCK) * stride_ksn)
    return (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)


@_jit
def _softmax(s, m_i, l_i, rs, KS, stride_ksn, start_n, SEQ_KV,
             QK_KIND: gl.constexpr, K_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr):
    """One online-softmax step on the raw ``S`` tile (int32 + 1.5·2^23 for int8, else fp32).

    Returns ``(p8, alpha, l, m)``: e4m3 ``448·exp2(z - m)``, the rescale factor of earlier tiles, row sum, max.
    """
    s_layout: gl.constexpr = s.type.layout
    PER_COL: gl.constexpr = K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0
    GROUPED: gl.constexpr = K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N
    if QK_KIND == 0:
        t = s.to(gl.float32, bitcast=True)
    else:
        t = s
    if GROUPED:
        G: gl.constexpr = BLOCK_N // K_BLOCK
        t3 = gl.reshape(t, [t.shape[0], G, K_BLOCK])
        L3: gl.constexpr = t3.type.layout
        offs_g = start_n // K_BLOCK + gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        if MASK:
            ks = gl.load(KS + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
        else:
            ks = gl.load(KS + offs_g * stride_ksn)
        ks = (ks.to(gl.int32, bitcast=True) & -4).to(gl.float32, bitcast=True)
        ks3 = ks[None, :, None]
        if QK_KIND == 0:
            t3 = gl.fma(t3, ks3, -(ks3 * 12582912.0))
        else:
            t3 = t3 * ks3
        t = gl.convert_layout(gl.reshape(t3, [t.shape[0], BLOCK_N]), s_layout, assert_trivial=True)
    elif PER_COL:
        ks = _col_scales(KS, stride_ksn, start_n, SEQ_KV, gl.SliceLayout(0, s_layout), K_BLOCK, BLOCK_N, MASK)
        if QK_KIND == 0:
            t = gl.fma(t, ks[None, :], -(ks * 12582912.0)[None, :])
        else:
            t = t * ks[None, :]
    else:
        if QK_KIND == 0:
            t = t - 12582912.0
        if K_BLOCK > 0:  # one K scale for the whole tile
            rs = rs * gl.load(KS + (start_n // K_BLOCK) * stride_ksn)
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        valid = (offs_n < SEQ_KV)[None, :]
        t_max = gl.max(gl.where(valid, t, float("-inf")), axis=1)
    else:
        t_max = gl.max(t, axis=1)
    m_new = gl.maximum(m_i, t_max * rs)
    p = gl.exp2(t * rs[:, None] - (m_new - 8.807354922057604)[:, None])  # 448 · exp2(z - m)
    if MASK:
        p = gl.where(valid, p, 0.0)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p.to(gl.float8e4nv), alpha, l_i, m_new


@_jit
def _sage_fwd_sm90(
    q_desc, k_desc, v_desc, QS, KS, VS, Out, Lse,
    qk_scale,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsd,
    stride_ob, stride_oh, stride_os,
    H, GROUP, SEQ_Q, SEQ_KV,
    QK_KIND: gl.constexpr, Q_BLOCK: gl.constexpr, K_BLOCK: gl.constexpr, RETURN_LSE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """Grid ``(cdiv(Sq, 64), B · Hq)``, 4 warps. Descriptors: Q/K ``(B, H, S, D)``, V ``(B, Hkv, Dv, S)``."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    HEAD_DIM_V: gl.constexpr = v_desc.block_type.shape[2]
    NW: gl.constexpr = gl.num_warps()
    qk_bits: gl.constexpr = q_desc.dtype.primitive_bitwidth
    s_layout: gl.constexpr = _mma_layout(NW, BLOCK_N, qk_bits)
    o_layout: gl.constexpr = _mma_layout(NW, HEAD_DIM_V, 8)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    start_m = pid_m * BM
    n_tiles = gl.cdiv(SEQ_KV, BLOCK_N)

    # ---- shared memory: Q tile, K/V rings, barriers ----------------------------------------------------------
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        fill = i < n_tiles
        mbarrier.expect(k_bar.index(i), k_desc.block_type.nbytes, pred=fill)
        tma.async_copy_global_to_shared(k_desc, [b, hk, i * BLOCK_N, 0], k_bar.index(i), k_smem.index(i), pred=fill)
        mbarrier.expect(v_bar.index(i), v_desc.block_type.nbytes, pred=fill)
        tma.async_copy_global_to_shared(v_desc, [b, hk, 0, i * BLOCK_N], v_bar.index(i), v_smem.index(i), pred=fill)

    # ---- row scale: q_scale · sm_scale · log2(e) (· K's scale when it is per head/tensor) ---------------------
    offs_m = start_m + gl.arange(0, BM, layout=row_s)
    m_valid = offs_m < SEQ_Q
    ks_ptr = KS + b * stride_ksb + hk * stride_ksh
    if QK_KIND == 2:
        rs = gl.full([BM], 0.0, gl.float32, row_s) + qk_scale
    else:
        qs_ptr = QS + b * stride_qsb + h * stride_qsh
        if Q_BLOCK == 0:
            rs = gl.full([BM], 0.0, gl.float32, row_s) + gl.load(qs_ptr) * qk_scale
        else:
            rs = gl.load(qs_ptr + (offs_m // Q_BLOCK) * stride_qsn, mask=m_valid, other=0.0) * qk_scale
        if K_BLOCK == 0:
            rs = rs * gl.load(ks_ptr)

    if QK_KIND == 0:
        s_init = gl.full([BM, BLOCK_N], 0x4B400000, gl.int32, s_layout)  # S + 1.5·2^23 read as fp32
    else:
        s_init = gl.zeros([BM, BLOCK_N], gl.float32, s_layout)
    pv_zero = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)
    q2 = q_smem.reshape([BM, HEAD_DIM])

    # ---- tile 0 ----------------------------------------------------------------------------------------------
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q2, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_init,
                      use_acc=QK_KIND == 0, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    refill = STAGES < n_tiles
    mbarrier.expect(k_bar.index(0), k_desc.block_type.nbytes, pred=refill)
    tma.async_copy_global_to_shared(k_desc, [b, hk, STAGES * BLOCK_N, 0], k_bar.index(0), k_smem.index(0),
                                    pred=refill)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BM], 0.0, gl.float32, row_s)
    if n_tiles == 1:
        p8, alpha, l_i, m_i = _softmax(s, m_i, l_i, rs, ks_ptr, stride_ksn, 0, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N,
                                       True)
    else:
        p8, alpha, l_i, m_i = _softmax(s, m_i, l_i, rs, ks_ptr, stride_ksn, 0, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N,
                                       False)
    p_prev = gl.convert_layout(p8, p_layout)
    alpha_prev = gl.convert_layout(alpha, row_o)
    acc = gl.zeros([BM, HEAD_DIM_V], gl.float32, o_layout)

    # ---- steady state: S_j and PV_{j-1} in flight together; softmax_j overlaps PV_{j-1} ---------------------
    for j in range(1, n_tiles):
        slot = j % STAGES
        pslot = (j - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
        s = warpgroup_mma(q2, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_init,
                          use_acc=QK_KIND == 0, is_async=True)
        mbarrier.wait(v_bar.index(pslot), ((j - 1) // STAGES) & 1)
        pv = warpgroup_mma(p_prev, v_smem.index(pslot).reshape([HEAD_DIM_V, BLOCK_N]).permute((1, 0)), pv_zero,
                           use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        refill = j + STAGES < n_tiles
        mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes, pred=refill)
        tma.async_copy_global_to_shared(k_desc, [b, hk, (j + STAGES) * BLOCK_N, 0], k_bar.index(slot),
                                        k_smem.index(slot), pred=refill)
        if j == n_tiles - 1:
            p8, alpha, l_i, m_i = _softmax(s, m_i, l_i, rs, ks_ptr, stride_ksn, j * BLOCK_N, SEQ_KV, QK_KIND,
                                           K_BLOCK, BLOCK_N, True)
        else:
            p8, alpha, l_i, m_i = _softmax(s, m_i, l_i, rs, ks_ptr, stride_ksn, j * BLOCK_N, SEQ_KV, QK_KIND,
                                           K_BLOCK, BLOCK_N, False)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        acc = acc * alpha_prev[:, None] + pv
        refill = j - 1 + STAGES < n_tiles
        mbarrier.expect(v_bar.index(pslot), v_desc.block_type.nbytes, pred=refill)
        tma.async_copy_global_to_shared(v_desc, [b, hk, 0, (j - 1 + STAGES) * BLOCK_N], v_bar.index(pslot),
                                        v_smem.index(pslot), pred=refill)
        p_prev = gl.convert_layout(p8, p_layout)
        alpha_prev = gl.convert_layout(alpha, row_o)

    # ---- last P·V, epilogue: O = acc · v_scale / l ---------------------------------------------------------
    last = n_tiles - 1
    mbarrier.wait(v_bar.index(last % STAGES), (last // STAGES) & 1)
    pv = warpgroup_mma(p_prev, v_smem.index(last % STAGES).reshape([HEAD_DIM_V, BLOCK_N]).permute((1, 0)), pv_zero,
                       use_acc=False, is_async=True)
    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    acc = acc * alpha_prev[:, None] + pv

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    offs_dv = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
    vs = gl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd)
    inv_l = gl.convert_layout(1.0 / l_i, row_o)
    out = acc * inv_l[:, None] * vs[None, :]
    offs_mo = start_m + gl.arange(0, BM, layout=row_o)
    o_ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
              + offs_mo.to(gl.int64)[:, None] * stride_os + offs_dv[None, :])
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_mo < SEQ_Q)[:, None])
    if RETURN_LSE:
        lse = (m_i + gl.log2(l_i) - 8.807354922057604) * 0.6931471805599453
        gl.store(Lse + (b.to(gl.int64) * H + h) * SEQ_Q + offs_m, lse, mask=m_valid)


# ------------------------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------------------------

#: Compute capability this kernel is built for (wgmma, TMA: Hopper only).
CAPABILITY = (9, 0)
ENV_CONFIG = "QATTN_GLUON_SAGE_CONFIG"


@dataclass(frozen=True)
class GluonConfig:
    """``block_n`` keys per tile (64 or 128) and ``stages`` (depth of the K/V TMA rings, 2-4)."""

    block_n: int
    stages: int

    def __post_init__(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n={self.block_n!r} is invalid; valid: 64, 128")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"stages={self.stages!r} is invalid; valid: 2, 3, 4")

    def __str__(self) -> str:
        return f"BM{BLOCK_M}_BN{self.block_n}_s{self.stages}"

    @classmethod
    def parse(cls, text: str) -> "GluonConfig":
        """``"64,3"`` (block_n, stages) or ``str()`` of a config (``BM64_BN64_s3``)."""
        fields = [f for f in text.replace("_", ",").split(",") if f.strip()]
        numbers = [int("".join(c for c in f if c.isdigit()) or -1) for f in fields]
        if len(numbers) == 3 and fields[0].upper().startswith("BM"):
            numbers = numbers[1:]
        if len(numbers) != 2:
            raise ValueError(f"config {text!r} is invalid; valid: 'BLOCK_N,STAGES' such as '64,3'")
        return cls(*numbers)


#: Default per head_dim: the largest tile that compiles without register spills (ptxas, Triton 3.6): at head_dim
#: 128 a 64-key tile (252 registers), at 64 a 128-key tile.
DEFAULT_CONFIGS = {128: GluonConfig(64, 3), 64: GluonConfig(128, 3)}
#: Swept by benchmarks/tune_triton_sage.py --kernel gluon.
CONFIGS = (GluonConfig(64, 2), GluonConfig(64, 3), GluonConfig(64, 4), GluonConfig(128, 2), GluonConfig(128, 3))

_forced: Optional[GluonConfig] = None


@contextlib.contextmanager
def use_config(config: Optional[GluonConfig | str]) -> Iterator[None]:
    """Force one config inside the block (``None``: the per-head-dim default)."""
    global _forced
    previous = _forced
    _forced = GluonConfig.parse(config) if isinstance(config, str) else config
    try:
        yield
    finally:
        _forced = previous


def config_for(head_dim: int) -> GluonConfig:
    if _forced is not None:
        return _forced
    text = os.environ.get(ENV_CONFIG)
    return GluonConfig.parse(text) if text else DEFAULT_CONFIGS[head_dim]


def _aligned(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """16-byte aligned base and strides on ``dims`` (TMA's rule)."""
    size = x.element_size()
    return x.data_ptr() % 16 == 0 and all((x.stride(d) * size) % 16 == 0 for d in dims)


def ineligible(q, k, v) -> Optional[str]:
    """Why this kernel cannot take these (already validated) inputs, or ``None``."""
    if _GLUON_ERROR is not None:
        return f"triton with Gluon (Hopper) is not importable: {_GLUON_ERROR}"
    if q.device.type != "cuda" or tuple(torch.cuda.get_device_capability(q.device)) != CAPABILITY:
        return "needs an sm_90 (Hopper) GPU"
    if not (v.stride(-2) == 1 and v.stride(-1) != 1):
        return f"needs sequence-major fp8 V (stride(-2) == 1); got strides {tuple(v.stride())}"
    for name, x, dims in (("q", q, (0, 1, 2)), ("k", k, (0, 1, 2)), ("v", v, (0, 1, 3))):
        if not _aligned(x, dims):
            return f"{name} needs a 16-byte aligned base and strides for TMA; got strides {tuple(x.stride())}"
    return None


def _descriptor(x: torch.Tensor, block: list[int]):
    dtype = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
             torch.float16: gl.float16}[x.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def attention(q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int, sm_scale: float,
              out_dtype: torch.dtype, *, return_lse: bool = False):
    """``qattn::scaled_attention`` on the Gluon sm_90 kernel (layouts/dtypes: triton_sage's module docstring).

    Raises ``ValueError`` (bad inputs, same checks as triton_sage) or ``RuntimeError`` naming what
    :func:`ineligible` found. Launches on the current stream, never synchronizes.
    """
    from . import triton_sage as ts

    ts._validate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block)
    reason = ineligible(q, k, v)
    if reason is not None:
        raise RuntimeError(f"gluon_sage_sm90: {reason}")
    bsz, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty(bsz, sq, hq, dv, dtype=out_dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    if sq == 0 or bsz == 0 or hq == 0:
        return (out, lse) if return_lse else out
    config = config_for(d)
    qs = q_scale if q_scale is not None else v_scale  # dummies for bf16/fp16 Q/K (never read)
    ks = k_scale if k_scale is not None else v_scale
    q_desc = _descriptor(q, [1, 1, BLOCK_M, d])
    k_desc = _descriptor(k, [1, 1, config.block_n, d])
    v_desc = _descriptor(v.transpose(2, 3), [1, 1, dv, config.block_n])
    grid = (triton.cdiv(sq, BLOCK_M), bsz * hq)
    with torch.cuda.device(q.device):
        _sage_fwd_sm90[grid](
            q_desc, k_desc, v_desc, qs, ks, v_scale, out, lse,
            float(sm_scale) * ts.LOG2E,
            *ts._scale_strides(q_scale), *ts._scale_strides(k_scale), *ts._scale_strides(v_scale),
            out.stride(0), out.stride(1), out.stride(2),
            hq, hq // hkv, sq, skv,
            QK_KIND=ts._QK_KIND[q.dtype], Q_BLOCK=q_block if q_scale is not None else 0,
            K_BLOCK=k_block if k_scale is not None else 0, RETURN_LSE=return_lse,
            BLOCK_N=config.block_n, STAGES=config.stages, num_warps=NUM_WARPS)
    return (out, lse) if return_lse else out


def scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype):
    """Kernel entry for ``qattn::scaled_attention``."""
    return attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype)
