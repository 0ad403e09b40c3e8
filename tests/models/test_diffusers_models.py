"""Real diffusers transformers (tiny configs, random weights) through ``torch.compile(backend=qattn_fx.backend())``.

Each model compiles with ``fullgraph=True`` (zero graph breaks) under Inductor, every SDPA site appears in the
report with the expected decision (pinned as a golden site table), a second call does not recompile, and the
output matches the dense model.

Tolerance: the default recipe (INT8 Q/K, 1 token per Q scale and 16 per K scale, FP8 P·V with per-channel V)
rounds Q/K to 8 bits (relative step 1/254 of the block amax) and P/V to e4m3 (3 mantissa bits, relative step
≤ 2^-4 per element, averaged over the keys), giving attention outputs ~1e-3 relative error; two residual layers
carry that into the model output. Measured on these models: max |out - dense| / max |dense| 1.4e-3 .. 3.1e-3 and
cosine ≥ 0.99999, so the tests require ≤ 1e-2 and cosine ≥ 0.9999.
"""

import expecttest
import pytest
import torch

import qattn_fx
from qattn_fx import AttentionSpec, Recipe, Spec, recipes, tiny_models

pytest.importorskip("diffusers")


def compile_and_run(model, inputs, backend):
    torch._dynamo.reset()
    with torch.no_grad():
        dense = model(**inputs)[0]
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(**inputs)[0]
        with torch.compiler.set_stance("fail_on_recompile"):
            again = compiled(**inputs)[0]
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    return dense, out


def assert_close_to_dense(out, dense):
    rel = (out - dense).abs().max() / dense.abs().max()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), dense.flatten(), dim=0)
    assert rel <= 1e-2, f"max relative error {rel:.3e}"
    assert cos >= 0.9999, f"cosine {cos:.6f}"


