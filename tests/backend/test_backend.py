"""The compile backend's behaviour around the rewrite: delegation, caching, nesting, dumps, logging, errors."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import qattn_fx
from qattn_fx import AttentionSpec, Recipe, Spec, tiny_models
from qattn_fx.backend import inductor_config_patches
from tests.fx.test_golden_graphs import AttentionBlock


def assert_close_to_dense(out, dense):
    """One quantized attention layer read straight out (no residual): with random projections the softmax is
    nearly uniform over the keys, so P·448 lands in e4m3's [256, 448] binade (step 32, ≤ 3.6 % per element) and
    V in e4m3 (≤ 6 %), averaged over the keys. Measured here: relative L2 error 0.8-1.5 %, cosine ≥ 0.9998."""
    rel = (out - dense).norm() / dense.norm()
    cos = F.cosine_similarity(out.flatten(), dense.flatten(), dim=0)
    assert rel < 3e-2 and cos > 0.999, (rel, cos)


def run(module, x, backend):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(module, backend=backend, fullgraph=True)(x)


@pytest.mark.slow
def test_inductor_output_matches_dense_and_quantize_nodes_reach_inductor():
    torch.manual_seed(0)
    block, x = AttentionBlock().eval(), torch.randn(2, 40, 64)
    backend = qattn_fx.backend(emulate=True)
    out = run(block, x, backend)
    with torch.no_grad():
        dense = block(x)
    assert_close_to_dense(out, dense)
    code = backend.graph_modules[0].code
    assert "torch.ops.qattn.quantize_per_block.default" in code and "scaled_dot_product_attention" not in code


@pytest.mark.slow
def test_second_compile_hits_inductor_fx_graph_cache():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block, x = AttentionBlock().eval(), torch.randn(1, 24, 64)
    run(block, x, qattn_fx.backend(emulate=True))
    hits = counters["inductor"]["fxgraph_cache_hit"]
    run(block, x, qattn_fx.backend(emulate=True))  # fresh Dynamo state, same rewrite → same FX graph
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1


def test_mode_and_options_become_inductor_config_patches():
    assert inductor_config_patches(None, None) == {}
    assert inductor_config_patches("default", {"max_autotune": False}) == {"max_autotune": False}
    patches = inductor_config_patches("max-autotune-no-cudagraphs", {"epilogue_fusion": False})
    assert patches["max_autotune"] is True and patches["epilogue_fusion"] is False
    torch.manual_seed(0)
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(block, backend=qattn_fx.backend(emulate=True), options={"epilogue_fusion": False})(x)


def test_unknown_compiler_and_spec_types_are_rejected():
    with pytest.raises(ValueError, match="compiler='tvm' is invalid; valid: inductor, aot_eager, eager"):
        qattn_fx.backend(compiler="tvm")
    with pytest.raises(TypeError, match="spec must be a Spec"):
        qattn_fx.backend(spec=42)


def test_explicit_backend_that_cannot_run_here_fails_the_compile_with_the_reason():
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    spec = Spec(default=AttentionSpec("TRTLLM", Recipe("int8", "fp8", 1, 16, 1)))
    with pytest.raises(Exception, match="backend 'TRTLLM' cannot serve site .* on cpu: TRTLLM: needs sm_100"):
        run(block, x, qattn_fx.backend(spec))


def test_summary_is_logged(caplog):
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    with caplog.at_level(logging.INFO, logger="qattn_fx"):
        run(block, x, qattn_fx.backend(emulate=True, compiler="eager"))
    # head_dim 32: emulated here, dense where the recipe deploys (gluon_sage and TRTLLM take 64/128 and 128)
    assert ("qattn_fx: 1/1 attention sites quantized (emulated; on sm_90 the spec would quantize 0 of 1, on sm_100 0 "
            "of 1), 0 dense (graph 0): without emulation the deployment would quantize none of them") in caplog.text


def test_debug_dump_files(tmp_path):
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    with qattn_fx.config.patch(debug_dir=str(tmp_path / "from_config")):  # default: $QATTN_FX_DEBUG
        run(block, x, qattn_fx.backend(emulate=True, compiler="eager"))
        run(block, x, qattn_fx.backend(emulate=True, compiler="eager", debug_dir=tmp_path / "explicit"))
    for folder in ("from_config", "explicit"):
        d = tmp_path / folder
        assert sorted(p.name for p in d.iterdir()) == [
            "graph_0_after.py", "graph_0_before.py", "graph_0_sites.json", "graph_0_sites.md", "spec.json"]
        assert "scaled_dot_product_attention" in (d / "graph_0_before.py").read_text()
        after = (d / "graph_0_after.py").read_text()
        assert "sdpa_attention" in after and "_nn.scaled_dot_product_attention(" not in after
        sites = json.loads((d / "graph_0_sites.json").read_text())["sites"]
        assert [s["kernel"] for s in sites] == ["reference"]
        context = json.loads((d / "spec.json").read_text())
        assert context["emulate"] is True and context["hardware"]["arch"] == "cpu"
        assert "| module |" in (d / "graph_0_sites.md").read_text()


def test_trace_artifacts_for_tlparse(monkeypatch):
    import torch._logging

    seen = []

    def fake_trace_structured(kind, metadata_fn=None, payload_fn=None, **kwargs):
        if kind == "artifact" and metadata_fn is not None and metadata_fn()["name"].startswith("qattn_fx"):
            seen.append((kind, metadata_fn()["name"], payload_fn()))

    monkeypatch.setattr(torch._logging, "trace_structured", fake_trace_structured)
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    run(block, x, qattn_fx.backend(emulate=True, compiler="eager"))
    names = [name for kind, name, _ in seen if kind == "artifact"]
    assert names == ["qattn_fx_before_rewrite", "qattn_fx_after_rewrite", "qattn_fx_sites"]
    assert seen[2][2]["sites"][0]["rewritten"] is True


def test_report_dict_has_the_documented_keys():
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    run(block, x, backend)
    (site,) = backend.report.to_dict()["sites"]
    for key in ("site", "module", "layer", "role", "q_shape", "kv_shape", "dtype", "mask", "mask_shape", "rewritten",
                "recipe", "kernel", "reason"):
        assert key in site
    assert site["q_shape"] == [1, 2, 8, 32] and site["dtype"] == "float32" and site["role"] == "self"
    assert site["mask"] == "none" and site["mask_shape"] is None


def test_pre_grad_pass_for_stacks_that_own_torch_compile(caplog):
    torch.manual_seed(0)
    block, x = AttentionBlock().eval(), torch.randn(1, 16, 64)
    qpass = qattn_fx.pre_grad_pass(emulate=True)
    assert isinstance(qpass.key(), bytes) and qpass.key() == qattn_fx.pre_grad_pass(emulate=True).key()
    assert qpass.key() != qattn_fx.pre_grad_pass(emulate=False).key()
    # torch >= 2.13 runs a pass with a uuid only on a cache miss: this one has none there, so it runs every compile
    late_when_keyed = hasattr(torch._inductor.config, "pre_grad_pass_timing")
    assert qpass.uuid() == (None if late_when_keyed else qpass.key())
    if late_when_keyed:  # early, and without torch's warning that the caches are bypassed (they are not)
        from torch._inductor import codecache

        codecache.log.addHandler(caplog.handler)
        try:
            with torch._inductor.config.patch(pre_grad_custom_pass=qpass):
                assert codecache.resolve_pre_grad_pass_timing() == "early"
        finally:
            codecache.log.removeHandler(caplog.handler)
        assert not [r for r in caplog.records if "uuid" in r.getMessage()]
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(pre_grad_custom_pass=qpass):
        out = torch.compile(block, fullgraph=True)(x)
        dense = block(x)
    assert qpass.report.quantized == 1
    assert_close_to_dense(out, dense)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = AttentionBlock(dim=32)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + self.attn(x)


class CheckpointedNet(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_sites_in_nested_subgraphs_are_rewritten_and_shared_graphs_refuse_per_layer_rules():
    torch.manual_seed(0)
    net, x = CheckpointedNet().eval(), torch.randn(1, 32, 32)
    spec = Spec.from_dict({"default": {"backend": "auto"}, "rules": [{"match": {"layers": [0]}, "use": "dense"}]})
    backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
    out = run(net, x, backend)
    with torch.no_grad():
        dense = net(x)
    (site,) = backend.report.sites  # one subgraph, shared by the three checkpointed layers
    assert site.site.startswith("wrap_body_0.subgraph_0.")
    assert site.rewritten and site.layer is None
    assert "rule 1 (layers=0) cannot be honoured" in site.notes[0]
    assert_close_to_dense(out, dense)


def test_regional_compilation_of_repeated_blocks():
    model, inputs = tiny_models.wan()
    spec = Spec.from_dict({"default": {"backend": "auto"}, "rules": [{"match": {"layers": ["-1:"]}, "use": "dense"},
                                                                      {"match": {"role": "cross"}, "use": "dense"}]})
    backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    model.compile_repeated_blocks(backend=backend, fullgraph=True)
    with torch.no_grad():
        model(**inputs)
    assert [(s.module, s.layer, s.role, s.rewritten) for s in backend.report.sites] == [
        ("attn1", None, "self", True), ("attn2", None, "cross", False)]
    assert "cannot be honoured" in backend.report.sites[0].notes[0]
    assert backend.report.sites[1].reason == "dense: rule 2 (role=cross)"


def test_dropout_and_causal_sites_stay_exactly_as_they_were():
    class Odd(torch.nn.Module):
        def forward(self, q, k, v):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            b = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, 8))
            return a + b

    q = k = v = torch.randn(1, 2, 8, 16)
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Odd(), backend=backend, fullgraph=True)(q, k, v)
    assert [s.reason for s in backend.report.sites] == [
        "dense: is_causal=True; qattn_fx's quantized attention ops are non-causal",
        "dense: attn_mask is a float bias of shape (8, 8) that varies per query or head; per-key biases are served"]
    assert backend.graph_modules[0].code.count("scaled_dot_product_attention") == 2


def test_a_rule_that_decides_no_site_is_noted_and_warned_once(caplog):
    torch.manual_seed(0)
    block, x = AttentionBlock().eval(), torch.randn(1, 24, 64)
    spec = Spec(rules=(qattn_fx.Rule(qattn_fx.Match(role=("cross",)), "dense"),
                       qattn_fx.Rule(qattn_fx.Match(module="blocks.*.attn"), "dense")))
    backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
    with caplog.at_level(logging.WARNING, logger="qattn_fx"):
        run(block, x, backend)
        run(block, torch.randn(1, 40, 64), backend)  # a second graph: no second warning
    assert backend.report.notes == [
        "rule 1 (role=cross) matched no site of the 2 site(s) in 2 graph(s) compiled so far",
        "rule 2 (module=blocks.*.attn) matched no site of the 2 site(s) in 2 graph(s) compiled so far"]
    warned = [r.getMessage() for r in caplog.records if "matched no site" in r.getMessage()]
    assert len(warned) == 2
    assert "note: rule 1 (role=cross) matched no site" in str(backend.report)
    assert backend.report.to_dict()["notes"] == backend.report.notes


def test_a_rule_shadowed_by_an_earlier_one_is_noted():
    torch.manual_seed(0)
    block, x = AttentionBlock().eval(), torch.randn(1, 24, 64)
    spec = Spec(rules=(qattn_fx.Rule(qattn_fx.Match(role=("self",)), "dense"),
                       qattn_fx.Rule(qattn_fx.Match(head_dim=(32,)), "dense")))
    backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
    run(block, x, backend)
    assert backend.report.notes == [
        "rule 2 (head_dim=32) matched 1 site(s), all decided by earlier rules of the 1 site(s) in 1 graph(s) "
        "compiled so far"]


@torch.library.custom_op("qattn_test::other_attention", mutates_args=())
def _other_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Another library's attention op, as ``torch.library`` registers it (FlashAttention's, SageAttention's)."""
    return F.scaled_dot_product_attention(q, k, v)


