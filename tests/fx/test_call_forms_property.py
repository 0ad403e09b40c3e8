"""What the policy approves, the kernel runs: a property test over SDPA call forms.

For every generated call that SDPA itself accepts (shapes 3-D/4-D/5-D, BSHD views, non-unit last strides, dtypes,
per-key and per-query masks, GQA with and without ``enable_gqa``, broadcast batches, lengths from 1), compiling
it with the backend never fails, and the site is either dense with a reason (the call then runs as written) or
quantized, in which case the compiled call succeeds and matches SDPA within the recipe's tolerance.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qattn_fx

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def sdpa(q, k, v, mask, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def operand(shape, dtype, layout, g):
    """A tensor of ``shape``: contiguous, a (.., S, H, D) buffer viewed as (.., H, S, D), or every other channel of
    a wider buffer (a last-dim stride of 2)."""
    if layout == "bshd" and len(shape) >= 4:
        x = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1], generator=g).transpose(-2, -3)
    elif layout == "strided":
        x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2]
    else:
        x = torch.randn(*shape, generator=g)
    return x.to(dtype)


@st.composite
def calls(draw):
    ndim = draw(st.sampled_from([3, 4, 4, 4, 5]))
    b = draw(st.sampled_from([1, 2]))
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2]))
    sq, skv = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    d = draw(st.sampled_from([8, 16, 32]))
    dtype = draw(st.sampled_from(list(DTYPES)))
    layout = draw(st.sampled_from(["contiguous", "bshd", "strided"]))
    k_batch = draw(st.sampled_from([b, 1]))
    mask = draw(st.sampled_from(["none", "key-bool", "key-float", "query-bool"]))
    enable_gqa = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    lead = {3: (b,), 4: (b, hq), 5: (2, b, hq)}[ndim]
    lead_k = {3: (k_batch,), 4: (k_batch, hk), 5: (2, k_batch, hk)}[ndim]
    return dict(ndim=ndim, q=(*lead, sq, d), k=(*lead_k, skv, d), dtype=dtype, layout=layout, mask=mask,
                enable_gqa=enable_gqa, seed=seed, sq=sq, skv=skv, b=b)


def make(call):
    g = torch.Generator().manual_seed(call["seed"])
    dtype = DTYPES[call["dtype"]]
    q = operand(call["q"], dtype, call["layout"], g)
    k = operand(call["k"], dtype, call["layout"], g)
    v = operand(call["k"], dtype, call["layout"], g)
    mask = None
    batch = call["q"][:-3] if call["ndim"] > 3 else ()
    if call["mask"] in ("key-bool", "key-float"):
        keep = torch.rand(call["b"], call["skv"], generator=g) > 0.3
        keep[:, 0] = True
        mask = keep[:, None, None, :] if call["ndim"] == 4 else keep[:, None, :] if call["ndim"] == 3 else None
        if mask is not None and call["mask"] == "key-float":
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, -1e4)
    elif call["mask"] == "query-bool":
        mask = torch.rand(*batch[:1], 1, call["sq"], call["skv"], generator=g) > 0.3 if call["ndim"] == 4 else None
    return q, k, v, mask


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(call=calls())
def test_approved_sites_run_and_match_sdpa(call):
    q, k, v, mask = make(call)
    try:
        dense = sdpa(q, k, v, mask, call["enable_gqa"])
    except RuntimeError:
        return  # SDPA itself rejects the call: nothing to serve
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(sdpa, backend=backend, fullgraph=True)(q, k, v, mask, call["enable_gqa"])
    (site,) = backend.report.sites
    assert out.shape == dense.shape and out.dtype == dense.dtype
    if not site.rewritten:
        assert site.reason.startswith("dense: ") and len(site.reason) > len("dense: ")
        torch.testing.assert_close(out, dense, atol=1e-2, rtol=1e-2)
        return
    # quantized: INT8 Q/K and FP8 P·V against SDPA in the input dtype (bf16/fp16 add their own rounding)
    ref, got = dense.double(), out.double()
    rel = (got - ref).norm() / ref.norm().clamp(min=1e-12)
    assert rel < 0.1, (site.reason, rel.item())


def test_float64_stays_dense_with_the_reason():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    torch.compile(sdpa, backend=backend, fullgraph=True)(q, q, q, None, False)
    assert backend.report.sites[0].reason == (
        "dense: reference: inputs are torch.float64, not bfloat16/float16/float32")


@pytest.mark.parametrize("ndim", [3, 5])
def test_3d_and_5d_operands_are_quantized(ndim):
    shape = (3, 20, 16) if ndim == 3 else (2, 3, 2, 20, 16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(sdpa, backend=backend, fullgraph=True)(q, k, v, None, False)
    assert backend.report.sites[0].rewritten
    dense = sdpa(q, k, v, None, False)
    assert out.shape == dense.shape and (out - dense).norm() / dense.norm() < 0.05


def test_a_broadcast_batch_and_a_strided_last_dim_are_quantized():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 20, 32, generator=g)
    k, v = (torch.randn(1, 2, 24, 64, generator=g)[..., ::2] for _ in range(2))
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    out = torch.compile(sdpa, backend=backend, fullgraph=True)(q, k, v, None, False)
    assert backend.report.sites[0].rewritten
    dense = sdpa(q, k, v, None, False)
    assert (out - dense).norm() / dense.norm() < 0.05
