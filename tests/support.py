"""Helpers shared by several test files: recipe inputs for the Triton kernel tests, opcheck on float8 outputs, the
environment of a test's subprocess, and the GPU tests' device-capability markers, CUDA-graph capture and no-host-sync
checks."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

import qattn_fx.ops  # noqa: F401  (registers qattn::* ops)
from qattn_fx.kernels.emulation import emulate  # noqa: F401  (re-exported for the tests)
from qattn_fx import formats

ops = torch.ops.qattn
FP8 = torch.float8_e4m3fn
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float8_e5m2)
#: The checkout's root: what a subprocess imports ``qattn_fx``, ``benchmarks`` and ``examples`` from.
ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict:
    """This process's environment with :data:`ROOT` first on ``PYTHONPATH`` (the entries already there kept: a
    machine may install packages through it), plus ``extra``."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, **extra}


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


def gpu_capability() -> tuple[int, int] | None:
    """This machine's CUDA compute capability, or None without CUDA."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def needs_capability(*capabilities: tuple[int, int], reason: str):
    """A ``skipif`` marker: the test runs only on a CUDA device of one of ``capabilities``."""
    return pytest.mark.skipif(gpu_capability() not in capabilities, reason=reason)


@contextlib.contextmanager
def triton_sage_compiled(monkeypatch, qattn_config, config):
    """For a GPU test of triton_sage: compiled kernels (``TRITON_INTERPRET`` unset), no config from the environment
    (``qattn_config``: the fixture of tests/conftest.py), ``config`` forced (None: autotuned); unforced after."""
    from qattn_fx.kernels import triton_sage as ts  # noqa: PLC0415  (imports triton)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qattn_config(triton_sage_config=None)
    ts.set_config(config)
    try:
        yield
    finally:
        ts.set_config(None)


def capture_graph(fn, warmups: int = 1):
    """``fn()`` captured in a CUDA graph after ``warmups`` eager calls, all on a side stream (what a call builds,
    compiles or allocates once happens before the capture); returns ``(graph, the captured call's result)``, the
    current stream ordered after the capture. Needs CUDA."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
        with torch.cuda.graph(graph, stream=stream):
            captured = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, captured


def without_host_sync(fn):
    """``fn()`` with every host synchronization an error (``torch.cuda.set_sync_debug_mode("error")``), the device
    synchronized before and after; returns its result. Needs CUDA."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return result


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


def gluon_meta_inputs(d=128, s=4096, h=4, qk=torch.int8, q_block=1, k_block=16):
    """Meta tensors of one gluon_sage launch for offline compiles: BSHD Q/K views as diffusers writes them,
    sequence-major fp8 V, per-block Q/K scales and per-channel V scales; ``(q, q_scale, k, k_scale, v, v_scale,
    q_block, k_block)``."""
    q = torch.empty(1, s, h, d, dtype=qk, device="meta").transpose(1, 2)
    k = torch.empty(1, s, h, d, dtype=qk, device="meta").transpose(1, 2)
    v = torch.empty(1, h, d, s, dtype=torch.float8_e4m3fn, device="meta").transpose(-1, -2)
    qs = torch.empty(1, h, -(-s // q_block), device="meta")
    ks = torch.empty(1, h, -(-s // k_block), device="meta")
    vs = torch.empty(1, h, d, device="meta")
    return q, qs, k, ks, v, vs, q_block, k_block


def gluon_loop_body(ops: list[str]) -> list[str]:
    """The full tiles' loop body of an int8 gluon_sage kernel's SASS (``sass_opcodes``): from ~40 instructions before
    the first Q·Kᵀ wgmma (the accumulator's re-initialization) to the branch after the first P·V wait."""
    start = next(i for i, op in enumerate(ops) if op.startswith("IGMMA"))
    pv = next(i for i, op in enumerate(ops) if i > start and op.startswith("QGMMA") and "gsb0" in op)
    end = next(i for i, op in enumerate(ops) if i > pv and op.startswith("BRA"))
    return ops[start - 40:end + 1]


def block_lists(b, h, sq, skv, density, *, seed=0, device="cpu", empty_tiles=True):
    """Random block lists ``(block_index, block_count)`` (:func:`qattn_fx.block_sparse.from_mask`) for a call of
    ``(b, h)`` heads over ``sq`` queries and ``skv`` keys, each block listed with probability ``density``; with
    ``empty_tiles`` some query tiles list nothing (every third of head 0) and the last one lists only the last key
    tile (the partial one, where ``skv`` is not a multiple of 128)."""
    from qattn_fx import block_sparse

    nq, nk = block_sparse.tiles(sq, skv)
    gen = torch.Generator(device=device).manual_seed(seed)
    visit = torch.rand(b, h, nq, nk, generator=gen, device=device) < density
    if empty_tiles:
        visit[:, 0, ::3] = False
        visit[:, -1, -1] = False
        visit[:, -1, -1, -1] = True
    return block_sparse.from_mask(visit)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |err| / max |ref|, mean |err| / mean |ref|)."""
    err = (out.double() - ref.double()).abs()
    return (err.max() / ref.double().abs().max()).item(), (err.mean() / ref.double().abs().mean()).item()


#: Flash kernels (triton_sage, gluon_sage_sm90) round P against the running max of the tiles seen so far instead of
#: the global row max (see the interpreter tests), so P of tiles before a row's max tile land on a different e4m3 grid.
#: The resulting difference grows with the number of such tiles towards the rms of one e4m3 rounding (~3 %): measured
#: under the interpreter (int8 1/16, d64), mean_rel 1.5e-2 / 1.8e-2 / 2.4e-2 and max_rel 3.1e-2 / 2.4e-2 / 2.7e-2 for
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
    that measured mean 1.13e-4, max 1.43e-3 on the H200 (2026-11-30), so the int8/bf16 mean bound doubles.
    An all-zero ``ref`` (block lists that visit nothing) is compared absolutely."""
    ref_max = ref.double().abs().max()
    err = (out.double() - ref.double()).abs() / (ref_max if ref_max > 0 else 1.0)
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


#: A huge finite value of each dtype, written into masked keys' K and V by the masked-junk tests.
JUNK = {torch.float16: 6e4, torch.bfloat16: 1e30, torch.float32: 1e30}


def masked_junk(b=2, hq=4, hkv=2, sq=45, skv=77, d=64, *, dtype=torch.bfloat16, device="cpu", seed=0, junk=None,
                valid=None):
    """``(q, k, v, k_junk, v_junk, mask)``: inputs of a key-padding-masked call (``mask`` boolean ``(B, 1, 1, Skv)``,
    batch element ``i`` keeping its first ``valid[i]`` keys, every key of the last one, and masked keys scattered
    through the first) with zeros in masked keys' K and V, and the same with ``junk`` (default :data:`JUNK`) there
    (``+junk`` in K, ``-junk`` in V). The output on kept keys must not depend on which is given (issue #43)."""
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, seed=seed, dtype=dtype, device=device)
    valid = valid or [skv * (i + 2) // (b + 1) for i in range(b - 1)] + [skv]
    keep = torch.arange(skv, device=device)[None, :] < torch.tensor(valid, device=device)[:, None]
    keep[0, 1:valid[0]:5] = False
    mask = keep[:, None, None, :]
    gone = ~keep[:, None, :, None]
    junk = JUNK[dtype] if junk is None else junk
    k, v = k.masked_fill(gone, 0), v.masked_fill(gone, 0)  # (masked_fill keeps the BSHD layout)
    return q, k, v, k.masked_fill(gone, junk), v.masked_fill(gone, -junk), mask


# ------------------------------------------------------------------------------------------------------------------
# Operand layouts SDPA takes (tests/fx/test_layouts.py, the property tests)
# ------------------------------------------------------------------------------------------------------------------


def _gaps(b, h, s, d, r):
    """Every other entry of every dim of a buffer twice as large, at a storage offset."""
    return r(2 * b, 2 * h, 2 * s, 2 * d + 1)[1::2, 1::2, 1::2, 1::2]


#: layout name -> maker of a logical ``(B, H, S, D)`` tensor stored that way (``r(*shape)``: a random buffer).
LAYOUTS = {
    "contiguous": lambda b, h, s, d, r: r(b, h, s, d),
    "bshd": lambda b, h, s, d, r: r(b, s, h, d).transpose(1, 2),
    "transposed": lambda b, h, s, d, r: r(b, h, d, s).transpose(-1, -2),
    "head-last": lambda b, h, s, d, r: r(b, s, d, h).permute(0, 3, 1, 2),
    "seq-first": lambda b, h, s, d, r: r(s, b, h, d).permute(1, 2, 0, 3),
    "seq-first-transposed": lambda b, h, s, d, r: r(d, s, b, h).permute(2, 3, 1, 0),
    "expanded-batch": lambda b, h, s, d, r: r(1, h, s, d).expand(b, -1, -1, -1),
    "expanded-heads": lambda b, h, s, d, r: r(b, 1, s, d).expand(-1, h, -1, -1),
    "expanded-transposed": lambda b, h, s, d, r: r(b, 1, d, s).expand(-1, h, -1, -1)
    .transpose(-1, -2),
    "gaps": _gaps,
    "gaps-transposed": lambda b, h, s, d, r: _gaps(b, h, d, s, r).transpose(-1, -2),
    "offset": lambda b, h, s, d, r: r(b * h * s * d + 3)[3:].view(b, h, s, d),
    "strided-d": lambda b, h, s, d, r: r(b, h, s, 2 * d)[..., ::2],
}


def make_layout(layout, b=2, h=2, s=40, d=32, *, seed=0, dtype=torch.float32, generator=None):
    """A random logical ``(b, h, s, d)`` tensor of ``dtype`` stored as :data:`LAYOUTS` names it."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    x = LAYOUTS[layout](b, h, s, d, lambda *shape: torch.randn(*shape, generator=g, device=g.device).to(dtype))
    assert x.shape == (b, h, s, d)
    return x