@_other_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class OtherAttentionBlock(torch.nn.Module):
    """One SDPA call, one flex attention call and two calls of another library's attention op."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 192)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.proj(x).view(1, -1, 3, 2, 32).permute(2, 0, 3, 1, 4)
        other = torch.ops.qattn_test.other_attention
        return F.scaled_dot_product_attention(q, k, v) + flex_attention(q, k, v) + other(q, k, v) + other(k, q, v)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_ops_other_than_sdpa_are_noted_and_warned(caplog):
    """Flex attention's higher-order op and other libraries' attention ops run as written; the report says how
    many and which, once per graph (qattn_fx's own ops, inserted by the rewrite, are not counted)."""
    torch.manual_seed(0)
    block, x = OtherAttentionBlock().eval().requires_grad_(False), torch.randn(1, 48, 64)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    with caplog.at_level(logging.WARNING, logger="qattn_fx"):
        out = run(block, x, backend)
    with torch.no_grad():
        torch.testing.assert_close(out, block(x), atol=0.1, rtol=0)
    note = ("graph 0: 3 call(s) of attention ops other than scaled_dot_product_attention run as the model wrote "
            "them (flex_attention x1, qattn_test.other_attention x2): qattn_fx rewrites "
            "scaled_dot_product_attention only")
    assert backend.report.notes == [note]
    assert [s.rewritten for s in backend.report.sites] == [True]
    assert [r.getMessage() for r in caplog.records if "other than" in r.getMessage()] == [f"qattn_fx: {note}"]
    assert qattn_fx.explain(block, x, emulate=True).notes == [note]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_graph_without_sdpa_still_notes_other_attention_ops():
    class FlexOnly(torch.nn.Module):
        def forward(self, q):
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, q, q)

    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    run(FlexOnly(), torch.randn(1, 2, 32, 16), backend)
    assert backend.report.sites == []
    assert backend.report.notes == [
        "graph 0: 1 call(s) of attention ops other than scaled_dot_product_attention run as the model wrote them "
        "(flex_attention x1): qattn_fx rewrites scaled_dot_product_attention only"]


