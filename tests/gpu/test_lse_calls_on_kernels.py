"""Ring attention's local call on an sm_90 GPU: the aten attention ops that return the LSE, rewritten by the pass to
``qattn::scaled_attention_lse`` on gluon_sage and triton_sage, against the ops themselves and the reference.

Run: ``pytest -m gpu tests/gpu/test_lse_calls_on_kernels.py -v -s``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import support

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import qattn_fx  # noqa: E402
from qattn_fx import AttentionSpec, Recipe, Spec  # noqa: E402

needs_sm90 = support.needs_capability((9, 0), reason="needs sm_90")
SAGE = Recipe("int8", "fp8", 1, 16, 1)


def flash(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]


def cudnn(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return out, lse.reshape(lse.shape[:3])


@needs_sm90
@pytest.mark.parametrize("kernel", ["gluon_sage", "triton_sage"])
@pytest.mark.parametrize("op", [flash, cudnn], ids=["flash", "cudnn"])
def test_lse_call_on_hopper_kernels(kernel, op):
    """bf16 (1, 8, 4600, 128) with K far from zero mean: output close to the dense op's, LSE to within 0.05 of
    the dense op's (the smoothed-K shift added back), and chunks merged by LSE close to the whole call."""
    backend = qattn_fx.backend(Spec(default=AttentionSpec("TRITON", SAGE, kernel=kernel)))
    torch._dynamo.reset()
    fn = torch.compile(op, backend=backend, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4600, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    k = k + 1.0
    with torch.no_grad():
        out, lse = fn(q, k, v)
        want_out, want_lse = op(q, k, v)
        halves = [fn(q, k[:, :, i:i + 2300], v[:, :, i:i + 2300]) for i in (0, 2300)]
    assert all(s.rewritten and s.kernel == kernel for s in backend.report.sites)
    cos = F.cosine_similarity(out.float().flatten(), want_out.float().flatten(), dim=0).item()
    lse_err = (lse.float() - want_lse.float()).abs().max().item()
    (o1, l1), (o2, l2) = halves
    total = torch.logaddexp(l1.float(), l2.float())
    merged = o1.float() * (l1 - total).exp()[..., None] + o2.float() * (l2 - total).exp()[..., None]
    merged_cos = F.cosine_similarity(merged.flatten(), want_out.float().flatten(), dim=0).item()
    print(f"[{kernel} {op.__name__}] cosine {cos:.5f}, max |LSE diff| {lse_err:.4f}, merged cosine {merged_cos:.5f}")
    assert cos > 0.998 and lse_err < 0.05 and merged_cos > 0.998
