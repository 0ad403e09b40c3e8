"""Helpers shared by several test files: recipe inputs for the Triton kernel tests, opcheck on float8 outputs."""

from __future__ import annotations

import contextlib

import torch

import qattn_fx.ops  # noqa: F401  (registers qattn::* ops)
from qattn_fx.ops import formats

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