class MultiheadBlock(torch.nn.Module):
    """``nn.MultiheadAttention`` as a model calls it without the weights."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(64, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


@pytest.fixture
def restore_mha_rule():
    """Put Dynamo's rule for ``F.multi_head_attention_forward`` back after a test that removed it."""
    from torch._dynamo import trace_rules

    from qattn_fx.fx import tracing

    rules = trace_rules.torch_non_c_binding_in_graph_functions
    saved = rules[tracing.MHA]
    yield
    rules[tracing.MHA] = saved
    trace_rules.get_torch_obj_rule_map.cache_clear()
    torch._dynamo.reset()


def test_multihead_attention_is_named_then_served_once_traced_into(restore_mha_rule):
    """Dynamo records ``F.multi_head_attention_forward`` as one call: the report names it with the switch that
    makes its attention a site; after :func:`qattn_fx.trace_multihead_attention` the same model has one quantized
    site and its output stays close to dense."""
    from qattn_fx.fx import tracing

    torch.manual_seed(0)
    block, x = MultiheadBlock().eval(), torch.randn(1, 48, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        report = qattn_fx.explain(block, x, emulate=True)
    assert report.sites == [] and report.notes == [
        "graph 0: 1 call(s) of attention ops other than scaled_dot_product_attention run as the model wrote them "
        f"({tracing.MHA} x1): qattn_fx rewrites scaled_dot_product_attention only; {tracing.MHA_HINT}"]
    assert qattn_fx.trace_multihead_attention() is True
    assert qattn_fx.trace_multihead_attention() is False  # already traced into
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = run(block, x, backend)
    assert [(s.module, s.role, s.rewritten) for s in backend.report.sites] == [("attn", "self", True)]
    assert backend.report.notes == []
    with torch.no_grad():
        dense = block(x)
    rel = (out - dense).norm() / dense.norm()  # measured 0.032 (the output projection of head_dim 32 rows)
    assert rel < 0.05 and F.cosine_similarity(out.flatten(), dense.flatten(), dim=0) > 0.999


def test_module_globs_match_the_path_tail_under_regional_compilation():
    """compile_repeated_blocks compiles one block alone: its sites' paths start inside the block (``attn2``); the
    rule ``blocks.*.attn2 → dense`` (docs/spec.md's module glob) must still make cross-attention dense, and say how
    it matched."""
    model, inputs = tiny_models.wan()
    spec = Spec(rules=(qattn_fx.Rule(qattn_fx.Match(module="blocks.*.attn2"), "dense"),))
    backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
    torch._dynamo.reset()
    model.compile_repeated_blocks(backend=backend, fullgraph=True)
    with torch.no_grad():
        model(**inputs)
    sites = {s.module: s for s in backend.report.sites}
    assert set(sites) == {"attn1", "attn2"}
    assert sites["attn1"].rewritten and not sites["attn2"].rewritten
    assert sites["attn2"].reason == "dense: rule 1 (module=blocks.*.attn2)"
    assert sites["attn2"].notes == ("rule 1: module glob 'blocks.*.attn2' matched against the path's tail 'attn2' "
                                    "(the site's graph is one block compiled alone, so its path starts inside the "
                                    "block)",)
    # the same rule, whole-model compiled, matches the full paths
    for module in model.modules():  # undo the regional compilation
        module._compiled_call_impl = None
    with torch.no_grad():
        whole = qattn_fx.explain(model, **inputs, spec=spec, emulate=True)
    assert {s.module: s.rewritten for s in whole.sites} == {
        "blocks.0.attn1": True, "blocks.0.attn2": False, "blocks.1.attn1": True, "blocks.1.attn2": False}


class _Attention(torch.nn.Module):
    """Self-attention over ``x`` (B, S, 32), or cross-attention to ``context`` when given: 2 heads of 16."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x, context=None):
        kv = x if context is None else context
        heads = lambda t: t.unflatten(-1, (2, 16)).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(kv)), heads(self.v(kv)))
        return x + o.transpose(1, 2).flatten(-2)


class _StreamsAttention(torch.nn.Module):
    """MM-DiT joint attention over image tokens ``x`` and text tokens, each stream projected by its own weights;
    the image keys are multiplied by a mask, as HiDream does for padded latents."""

    def __init__(self):
        super().__init__()
        self.image, self.text = _Attention(), _Attention()

    def forward(self, x, text, x_mask):
        heads = lambda t: t.unflatten(-1, (2, 16))  # noqa: E731
        k_image = heads(self.image.k(x)) * x_mask[..., None, None]
        q, k, v = (torch.cat(p, dim=1).transpose(1, 2) for p in (
            (heads(self.image.q(x)), heads(self.text.q(text))), (k_image, heads(self.text.k(text))),
            (heads(self.image.v(x)), heads(self.text.v(text)))))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


def test_roles_follow_the_token_streams_not_every_concatenation():
    class Roles(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.ModuleList(_Attention() for _ in range(4))
            self.streams = _StreamsAttention()
            self.hint = torch.nn.Linear(32, 32)

        def forward(self, x, text, control):
            x = self.attn[0](x)  # self
            padded = torch.cat([control, control.new_zeros(1, x.shape[1] - control.shape[1], 32)], dim=1)
            x = self.attn[1](x + self.hint(padded))  # still self: zeros pad the control tokens (WanVACE)
            x = self.attn[2](x, text)  # cross
            joint = self.attn[3](torch.cat([text, x], dim=1))  # joint: text and image tokens (Flux's single blocks)
            return self.streams(joint[:, text.shape[1]:], text, torch.ones(1, x.shape[1]))  # joint: two streams

    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Roles(), backend=backend, fullgraph=True)(
            torch.randn(1, 24, 32), torch.randn(1, 8, 32), torch.randn(1, 20, 32))
    assert [(s.module, s.role) for s in backend.report.sites] == [
        ("attn.0", "self"), ("attn.1", "self"), ("attn.2", "cross"), ("attn.3", "joint"), ("streams", "joint")]


def test_keys_of_another_length_that_hold_the_queries_tokens_are_not_cross():
    """Keys longer than the queries: text and image keys for image queries only (PRX) are ``joint``; the last
    image tokens' queries over every image token's keys (Cosmos3's and QwenImage21's target over its prefix) are
    ``self``; keys of text alone stay ``cross``."""
    class Keys(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.image, self.text = _Attention(), _Attention()

        def forward(self, x, text):
            heads = lambda t: t.unflatten(-1, (2, 16)).transpose(1, 2)  # noqa: E731
            image_only = heads(self.image.q(x))
            both = [heads(torch.cat([self.text.k(text), self.image.k(x)], dim=1)),
                    heads(torch.cat([self.text.v(text), self.image.v(x)], dim=1))]
            own = [heads(self.image.k(x)), heads(self.image.v(x))]
            return (F.scaled_dot_product_attention(image_only, *both),
                    F.scaled_dot_product_attention(image_only[:, :, 8:], *own), self.image(x, text))

    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Keys(), backend=backend, fullgraph=True)(torch.randn(1, 24, 32), torch.randn(1, 8, 32))
    assert [s.role for s in backend.report.sites] == ["joint", "self", "cross"]


@pytest.mark.parametrize("dense_role", [None, "cross", "self"])
def test_a_sites_role_does_not_depend_on_the_rewrites_before_it(dense_role):
    """Cross-attention to ``cat([image_tokens, text])`` (Wan image-to-video, ChronoEdit, HunyuanDiT), then the next
    block's self-attention: the latter stays ``self`` whether the cross site before it was rewritten or not, so role
    rules decide the same for every block."""
    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.ModuleList(_Attention() for _ in range(4))

        def forward(self, x, image, text):
            context = torch.cat([image, text], dim=1)
            for i in range(0, 4, 2):
                x = self.attn[i + 1](self.attn[i](x), context)
            return x

    rules = [{"match": {"role": [dense_role]}, "use": "dense"}] if dense_role else []
    backend = qattn_fx.backend({"rules": rules}, emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Blocks(), backend=backend, fullgraph=True)(
            torch.randn(1, 24, 32), torch.randn(1, 4, 32), torch.randn(1, 8, 32))
    assert [(s.role, s.rewritten) for s in backend.report.sites] == [
        (role, role != dense_role) for role in ("self", "cross", "self", "cross")]


@pytest.mark.parametrize("dense_role", [None, "self"])
def test_outputs_of_one_stream_attended_per_segment_and_put_back_together_stay_one_stream(dense_role):
    """QwenImage21's prefill: each layer attends per segment of its one token sequence (a prefix segment over its
    own keys, the rest over all keys) and concatenates the outputs. The next layer's first segment is ``self`` as
    in the first layer, whether the calls before it were rewritten or not: pieces of one stream join no streams.
    The rest's queries over the whole sequence are ``self`` too: their keys hold their own tokens."""
    class Segmented(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
            prefix = F.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8])
            rest = F.scaled_dot_product_attention(q[:, :, 8:], k, v)
            return x + self.out(torch.cat([prefix, rest], dim=2).transpose(1, 2).flatten(2))

    rules = [{"match": {"role": [dense_role]}, "use": "dense"}] if dense_role else []
    backend = qattn_fx.backend({"rules": rules}, emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(torch.nn.Sequential(Segmented(), Segmented()), backend=backend, fullgraph=True)(
            torch.randn(1, 24, 32))
    assert [(s.module, s.role, s.rewritten) for s in backend.report.sites] == [
        (layer, "self", dense_role is None) for layer in ("0", "1") for _ in range(2)]


@pytest.mark.slow
def test_a_restarted_analysis_leaves_one_row_per_site():
    """With ``dynamic=True`` a float attribute passed as SDPA's scale (diffusers' ``attn.scale``) becomes symbolic;
    Inductor then has Dynamo restart its analysis and call the backend again for the same frame."""
    class ScaledAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.scale = torch.nn.Linear(32, 96), 0.25

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale)

    backend = qattn_fx.backend(emulate=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(ScaledAttention(), backend=backend, fullgraph=True, dynamic=True)(torch.randn(1, 24, 32))
    assert len(backend.graph_modules) == 1 and len(backend.report.sites) == 1


def test_the_report_says_how_it_read_each_mask():
    def padded(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])

    backend = qattn_fx.backend(emulate=True, compiler="eager")
    q, keep = torch.randn(1, 2, 16, 32), torch.arange(16) < 12
    torch._dynamo.reset()
    torch.compile(padded, backend=backend, fullgraph=True)(q, q, q, keep[None])
    (site,) = backend.report.to_dict()["sites"]
    assert site["mask"] == "key_padding" and site["mask_shape"] == [1, 1, 1, 16] and site["rewritten"]
    assert backend.report.table(("role", "mask", "recipe")).splitlines()[2] == "self  key_padding  int8 1/16, fp8/ch"


