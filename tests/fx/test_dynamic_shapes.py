"""Every resolution compiles: symbolic lengths (automatic dynamic shapes, ``dynamic=True``) reach the quantize ops,
their padding, the fake kernels and the attention op without specializing the graph, and every call is quantized.

Under a default ``torch.compile`` the first call compiles for its static shapes and the second distinct length
recompiles once with symbolic lengths; that graph must then serve every later length (at most 2 graphs).
"""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import qattn_fx
from qattn_fx import AttentionSpec, Recipe, Spec, tiny_models
from qattn_fx.ops import quantized_attention
from qattn_fx.spec import DEFAULT_RECIPE

LENGTHS = (64, 100, 129, 1000)


def sdpa(q, k, v, scale=None):
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def compiled(backend, dynamic=None, fn=sdpa):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [None, True, False], ids=["default", "dynamic", "static"])
def test_bare_sdpa_at_every_length_is_quantized_and_exact(dynamic):
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend, dynamic)
    torch.manual_seed(0)
    for s in LENGTHS:
        q, k, v = (torch.randn(2, 3, s, 48) for _ in range(3))
        out = fn(q, k, v)
        # the compiled graph runs the same ops as the eager lowering, so the outputs are identical
        torch.testing.assert_close(out, quantized_attention(q, k, v, DEFAULT_RECIPE), rtol=0, atol=0)
    assert all(site.rewritten for site in backend.report.sites)
    graphs = len(backend.graph_modules)
    assert graphs == {None: 2, True: 1, False: len(LENGTHS)}[dynamic], backend.report


def test_symbolic_lengths_show_in_the_report():
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend, dynamic=True)
    fn(*(torch.randn(1, 2, 100, 48) for _ in range(3)))
    (site,) = backend.report.sites
    assert isinstance(site.q_shape[2], str) and site.q_shape[3] == 48  # head_dim is specialized, lengths are not
    assert site.rewritten and site.cell("q/kv") == f"{site.q_shape[2]}/{site.kv_shape[2]}"
    video = dataclasses.replace(site, q_shape=[1, 2, "((s0//2))*s1", 48], kv_shape=[1, 2, "s2", 48])
    assert video.cell("q/kv") == "((s0//2))*s1 / s2"  # a length with "//" keeps the separator apart
    joint = dataclasses.replace(site, q_shape=[1, 2, "4*s0 + 10", 48], kv_shape=[1, 2, "4*s0 + 10", 48])
    assert joint.cell("q/kv") == "4*s0 + 10 / 4*s0 + 10"  # so does any expression (QwenImage's joint length)


def test_cross_attention_lengths_vary_independently():
    """Query and key lengths are separate symbols, and a call where they happen to be equal (200, 200) runs the
    same graph: the pass compares lengths without a guard. So does a call with 9 keys, one K scale block of 16
    (:func:`test_one_graph_serves_key_lengths_of_one_scale_block`)."""
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend)
    torch.manual_seed(0)
    for sq, skv in ((64, 20), (100, 33), (129, 77), (200, 200), (40, 9), (1000, 250)):
        q, k, v = torch.randn(1, 2, sq, 32), torch.randn(1, 2, skv, 32), torch.randn(1, 2, skv, 32)
        torch.testing.assert_close(fn(q, k, v), quantized_attention(q, k, v, DEFAULT_RECIPE), rtol=0, atol=0)
    assert len(backend.graph_modules) == 2 and all(s.rewritten for s in backend.report.sites)


def test_a_scale_that_changes_between_calls_compiles():
    """A ``scale=`` that changes between calls: Dynamo may trace it as a value of the graph (a SymFloat read with
    ``.item()``), which the rewrite hands to the op as a CPU scalar tensor (``runtime_scale``); every call is
    quantized and exact, and no compile fails."""
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    for scale in (0.1, 0.2, 0.35):
        expected = quantized_attention(q, k, v, DEFAULT_RECIPE, sm_scale=scale)
        torch.testing.assert_close(fn(q, k, v, scale), expected, rtol=0, atol=0)
    assert backend.report.sites and all(site.rewritten for site in backend.report.sites)


def test_the_op_takes_a_runtime_scale():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    expected = quantized_attention(q, k, v, DEFAULT_RECIPE, sm_scale=0.2)

    def emit(target, args, name):
        if target is torch.ops.qattn.scaled_attention.default:  # the same call with the scale as a tensor
            args = (*args[:8], 1.0, *args[9:], None, torch.tensor(0.2, dtype=torch.float64))
        return target(*args)

    out = quantized_attention(q, k, v, DEFAULT_RECIPE, sm_scale=0.2, emit=emit)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


#: Recipes whose scales come in blocks of tokens: K per 16 tokens (the default), V's MXFP8 scales per 32 tokens,
#: V's NVFP4 scales per 16 (V quantized along the sequence).
TOKEN_BLOCK_RECIPES = {
    "int8-k16": ("auto", DEFAULT_RECIPE),
    "mxfp8": ("CUDNN", Recipe("mxfp8", "mxfp8", 0, 0, 0)),
    "nvfp4": ("FLASHINFER", Recipe("nvfp4", "nvfp4", 0, 0, 0)),
}


