"""Every compiled SDPA call is served within the recipe's bound or kept dense with a reason, never a crash: a
property test over operand layouts, dtypes, masks (junk in masked keys), GQA and dynamic shapes (issue #43), and
the same with block sparsity on.

Drawn per call: each of Q, K, V stored in any :data:`support.LAYOUTS` layout (transposed last two dims, head-last
and sequence-first permutes, broadcast batch or heads, gaps in every dim, storage offsets, ...); K/V batch 1
against a larger Q batch; bf16, fp16 or fp32; no mask, a boolean key-padding mask or a ``-inf`` float key mask
(both with huge finite values in masked keys' K and V: :data:`support.JUNK`), a finite float key bias, or a mask
that varies per query (kept dense); ``Hq`` a multiple of ``Hkv`` with and without ``enable_gqa``. Compiled with
``qattn_fx.backend(emulate=True)`` (aot_eager; a few under Inductor, ``slow``), under ``torch.no_grad()``; with
``dynamic=True`` at two lengths without a recompile.

A quantized call is compared with fp32 SDPA on the same inputs: relative L2 error below :data:`BOUND` (the bound of
the default recipe, INT8 Q/K and FP8 P·V, that tests/fx/test_call_forms_property.py uses; measured below 0.06 here),
and with a key mask, equal to the same call whose masked keys hold zeros. A dense call runs SDPA as written.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import support
import qattn_fx

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASKS = ("none", "key-bool", "key-inf", "key-bias", "query-bool")
#: Relative L2 error of the default recipe against fp32 SDPA (tests/fx/test_call_forms_property.py's bound).
BOUND = 0.1
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow],
                phases=[Phase.explicit, Phase.generate])  # no shrinking: each example compiles


def sdpa(q, k, v, mask, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


@st.composite
def calls(draw, min_len=1, min_kv=1):
    b = draw(st.sampled_from([1, 2]))
    hk = draw(st.sampled_from([1, 2]))
    return dict(
        b=b, k_batch=draw(st.sampled_from([b, 1])), hk=hk, hq=hk * draw(st.sampled_from([1, 2])),
        sq=draw(st.integers(min_len, 40)), skv=draw(st.integers(max(min_len, min_kv), 40)), d=draw(st.sampled_from([16, 32])),
        layouts=tuple(draw(st.sampled_from(list(support.LAYOUTS))) for _ in range(3)),
        dtype=draw(st.sampled_from(list(DTYPES))), mask=draw(st.sampled_from(MASKS)),
        enable_gqa=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make(call, sq=None, skv=None, junk=True):
    """``(q, k, v, mask)`` of ``call`` (lengths overridden by ``sq``/``skv``); masked keys hold :data:`support.JUNK`
    in K and V when ``junk``, else zeros."""
    g = torch.Generator().manual_seed(call["seed"])
    sq, skv = sq or call["sq"], skv or call["skv"]
    dtype = DTYPES[call["dtype"]]
    q = support.make_layout(call["layouts"][0], call["b"], call["hq"], sq, call["d"], dtype=dtype, generator=g)
    k, v = (support.make_layout(lay, call["k_batch"], call["hk"], skv, call["d"], dtype=dtype, generator=g)
            for lay in call["layouts"][1:])
    mask = None
    if call["mask"].startswith("key"):
        keep = torch.rand(call["b"], skv, generator=g) > 0.3
        keep[:, 0] = True
        mask = keep[:, None, None, :]
        if call["mask"] == "key-bias":
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, -1e4)
        else:
            if call["k_batch"] == call["b"]:  # (a K/V batch of 1 serves every batch element's own mask)
                # masked keys' K and V: junk (huge, finite) or zeros, written in the operands' own layouts
                gone = ~keep[:, None, :, None]
                k, v = (_fill(x, gone, sign * support.JUNK[dtype] if junk else 0.0) for x, sign in ((k, 1), (v, -1)))
            if call["mask"] == "key-inf":
                mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    elif call["mask"] == "query-bool":
        mask = torch.rand(call["b"], 1, sq, skv, generator=g) > 0.3
    return q, k, v, mask


def _fill(x, where, value):
    """``x`` with ``value`` where ``where`` is set: in place, in its own layout (a view of a buffer of its own), or for
    a broadcast view (stride 0) out of place, a dense tensor."""
    if 0 in x.stride():
        return x.masked_fill(where, value)
    return x.masked_fill_(where, value)


def _check(call, out, q, k, v, mask, site, clean=None):
    """``out`` of the compiled call against fp32 SDPA (quantized) or SDPA as written (dense)."""
    dense = sdpa(q, k, v, mask, call["enable_gqa"])
    assert out.shape == dense.shape and out.dtype == dense.dtype
    if not site.rewritten:
        assert site.reason.startswith("dense: ") and len(site.reason) > len("dense: ")
        torch.testing.assert_close(out, dense, atol=1e-2, rtol=1e-2)
        return
    # (with one query a per-query mask is a key mask: served as one)
    assert call["mask"] != "query-bool" or q.shape[2] == 1, "a mask that varies per query was quantized"
    fp32_mask = mask.float() if mask is not None and mask.dtype != torch.bool else mask
    ref = sdpa(q.double(), k.double(), v.double(), None if fp32_mask is None else fp32_mask.double()
               if fp32_mask.dtype != torch.bool else fp32_mask, call["enable_gqa"])
    rel = (out.double() - ref).norm() / ref.norm().clamp(min=1e-12)
    assert rel < BOUND, (site.reason, rel.item())
    if clean is not None:
        assert torch.equal(out, clean), "what masked keys hold changed the output"


def _sdpa_accepts(q, k, v, mask, enable_gqa) -> bool:
    try:
        sdpa(q, k, v, mask, enable_gqa)
    except RuntimeError:
        return False  # SDPA itself rejects the call: nothing to serve
    return True


def _run(call, compiler="aot_eager"):
    q, k, v, mask = make(call)
    if not _sdpa_accepts(q, k, v, mask, call["enable_gqa"]):
        return
    backend = qattn_fx.backend(emulate=True, compiler=compiler)
    torch._dynamo.reset()
    fn = torch.compile(sdpa, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = fn(q, k, v, mask, call["enable_gqa"])
        (site,) = backend.report.sites
        junk = call["mask"] in ("key-bool", "key-inf") and site.rewritten
        clean = fn(*make(call, junk=False), call["enable_gqa"]) if junk else None
        _check(call, out, q, k, v, mask, site, clean)


@pytest.mark.slow
@settings(max_examples=25, **SETTINGS)
@given(call=calls())
def test_every_layout_dtype_mask_and_gqa_is_served_or_dense_with_a_reason(call):
    _run(call)


@pytest.mark.slow
@settings(max_examples=8, **SETTINGS)
@given(call=calls(min_len=2, min_kv=17), other=st.tuples(st.integers(2, 40), st.integers(17, 40)))
def test_dynamic_shapes_serve_two_lengths_with_one_graph(call, other):
    """``dynamic=True``: a second pair of lengths runs on the same graph (no recompile), served alike. (Lengths from 2:
    Dynamo specializes a length of 1; key lengths from 17: the graph traced at more than one 16-key block of K
    scales guards on that count not being 1, so a K of at most 16 keys after a longer one compiles once more, as it
    does on main: torch's contiguity check of the scales' block axis, ``is_contiguous`` in the metadata AOT
    tracing records.)"""
    q, k, v, mask = make(call)
    if not _sdpa_accepts(q, k, v, mask, call["enable_gqa"]):
        return
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(sdpa, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for sq, skv in ((call["sq"], call["skv"]), other):
            q, k, v, mask = make(call, sq, skv)
            out = fn(q, k, v, mask, call["enable_gqa"])
            site = backend.report.sites[-1]
            _check(call, out, q, k, v, mask, site)
    assert len(backend.graph_modules) == 1, backend.report


@pytest.mark.slow
@settings(max_examples=6, **SETTINGS)
@given(call=calls())
def test_every_layout_dtype_mask_and_gqa_under_inductor(call):
    _run(call, compiler="inductor")


BLOCK_SPARSE = {
    "top_k": lambda keep: qattn_fx.BlockSparse(top_k=keep, similarity=0.0, sink_tiles=0, diagonal=False),
    "cdf": lambda keep: qattn_fx.BlockSparse(cdf=keep),
}


def _block_sparse_run(call, setting):
    """``call`` compiled with ``block_sparse`` (``setting``: ``(mode, keep)``) and, unless ``keep`` is 1, the same
    call with ``top_k=1`` (every block visited). Returns ``(out, out_all, site)``."""
    mode, keep = setting
    q, k, v, mask = make(call)
    outs = []
    for bs in (BLOCK_SPARSE[mode](keep), BLOCK_SPARSE["top_k"](1.0)):
        spec = qattn_fx.Spec(default=qattn_fx.AttentionSpec(recipe=qattn_fx.Recipe("int8", "fp8", 1, 16, 1),
                                                            block_sparse=bs))
        backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
        torch._dynamo.reset()
        with torch.no_grad():
            outs.append((torch.compile(sdpa, backend=backend, fullgraph=True)(q, k, v, mask, call["enable_gqa"]),
                         backend.report.sites[0], backend))
    return (q, k, v, mask), outs


@pytest.mark.slow
@settings(max_examples=12, **SETTINGS)
@given(call=calls(), length=st.tuples(st.integers(1, 300), st.integers(1, 300)),
       setting=st.tuples(st.sampled_from(list(BLOCK_SPARSE)), st.sampled_from([0.3, 0.6, 1.0])))
def test_block_sparse_sites_over_layouts_dtypes_masks_and_gqa(call, length, setting):
    """With ``block_sparse`` in the spec, over the same calls at lengths of up to 3 blocks: never a crash; a site is
    served (a predictor node feeds the attention op) or dense with a reason; ``top_k=1`` is the quantized call within
    the recipe's bound; at any keep the output is finite and, with a key mask, what masked keys hold (junk or zeros)
    changes no bit (the predictor pools kept keys only)."""
    call = {**call, "sq": length[0], "skv": length[1]}
    q, k, v, mask = make(call)
    if not _sdpa_accepts(q, k, v, mask, call["enable_gqa"]):
        return
    _, ((out, site, backend), (out_all, site_all, _)) = _block_sparse_run(call, setting)
    _check(call, out_all, q, k, v, mask, site_all)
    assert out.shape == out_all.shape and out.dtype == out_all.dtype
    if not site.rewritten:
        assert site.reason.startswith("dense: ")
        return
    assert any("predict_blocks" in str(n.target) for gm in backend.graph_modules for n in gm.graph.nodes)
    assert torch.isfinite(out).all()
    if setting == ("top_k", 1.0):
        assert torch.equal(out, out_all)
    if call["mask"] in ("key-bool", "key-inf") and call["k_batch"] == call["b"]:
        clean = make(call, junk=False)
        spec = qattn_fx.Spec(default=qattn_fx.AttentionSpec(recipe=qattn_fx.Recipe("int8", "fp8", 1, 16, 1),
                                                            block_sparse=BLOCK_SPARSE[setting[0]](setting[1])))
        torch._dynamo.reset()
        with torch.no_grad():
            again = torch.compile(sdpa, backend=qattn_fx.backend(spec, emulate=True, compiler="aot_eager"),
                                  fullgraph=True)(*clean, call["enable_gqa"])
        assert torch.equal(out, again), "what masked keys hold changed the block-sparse output"
