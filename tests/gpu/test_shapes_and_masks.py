"""Symbolic lengths and per-key masks on the H200: the compiled pass at changing lengths on every Hopper kernel, the
key bias in gluon_sage and triton_sage against the emulated tile loop and the reference, and the kernels' output
independent of what masked keys hold.

Run: ``pytest -m gpu tests/gpu/test_shapes_and_masks.py -v -s``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import support
from support import emulate, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import qattn_fx  # noqa: E402
from qattn_fx import AttentionSpec, Recipe, Spec, kernels  # noqa: E402
from qattn_fx.kernels import emulation, reference  # noqa: E402

DEV = "cuda"
needs_sm90 = support.needs_capability((9, 0), reason="needs sm_90")
SAGE = Recipe("int8", "fp8", 1, 16, 1)
KERNEL_SPECS = {
    "gluon_sage": (Spec(default=AttentionSpec("TRITON", SAGE, kernel="gluon_sage")), None),
    "triton_sage": (Spec(default=AttentionSpec("TRITON", SAGE, kernel="triton_sage")), None),
    "cudnn_fp8": (Spec(default=AttentionSpec("CUDNN", Recipe("fp8", "fp8"))), "cudnn"),
    "flashinfer_fa3_fp8": (Spec(default=AttentionSpec("FLASHINFER", Recipe("fp8", "fp8", scale_scope="head"))),
                           "flashinfer"),
}


def cos(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@needs_sm90
@pytest.mark.parametrize("kernel", list(KERNEL_SPECS))
def test_symbolic_lengths_on_every_hopper_kernel(kernel):
    """bf16 SDPA at lengths 4096, 4608, 6144, 8190 under a default torch.compile: the second length recompiles with
    a symbolic length, which then serves the rest (2 graphs), every call quantized and close to SDPA."""
    spec, library = KERNEL_SPECS[kernel]
    if library:
        pytest.importorskip(library)
    backend = qattn_fx.backend(spec)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend=backend, fullgraph=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    for s in (4096, 4608, 6144, 8190):
        q, k, v = (torch.randn(1, s, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
        out = fn(q, k, v)
        c = cos(out, F.scaled_dot_product_attention(q, k, v))
        print(f"[{kernel}] S={s}: cosine {c:.5f}")
        assert c > 0.998, (kernel, s, c)
    assert len(backend.graph_modules) == 2, str(backend.report)
    assert all(site.kernel == kernel for site in backend.report.sites), str(backend.report)


def key_bias(b, skv, pattern, device=DEV):
    g = torch.Generator().manual_seed(1)
    bias = torch.zeros(b, skv)
    if pattern == "tail":  # HunyuanVideo: the text padding at the end of the joint sequence
        bias[:, skv - skv // 5:] = float("-inf")
    elif pattern == "middle":  # a band inside the keys: tiles without the bias before and after it
        bias[:, skv // 3: skv // 2] = float("-inf")
    elif pattern == "scattered":
        bias[torch.rand(b, skv, generator=g) < 0.4] = float("-inf")
    elif pattern == "finite":
        bias = torch.randn(b, skv, generator=g)
        bias[:, ::3] = -10000.0
    elif pattern == "all":
        bias[1] = float("-inf")
    return bias.to(device)


make_qkv = functools.partial(support.make_qkv, hq=8, hkv=4, sq=1000, skv=1500, d=128, device=DEV)


@needs_sm90
@pytest.mark.parametrize("pattern", ["tail", "middle", "scattered", "finite", "all"])
@pytest.mark.parametrize("kernel", ["gluon_sage", "triton_sage"])
@pytest.mark.parametrize("qk, blocks", [("int8", (1, 16)), ("bf16", (0, 0))])
def test_key_bias_matches_emulation_and_reference(kernel, qk, blocks, pattern):
    """The kernel with a key bias runs the emulated tile loop (fp32 level, Hopper FP8-MMA precision; gluon_sage
    with its tail split and mmasum where its config has them) and stays close to the reference."""
    from qattn_fx.kernels import gluon_sage as gs
    from qattn_fx.kernels import triton_sage as ts

    args = quantize(*make_qkv(), qk, *blocks)
    bias = key_bias(2, args[2].shape[2], pattern)
    module = gs if kernel == "gluon_sage" else ts
    out = module.scaled_attention(*args, 1 / math.sqrt(128), torch.float32, key_bias=bias)
    ref = reference.scaled_attention(*args, 1 / math.sqrt(128), torch.float32, key_bias=bias)
    if kernel == "gluon_sage":
        config, tail = gs.last_config(), gs.last_tail_plan()
        want = emulation.emulate_launched(*args, 1 / math.sqrt(128), config, tail, key_bias=bias)
        mmasum = bool(config.mmasum)
    else:
        config = ts.best_config() or ts.KernelConfig(128, 64, 8, 3)
        want = emulate(*args, 1 / math.sqrt(128), config.block_n, key_bias=bias)
        mmasum = False
    if pattern == "all":
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(ref[1], out[1])
        out, ref, want = out[:1], ref[:1], want[:1]
    support.assert_fp32_level(out.float(), want, f"{kernel} {qk} {pattern}", name=kernel, mmasum=mmasum)
    support.assert_close_to_reference(out.float(), ref, f"{kernel} {qk} {pattern}", name=kernel)


@needs_sm90
@pytest.mark.parametrize("kernel", ["gluon_sage", "triton_sage"])
def test_a_padded_call_equals_the_unpadded_call(kernel):
    """HunyuanVideo-like: 4096 video tokens + 256 text tokens of which 100 are valid. The padded, masked call
    matches the call on the 4196 valid tokens within quantization tolerance."""
    spec = KERNEL_SPECS[kernel][0]
    backend = qattn_fx.backend(spec)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), backend=backend,
                       fullgraph=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, 4352, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    mask = torch.ones(1, 1, 1, 4352, dtype=torch.bool, device=DEV)
    mask[..., 4196:] = False
    padded = fn(q, k, v, mask)
    assert backend.report.sites[0].kernel == kernel, str(backend.report)
    unpadded = F.scaled_dot_product_attention(q[:, :, :4196], k[:, :, :4196], v[:, :, :4196])
    c = cos(padded[:, :, :4196], unpadded)
    print(f"[{kernel}] padded vs unpadded: cosine {c:.5f}")
    assert c > 0.998


@needs_sm90
@pytest.mark.parametrize("kernel", ["gluon_sage", "triton_sage"])
def test_a_symmetric_padding_mask_runs_per_key_on_the_kernel(kernel):
    """HunyuanVideo-1.5's ``m_i & m_j`` mask (4096 video tokens + 256 text tokens of which 100 are valid): the site
    runs the kernel with the key mask, the rows of masked queries are 0, and the kept rows match SDPA."""
    spec = KERNEL_SPECS[kernel][0]
    backend = qattn_fx.backend(spec)
    torch._dynamo.reset()

    def hv15(q, k, v, m):
        r = m.view(1, 1, 1, -1).repeat(1, 1, m.shape[-1], 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(r & r.transpose(2, 3)).bool())

    fn = torch.compile(hv15, backend=backend, fullgraph=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, 4352, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    m = torch.ones(1, 4352, dtype=torch.bool, device=DEV)
    m[:, 4196:] = False
    out = fn(q, k, v, m)
    (site,) = backend.report.sites
    assert site.kernel == kernel and site.notes and "m_i & m_j" in site.notes[0], str(backend.report)
    assert torch.equal(out[:, :, 4196:], torch.zeros_like(out[:, :, 4196:]))
    c = cos(out[:, :, :4196], hv15(q, k, v, m)[:, :, :4196])
    print(f"[{kernel}] m_i & m_j: kept rows' cosine {c:.5f}")
    assert c > 0.998


MASK_FORMS = {  # a per-key mask (B, Skv) -> the attn_mask a model hands SDPA
    "prepared-2d": lambda m, h, sq: m.float().sub(1).mul(10000).repeat_interleave(h, 0).view(m.shape[0], h, 1, -1),
    "prepared-3d": lambda m, h, sq: (m.float().sub(1).mul(10000)[:, None].repeat_interleave(h, 0)
                                     .view(m.shape[0], h, 1, -1)),
    "prepared-2d-cast": lambda m, h, sq: MASK_FORMS["prepared-2d"](m, h, sq).to(torch.bfloat16),
    "expand-heads-queries": lambda m, h, sq: m.bool().view(m.shape[0], 1, 1, -1).expand(-1, h, sq, -1),
}


@needs_sm90
@pytest.mark.parametrize("form", list(MASK_FORMS))
def test_masks_repeated_or_broadcast_over_heads_run_per_key_on_gluon_sage(form):
    """diffusers' ``prepare_attention_mask`` (LTX-Video's bias from a 2-D or 3-D source, fp32 or cast to the
    queries' bf16 after the repeat) and Lumina-Next's ``expand`` over heads and queries: the site runs gluon_sage
    with the per-key mask and matches fp32 attention with the full mask (2 samples, 4352 keys, the first sample's
    last 156 masked). The reference is SDPA's math kernel: torch 2.11's cuDNN SDPA, the default on the H200,
    reads an fp32 mask beside bf16 queries as bf16 (pytorch/pytorch#191612; cosine 0.79 here)."""
    backend = qattn_fx.backend(KERNEL_SPECS["gluon_sage"][0])
    torch._dynamo.reset()

    def model(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=MASK_FORMS[form](m, q.shape[1], q.shape[2]))

    fn = torch.compile(model, backend=backend, fullgraph=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(2, 4352, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    m = torch.ones(2, 4352, dtype=torch.int32, device=DEV)
    m[0, 4196:] = 0
    out = fn(q, k, v, m)
    (site,) = backend.report.sites
    assert site.kernel == "gluon_sage" and len(site.notes) == 1 and "read per key" in site.notes[0], str(
        backend.report)
    mask = MASK_FORMS[form](m, 8, 4352)
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                              attn_mask=mask if mask.dtype == torch.bool else mask.float())
    c = cos(out, want)
    print(f"[{form}] cosine against fp32 attention with the full mask {c:.5f}")
    assert c > 0.998


#: Kernels that serve masks (``KernelInfo.key_bias``), the reference aside, each with a spec that forces it.
MASK_KERNELS = [n for n, i in kernels.KERNELS.items() if i.key_bias and n != "reference"]


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", MASK_KERNELS)
def test_what_masked_keys_hold_does_not_change_the_kernels_output(kernel, dtype):
    """Issue #43: huge finite K and V in masked keys (6e4 in fp16, 1e30 in bf16; key padding, scattered masked keys
    too, GQA) give bit for bit the output of the same compiled call with zeros there (the lowering zeroes them
    before smoothing and quantizing, so the kernel's inputs are identical), close to fp32 SDPA's math kernel.
    Before the fix: cos 0.35-0.64 against the clean call in fp16 (CPU emulation)."""
    spec = Spec(default=AttentionSpec("TRITON", SAGE, kernel=kernel))
    backend = qattn_fx.backend(spec)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
                       backend=backend, fullgraph=True)
    q, k, v, k_junk, v_junk, mask = support.masked_junk(b=2, hq=8, hkv=2, sq=1000, skv=1500, d=128, dtype=dtype,
                                                        device=DEV)
    out = fn(q, k_junk, v_junk, mask)
    assert all(s.kernel == kernel for s in backend.report.sites), str(backend.report)
    clean = fn(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean), (out.float() - clean.float()).abs().max().item()
    with sdpa_kernel(SDPBackend.MATH):
        dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    c = cos(out, dense)
    print(f"[{kernel}] {dtype} masked junk: cosine {c:.5f} against fp32 SDPA")
    assert c > 0.998, c


@needs_sm90
@pytest.mark.parametrize("layout", ["transposed", "head-last", "seq-first-transposed", "expanded-transposed",
                                    "expanded-batch", "expanded-heads", "gaps", "offset", "strided-d"])
@pytest.mark.parametrize("kernel", ["gluon_sage", "triton_sage"])
def test_every_layout_runs_on_the_kernel(kernel, layout):
    """Issue #43: Q, K and V stored in any layout SDPA takes (here each in ``layout``; a key-padding mask, GQA) run on
    the kernel, close to SDPA: Q/K without a unit-stride D are copied contiguous by the lowering (the copy fuses into
    the quantize pass), every other layout is read as it is (gluon_sage copies a bf16 Q TMA cannot address)."""
    spec = Spec(default=AttentionSpec("TRITON", SAGE, kernel=kernel))
    backend = qattn_fx.backend(spec)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
                       backend=backend, fullgraph=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = support.make_layout(layout, 2, 8, 1000, 128, dtype=torch.bfloat16, generator=g)
    k, v = (support.make_layout(layout, 2, 2, 1500, 128, dtype=torch.bfloat16, generator=g) for _ in range(2))
    mask = (torch.arange(1500, device=DEV) < torch.tensor([1200, 1500], device=DEV)[:, None])[:, None, None, :]
    out = fn(q, k, v, mask)
    assert all(s.kernel == kernel for s in backend.report.sites), str(backend.report)
    with sdpa_kernel(SDPBackend.MATH):
        dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    c = cos(out, dense)
    print(f"[{kernel}] {layout}: cosine {c:.5f}")
    assert c > 0.998, c