def masked_sdpa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(TOKEN_BLOCK_RECIPES))
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
@torch.compiler.config.patch(force_disable_caches=True)
def test_one_graph_serves_key_lengths_of_one_scale_block(name, compiler):
    """Key lengths on both sides of one scale block (17 tokens: one MXFP8 V block of 32; 5: one K block of 16 and
    one NVFP4 V block) run the graph compiled at 80 keys, with ``dynamic=True`` and a key-padding mask: the quantize
    ops pad their block counts to a multiple of 4, so no tensor in the graph has a dim ``ceil(S/block)``, which the
    compiler guards on being 1 (every traced node's metadata checks its contiguity). That guard recompiled the graph
    for the short keys, and the recompiled MXFP8 graph failed in Inductor's C++ codegen (``AssertionError`` in
    ``try_loop_split``: K's and V's lengths, separate symbols there, made equal by a guard). The failure depends on
    the symbols' names, which Dynamo derives from the sources: the mask is ``m`` as in the fuzzer's repro. Caches
    off: a warm Inductor cache skips the codegen that failed."""
    backend_name, recipe = TOKEN_BLOCK_RECIPES[name]
    spec = Spec(default=AttentionSpec(backend_name, recipe))
    backend = qattn_fx.backend(spec, emulate=True, compiler=compiler)
    fn = compiled(backend, dynamic=True, fn=masked_sdpa)
    counters.clear()
    torch.manual_seed(0)
    for skv in (80, 17, 5, 100):  # the query length stays 40 (no length equals another dim: duck sizing)
        q = torch.randn(2, 1, 40, 64, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 1, skv, 64, dtype=torch.bfloat16) for _ in range(2))
        mask = torch.rand(2, 1, 1, skv) > 0.3
        mask[..., 0] = True
        with torch.no_grad():
            out = fn(q, k, v, mask)
        torch.testing.assert_close(out, quantized_attention(q, k, v, recipe, attn_mask=mask), rtol=0, atol=0)
    assert backend.report.sites and all(site.rewritten for site in backend.report.sites), backend.report
    assert counters["stats"]["unique_graphs"] == 1 and len(backend.graph_modules) == 1, backend.report


#: (frames, height, width) for Wan, image tokens for Flux. The second call changes every varying dim, so Dynamo's
#: automatic dynamic shapes mark them all symbolic at once (a dim that first changes later recompiles again,
#: whatever the backend); no first size equals another dim of the tiny models (text dim 16, text tokens 12/48),
#: which Dynamo's duck sizing would give the same symbol, so that a guard on one specializes the other.
RESOLUTIONS = {"wan": [(2, 20, 18), (3, 24, 22), (4, 28, 24), (3, 22, 30)], "flux": [20, 28, 36, 50]}


def _resized(name, inputs, size):
    call = dict(inputs)
    if name == "wan":
        call["hidden_states"] = torch.randn(1, 4, *size)
    else:
        call["hidden_states"] = torch.randn(1, size, 4)
        call["img_ids"] = torch.randn(size, 3)
    return call


@pytest.mark.slow
@pytest.mark.parametrize("name, dynamic, compiler", [
    ("wan", None, "inductor"), ("wan", True, "aot_eager"), ("wan", False, "aot_eager"),
    ("flux", None, "aot_eager"), ("flux", True, "aot_eager"), ("flux", False, "aot_eager")],
    ids=["wan-default-inductor", "wan-dynamic", "wan-static", "flux-default", "flux-dynamic", "flux-static"])
def test_tiny_models_at_four_resolutions(name, dynamic, compiler):
    """A diffusers model called at 4 resolutions: every call quantized and close to the dense model; under default
    settings at most 2 graphs, with ``dynamic=True`` one, with ``dynamic=False`` one per resolution. The graph
    counts are Dynamo's, whatever compiles the graphs: Inductor compiles Wan's (its symbolic-shape codegen of the
    rewritten graph, as a user's default compile runs it), aot_eager the rest (CI time)."""
    model, inputs = tiny_models.MODELS[name]()
    backend = qattn_fx.backend(emulate=True, compiler=compiler)
    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(model, backend=backend, dynamic=dynamic)
    for size in RESOLUTIONS[name]:
        call = _resized(name, inputs, size)
        with torch.no_grad():
            out, dense = cf(**call)[0], model(**call)[0]
        rel = (out - dense).norm() / dense.norm()
        assert rel < 2e-2, (size, rel)
    # graphs Dynamo installed (a restarted analysis hands the backend a graph it then drops)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == {None: 2, True: 1, False: 4}[dynamic], backend.report
    assert backend.report.sites and all(s.rewritten for s in backend.report.sites), backend.report


def test_a_graph_with_no_quantized_site_logs_a_warning(caplog):
    backend = qattn_fx.backend(compiler="aot_eager", hardware=qattn_fx.Hardware.for_arch("sm_80"))
    with caplog.at_level(logging.WARNING, logger="qattn_fx"):
        compiled(backend)(*(torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0/1 attention sites quantized" in warnings[0]
    assert "no attention site was quantized" in warnings[0]