@pytest.mark.slow
class TestCompiledModels(expecttest.TestCase):
    def check(self, name):
        model, inputs = tiny_models.MODELS[name]()
        backend = qattn_fx.backend(emulate=True)
        dense, out = compile_and_run(model, inputs, backend)
        assert len(backend.graph_modules) == 1, "one graph: no graph breaks"
        assert_close_to_dense(out, dense)
        return backend.report.table()

    def test_wan_self_and_cross(self):
        self.assertExpectedInline(self.check("wan"), """\
module          layer  role   q/kv     d   recipe             kernel     reason
--------------  -----  -----  -------  --  -----------------  ---------  -----------------------------------------------
blocks.0.attn1  0      self   128/128  12  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense (TRITON:
                                                                         head_dim 12 not in 64/128); on sm_100: dense
                                                                         (TRTLLM, TRTLLM_ATTN: head_dim 12 not in 128)
blocks.0.attn2  0      cross  128/12   12  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense (TRITON:
                                                                         head_dim 12 not in 64/128); on sm_100: dense
                                                                         (TRTLLM, TRTLLM_ATTN: head_dim 12 not in 128)
blocks.1.attn1  1      self   128/128  12  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense (TRITON:
                                                                         head_dim 12 not in 64/128); on sm_100: dense
                                                                         (TRTLLM, TRTLLM_ATTN: head_dim 12 not in 128)
blocks.1.attn2  1      cross  128/12   12  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense (TRITON:
                                                                         head_dim 12 not in 64/128); on sm_100: dense
                                                                         (TRTLLM, TRTLLM_ATTN: head_dim 12 not in 128)""")

    def test_flux_joint_and_single_blocks(self):
        self.assertExpectedInline(self.check("flux"), """\
module                            layer  role   q/kv   d   recipe             kernel     reason
--------------------------------  -----  -----  -----  --  -----------------  ---------  -------------------------------
transformer_blocks.0.attn         0      joint  64/64  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90:
                                                                                         dense (TRITON: head_dim 16 not
                                                                                         in 64/128); on sm_100: dense
                                                                                         (TRTLLM, TRTLLM_ATTN: head_dim
                                                                                         16 not in 128)
single_transformer_blocks.0.attn  0      joint  64/64  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90:
                                                                                         dense (TRITON: head_dim 16 not
                                                                                         in 64/128); on sm_100: dense
                                                                                         (TRTLLM, TRTLLM_ATTN: head_dim
                                                                                         16 not in 128)""")

    def test_dit_direct_sdpa_call(self):
        self.assertExpectedInline(self.check("dit"), """\
module                      layer  role  q/kv   d  recipe             kernel     reason
--------------------------  -----  ----  -----  -  -----------------  ---------  ---------------------------------------
transformer_blocks.0.attn1  0      self  16/16  4  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                 (TRITON: head_dim 4 not in 64/128); on
                                                                                 sm_100: dense (TRTLLM, TRTLLM_ATTN:
                                                                                 head_dim 4 not in 128)""")

    def test_sd3_joint_and_dual_attention(self):
        self.assertExpectedInline(self.check("sd3"), """\
module                      layer  role   q/kv   d   recipe             kernel     reason
--------------------------  -----  -----  -----  --  -----------------  ---------  -------------------------------------
transformer_blocks.0.attn   0      joint  76/76  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                   (TRITON: head_dim 16 not in 64/128);
                                                                                   on sm_100: dense (TRTLLM,
                                                                                   TRTLLM_ATTN: head_dim 16 not in 128)
transformer_blocks.0.attn2  0      self   64/64  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                   (TRITON: head_dim 16 not in 64/128);
                                                                                   on sm_100: dense (TRTLLM,
                                                                                   TRTLLM_ATTN: head_dim 16 not in 128)
transformer_blocks.1.attn   1      joint  76/76  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                   (TRITON: head_dim 16 not in 64/128);
                                                                                   on sm_100: dense (TRTLLM,
                                                                                   TRTLLM_ATTN: head_dim 16 not in 128)""")

    def test_cogvideox_joint_attention_with_rotary_embeddings(self):
        self.assertExpectedInline(self.check("cogvideox"), """\
module                      layer  role   q/kv     d   recipe             kernel     reason
--------------------------  -----  -----  -------  --  -----------------  ---------  -----------------------------------
transformer_blocks.0.attn1  0      joint  140/140  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                     (TRITON: head_dim 16 not in
                                                                                     64/128); on sm_100: dense (TRTLLM,
                                                                                     TRTLLM_ATTN: head_dim 16 not in
                                                                                     128)
transformer_blocks.1.attn1  1      joint  140/140  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                     (TRITON: head_dim 16 not in
                                                                                     64/128); on sm_100: dense (TRTLLM,
                                                                                     TRTLLM_ATTN: head_dim 16 not in
                                                                                     128)""")

    def test_ltx_video_cross_attention_mask_repeated_over_heads(self):
        self.assertExpectedInline(self.check("ltx_video"), """\
module                      layer  role   q/kv     d   recipe             kernel     reason
--------------------------  -----  -----  -------  --  -----------------  ---------  -----------------------------------
transformer_blocks.0.attn1  0      self   128/128  16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                     (TRITON: head_dim 16 not in
                                                                                     64/128); on sm_100: dense (TRTLLM,
                                                                                     TRTLLM_ATTN: head_dim 16 not in
                                                                                     128)
transformer_blocks.0.attn2  0      cross  128/12   16  int8 1/16, fp8/ch  reference  default; (as bf16) on sm_90: dense
                                                                                     (TRITON: head_dim 16 not in
                                                                                     64/128); on sm_100: dense (TRTLLM,
                                                                                     TRTLLM_ATTN: head_dim 16 not in
                                                                                     128)
note (transformer_blocks.0.attn2): attn_mask (1, 2, 1, 12) repeats a (1, 1, 12) mask over the heads (repeat_interleave +
  view): read per key as (1, 1, 1, 12)""")