def test_long_module_paths_keep_what_tells_them_apart():
    from qattn_fx.report import _fit_path

    assert _fit_path("transformer_blocks.0.audio_to_video_attn", 40) == "transformer_blocks.0.audio_to_video_attn"
    assert [_fit_path(f"{side}_transformer_blocks.10.self_attention", 40) for side in ("text", "visual")] == [
        "text_transformer_blo...10.self_attention", "visual_transformer_b...10.self_attention"]
    assert _fit_path("context_embedder.token_refiner.refiner_blocks.0.attn", 40) == (
        "context_embedder.token_refiner...0.attn")


def test_tokens_written_into_one_buffer_are_joint_when_they_come_from_two_streams():
    """Lumina2 assembles text and image tokens per sample by slice assignment into a zero buffer; the same writes
    of one stream (packing samples of different lengths) keep the site self-attention."""
    class Assembled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.ModuleList(_Attention() for _ in range(2))

        def forward(self, x, text):
            joint = x.new_zeros(x.shape[0], text.shape[1] + x.shape[1], 32)
            packed = x.new_zeros(x.shape)
            for i in range(x.shape[0]):
                joint[i, :text.shape[1]] = text[i]
                joint[i, text.shape[1]:] = x[i]
                packed[i, :x.shape[1] - i] = x[i, i:]
            return self.attn[0](joint)[:, text.shape[1]:] + self.attn[1](packed)

    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Assembled(), backend=backend, fullgraph=True)(torch.randn(2, 24, 32), torch.randn(2, 8, 32))
    assert [(s.module, s.role) for s in backend.report.sites] == [("attn.0", "joint"), ("attn.1", "self")]


