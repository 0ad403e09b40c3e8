"""qattn_fx's own Triton SageAttention kernel for Ada (sm_89) and Hopper (sm_90).

Implements ``qattn::scaled_attention`` with exactly the numerics of
:func:`qattn_fx.kernels.reference.scaled_attention` (non-causal; masks as a per-key logit bias):

* ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)``: int8 or float8_e4m3fn with fp32 scales ``(B|1, H|1, NB)``, one
  scale per ``q_block`` / ``k_block`` tokens (``NB = ceil(S / block)``), or ``block == 0``: one scale per head
  ``(1, H, 1)`` or per tensor ``(1, 1, 1)``. Or bf16/fp16 Q/K with ``q_scale = k_scale = None`` (QK16PV8).
  Any strides with unit stride on D (BSHD views and BHSD both; nothing is copied). Scales must be >= 0
  (they are ``amax / qmax``); size-1 scale dims broadcast.
* ``v (B, Hkv, Skv, Dv)``: float8_e4m3fn, sequence-major (``stride(-2) == 1``, physically ``(B, H, Dv, S)``, what
  the quantize node writes for this kernel and what Hopper's FP8 wgmma wants for its B operand) or D-major
  (``stride(-1) == 1``, accepted; P·V then runs as an exact fp16 MMA, slower). ``v_scale (B|1, Hkv|1, Dv|1)``.
* ``key_bias`` (optional): fp32 ``(B|1, Skv)``, unit stride on keys, added to the logits in natural-log units
  (``-inf`` masks a key; how key-padding masks run). A row whose keys are all masked gives 0.
* ``V`` may hold more rows than K (``Sv >= Skv``: the quantize node pads sequence-major V to 16 tokens); only the
  first ``Skv`` are read. Calls of more than 65,535 (batch, head) pairs run in batch chunks (the grid limit).
* GQA (``Hq = g · Hkv``), ``Sq != Skv``, lengths that are not multiples of any tile, head_dim 64 or 128.
* Returns ``(B, Hq, Sq, Dv)`` in ``out_dtype`` stored BSHD (``torch.empty(B, Sq, Hq, Dv).transpose(1, 2)``);
  :func:`attention` can also return the natural-log LSE ``(B, Hq, Sq)`` fp32.

Algorithm (one program = ``BLOCK_M`` query rows of one (batch, head)):

1. Q's tile is loaded once. Its per-row scale ``q_scale · sm_scale · log2(e)`` (times K's scale when K has one
   scale per head/tensor) is a ``BLOCK_M`` vector ``rs``.
2. For each ``BLOCK_N`` tile of K/V: ``S = dot(q, kᵀ)`` (int32 for int8, fp32 for fp8/bf16). INT8 accumulators
   are converted exactly with the ``2^23 · 1.5`` magic number (an integer add that Triton folds into the MMA's
   initial accumulator, then one fp op, instead of a slow I2F; exact because ``|S| <= 128³ < 2^22``). K scales
   with ``k_block < BLOCK_N`` multiply the columns, fused with that conversion into one correctly rounded fma
   (K scales used with 22 significant bits there, a relative change < 2e-7); when ``k_block`` divides the tile
   only ``BLOCK_N / k_block`` scales are loaded and applied through a (BLOCK_M, groups, k_block) view of S (a
   register relabeling, no data movement); coarser K scales are uniform over the tile and fold into ``rs``.
   Logits in log2 units are ``z = t · rs`` with ``t`` the K-scaled accumulator; because scales are >= 0 the row
   max is ``max(t) · rs``. With ``pipe`` configs the next tile's ``S`` is issued (async wgmma) before this
   tile's softmax, so the exp2s run while the tensor cores compute it.
3. Online softmax in fp32 with exp2: ``P448 = exp2(z - m + log2(448))`` = ``448 · exp2(z - m)`` where ``m`` is
   the running row max, so the e4m3 operand is just ``P448`` rounded (RNE, saturating: the reference's
   ``e4m3(P · 448)``) and ``l = Σ P448`` (unrounded) carries the same factor 448, which cancels in ``acc / l``.
4. Two-level accumulation: every tile's ``P·V`` goes into a fresh fp32 MMA accumulator (FP8 MMAs on Ada and Hopper
   keep ~22 bits in the accumulator) which is then added in full fp32 to the running output:
   ``acc = acc · alpha + dot(P8, V8)``. (Triton folds ``acc + dot(a, b)`` into ``dot(a, b, acc)`` only when the
   dot's ``max_num_imprecise_acc`` is 0: on sm_90 FP8 dots default to 2^30, on sm_89 we pass ``BLOCK_N``.)
5. Epilogue: ``O = acc · v_scale / l``, stored in ``out_dtype``; ``lse = ln2 · (m + log2(l) - log2(448))``.

Differences from the reference are fp32 rounding and the P rounding point: the reference rounds
``exp(s - global_max) · 448`` while a flash kernel rounds against the running max of the tiles seen so far
(identical when the row max sits in the first tile). P of tiles before a row's max tile therefore land on a
different e4m3 grid; outputs differ from the reference by ~1-3 % relative (growing with the number of such tiles
towards the rms of one e4m3 rounding), which is the size of the reference's own FP8-P error against fp32
attention, not an accuracy loss. The tests pin the algorithm itself to fp32 level (emulation, first-tile max).

Offsets: batch/head bases and the Q/O tile base are int64; inside a head, K/V pointers advance by
``BLOCK_N · stride`` per tile (pointer arithmetic, 64-bit), so tensors past 2^31 elements index correctly as long
as one tile's span (``BLOCK_N · stride_s``, ``Dv · stride_d``) fits in int32.

Configs: :data:`CONFIGS` are autotuned (``triton.autotune``) per (head_dim, dtypes, block sizes, V layout,
sequence-length buckets). :func:`set_config` / :func:`use_config` or the environment variable
``QATTN_TRITON_SAGE_CONFIG="BLOCK_M,BLOCK_N,num_warps,num_stages[,pipe]"`` force one (benchmarks sweep with them).
Autotuning benchmarks on the first call per key: warm up before CUDA-graph capture, or force a config. Variants
tried and removed (an fp16 P·V, K/V through TMA descriptors, a depth-2 pipeline): docs/kernel-design.md.

The jitted kernel is built lazily on first use so that ``TRITON_INTERPRET=1`` set at any time before the first
call runs it under the Triton interpreter (CPU tensors allowed there). The interpreter's fp32→fp8 cast and its
bf16 ``dot`` are not exact, so under the interpreter the kernel rounds P onto the e4m3 grid itself (RNE, exact) and
upcasts bf16/fp16 Q/K to fp32 (exact products); compiled kernels use the hardware paths.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

try:  # GPU libraries are optional at import time; the kernel raises a clear error without them.
    import triton
    import triton.language as tl

    _TRITON_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _TRITON_ERROR = exc

#: Head dims the kernel is compiled for (Q/K and V).
HEAD_DIMS = (64, 128)
#: Compute capabilities with FP8 MMAs that this kernel targets.
CAPABILITIES = ((8, 9), (9, 0))

#: log2(e) (folded into the row scale) and log2(448) (the P offset); the kernel spells these and the int→fp32
#: magic numbers (0x4B400000 = bits of 1.5·2^23 = 12582912.0) as literals.
LOG2E = 1.4426950408889634
LOG2_448 = math.log2(448.0)

_QK_KIND = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2, torch.float16: 2}


# ------------------------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration.

    ``block_m`` query rows per program, ``block_n`` keys per tile, ``num_warps``, ``num_stages`` (cp.async
    pipeline depth of the K/V loads), ``pipe``: software pipelining across tiles — 0: none; 1: the next tile's
    Q·Kᵀ is issued (async wgmma) before this tile's softmax.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pipe: int = 0

    def __post_init__(self) -> None:
        for name in self.FLAGS:
            if int(getattr(self, name)) not in (0, 1):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; valid: 0, 1")
            object.__setattr__(self, name, int(getattr(self, name)))

    FLAGS = ("pipe",)

    def __str__(self) -> str:
        suffix = "".join(f"_{name}" for name in self.FLAGS if getattr(self, name))
        return f"BM{self.block_m}_BN{self.block_n}_w{self.num_warps}_s{self.num_stages}{suffix}"

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """``"128,128,8,3"``, ``"128,64,8,3,pipe"`` (or ``str()`` of a config)."""
        fields = [f.strip().lower() for f in text.replace("_", ",").split(",") if f.strip()]
        flags = dict.fromkeys(cls.FLAGS, 0)
        while len(fields) > 4:
            flag = fields.pop()
            if flag in flags or flag == "pipe1":
                flags[flag[:4] if flag.startswith("pipe") else flag] = 1
            elif flag not in ("0", "nopipe"):
                fields = []
        try:
            numbers = [int("".join(c for c in f if c.isdigit())) for f in fields]
        except ValueError:
            numbers = []
        if len(numbers) != 4:
            raise ValueError(f"config {text!r} is invalid; valid: "
                             "'BLOCK_M,BLOCK_N,num_warps,num_stages[,pipe]'")
        return cls(*numbers, **flags)

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "PIPE": self.pipe}

    def to_triton(self):
        return triton.Config(self.meta(), num_warps=self.num_warps, num_stages=self.num_stages)


#: The autotuned set. Hopper wgmma wants 4 warps per 64 query rows; all but the last entry compile without
#: register spills for int8/fp8 Q/K at head_dim 64/128 on sm_90 (Triton 3.6, checked offline with ptxas, see
#: compile_for). ``pipe`` entries issue the next tile's Q·Kᵀ before this tile's softmax (ptxas then interleaves
#: ~90 % of the exp2s with that wgmma).
CONFIGS: tuple[KernelConfig, ...] = (
    KernelConfig(128, 128, 8, 2),
    KernelConfig(128, 128, 8, 3),
    KernelConfig(128, 64, 8, 3),
    KernelConfig(128, 64, 8, 4),
    KernelConfig(64, 64, 4, 3),
    KernelConfig(64, 64, 4, 4),
    KernelConfig(128, 64, 8, 3, pipe=1),
    KernelConfig(128, 64, 8, 4, pipe=1),
    KernelConfig(64, 64, 4, 3, pipe=1),
    KernelConfig(64, 64, 4, 4, pipe=1),
    KernelConfig(128, 128, 8, 3, pipe=1),  # at head_dim 128: 255 registers, <= 16 B spilled for some strides
)
#: Used under the Triton interpreter (small tiles: many tiles and tails on test shapes).
INTERPRET_CONFIG = KernelConfig(32, 32, 4, 1)

_forced: Optional[KernelConfig] = None
ENV_CONFIG = "QATTN_TRITON_SAGE_CONFIG"


def set_config(config: Optional[KernelConfig | str]) -> None:
    """Force one launch config for every call (``None`` restores autotuning)."""
    global _forced
    _forced = KernelConfig.parse(config) if isinstance(config, str) else config


@contextlib.contextmanager
def use_config(config: Optional[KernelConfig | str]) -> Iterator[None]:
    """Context manager form of :func:`set_config`."""
    previous = _forced
    set_config(config)
    try:
        yield
    finally:
        set_config(previous)


def forced_config() -> Optional[KernelConfig]:
    """The config calls will use instead of autotuning: :func:`set_config`'s, else ``$QATTN_TRITON_SAGE_CONFIG``."""
    if _forced is not None:
        return _forced
    text = os.environ.get(ENV_CONFIG)
    return KernelConfig.parse(text) if text else None