class TestSiteDecisions(expecttest.TestCase):
    def test_hunyuan_video_masks_stay_dense_with_reasons(self):
        model, inputs = tiny_models.hunyuan_video()
        with torch.no_grad():
            report = qattn_fx.explain(model, **inputs, spec=None, emulate=True)
        self.assertExpectedInline(report.table(), """\
module                                   layer  role   q/kv     d   recipe             kernel     reason
---------------------------------------  -----  -----  -------  --  -----------------  ---------  ----------------------
context_embedder.token_refiner...0.attn  0      self   12/12    10  -                  -          dense: attn_mask is a
                                                                                                  boolean mask of shape
                                                                                                  (1, 2, 12, 12) that
                                                                                                  varies per query or
                                                                                                  head; per-key masks
                                                                                                  are served
transformer_blocks.0.attn                0      joint  268/268  10  int8 1/16, fp8/ch  reference  default; (as bf16) on
                                                                                                  sm_90: dense (TRITON:
                                                                                                  head_dim 10 not in
                                                                                                  64/128); on sm_100:
                                                                                                  dense (TRTLLM,
                                                                                                  TRTLLM_ATTN: head_dim
                                                                                                  10 not in 128)
single_transformer_blocks.0.attn         0      joint  268/268  10  int8 1/16, fp8/ch  reference  default; (as bf16) on
                                                                                                  sm_90: dense (TRITON:
                                                                                                  head_dim 10 not in
                                                                                                  64/128); on sm_100:
                                                                                                  dense (TRTLLM,
                                                                                                  TRTLLM_ATTN: head_dim
                                                                                                  10 not in 128)""")

    def test_grad_enabled_graphs_stay_dense(self):
        model, inputs = tiny_models.dit()
        report = qattn_fx.explain(model, **inputs, emulate=True)  # parameters require grad, grad mode on
        self.assertEqual([s.reason for s in report.sites],
                         ["dense: autograd is enabled (training graph); the quantized attention ops have no backward"])

    def test_wan_rules_by_role_and_layer(self):
        model, inputs = tiny_models.wan()
        spec = Spec.from_dict({
            "default": {"backend": "auto", "recipe": {"qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": 1,
                                                        "k_block_size": 16, "v_block_size": 1}},
            "rules": [{"match": {"role": "cross"}, "use": "dense"},
                      {"match": {"layers": [-1]}, "use": {"backend": "CUDNN",
                                                           "recipe": {"qk_dtype": "fp8", "v_dtype": "fp8"}}}],
        })
        with torch.no_grad():
            report = qattn_fx.explain(model, **inputs, spec=spec, emulate=True)
        self.assertExpectedInline(report.table(), """\
module          layer  role   q/kv     d   recipe                  kernel     reason
--------------  -----  -----  -------  --  ----------------------  ---------  ------------------------------------------
blocks.0.attn1  0      self   128/128  12  int8 1/16, fp8/ch       reference  default; (as bf16) on sm_90: dense
                                                                              (TRITON: head_dim 12 not in 64/128); on
                                                                              sm_100: dense (TRTLLM, TRTLLM_ATTN:
                                                                              head_dim 12 not in 128)
blocks.0.attn2  0      cross  128/12   12  -                       -          dense: rule 1 (role=cross)
blocks.1.attn1  1      self   128/128  12  fp8/tensor, fp8/tensor  reference  rule 2 (layers=-1); (as bf16) on sm_100:
                                                                              error (CUDNN: head_dim 12 not in
                                                                              32/64/96/128); on sm_90: error (CUDNN:
                                                                              head_dim 12 not in multiple of 16, <= 256)
blocks.1.attn2  1      cross  128/12   12  -                       -          dense: rule 1 (role=cross)""")
        self.assertEqual(report.summary(), "qattn_fx: 2/4 attention sites quantized (emulated; on sm_90 the spec would "
                                           "quantize 0 of 2, on sm_100 0 of 2), 2 dense: 2x rule 1 (role=cross)")

    def test_wan_on_sm90_and_sm100_without_running_there(self):
        model, inputs = tiny_models.wan(head_dim=64)
        libs = {"triton": "3.6.0", "flashinfer-python": "0.7.4", "cudnn": "9.19.0"}
        with torch.no_grad():
            model = model.to(torch.bfloat16)
            inputs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                      for k, v in inputs.items()}
            hopper = qattn_fx.explain(model, **inputs, hardware=qattn_fx.Hardware.for_arch("sm_90", libs))
            blackwell = qattn_fx.explain(model, **inputs, hardware=qattn_fx.Hardware.for_arch("sm_100", libs))
        # gluon_sage is what sm_90 would run; at these tiny lengths (below every measured call) auto keeps it dense
        self.assertEqual({s.kernel for s in hopper.sites}, {None})
        self.assertTrue(all(s.reason.startswith("dense: gluon_sage predicted at most 0.88x of cuDNN bf16")
                            for s in hopper.sites), [s.reason for s in hopper.sites])
        self.assertEqual({s.kernel for s in blackwell.sites}, {None})  # head_dim 64: trtllm-gen Sage needs 128
        self.assertIn("TRTLLM: head_dim 64 not in 128", blackwell.sites[0].reason)
        # an explicit backend quantizes them anyway, and the report says auto would not
        with torch.no_grad():
            forced = qattn_fx.explain(model, **inputs, spec={"default": {"backend": "TRITON"}},
                                      hardware=qattn_fx.Hardware.for_arch("sm_90", libs))
        self.assertEqual({s.kernel for s in forced.sites}, {"gluon_sage"})
        self.assertTrue(all("on gluon_sage (sm_90); slower than dense: gluon_sage predicted at most 0.88x of cuDNN "
                            "bf16" in s.reason and s.reason.endswith("; auto would keep it dense")
                            for s in forced.sites), [s.reason for s in forced.sites])
        self.assertEqual(forced.summary(), "qattn_fx: 4/4 attention sites quantized (4 predicted slower than dense: "
                                           "auto would keep them dense), 0 dense")
        # the prediction is also data: in each site's record and its JSON
        self.assertTrue(all(s.predicted_slower.startswith("gluon_sage predicted at most 0.88x of cuDNN bf16")
                            for s in forced.sites + hopper.sites), forced.to_dict())
        self.assertEqual(forced.to_dict()["sites"][0]["predicted_slower"], forced.sites[0].predicted_slower)


