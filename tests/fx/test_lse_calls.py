"""Attention calls that also return the log-sum-exp (ring attention's local attention) are sites served with LSE.

``aten._scaled_dot_product_flash_attention`` / ``_cudnn_attention`` return ``(out, lse, ...)``; diffusers' ring
attention merges the partial outputs of each K/V chunk by ``lse``. A quantized site returns both, the LSE of the
call's own logits (smoothing K shifts it; the shift is added back), so chunks merge as the unquantized call would.
No CPU kernel exists for these aten ops: compiled, the rewritten graph runs on the reference kernel.
"""

import pytest
import torch
import torch.nn.functional as F

import qattn_fx
from qattn_fx import Hardware, Spec
from qattn_fx.fx.match import clean_module_path
from qattn_fx.ops import quantized_attention
from qattn_fx.policy import Site, resolve
from qattn_fx.recipes import Recipe
from qattn_fx.spec import DEFAULT_RECIPE, AttentionSpec

SAGE = Recipe("int8", "fp8", 1, 16, 1)


def qkv(b=1, h=2, sq=48, skv=64, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for s in (sq, skv, skv))
    return q, k + 2.0, v  # a K mean far from 0: smoothing shifts the LSE


def exact_lse(q, k):
    return torch.logsumexp((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1)


def test_reference_lse_is_the_calls_log_sum_exp_with_smoothed_k():
    q, k, v = qkv()
    out, lse = quantized_attention(q, k, v, SAGE, return_lse=True)
    assert lse.shape == (1, 2, 48) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, exact_lse(q, k), atol=0.05, rtol=0)
    torch.testing.assert_close(out, quantized_attention(q, k, v, SAGE), atol=0, rtol=0)


def test_partial_results_merge_by_lse_like_the_whole_call():
    """Two K/V chunks (each smoothed by its own mean), merged as ring attention does, give the whole call."""
    q, k, v = qkv()
    o1, l1 = quantized_attention(q, k[:, :, :32], v[:, :, :32], SAGE, return_lse=True)
    o2, l2 = quantized_attention(q, k[:, :, 32:], v[:, :, 32:], SAGE, return_lse=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
    ref = F.scaled_dot_product_attention(q, k, v)
    assert ((merged - ref).norm() / ref.norm()) < 0.05
    torch.testing.assert_close(lse, exact_lse(q, k), atol=0.05, rtol=0)


def test_lse_needs_a_scaled_recipe():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="return_lse=True needs a recipe of the scaled family"):
        quantized_attention(q, k, v, Recipe("mxfp8", "fp8"), return_lse=True)


def flash(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    return out * 2, lse


def cudnn(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return out * 2, lse


@pytest.mark.parametrize("fn, lse_shape", [(flash, (1, 2, 48)), (cudnn, (1, 2, 48, 1))], ids=["flash", "cudnn"])
def test_compiled_lse_call_returns_quantized_output_and_lse(fn, lse_shape):
    q, k, v = qkv()
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        out, lse = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
    (record,) = backend.report.sites
    assert record.rewritten and "log-sum-exp" in " ".join(record.notes)
    assert lse.shape == lse_shape
    want_out, want_lse = quantized_attention(q, k, v, DEFAULT_RECIPE, return_lse=True)
    torch.testing.assert_close(out, want_out * 2)
    torch.testing.assert_close(lse.reshape(want_lse.shape), want_lse)


def reads_rng_state(q, k, v):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    return res[0], res[6]


def test_lse_call_whose_bookkeeping_outputs_are_read_stays_dense():
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception):  # no CPU kernel for the dense aten op: it cannot run here
        torch.compile(reads_rng_state, backend=backend, fullgraph=True)(*qkv())
    (record,) = backend.report.sites
    assert not record.rewritten
    assert record.reason == ("dense: the graph reads outputs 6 of the LSE attention op (backward bookkeeping); the "
                             "quantized ops return the output and the LSE only")


SITE = Site(q_shape=(1, 20, 37800, 128), k_shape=(1, 20, 37800, 128), v_shape=(1, 20, 37800, 128),
            dtype=torch.bfloat16, lse=True)


def test_policy_serves_lse_sites_with_kernels_that_return_lse():
    hopper = Hardware.supported_install("sm_90")
    assert resolve(SITE, hopper, Spec()).kernel == "gluon_sage"
    cudnn_fp8 = Spec(default=AttentionSpec("CUDNN", Recipe("fp8", "fp8")))
    with pytest.raises(ValueError, match="CUDNN: needs sm_100/sm_103, have sm_90; returns no LSE"):
        resolve(SITE, hopper, cudnn_fp8)
    emulated = resolve(SITE, qattn_fx.detect("cpu"), Spec(default=AttentionSpec("auto", Recipe("mxfp8", "fp8"))),
                       emulate=True)
    assert emulated.reason == ("dense: reference: no LSE op for mxfp8 Q/K, fp8 V (LSE calls are served for "
                               "int8/fp8/bf16 Q/K with fp8 V)")


def test_module_paths_through_diffusers_hooks_are_the_modules_own():
    raw = ("L['function_reference'].forward.__self__.__dict__['_modules']['blocks'].0.forward.func.__closure__[0]"
           ".cell_contents.forward.__self__.attn1.to_q")
    assert clean_module_path(raw) == "blocks.0.attn1.to_q"
