"""Every operand layout SDPA takes is served: the lowering asks for the layout each op needs.

The attention ops need a unit stride on D for Q and K and on D or S for V (:mod:`qattn_fx.ops.attention`); the
quantize ops keep their input's memory order (:mod:`qattn_fx.ops.quantize`). A Q or K whose last dim is not the
innermost in memory (``transpose(-1, -2)`` of a ``(..., D, S)`` buffer, a head-last ``permute``) is copied
contiguous first (:func:`qattn_fx.ops.lowering.contiguous_copy`: ``aten.clone`` alone keeps a dense input's
strides); any other layout (gaps in any dim, broadcast batch or heads, storage offsets, BSHD and sequence-first
views) reaches the ops as it is. Issue #43, item 1: these calls used to fail at run time with ``ValueError: q needs a
unit stride on D``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import support
import qattn_fx
from qattn_fx import kernels
from qattn_fx.ops import quantized_attention
from qattn_fx.ops.attention import ATTENTION_OPS, check_block_scaled_inputs, check_key_bias, check_scaled_inputs
from qattn_fx.recipes import Recipe
from qattn_fx.spec import DEFAULT_RECIPE

ops = torch.ops.qattn


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


LAYOUTS = support.LAYOUTS


def make(layout, b=2, h=2, s=40, d=32, seed=0, dtype=torch.float32):
    return support.make_layout(layout, b, h, s, d, seed=seed, dtype=dtype)


def close(out, ref, *, rel=5e-2, cos=0.998):
    r = (out.double() - ref.double()).norm() / ref.double().norm()
    c = F.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0)
    assert r < rel and c > cos, (r.item(), c.item())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_is_quantized_and_runs_under_aot_eager(layout):
    q, k, v = make(layout, seed=1), make(layout, s=48, seed=2), make(layout, s=48, seed=3)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(sdpa, backend=backend, fullgraph=True)(q, k, v)
    (site,) = backend.report.sites
    assert site.rewritten, site.reason
    torch.testing.assert_close(out, quantized_attention(q, k, v, DEFAULT_RECIPE), rtol=0, atol=0)
    close(out, sdpa(q, k, v))


@pytest.mark.parametrize("layouts", [("transposed", "head-last", "seq-first"), ("head-last", "transposed", "gaps"),
                                     ("seq-first", "transposed", "head-last")])
def test_mixed_layouts_with_a_key_mask_and_gqa(layouts):
    q = make(layouts[0], h=4, seed=1)
    k, v = make(layouts[1], s=48, seed=2), make(layouts[2], s=48, seed=3)
    mask = (torch.arange(48) < torch.tensor([30, 48])[:, None])[:, None, None, :]
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)  # noqa: E731
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, mask)
    assert backend.report.sites[0].rewritten, backend.report.sites[0].reason
    close(out, fn(q, k, v, mask))


def _contract(kernel: str, seq_major: bool):
    """An emitter that runs each attention op's input checks for ``kernel`` (and checks V's layout for a kernel that
    wants it sequence-major), then the reference kernel."""
    seen = []

    def emit(target, args, name):
        if target in ATTENTION_OPS:
            if target is ops.block_scaled_attention.default:
                check_block_scaled_inputs(*args[:11], args[12])
                check_key_bias(args[14] if len(args) > 14 else None, args[3])
            elif target is not ops.skip_softmax_attention.default:
                bias = args[11] if len(args) > 11 else None
                check_scaled_inputs(*args[:8], args[9], kernel, bias)
                if seq_major and args[4].shape[-2] > 1:
                    assert args[4].stride(-2) == 1, args[4].stride()
                if args[1] is None and args[3] is not None:  # Q quantized in the kernel: no reference for it
                    seen.append("q in kernel")
                    q = args[0]
                    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], args[4].shape[-1]).transpose(1, 2)
            seen.append(name)
            args = tuple("reference" if a == kernel else a for a in args)
        return target(*args)

    return emit, seen


#: (kernel, recipe) pairs whose lowering paths differ: Q quantized in the graph or by the kernel, bf16 Q/K, V
#: sequence-major or not, per-tensor/head scales, block-scaled formats.
PATHS = [
    ("reference", DEFAULT_RECIPE),
    ("reference", Recipe("fp8", "fp8", 0, 0, 0)),
    ("reference", Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head")),
    ("reference", Recipe("bf16", "fp8", 0, 0, 1)),
    ("reference", Recipe("mxfp8", "mxfp8")),
    ("reference", Recipe("nvfp4", "nvfp4")),
    ("triton_sage", Recipe("int8", "fp8", 1, 16, 1)),
    ("gluon_sage", Recipe("int8", "fp8", 1, 16, 1)),  # Q quantized in the kernel
    ("gluon_sage", Recipe("int8", "fp8", 64, 128, 1)),
    ("cudnn_fp8", Recipe("fp8", "fp8", 0, 0, 0)),
    ("flashinfer_fa3_fp8", Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head")),
]


@pytest.mark.parametrize("layout", ["transposed", "head-last", "seq-first-transposed", "expanded-transposed",
                                    "gaps-transposed", "strided-d", "offset"])
@pytest.mark.parametrize("kernel, recipe", PATHS, ids=[f"{k}-{r.name}" for k, r in PATHS])
def test_the_ops_get_the_layout_each_kernel_needs(kernel, recipe, layout):
    dtype = torch.float32 if kernel == "reference" else torch.bfloat16
    q, k, v = (make(layout, s=s, seed=i, dtype=dtype) for i, s in ((1, 40), (2, 48), (3, 48)))
    mask = torch.arange(48)[None, None, None, :] < 40 if kernels.info(kernel).key_bias else None
    emit, seen = _contract(kernel, kernels.info(kernel).v_seq_major and recipe.v_dtype == "fp8")
    out = quantized_attention(q, k, v, recipe, kernel=kernel, emit=emit, attn_mask=mask)
    assert len(seen) == 1, seen
    if seen == ["attention"]:
        # NVFP4's 4-bit elements: the loosest recipe (rel L2 ~0.18 on these Gaussian inputs)
        tol = dict(rel=0.3, cos=0.97) if recipe.qk_dtype == "nvfp4" else dict(rel=0.15, cos=0.99)
        close(out, sdpa(q.float(), k.float(), v.float(), mask), **tol)


@pytest.mark.parametrize("layout", ["transposed", "head-last"])
def test_lse_and_skip_softmax_calls_take_any_layout(layout):
    from qattn_fx.recipes import SkipSoftmax

    q, k, v = make(layout, seed=1), make(layout, s=48, seed=2), make(layout, s=48, seed=3)
    out, lse = quantized_attention(q, k, v, Recipe("int8", "fp8", 1, 16, 1), return_lse=True)
    exact = torch.logsumexp((q @ k.transpose(-1, -2)) * 32 ** -0.5, dim=-1)
    torch.testing.assert_close(lse, exact, atol=0.05, rtol=0)
    close(out, sdpa(q, k, v))
    dense = quantized_attention(q, k, v, None, skip_softmax=SkipSoftmax(threshold=0.0))
    torch.testing.assert_close(dense, sdpa(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_transposed_operand_is_copied_contiguous_once_and_only_then():
    """The copy is ``contiguous_copy`` (not ``aten.clone``, which keeps a dense permuted tensor's strides), emitted only
    for an operand without a unit stride on D (V: on D or S for a sequence-major kernel)."""
    names = []

    def emit(target, args, name):
        names.append(name)
        return target(*args)

    q, k, v = make("transposed", seed=1), make("bshd", s=48, seed=2), make("transposed", s=48, seed=3)
    quantized_attention(q, k, v, DEFAULT_RECIPE, emit=emit)
    assert [n for n in names if n.endswith("_contiguous")] == ["q_contiguous", "v_contiguous"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["transposed", "head-last", "gaps-transposed"])
def test_every_layout_runs_under_inductor(layout):
    q, k, v = make(layout, seed=1), make(layout, s=48, seed=2), make(layout, s=48, seed=3)
    backend = qattn_fx.backend(emulate=True)
    torch._dynamo.reset()
    out = torch.compile(sdpa, backend=backend, fullgraph=True)(q, k, v)
    assert backend.report.sites[0].rewritten
    close(out, sdpa(q, k, v))