@pytest.mark.parametrize("row", recipes.TABLE, ids=lambda r: f"{r.backend}-{r.qk_dtype}-{r.v_dtype}")
def test_every_seed_recipe_emulates_on_cpu(row):
    """emulate=True runs each accepted recipe through the reference kernel in a real Wan transformer."""
    model, inputs = tiny_models.wan(head_dim=16)  # nvfp4 needs head_dim % 16 == 0
    recipe = Recipe(row.qk_dtype, row.v_dtype, *row.blocks.all()[0], scale_scope=row.scale_scopes[0])
    backend = qattn_fx.backend(Spec(default=AttentionSpec(row.backend, recipe)), emulate=True, compiler="eager")
    dense, out = compile_and_run(model, inputs, backend)
    assert backend.report.quantized == len(backend.report.sites) == 4
    assert {s.recipe for s in backend.report.sites} == {recipe.name}
    cos = torch.nn.functional.cosine_similarity(out.flatten(), dense.flatten(), dim=0)
    assert cos >= 0.9999, f"{recipe.name}: cosine {cos:.6f}"  # measured >= 0.99993 (nvfp4 Q/K/V lowest)


def test_diffusers_sdpa_kernel_context_nodes_are_matched():
    model, inputs = tiny_models.wan()
    model.set_attention_backend("_native_math")  # wraps every SDPA in sdpa_kernel(...) context nodes
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    dense, out = compile_and_run(model, inputs, backend)
    assert backend.report.quantized == 4
    assert_close_to_dense(out, dense)


def test_wan_vace_self_attention_is_self_behind_zero_padded_control_tokens():
    """WanVACE pads its control tokens to the video's length with zeros (``cat`` on the sequence axis) and adds the
    control hints into the residual stream: every ``attn1`` is still self-attention, every ``attn2`` cross."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, vace_layers=[0, 1], vace_in_channels=6).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 16), control_hidden_states=torch.randn(1, 6, 2, 16, 16),
                  return_dict=False)
    with torch.no_grad():
        report = qattn_fx.explain(model, **inputs, emulate=True)
    assert [(s.module, s.role) for s in report.sites] == [
        (f"{blocks}.{i}.attn{n}", "self" if n == 1 else "cross")
        for blocks in ("vace_blocks", "blocks") for i in (0, 1) for n in (1, 2)]
