"""Helpers shared by several test files: recipe inputs for the Triton kernel tests, opcheck on float8 outputs."""

from __future__ import annotations

import contextlib
import math

import torch

import qattn_fx.ops  # noqa: F401  (registers qattn::* ops)
from qattn_fx.kernels import triton_sage as ts
from qattn_fx import formats

ops = torch.ops.qattn
FP8 = torch.float8_e4m3fn
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float8_e5m2)


@contextlib.contextmanager
def fp8_comparable_allclose():
    """opcheck's schema test compares every aten op's inputs before/after with ``torch.allclose``, which has no
    CPU kernel for float8 dtypes; compare those bitwise instead (torch test tooling, not the op under test)."""
    original = torch.allclose

    def allclose(a, b, *args, **kwargs):
        if a.dtype in _FLOAT8:
            return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return original(a, b, *args, **kwargs)

    torch.allclose = allclose
    try:
        yield
    finally:
        torch.allclose = original


@contextlib.contextmanager
def inputs_unchanged(args):
    """Asserts on exit that every tensor in ``args`` kept its dtype, strides and bits (1-byte dtypes compared as
    uint8, so float8 needs no comparison kernel)."""
    before = [(a.clone(), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else None for a in args]
    yield
    for a, b in zip(args, before):
        if b is not None:
            copy, dtype, stride = b
            assert a.dtype == dtype and a.stride() == stride, (a.dtype, dtype, a.stride(), stride)
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               copy.view(torch.uint8) if copy.element_size() == 1 else copy)


def make_qkv(b=2, hq=4, hkv=2, sq=45, skv=77, d=64, dv=None, *, bshd=True, seed=0, k_bias=3.0, q_bias=1.0,
             dtype=torch.bfloat16, device="cpu"):
    """Random Q/K/V with per-(head, channel) outliers; BSHD views (diffusers' buffers) or contiguous BHSD."""
    g = torch.Generator(device=device).manual_seed(seed)
    dv = dv or d

    def rnd(s, h, dd, bias):
        x = torch.randn(b, s, h, dd, generator=g, device=device)
        if bias:
            x = x + bias * torch.randn(1, 1, h, dd, generator=g, device=device)
        x = x.to(dtype).transpose(1, 2)  # logical (B, H, S, D), BSHD storage
        return x if bshd else x.contiguous()

    return rnd(sq, hq, d, q_bias), rnd(skv, hkv, d, k_bias), rnd(skv, hkv, dv, 0.0)


def _quant_qk(x, block, dtype, scope):
    if block:
        return ops.quantize_per_block(x, block, dtype)
    return (ops.quantize_per_head if scope == "head" else ops.quantize_per_tensor)(x, dtype)


#: Shape classes the GPU kernel tests run (``make_qkv`` overrides of their 8-head, 1000x1500, head_dim 128 default):
#: head_dim 64, BHSD storage, MHA, GQA, Sq > Skv, short K/V, one query, lengths that are tile multiples.
GPU_SHAPE_CLASSES = {
    "d64": dict(d=64),
    "bhsd": dict(bshd=False),
    "b1-mha": dict(b=1, hq=12, hkv=12, sq=777, skv=777),
    "gqa8": dict(b=1, hq=16, hkv=2, sq=300, skv=2000),
    "sq>skv": dict(sq=2000, skv=300),
    "short-kv": dict(sq=512, skv=77),
    "single-query": dict(b=3, sq=1, skv=4097),
    "multiples": dict(b=1, hq=4, hkv=4, sq=1024, skv=2048),
}