def test_aten_sdpa_overload_packet_is_a_site():
    """``torch.ops.aten.scaled_dot_product_attention(...)`` (the overload packet, as Dynamo keeps a model's own
    call) is a site like ``F.scaled_dot_product_attention``, not "an attention op other than SDPA"."""
    def attend(q, k, v):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=0.5)

    q, k, v = (torch.randn(1, 2, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v)
    (site,) = backend.report.sites
    assert site.rewritten and backend.report.notes == []
    dense = attend(q, k, v)
    assert (out - dense).norm() / dense.norm() < 0.05


def test_one_query_head_over_several_key_heads_stays_dense_with_the_true_reason():
    """SDPA broadcasts one query head over several key heads without enable_gqa (it runs the call); the ops do not
    serve it, and the reason says so rather than that SDPA rejects it."""
    q, k = torch.randn(1, 1, 16, 64), torch.randn(1, 4, 16, 64)
    dense = F.scaled_dot_product_attention(q, k, k)
    assert dense.shape == (1, 4, 16, 64)
    backend = qattn_fx.backend(emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(F.scaled_dot_product_attention, backend=backend, fullgraph=True)(q, k, k)
    (site,) = backend.report.sites
    assert not site.rewritten
    assert site.reason == ("dense: 1 query head and 4 key heads: SDPA broadcasts the query head (the output has 4 "
                           "heads); the ops need query heads that are a multiple of the key heads")
    torch.testing.assert_close(out, dense)


# ----------------------------------------------------------------------------------------------------------------
# Arguments and specs: ValueError for a bad value, TypeError for a wrong Python type, when the backend is made
# ----------------------------------------------------------------------------------------------------------------

HUGE = 10**400  # an int beyond float's range


def test_spec_text_is_parsed_as_a_spec():
    data = {"default": "dense", "rules": [{"match": {"role": "self"}, "use": {"backend": "REFERENCE"}}]}
    expected = Spec.from_dict(data)
    assert qattn_fx.backend(json.dumps(data)).spec == expected
    assert qattn_fx.backend("  " + json.dumps(data, indent=2)).spec == expected
    assert qattn_fx.backend("default: dense\nrules:\n  - match: {role: self}\n    use: {backend: REFERENCE}\n"
                            ).spec == expected
    assert qattn_fx.backend("{default: dense, rules: [{match: {role: self}, use: {backend: REFERENCE}}]}"
                            ).spec == expected  # YAML flow mapping


def test_spec_paths_still_name_files(tmp_path):
    (tmp_path / "spec.json").write_text('{"default": "dense"}')
    (tmp_path / "spec.yaml").write_text("default: dense\n")
    for path in (tmp_path / "spec.json", str(tmp_path / "spec.json"), str(tmp_path / "spec.yaml")):
        assert qattn_fx.backend(path).spec == qattn_fx.spec.dense_spec()


@pytest.mark.parametrize("spec, message", [
    ("", "spec path '' is empty; valid: the path of a .json, .yaml or .yml spec file"),
    ("no/such/spec.json", "no such spec file: 'no/such/spec.json'"),
    ("default: dense", "no such spec file: 'default: dense' (a str is read as spec text when it starts with '{' or "
                       "holds a newline, else as a path)"),
    ("x" * 5000, "cannot be read: "),  # today: OSError File name too long
    ('{"default": "dense"', "Expecting ','"),  # JSON that does not parse is tried as YAML, which says why
    ("[1, 2]\n", "spec must be a mapping (canonical, TensorRT-LLM attention_config or vLLM-Omni diffusion "
                 "attention config), got list: [1, 2]"),
    ({"default": {"skip_softmax": {"threshold": HUGE}}},
     "spec.default.skip_softmax.threshold=1000"),  # today: OverflowError at compile time
    ('{"attention_config": {"backend": "TRTLLM", "sparse_attention_config": {"algorithm": "skip_softmax", '
     '"threshold_scale_factor": 1e400}}}',
     "attention_config.sparse_attention_config.threshold_scale_factor=inf is invalid; valid: a finite number"),
])
@pytest.mark.parametrize("entry", ["backend", "pre_grad_pass", "explain"])
def test_bad_specs_raise_value_error_at_every_entry_point(entry, spec, message):
    make = {"backend": qattn_fx.backend, "pre_grad_pass": qattn_fx.pre_grad_pass,
            "explain": lambda s: qattn_fx.explain(F.scaled_dot_product_attention, *(torch.randn(1, 2, 8, 16),) * 3,
                                                  spec=s)}[entry]
    with pytest.raises(ValueError) as e:
        make(spec)
    assert message in str(e.value) or (message == "Expecting ','" and "does not parse" in str(e.value))


def test_a_directory_is_not_a_spec_file(tmp_path):
    with pytest.raises(ValueError, match=f"^spec path '{tmp_path}' is a directory; valid: the path of a .json"):
        qattn_fx.backend(str(tmp_path))


def test_hardware_takes_an_arch_string():
    """hardware="sm_90" is a supported install of sm_90 (as target= and calibrate(hardware=) read it); it used to
    fail deep inside the compile with an AttributeError."""
    assert qattn_fx.backend(hardware="sm_90").hardware == qattn_fx.Hardware.supported_install("sm_90")
    with torch.no_grad():
        report = qattn_fx.explain(F.scaled_dot_product_attention, *(torch.randn(1, 2, 8, 16),) * 3, hardware="sm_90")
    assert report.sites[0].reason == ("dense: no kernel serves int8 Q/K 1/16, fp8 V per-channel, smooth K via auto "
                                      "here (TRITON: head_dim 16 not in 64/128; TRTLLM: needs sm_100, have sm_90; "
                                      "TRTLLM_ATTN: needs sm_100, have sm_90)")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(spec=42), TypeError, "spec must be a Spec, a mapping, JSON or YAML text, a path to a .json/.yaml/.yml "
                               "file, or None; got int: 42"),
    (dict(spec=b"{}"), TypeError, "spec must be a Spec"),
    (dict(hardware=90), TypeError, "hardware must be a Hardware or an arch such as 'sm_90' (a supported install of "
                                   "it), or None (this machine); got int: 90"),
    (dict(hardware="h100"), ValueError, "arch='h100' is invalid; valid: 'cpu' or 'sm_XY' such as sm_90"),
    (dict(emulate="yes"), TypeError, "emulate must be True or False; got str: 'yes'"),
    (dict(compiler=None), TypeError, "compiler must be one of inductor, aot_eager, eager; got NoneType: None"),
    (dict(compiler="tvm"), ValueError, "compiler='tvm' is invalid; valid: inductor, aot_eager, eager"),
    (dict(debug_dir=3), TypeError, "debug_dir must be a str or Path naming a directory, or None; got int: 3"),
    (dict(timestep=1), TypeError, "timestep must be the name of the model's forward argument"),
    (dict(timestep_scale="1000"), TypeError, "timestep_scale must be a number > 0; got str: '1000'"),
    (dict(timestep_scale=HUGE), ValueError, "is invalid; valid: a finite number > 0"),
    (dict(timestep_scale=float("inf")), ValueError, "timestep_scale=inf is invalid; valid: a finite number > 0"),
    (dict(emulate=True, target="h100"), ValueError, "arch='h100' is invalid"),
    (dict(emulate=True, target=[]), ValueError, "target=[] is invalid; valid: a Hardware or an arch"),
    (dict(emulate=True, target=[90]), TypeError, "target must be a Hardware or an arch such as 'sm_90'"),
])
def test_bad_arguments_name_what_is_accepted(kwargs, error, message):
    with pytest.raises(error) as e:
        qattn_fx.backend(**kwargs)
    assert message in str(e.value)
    if "compiler" not in kwargs:  # the pre-grad pass runs inside Inductor: it takes no compiler
        with pytest.raises(error):
            qattn_fx.pre_grad_pass(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# What a CPU user sees
# ----------------------------------------------------------------------------------------------------------------


def test_summary_says_what_the_deployment_would_quantize():
    from qattn_fx.report import Report, SiteRecord

    from qattn_fx.site import Deployment, DeploymentClause as On

    def record(deployment, rewritten=True):
        return SiteRecord(0, "o", "", None, "self", [1, 2, 8, 64], [1, 2, 8, 64], "float32", rewritten, None,
                          "reference", "quantized (emulated)", deployment=deployment)

    dense_90 = Deployment((On("sm_90", "dense", detail="TRITON: head_dim 12 not in 64/128"),
                           On("sm_100", "dense", detail="TRTLLM: needs x")), as_bf16=True)
    served = Deployment((On("sm_90", "kernel", "gluon_sage"), On("sm_100", "kernel", "flashinfer_trtllm_sage")), True)
    mixed = Deployment((On("sm_90", "kernel", "gluon_sage", "predicted 1.5x"),
                        On("sm_100", "error", detail="TRTLLM: head_dim 64 not in 128")))
    assert str(dense_90) == ("(as bf16) on sm_90: dense (TRITON: head_dim 12 not in 64/128); on sm_100: dense "
                             "(TRTLLM: needs x)")
    assert str(mixed) == "on sm_90: gluon_sage (predicted 1.5x); on sm_100: error (TRTLLM: head_dim 64 not in 128)"
    assert Report([record(dense_90)] * 4).summary() == (
        "qattn_fx: 4/4 attention sites quantized (emulated; on sm_90 the spec would quantize 0 of 4, on sm_100 0 of "
        "4), 0 dense")
    assert Report([record(served)] * 2).summary() == "qattn_fx: 2/2 attention sites quantized (emulated), 0 dense"
    assert Report([record(served), record(mixed), record(None)]).summary() == (
        "qattn_fx: 3/3 attention sites quantized (2 emulated; on sm_100 the spec would quantize 1 of 2), 0 dense")
    assert Report([record(served), record(mixed)]).deployed() == {"sm_90": (2, 2), "sm_100": (1, 2)}


@pytest.mark.parametrize("emulate, grad, hints", [
    (False, True, ["emulate=True", "torch.no_grad()"]),
    (False, False, ["emulate=True"]),
    (True, True, ["torch.no_grad()"]),
])
def test_a_cpu_run_that_quantizes_nothing_says_what_would(caplog, emulate, grad, hints):
    """On a CPU nothing is quantized unless emulate=True and torch.no_grad() are both in force: the warning names
    whichever is missing."""
    block, x = AttentionBlock().eval(), torch.randn(1, 8, 64)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="qattn_fx"), torch.set_grad_enabled(grad):
        torch.compile(block, backend=qattn_fx.backend(emulate=emulate, compiler="eager"), fullgraph=True)(x)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no attention site was quantized (" in warning
    assert [hint for hint in ("emulate=True", "torch.no_grad()") if hint in warning] == hints
    if "emulate=True" in hints:
        assert "no quantized kernel runs on cpu: emulate=True runs the recipes on the reference kernel" in warning


class _GradModeInside(torch.nn.Module):
    """Two attention blocks: ``frozen`` under ``torch.no_grad()`` (a frozen encoder), ``tuned`` under
    ``torch.enable_grad()`` (its parameters require grad), whatever grad mode the caller has."""

    def __init__(self):
        super().__init__()
        self.frozen, self.tuned = AttentionBlock(), AttentionBlock()

    def forward(self, x):
        with torch.no_grad():
            context = self.frozen(x)
        with torch.enable_grad():
            return self.tuned(x + context)


TRAINING = "dense: autograd is enabled (training graph); the quantized attention ops have no backward"


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["backend", "explain", "pre_grad_pass"])
@pytest.mark.parametrize("grad", [False, True])
def test_grad_mode_set_inside_the_compiled_function_decides_each_site(entry, grad):
    """Autograd records a site when grad mode is on at its place in the graph and an input requires grad: the
    caller's grad mode at compile time decides nothing. The ``no_grad`` block's site is quantized, the
    ``enable_grad`` block's stays dense with the training reason, and its backward runs."""
    torch.manual_seed(0)
    model, x = _GradModeInside(), torch.randn(1, 16, 64)
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        if entry == "explain":
            report = qattn_fx.explain(model, x, emulate=True)
        elif entry == "backend":
            backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
            out = torch.compile(model, backend=backend, fullgraph=True)(x)
            report = backend.report
        else:
            qpass = qattn_fx.pre_grad_pass(emulate=True)
            with torch._inductor.config.patch(pre_grad_custom_pass=qpass):
                out = torch.compile(model, fullgraph=True)(x)
            report = qpass.report
    assert [(s.module, s.rewritten) for s in report.sites] == [("frozen", True), ("tuned", False)]
    assert report.sites[1].reason == TRAINING
    if entry != "explain":
        out.sum().backward()
        assert model.tuned.qkv.weight.grad is not None and model.frozen.qkv.weight.grad is None
        with torch.no_grad():
            dense = model(x)
        assert_close_to_dense(out.detach(), dense)


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class _BlockScaledSites(torch.nn.Module):
    """Three attention sites on the same Q/K/V (no projections: the output is the quantize ops' and the reference
    attention's alone), for one recipe each."""

    def __init__(self):
        super().__init__()
        self.mx, self.mx_fp8v, self.nv = _Sdpa(), _Sdpa(), _Sdpa()

    def forward(self, q, k, v):
        return self.mx(q, k, v), self.mx_fp8v(q, k, v), self.nv(q, k, v)