def _seq_bucket(n: int) -> int:
    """Autotune key for a sequence length: powers of 4 from 256 up (tiling choices change slowly with length)."""
    bucket = 256
    while bucket < n and bucket < (1 << 20):
        bucket *= 4
    return bucket


# ------------------------------------------------------------------------------------------------------------------
# Kernel source (plain functions; jitted lazily by _build so the interpreter can be chosen at first use)
# ------------------------------------------------------------------------------------------------------------------


def _qk_tile(q, k_base, k_offs, start_n, SEQ_KV,
             QK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr):
    """Raw ``S = Q·Kᵀ`` of the K tile starting at key ``start_n``: int32 (int8 Q/K) or fp32.

    ``k_base + k_offs``: (D, BLOCK_N) pointers to the tile of Kᵀ (a scalar 64-bit base advanced per tile plus
    loop-invariant int32 offsets: fewer registers than carried pointer tiles). For int8 the accumulator starts at
    ``0x4B400000`` (Triton folds the add into the MMA's initial value): read as fp32 that is ``S + 1.5·2^23``.
    """
    if MASK_KV:
        n_valid = (start_n + tl.arange(0, BLOCK_N)) < SEQ_KV
        if INTERPRET:  # the interpreter zero-fills masked lanes and cannot cast `other` to fp8
            kt = tl.load(k_base + k_offs, mask=n_valid[None, :])
        else:
            kt = tl.load(k_base + k_offs, mask=n_valid[None, :], other=0.0)
    else:
        kt = tl.load(k_base + k_offs)
    if QK_KIND == 2 and INTERPRET:  # the interpreter's bf16 dot is not exact; fp32 products of bf16 are
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
    else:
        s = tl.dot(q, kt)
    if QK_KIND == 0:
        s = s + 0x4B400000
    return s