def quantize(q, k, v, qk="int8", q_block=1, k_block=16, *, v_scale="channel", v_seq_major=True, scope="tensor",
             smooth=True):
    """The op-level arguments ``(q, q_scale, k, k_scale, v, v_scale, q_block, k_block)`` of one recipe."""
    if qk in ("bf16", "fp16"):
        qd, qs, kd, ks = q, None, k, None
        q_block = k_block = 0
    else:
        dtype = formats.torch_dtype(qk)
        if smooth:
            k = ops.smooth_k(k)
        qd, qs = _quant_qk(q, q_block, dtype, scope)
        kd, ks = _quant_qk(k, k_block, dtype, scope)
    quant_v = {"channel": ops.quantize_per_channel, "head": ops.quantize_per_head, "tensor": ops.quantize_per_tensor}
    vd, vs = quant_v[v_scale](v, FP8, v_seq_major)
    return qd, qs, kd, ks, vd, vs, q_block, k_block


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |err| / max |ref|, mean |err| / mean |ref|)."""
    err = (out.double() - ref.double()).abs()
    return (err.max() / ref.double().abs().max()).item(), (err.mean() / ref.double().abs().mean()).item()


def emulate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, block_n, mmasum=False, return_lse=False,
            key_bias=None):
    """The Triton kernel's tile loop in torch, in the kernel's fp32 operation order (no fused multiply-add).

    Per K tile of ``block_n`` keys: ``t`` = K-scaled accumulator, running max ``m``, ``P448 = exp2(t·rs - (m -
    log2 448))`` rounded to e4m3, ``acc = acc·alpha + P8·V8`` (exact in fp64 here), ``O = acc / l · v_scale``;
    ``l = l·alpha + ΣP448`` (``mmasum``: ``Σ e4m3(P448)``, gluon_sage's ones-MMA). Shared by the interpreter
    tests (exact fp32 agreement) and the GPU tests. ``return_lse``: also the kernels' natural-log LSE
    ``(m + log2 l - log2 448) · ln 2``. ``key_bias`` ``(B|1, Skv)``: logits are ``z = t·rs + bias·log2 e`` and the
    max is taken over ``z``; a running max of ``-inf`` (every key so far masked) is used as 0, and a row with
    ``l = 0`` gives 0.
    """
    b, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = k.repeat_interleave(g, 1)
    v8 = v.double().repeat_interleave(g, 1)
    qk_scale = torch.tensor(sm_scale * ts.LOG2E, dtype=torch.float32, device=q.device)
    s_all = q.double() @ kk.double().transpose(-1, -2)
    if q_scale is None:
        s_all = s_all.float()
        rs = torch.full((b, hq, sq), qk_scale.item(), device=q.device)
    else:
        s_all = s_all.to(torch.int32) if q.dtype == torch.int8 else s_all.float()
        rs = formats.expand_seq_scale(q_scale, q_block, sq)[..., 0].float().expand(b, hq, sq) * qk_scale
        if k_block == 0:
            rs = rs * k_scale.float().repeat_interleave(hq // k_scale.shape[1], 1)[..., :1]
    per_col = k_scale is not None and k_block > 0 and k_block % block_n != 0
    m = torch.full((b, hq, sq), -math.inf, device=q.device)
    l = torch.zeros(b, hq, sq, device=q.device)
    acc = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64, device=q.device)
    for s0 in range(0, skv, block_n):
        n = torch.arange(s0, min(s0 + block_n, skv), device=q.device)
        s = s_all[..., n]
        if k_scale is not None and k_block > 0:
            ks = k_scale.float().expand(b, hkv, -1).repeat_interleave(g, 1)[..., n // k_block]
        if q.dtype == torch.int8:
            t = (s + 0x4B400000).view(torch.float32)
            if per_col:
                t = (t - 12582912.0) * (ks.view(torch.int32) & -4).view(torch.float32)[:, :, None, :]
            else:
                t = t - 12582912.0
        else:
            t = s * ks[:, :, None, :] if per_col else s
        r = rs * ks[..., :1] if (k_scale is not None and k_block > 0 and not per_col) else rs
        if key_bias is None:
            m_new = torch.maximum(m, t.amax(-1) * r)
            p = torch.exp2(t * r[..., None] - (m_new - ts.LOG2_448)[..., None])
            alpha = torch.exp2(m - m_new)
        else:
            kb = (key_bias.float()[:, None, None, :] * torch.tensor(ts.LOG2E, dtype=torch.float32))[..., n]
            z = t * r[..., None] + kb
            m_new = torch.maximum(m, z.amax(-1))
            m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            p = torch.exp2(z - (m_use - ts.LOG2_448)[..., None])
            alpha = torch.exp2(m - m_use)
        l = l * alpha + (p.to(FP8).float().sum(-1) if mmasum else p.sum(-1))
        acc = acc * alpha[..., None].double() + p.to(FP8).double() @ v8[..., n, :]
        m = m_new
    vs = v_scale.double().repeat_interleave(hq // v_scale.shape[1], 1)[:, :, None, :]
    out = acc / l[..., None].double() * vs
    if key_bias is not None:
        out = torch.where(l[..., None] == 0, torch.zeros_like(out), out)
    if return_lse:
        return out, (m + torch.log2(l) - ts.LOG2_448) * math.log(2.0)
    return out


#: Flash kernels (triton_sage, gluon_sage_sm90) round P against the running max of the tiles seen so far instead of
#: the global row max (see the interpreter tests), so P of tiles before a row's max tile land on a different e4m3 grid. The resulting
#: difference grows with the number of such tiles towards the rms of one e4m3 rounding (~3 %): measured under
#: the interpreter (int8 1/16, d64), mean_rel 1.5e-2 / 1.8e-2 / 2.4e-2 and max_rel 3.1e-2 / 2.4e-2 / 2.7e-2 for
#: Skv = 150 / 1000 / 4097. Bounds: that plateau with margin. (The tight checks are the emulation and
#: first-tile tests below.)
REFERENCE_TOL = dict(max_rel=5.0e-2, mean_rel=3.5e-2)


def assert_close_to_reference(out, ref, what="", tol=None, *, name="kernel"):
    """Kernel vs reference within :data:`REFERENCE_TOL` (or ``tol``); prints the errors."""
    tol = tol or REFERENCE_TOL
    max_rel, mean_rel = errors(out, ref)
    print(f"[{name} vs reference] {what}: max_rel={max_rel:.2e} mean_rel={mean_rel:.2e}")
    assert max_rel <= tol["max_rel"] and mean_rel <= tol["mean_rel"], (what, max_rel, mean_rel)


def assert_fp32_level(out, ref, what="", fp8_qk=False, *, name="kernel", mmasum=False):
    """Agreement at the precision of Hopper's FP8 MMAs, not of fp32 CUDA cores.

    FP8 wgmma accumulates each tile's products with ~22 bits (13 mantissa bits, relative 2^-14 ≈ 6e-5): every
    tile's P·V sum carries that error, and with FP8 Q/K so does every logit (which then moves P). Measured on the
    H200 (2026-11-29), errors relative to max|O|: int8/bf16 Q/K mean 3.5e-5, max 1.5e-3 (66 % of the elements
    above 1e-5: the P·V accumulator, everywhere); FP8 Q/K mean 4.1e-4, max 4.3e-3. Under the Triton
    interpreter (exact fp32) the same inputs agree to ~1e-6. Bounds: 3x the measured means, max < 2e-2.

    ``mmasum``: the softmax denominator is also an FP8 wgmma sum (of e4m3 P), with the same ~22-bit accumulator,
    which the emulation sums in fp32; with one dominant key per row (``test_exact_when_row_max_is_in_first_tile``)
    that measured mean 1.13e-4, max 1.43e-3 on the H200 (2026-11-30), so the int8/bf16 mean bound doubles."""
    err = (out.double() - ref.double()).abs() / ref.double().abs().max()
    print(f"[{name} fp32-level] {what}: max={err.max().item():.2e} mean={err.mean().item():.2e}")
    mean_bound = 1.5e-3 if fp8_qk else (2e-4 if mmasum else 1e-4)
    assert err.mean().item() < mean_bound and err.max().item() < 2e-2, what


def captured_attention_inputs(head_dim: int = 64, frames: int = 4, size: int = 32, device="cpu"):
    """(role, q, k, v) of every attention call of a forward of the tiny Wan transformer (random weights).

    ``wan(num_layers=2, head_dim)`` on a ``(1, 4, frames, size, size)`` latent: ``frames · (size/2)²`` tokens of
    self-attention per layer (1024 by default) and cross-attention to the 12 text tokens. Captured by wrapping
    ``F.scaled_dot_product_attention`` (the call diffusers' native backend makes), in fp32 on ``device``.
    """
    import torch.nn.functional as F

    from qattn_fx import tiny_models

    captured = []
    original = F.scaled_dot_product_attention

    def capture(*args, **kwargs):
        q, k, v = (args + tuple(kwargs[n] for n in ("query", "key", "value") if n in kwargs))[:3]
        captured.append(("self" if q.shape == k.shape else "cross", q.detach().clone(), k.detach().clone(),
                         v.detach().clone()))
        return original(*args, **kwargs)

    model, inputs = tiny_models.wan(num_layers=2, head_dim=head_dim)
    inputs["hidden_states"] = torch.randn(1, 4, frames, size, size, generator=torch.Generator().manual_seed(0))
    F.scaled_dot_product_attention = capture
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        F.scaled_dot_product_attention = original
    return [(role, q.to(device), k.to(device), v.to(device)) for role, q, k, v in captured]