@pytest.mark.slow
def test_block_scaled_recipes_emulate_under_inductor_on_cpu():
    """MXFP8 and NVFP4 recipes, emulated, compile with Inductor on a CPU (whose C++ code has no float8_e8m0fnu: the
    MXFP8 scales travel as their bytes) and give aot_eager's output bit for bit."""
    def use(backend, qk, v):
        return {"backend": backend, "recipe": {"qk_dtype": qk, "v_dtype": v, "q_block_size": 0, "k_block_size": 0,
                                               "v_block_size": 0}}

    spec = {"rules": [{"match": {"module": "mx"}, "use": use("CUDNN", "mxfp8", "mxfp8")},
                      {"match": {"module": "mx_fp8v"}, "use": use("CUTEDSL", "mxfp8", "fp8")},
                      {"match": {"module": "nv"}, "use": use("FLASHINFER", "nvfp4", "nvfp4")}]}
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64) * 3, torch.randn(1, 2, 40, 64)
    outs = {}
    for compiler in ("inductor", "aot_eager"):
        backend = qattn_fx.backend(spec, emulate=True, compiler=compiler)
        torch._dynamo.reset()
        with torch.no_grad():
            outs[compiler] = torch.compile(_BlockScaledSites(), backend=backend, fullgraph=True)(q, k, v)
        assert [(s.module, s.recipe, s.rewritten) for s in backend.report.sites] == [
            ("mx", "mxfp8 Q/K, mxfp8 V, smooth K", True), ("mx_fp8v", "mxfp8 Q/K, fp8 V per-tensor, smooth K", True),
            ("nv", "nvfp4 Q/K, nvfp4 V, smooth K", True)]
    for compiled, eager in zip(outs["inductor"], outs["aot_eager"]):
        assert torch.equal(compiled, eager)
    with torch.no_grad():
        dense = F.scaled_dot_product_attention(q, k, v)
    for out in outs["inductor"]:  # the recipes' own error (measured: cosine >= 0.969, NVFP4's the lowest)
        assert F.cosine_similarity(out.flatten(), dense.flatten(), dim=0) > 0.95