def _load_v(v_base, v_offs, start_n, SEQ_KV, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr):
    """The (BLOCK_N, Dv) V tile at key ``start_n`` (rows past ``SEQ_KV`` read as 0 when ``MASK_KV``)."""
    if MASK_KV:
        n_valid = (start_n + tl.arange(0, BLOCK_N)) < SEQ_KV
        if INTERPRET:
            v = tl.load(v_base + v_offs, mask=n_valid[:, None])
        else:
            v = tl.load(v_base + v_offs, mask=n_valid[:, None], other=0.0)
    else:
        v = tl.load(v_base + v_offs)
    return v


def _load_ks(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_KV: tl.constexpr):
    """K scales of the tile at ``start_n``: a (BLOCK_N,) column vector when ``k_block`` splits the tile, else one
    scalar (``k_block`` a multiple of BLOCK_N), else 1 (``k_block == 0``: already folded into the row scale).

    Loaded before the tile's Q·Kᵀ is issued so that, when Q·Kᵀ runs ahead (``PIPE``), nothing the softmax
    needs waits behind the asynchronous MMA.
    """
    if K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N:
        # grouped: one scale per K_BLOCK columns, (BLOCK_N // K_BLOCK,) values (applied through a 3-D view of S)
        offs_g = start_n // K_BLOCK + tl.arange(0, BLOCK_N // K_BLOCK)
        if MASK_KV:
            ks = tl.load(ks_ptr + offs_g * stride_ksn, mask=offs_g * K_BLOCK < SEQ_KV, other=0.0)
        else:
            ks = tl.load(ks_ptr + offs_g * stride_ksn)
        ks = (ks.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
    elif K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASK_KV:
            ks = tl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn, mask=offs_n < SEQ_KV, other=0.0)
        else:
            ks = tl.load(ks_ptr + (offs_n // K_BLOCK) * stride_ksn)
        # cut to 22 significant bits (relative change < 2e-7): then 1.5·2^23·ks is exact in fp32 (see _softmax_pv)
        ks = (ks.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
    elif K_BLOCK > 0:
        ks = tl.load(ks_ptr + (start_n // K_BLOCK) * stride_ksn)
    else:
        ks = 1.0
    return ks


def _load_kb(kb_ptr, start_n, SEQ_KV, BLOCK_N: tl.constexpr, MASK_KV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The key bias of the tile at ``start_n`` in log2 units, ``(BLOCK_N,)`` (``-inf`` past ``SEQ_KV``); 0 without
    ``HAS_BIAS``."""
    if HAS_BIAS:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASK_KV:
            kb = tl.load(kb_ptr + offs_n, mask=offs_n < SEQ_KV, other=float("-inf"))
        else:
            kb = tl.load(kb_ptr + offs_n)
        kb = kb * 1.4426950408889634
    else:
        kb = 0.0
    return kb


def _softmax(l_i, m_i, s, ks, rs, kb, start_n, SEQ_KV,
             QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
             MASK_KV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Online-softmax step for the tile at ``start_n`` given its ``S`` (from :func:`_qk_tile`).

    ``ks``: the tile's K scales (:func:`_load_ks`); ``rs`` (BLOCK_M,) row scale; ``kb``: with ``HAS_BIAS`` the
    tile's key bias in log2 units (:func:`_load_kb`, ``-inf`` for masked keys and past ``SEQ_KV``), added to the
    logits ``z = t·rs + kb`` whose max is then taken directly (a running max of ``-inf``, every key so far masked,
    is used as 0: the tile's P are 0, not NaN); ``MASK_KV``: the tile may run past ``SEQ_KV``. Returns ``(p8,
    alpha, l, m)``: the e4m3 ``P448`` tile, the factor rescaling earlier accumulations, and the updated row sum / max.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_KV:
        n_valid = offs_n < SEQ_KV

    # ---- t = S with per-column K scales applied (exact int32 → fp32 for int8) ------------------------------
    PER_COL: tl.constexpr = K_BLOCK > 0 and (K_BLOCK % BLOCK_N) != 0
    GROUPED: tl.constexpr = K_BLOCK > 1 and (BLOCK_N % K_BLOCK) == 0 and K_BLOCK < BLOCK_N
    if GROUPED:
        # S viewed as (BLOCK_M, groups, K_BLOCK): the split of the key axis is a pure relabeling of registers
        t3 = tl.reshape(s.to(tl.float32, bitcast=True) if QK_KIND == 0 else s,
                        (s.shape[0], BLOCK_N // K_BLOCK, K_BLOCK))
        if QK_KIND == 0:
            if INTERPRET:
                t3 = (t3 - 12582912.0) * ks[None, :, None]
            else:
                t3 = tl.fma(t3, tl.broadcast_to(ks[None, :, None], t3.shape),
                            tl.broadcast_to(-(ks * 12582912.0)[None, :, None], t3.shape))
        else:
            t3 = t3 * ks[None, :, None]
        t = tl.reshape(t3, (s.shape[0], BLOCK_N))
    elif QK_KIND == 0:
        t = s.to(tl.float32, bitcast=True)  # = S + 1.5·2^23 exactly (|S| < 2^22)
        if PER_COL:
            # t = round(S · ks) in one fma: ks has 22 significant bits, so the constant 1.5·2^23·ks = 3·2^22·ks
            # is exact in fp32 and fma(S + 1.5·2^23, ks, -1.5·2^23·ks) rounds the exact product S·ks once; the
            # interpreter (no fma) gets the same bits from (t - 1.5·2^23)·ks.
            if INTERPRET:
                t = (t - 12582912.0) * ks[None, :]
            else:
                t = tl.fma(t, tl.broadcast_to(ks[None, :], t.shape),
                           tl.broadcast_to(-(ks * 12582912.0)[None, :], t.shape))
        else:
            t = t - 12582912.0
    else:
        t = s
        if PER_COL:
            t = t * ks[None, :]
    if K_BLOCK > 0 and not PER_COL:  # one K scale for the whole tile
        rs = rs * ks

    # ---- online softmax (log2 units, scales >= 0 so max(t·rs) = max(t)·rs) --------------------------------------
    if HAS_BIAS:  # z = t·rs + kb; kb is -inf past SEQ_KV, so no column mask is needed
        z = t * rs[:, None] + kb[None, :]
        if INTERPRET:
            z_max = tl.reduce(z, 1, tl.standard._elementwise_max)
        else:
            z_max = tl.max(z, 1)
        m_new = tl.maximum(m_i, z_max)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(z - (m_use - 8.807354922057604)[:, None])  # 448 · exp2(z - m)
        alpha = tl.math.exp2(m_i - m_use)
    else:
        if MASK_KV:
            t_for_max = tl.where(n_valid[None, :], t, float("-inf"))
        else:
            t_for_max = t
        if INTERPRET:  # tl.max/tl.sum are @jit functions, compiled-mode objects if triton was imported before
            t_max = tl.reduce(t_for_max, 1, tl.standard._elementwise_max)  # TRITON_INTERPRET=1; the interpreter
        else:  # runs tl.reduce with these combine functions natively
            t_max = tl.max(t_for_max, 1)
        m_new = tl.maximum(m_i, t_max * rs)
        p = tl.math.exp2(t * rs[:, None] - (m_new - 8.807354922057604)[:, None])  # 448 · exp2(z - m)
        if MASK_KV:
            p = tl.where(n_valid[None, :], p, 0.0)
        alpha = tl.math.exp2(m_i - m_new)
    if INTERPRET:
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)

    # ---- P448 in e4m3 (RNE, saturating) --------------------------------------------------------------------
    if INTERPRET:
        # Round P448 ∈ [0, 448] onto the e4m3 grid with RNE in fp32 (exact); the interpreter's own cast is not.
        e = tl.maximum((p.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # biased exponent, floor 2^-6
        ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
        inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)
        p = ((p * inv_ulp + 8388608.0) - 8388608.0) * ulp
    return p.to(tl.float8e4nv), alpha, l_i, m_new


def _pv(acc, alpha, p8, v, BLOCK_N: tl.constexpr, PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr):
    """Two-level accumulation: ``acc · alpha + P8·V8``, the product in a fresh fp32 MMA accumulator."""
    if PV_FP16:  # D-major V: exact fp16 MMA (e4m3 values and their products are exact in fp16/fp32)
        pv = tl.dot(p8.to(tl.float16), v.to(tl.float16))
    elif PV_SPLIT:
        pv = tl.dot(p8, v, max_num_imprecise_acc=BLOCK_N)
    else:
        pv = tl.dot(p8, v)
    return acc * alpha[:, None] + pv


def _softmax_pv(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV,
                QK_KIND: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                PV_FP16: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, MASK_KV: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """:func:`_softmax` then :func:`_pv` for one tile; returns the updated ``(acc, l, m)``."""
    p8, alpha, l_i, m_i = _softmax_jit(l_i, m_i, s, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK, BLOCK_N,
                                       INTERPRET, MASK_KV, HAS_BIAS)
    acc = _pv_jit(acc, alpha, p8, v, BLOCK_N, PV_FP16, PV_SPLIT)
    return acc, l_i, m_i


def _sage_fwd(
    Q, K, V, QS, KS, VS, KB, Out, Lse,
    qk_scale,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsd,
    stride_kbb,
    stride_ob, stride_oh, stride_os,
    H, GROUP, SEQ_Q, SEQ_KV,
    SQ_BUCKET, SKV_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, QK_KIND: tl.constexpr,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, V_SEQ_MAJOR: tl.constexpr,
    RETURN_LSE: tl.constexpr, PV_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    V_ALIGN: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_LOOP_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr,
):
    """Grid ``(cdiv(Sq, BLOCK_M), B · Hq)``. Unit strides on D (Q, K, Out) and on S or D (V) are implicit."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_ml = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_ml
    m_valid = offs_m < SEQ_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)

    # ---- Q tile (loaded once) and its row scale ---------------------------------------------------------------
    q_ptrs = (Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qs
              + offs_ml[:, None] * stride_qs + offs_d[None, :])
    if INTERPRET:
        q = tl.load(q_ptrs, mask=m_valid[:, None])
    else:
        q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    ks_ptr = KS + b * stride_ksb + hk * stride_ksh
    kb_ptr = KB + b * stride_kbb
    if QK_KIND == 2:
        rs = tl.full([BLOCK_M], 0.0, tl.float32) + qk_scale
    else:
        qs_ptr = QS + b * stride_qsb + h * stride_qsh
        if Q_BLOCK == 0:
            rs = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(qs_ptr) * qk_scale
        else:
            rs = tl.load(qs_ptr + (offs_m // Q_BLOCK) * stride_qsn, mask=m_valid, other=0.0) * qk_scale
        if K_BLOCK == 0:
            rs = rs * tl.load(ks_ptr)

    # ---- K/V tiles ------------------------------------------------------------------------------------------
    k_base = K + b * stride_kb + hk * stride_kh
    k_offs = offs_d[:, None] + offs_n[None, :] * stride_ks
    v_base = V + b * stride_vb + hk * stride_vh
    if V_SEQ_MAJOR:
        # V rows (one per channel) start stride_vd bytes apart; tell Triton how aligned they are (the host passes
        # the largest power of two <= 16 dividing stride_vd) so the copies stay vectorized and asynchronous.
        v_offs = offs_n[:, None] + tl.multiple_of(offs_dv * stride_vd, V_ALIGN)[None, :]
        v_step = BLOCK_N
    else:
        v_offs = offs_n[:, None] * stride_vs + offs_dv[None, :]
        v_step = BLOCK_N * stride_vs
    k_step = BLOCK_N * stride_ks

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_V], 0.0, tl.float32)
    PV_FP16: tl.constexpr = not V_SEQ_MAJOR
    # Loop bounds: under the interpreter every assigned scalar is a 1-element numpy array, which numpy >= 2.4
    # refuses to turn into a Python int for range(), so there the host passes the bound as a constexpr.
    if PIPE == 1:
        # Software-pipelined: S of tile j+1 is issued (async wgmma) before tile j's softmax, so the tensor cores
        # work while the exp2s of tile j run. The last tile (full or tail) is finished after the loop, masked.
        s = _qk_tile_jit(q, k_base, k_offs, 0, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
        for start_n in range(0, INTERP_LOOP_END if INTERPRET else ((SEQ_KV - 1) // BLOCK_N) * BLOCK_N, BLOCK_N):
            ks = _load_ks_jit(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, False)
            kb = _load_kb_jit(kb_ptr, start_n, SEQ_KV, BLOCK_N, False, HAS_BIAS)
            k_base += k_step
            s_next = _qk_tile_jit(q, k_base, k_offs, start_n + BLOCK_N, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
            v = _load_v_jit(v_base, v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, False)
            acc, l_i, m_i = _softmax_pv_jit(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                            BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, HAS_BIAS)
            v_base += v_step
            s = s_next
        last = ((SEQ_KV - 1) // BLOCK_N) * BLOCK_N
        v = _load_v_jit(v_base, v_offs, last, SEQ_KV, BLOCK_N, INTERPRET, True)
        ks = _load_ks_jit(ks_ptr, stride_ksn, last, SEQ_KV, K_BLOCK, BLOCK_N, True)
        kb = _load_kb_jit(kb_ptr, last, SEQ_KV, BLOCK_N, True, HAS_BIAS)
        acc, l_i, m_i = _softmax_pv_jit(acc, l_i, m_i, s, v, ks, rs, kb, last, SEQ_KV, QK_KIND,
                                        K_BLOCK, BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)
    else:
        # Full tiles without masks, then the tail tile (if any) with masks.
        for start_n in range(0, INTERP_LOOP_END if INTERPRET else (SEQ_KV // BLOCK_N) * BLOCK_N, BLOCK_N):
            v = _load_v_jit(v_base, v_offs, start_n, SEQ_KV, BLOCK_N, INTERPRET, False)
            ks = _load_ks_jit(ks_ptr, stride_ksn, start_n, SEQ_KV, K_BLOCK, BLOCK_N, False)
            kb = _load_kb_jit(kb_ptr, start_n, SEQ_KV, BLOCK_N, False, HAS_BIAS)
            s = _qk_tile_jit(q, k_base, k_offs, start_n, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, False)
            acc, l_i, m_i = _softmax_pv_jit(acc, l_i, m_i, s, v, ks, rs, kb, start_n, SEQ_KV, QK_KIND, K_BLOCK,
                                            BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, False, HAS_BIAS)
            k_base += k_step
            v_base += v_step
        n_full = (SEQ_KV // BLOCK_N) * BLOCK_N
        if n_full < SEQ_KV:
            v = _load_v_jit(v_base, v_offs, n_full, SEQ_KV, BLOCK_N, INTERPRET, True)
            ks = _load_ks_jit(ks_ptr, stride_ksn, n_full, SEQ_KV, K_BLOCK, BLOCK_N, True)
            kb = _load_kb_jit(kb_ptr, n_full, SEQ_KV, BLOCK_N, True, HAS_BIAS)
            s = _qk_tile_jit(q, k_base, k_offs, n_full, SEQ_KV, QK_KIND, BLOCK_N, INTERPRET, True)
            acc, l_i, m_i = _softmax_pv_jit(acc, l_i, m_i, s, v, ks, rs, kb, n_full, SEQ_KV, QK_KIND, K_BLOCK,
                                            BLOCK_N, PV_FP16, PV_SPLIT, INTERPRET, True, HAS_BIAS)

    # ---- epilogue: O = acc · v_scale / l  (the 448s of P and l cancel) ---------------------------------------
    vs = tl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd)
    if HAS_BIAS:  # a row whose keys are all masked has l = 0 (and acc = 0): its output is 0, as SDPA's
        inv_l = tl.where(l_i == 0.0, 0.0, 1.0 / tl.where(l_i == 0.0, 1.0, l_i))
    else:
        inv_l = 1.0 / l_i
    out = acc * inv_l[:, None] * vs[None, :]
    o_ptrs = (Out + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_os
              + offs_ml[:, None] * stride_os + offs_dv[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_valid[:, None])
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_i) - 8.807354922057604) * 0.6931471805599453
        tl.store(Lse + (b * H + h) * SEQ_Q + offs_m, lse, mask=m_valid)


# ------------------------------------------------------------------------------------------------------------------
# Lazy build
# ------------------------------------------------------------------------------------------------------------------

_AUTOTUNE_KEY = ["HEAD_DIM", "HEAD_DIM_V", "QK_KIND", "Q_BLOCK", "K_BLOCK", "V_SEQ_MAJOR", "RETURN_LSE",
                 "PV_SPLIT", "HAS_BIAS", "SQ_BUCKET", "SKV_BUCKET"]


class _Built:
    mode: Optional[bool] = None  # interpreter on/off when built
    kernel = None  # jitted _sage_fwd (configs passed explicitly)
    tuned = None  # autotuned wrapper (compiled mode only)


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), read now."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _prune(configs, named_args, **kwargs):
    """Drop configs that spill registers (ptxas, Triton 3.6) or oversize the problem; keeps at least one.

    ``PV_SPLIT`` is set off sm_90 (Ada's mma.sync path).
    """
    sq = named_args.get("SEQ_Q", 1 << 30)
    ada = kwargs.get("PV_SPLIT", named_args.get("PV_SPLIT", False))
    kept = []
    for c in configs:
        bm, bn, pipe = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs.get("PIPE", 0)
        if bm > max(64, triton.next_power_of_2(sq)):
            continue  # short query sequences: smaller row blocks fill the GPU
        if ada and (bn > 64 or c.num_warps < 8 or pipe):
            continue  # sm_89 mma.sync path: only 128x64 tiles with 8 warps compile without spills
        kept.append(c)
    return kept or list(configs)


def _build():
    """Jit the kernel for the current interpreter setting (re-jitted if the setting changed since)."""
    if triton is None:
        raise RuntimeError(f"triton_sage needs triton: {_TRITON_ERROR}")
    mode = interpreter_active()
    if _Built.mode is not mode or _Built.kernel is None:
        # _sage_fwd calls the helpers by these global names; bind them before jitting so both modes resolve them.
        globals()["_qk_tile_jit"] = triton.jit(_qk_tile)
        globals()["_softmax_jit"] = triton.jit(_softmax)
        globals()["_pv_jit"] = triton.jit(_pv)
        globals()["_softmax_pv_jit"] = triton.jit(_softmax_pv)
        globals()["_load_v_jit"] = triton.jit(_load_v)
        globals()["_load_ks_jit"] = triton.jit(_load_ks)
        globals()["_load_kb_jit"] = triton.jit(_load_kb)
        kernel = triton.jit(_sage_fwd)
        _Built.kernel = kernel
        _Built.tuned = None if mode else triton.autotune(
            configs=[c.to_triton() for c in CONFIGS], key=_AUTOTUNE_KEY,
            prune_configs_by={"early_config_prune": _prune})(kernel)
        _Built.mode = mode
    return _Built


def best_config() -> Optional[KernelConfig]:
    """The autotuner's most recent choice (for reports); ``None`` before any tuning."""
    tuned = _Built.tuned
    cfg = getattr(tuned, "best_config", None) if tuned is not None else None
    if cfg is None:
        return None
    return KernelConfig(cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages,
                        int(cfg.kwargs.get("PIPE", 0)))


# ------------------------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------------------------


def _check_device(x: torch.Tensor) -> Optional[tuple[int, int]]:
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


def _scale_strides(s: Optional[torch.Tensor]) -> tuple[int, int, int]:
    """Strides of a 3-D scale with 0 on size-1 (broadcast) dims."""
    if s is None:
        return (0, 0, 0)
    return tuple(0 if n == 1 else st for n, st in zip(s.shape, s.stride()))


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= ``cap`` dividing ``n`` (``cap`` for 0)."""
    p = 1
    while p < cap and n % (2 * p) == 0:
        p *= 2
    return p


def _validate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias=None) -> None:
    d, dv = q.shape[-1], v.shape[-1]
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        bad = d if d not in HEAD_DIMS else dv
        raise ValueError(f"triton_sage supports head_dim in {HEAD_DIMS}; got head_dim={bad} "
                         f"(q/k {d}, v {dv}); valid: {', '.join(map(str, HEAD_DIMS))}")
    if q.dtype not in _QK_KIND:
        raise ValueError(f"triton_sage: q/k dtype {q.dtype} is invalid; valid: int8, float8_e4m3fn, bfloat16, float16")
    if (q_scale is None) != (q.dtype in (torch.bfloat16, torch.float16)):
        raise ValueError(f"triton_sage: {q.dtype} q/k {'needs' if q_scale is None else 'takes no'} scales")
    if v.dtype != torch.float8_e4m3fn:
        raise ValueError(f"triton_sage: v must be float8_e4m3fn; got {v.dtype}")
    if v.stride(-2) != 1 and v.stride(-1) != 1:
        raise ValueError(f"triton_sage: v needs a unit stride on S or D; got strides {v.stride()}")
    for name, x in (("q", q), ("k", k)):
        if x.stride(-1) != 1:
            raise ValueError(f"triton_sage: {name} needs a unit stride on D; got strides {x.stride()}")
    if k.shape[2] == 0 or v.shape[2] < k.shape[2]:
        raise ValueError(f"triton_sage: k needs tokens and v at least as many (rows past k's are padding); got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"triton_sage: heads must satisfy Hq % Hkv == 0 with equal batch sizes; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_bias is not None and (key_bias.dtype != torch.float32 or key_bias.dim() != 2
                                 or key_bias.shape[0] not in (1, k.shape[0]) or key_bias.shape[1] != k.shape[2]
                                 or (key_bias.stride(-1) != 1 and k.shape[2] > 1)):
        raise ValueError(f"triton_sage: key_bias must be float32 (B|1, Skv) with unit stride on keys; got "
                         f"{key_bias.dtype} {tuple(key_bias.shape)} strides {key_bias.stride()}")
    if q_block < 0 or k_block < 0:
        raise ValueError(f"triton_sage: q_block={q_block}, k_block={k_block} are invalid; valid: 0 or >= 1")


def _seq_major(v: torch.Tensor) -> bool:
    """V stored sequence-fastest (unit stride on S; when both S and D are unit, Skv == 1 and D-major is exact)."""
    return v.stride(-2) == 1 and v.stride(-1) != 1


def _launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, return_lse, cap, interpret,
            key_bias=None, out=None, lse=None):
    """Output tensors, positional kernel args and constexpr meta for one call (shared by the launch and AOT);
    ``out``/``lse`` given: write into them (a batch chunk of a larger call)."""
    bsz, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if out is None:
        out = torch.empty(bsz, sq, hq, dv, dtype=out_dtype, device=q.device).transpose(1, 2)
    if lse is None:
        lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device) if return_lse else out
    v_seq_major = _seq_major(v)
    qs = q_scale if q_scale is not None else v_scale  # dummies for bf16/fp16 Q/K and no bias (never read)
    ks = k_scale if k_scale is not None else v_scale
    kb = key_bias if key_bias is not None else v_scale
    args = [
        q, k, v, qs, ks, v_scale, kb, out, lse,
        float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        *_scale_strides(q_scale), *_scale_strides(k_scale), *_scale_strides(v_scale),
        0 if key_bias is None or key_bias.shape[0] == 1 else key_bias.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, sq, skv,
        _seq_bucket(sq), _seq_bucket(skv),
    ]
    meta = dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, QK_KIND=_QK_KIND[q.dtype],
        Q_BLOCK=q_block if q_scale is not None else 0, K_BLOCK=k_block if k_scale is not None else 0,
        V_SEQ_MAJOR=v_seq_major, RETURN_LSE=return_lse,
        # sm_90 FP8 dots default to max_num_imprecise_acc = 2^30, which keeps Triton from folding `acc + dot` into
        # the MMA; elsewhere the default is 0, so the kernel passes BLOCK_N to keep the per-tile accumulator apart.
        PV_SPLIT=cap is not None and cap != (9, 0),
        INTERPRET=interpret,
        V_ALIGN=_pow2_divisor(v.stride(-1), 16) if v_seq_major else 16,
        HAS_BIAS=key_bias is not None,
    )
    return out, lse, args, meta


def _loop_end(config: KernelConfig, skv: int, interpret: bool) -> int:
    """The main loop's end (a constexpr only under the interpreter; compiled kernels compute it themselves)."""
    if not interpret:
        return 0
    if config.pipe:
        return ((skv - 1) // config.block_n) * config.block_n
    return (skv // config.block_n) * config.block_n


#: The grid's second dimension (B · Hq programs) is at most 65535: larger calls run in batch chunks.
MAX_GRID_Y = 65535


def _batch_chunk(t: Optional[torch.Tensor], lo: int, hi: int) -> Optional[torch.Tensor]:
    """Rows ``lo:hi`` of a tensor's batch dim (a size-1 batch broadcasts: kept whole)."""
    return t if t is None or t.shape[0] == 1 else t[lo:hi]


def attention(q, q_scale, k, k_scale, v, v_scale, q_block: int, k_block: int, sm_scale: float,
              out_dtype: torch.dtype, *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None):
    """``qattn::scaled_attention`` on this kernel; with ``return_lse`` also the LSE ``(B, Hq, Sq)`` fp32.

    Layouts and dtypes: see the module docstring. ``key_bias``: fp32 ``(B|1, Skv)`` added to the logits (masked
    keys ``-inf``; a row with every key masked gives 0 and LSE ``-inf``). The LSE is ``ln Σ_j exp(s_ij)`` of the
    dequantized, scaled (and biased) logits ``s = q·kᵀ·sm_scale + bias`` (natural log). Launches on the current
    stream, never synchronizes.
    """
    _validate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    cap = _check_device(q)
    built = _build()
    config = forced_config() or (INTERPRET_CONFIG if built.mode else None)
    out, lse, args, meta = _launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype,
                                   return_lse, cap, built.mode, key_bias)
    bsz, hq, sq = q.shape[0], q.shape[1], q.shape[2]
    if sq == 0 or bsz == 0 or hq == 0:
        return (out, lse) if return_lse else out
    per_chunk = max(1, MAX_GRID_Y // hq)
    for lo in range(0, bsz, per_chunk):
        hi = min(bsz, lo + per_chunk)
        if (lo, hi) != (0, bsz):
            chunk = [_batch_chunk(t, lo, hi) for t in (q, q_scale, k, k_scale, v, v_scale, key_bias)]
            _, _, args, meta = _launch(*chunk[:6], q_block, k_block, sm_scale, out_dtype, return_lse, cap,
                                       built.mode, chunk[6], out[lo:hi], lse[lo:hi] if return_lse else None)
        _run(built, config, args, meta, hi - lo, hq, sq, k.shape[2], q.device)
    return (out, lse) if return_lse else out


def _run(built, config, args, meta, bsz, hq, sq, skv, device) -> None:
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if config is not None:
            grid = (triton.cdiv(sq, config.block_m), bsz * hq)
            built.kernel[grid](*args, **meta, **config.meta(), INTERP_LOOP_END=_loop_end(config, skv, built.mode),
                               num_warps=config.num_warps, num_stages=config.num_stages)
        else:
            grid = lambda meta_: (triton.cdiv(sq, meta_["BLOCK_M"]), bsz * hq)  # noqa: E731
            built.tuned[grid](*args, **meta, INTERP_LOOP_END=0)


def scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, *, key_bias=None):
    """Kernel entry for ``qattn::scaled_attention`` (``kernel="triton_sage"``)."""
    return attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, key_bias=key_bias)


# ------------------------------------------------------------------------------------------------------------------
# Offline compilation (no GPU needed): what a launch would compile, for CI checks and register/spill reports
# ------------------------------------------------------------------------------------------------------------------

from ._offline import ptxas_report  # noqa: E402,F401  (re-exported: tests and tools call ts.ptxas_report)


def compile_for(capability: tuple[int, int], config: KernelConfig, q, q_scale, k, k_scale, v, v_scale,
                q_block: int, k_block: int, sm_scale: float = 0.125, out_dtype: torch.dtype = torch.bfloat16,
                *, return_lse: bool = False, key_bias: Optional[torch.Tensor] = None):
    """Compile (not run) the kernel a CUDA launch with these inputs would use, for ``capability`` and ``config``.

    Inputs may live on the ``meta`` device (only dtypes, shapes and strides are read); data pointers are assumed
    16-byte aligned and ints are specialized like a real launch (== 1 → constant, % 16 == 0 → divisibility).
    Returns Triton's compiled kernel (``.asm["ttgir" | "ptx" | "cubin"]``, ``.metadata.shared``). Needs only
    Triton's bundled ptxas, not a GPU.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ._offline import launch_signature

    if _Built.mode:
        _Built.mode = None  # rebuild in compiled mode even if the interpreter was used before
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        built = _build()
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    _validate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, key_bias)
    _, _, args, meta = _launch(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype,
                               return_lse, tuple(capability), False, key_bias)
    meta.update(INTERP_LOOP_END=0, **config.meta())
    kernel = built.kernel
    signature, constexprs, attrs = launch_signature(kernel, args, meta)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})