def _fresh_inductor_cache():
    from torch._inductor import utils

    return getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([AttentionBlock(), AttentionBlock()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


@pytest.mark.parametrize("entry", ["backend", "pre_grad_pass"])
def test_the_report_is_complete_whether_or_not_a_warm_cache_served_the_graph(entry):
    """A cold compile, then the same compile in a fresh Dynamo state, served by Inductor's FX-graph and
    AOT-autograd caches: both reports list the same sites with the same decisions (torch 2.13 would skip a
    pre-grad pass with a uuid on the cache hit)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model, x = _TwoBlocks().eval(), torch.randn(1, 16, 64)
    spec = {"rules": [{"match": {"module": "blocks.1"}, "use": "dense"}]}
    reports, hits = [], []
    with (_fresh_inductor_cache()(),
          torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=True)):
        for _ in range(2):
            before = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
            torch._dynamo.reset()
            with torch.no_grad():
                if entry == "backend":
                    owner = qattn_fx.backend(spec, emulate=True)
                    torch.compile(model, backend=owner, fullgraph=True)(x)
                    report = owner.report
                else:
                    qpass = qattn_fx.pre_grad_pass(spec, emulate=True)
                    with torch._inductor.config.patch(pre_grad_custom_pass=qpass):
                        torch.compile(model, fullgraph=True)(x)
                    report = qpass.report
            reports.append([(s.graph, s.site, s.module, s.rewritten, s.reason) for s in report.sites])
            hits.append(counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
                        - before)
    assert hits[0] == 0 and hits[1] > 0  # cold, then served by a cache
    assert reports[0] == reports[1]
    assert [(module, rewritten) for _, _, module, rewritten, _ in reports[1]] == [
        ("blocks.0", True), ("blocks.1", False)]
    assert reports[1][1][4] == "dense: rule 1 (module=blocks.1)"
