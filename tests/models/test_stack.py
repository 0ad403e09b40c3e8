"""The whole stack on a CPU: TorchAO's quantized linears and diffusers' First Block Cache with the backend.

* TorchAO (int8 weight-only, the CPU config, and int8 dynamic activation + weight; ``tests/gpu/test_stack.py``
  runs FP8 rowwise): the backend finds and decides the same sites as on the plain model, in one graph
  (``fullgraph=True``), Inductor compiles TorchAO's subclass ops with the rewritten attention (fusing the
  activation quantization), and the output matches the same TorchAO model run with the rewritten graph eagerly
  (the reference kernel, no Inductor) and, within quantization error, the TorchAO model without the backend.
* First Block Cache: a graph break by design (its decision is a host read under ``torch.compiler.disable``), so
  the model compiles to the graphs of the cache's paths. Over a denoising loop on a tiny 3-block Wan whose cache
  recomputes the first step and reuses the next four (threshold 0.5), Dynamo compiles 7 graphs in the first run
  under any backend (measured on torch 2.13): the rotary embedder, the condition embedder and the output norm (the
  model's own forward runs eagerly: the break inside its loop over blocks skips its frame), the head block's hook
  twice (its state created, then present), and the middle and the tail block's hooks (a guard on ``is_tail``; the
  reused path, a guard on ``should_compute``, returns its input and compiles no graph). The second run compiles 1
  more (the head block's forward as a frame of its own), the third none. The backend compiles the same graphs,
  every SDPA of every graph is in the report (named from the hooked block: ``attn1``, ``attn2``), the cache takes
  the same decisions as uncompiled, and the output matches the uncompiled cached model within quantization error.
* diffusers' other caches (``OTHER_CACHES``): Pyramid Attention Broadcast, TaylorSeer and the text K/V cache
  compile ``fullgraph``; SeaCache and MagCache run block hooks under ``torch.compiler.disable``, whose attention
  calls stay dense outside every graph (SeaCache: the first block's, which ``qattn_fx.explain`` names in a note;
  MagCache: every block's, so the backend sees no site).
"""

import re

import pytest
import torch

import qattn_fx
from qattn_fx import stack, tiny_models
from qattn_fx.fx import match

pytest.importorskip("diffusers")


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


def inductor_twice(model, inputs):
    """``model`` compiled ``fullgraph`` by the backend (emulated recipes, Inductor) and called twice, the second time
    under ``fail_on_recompile``: the backend, both outputs and Inductor's code of the first call."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    backend = qattn_fx.backend(emulate=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out, code = run_and_get_code(compiled, **inputs)
    with torch.compiler.set_stance("fail_on_recompile"):
        again = compiled(**inputs)[0]
    return backend, out[0], again, code


def site_rows(report):
    return [(s.module, s.layer, s.role, s.rewritten, s.reason) for s in report.sites]


@pytest.mark.slow
@pytest.mark.parametrize("linears", ["int8wo", "int8dq"])
def test_torchao_int8_linears_and_qattn_in_one_inductor_graph(linears):
    """``int8wo``: int8 weight-only (the CPU config of issue #47); ``int8dq``: int8 dynamic activation and weight,
    whose per-token activation quantization Inductor fuses with the op before the linear (a layer norm, a GELU)."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8Tensor

    model, inputs = tiny_models.wan()
    with torch.no_grad():
        plain = qattn_fx.explain(model, **inputs, emulate=True)
        assert stack.quantize_linears(model, linears) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert isinstance(model.blocks[0].attn1.to_q.weight, Int8Tensor)
        torchao_eager = model(**inputs)[0]

        torch._dynamo.reset()
        reference = qattn_fx.backend(emulate=True, compiler="eager")  # the rewritten graph, run op by op
        expected = torch.compile(model, backend=reference, fullgraph=True)(**inputs)[0]
        backend, out, again, code = inductor_twice(model, inputs)

    assert len(backend.graph_modules) == 1, "one graph: no graph break"
    assert site_rows(backend.report) == site_rows(plain) == site_rows(reference.report)
    assert [s.rewritten for s in backend.report.sites] == [True] * 4
    # Dynamo's graph calls linear on the subclass weights: Q, K and V come out of linear as plain tensors
    gm = backend.graph_modules[0]
    linears_called = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]
    assert len(linears_called) >= 8 and all(isinstance(n.meta["example_value"], torch.Tensor)
                                            for n in linears_called)
    if linears == "int8dq":  # the activation's amax / amin and rounding in one kernel with the op that feeds it
        kernels = set(re.findall(r"cpp_fused_\w+", "\n".join(code)))
        assert any("amax" in k and ("layer_norm" in k or "gelu" in k) for k in kernels), sorted(kernels)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    if linears == "int8wo":  # Inductor vs eager on the same TorchAO model
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    else:  # Inductor computes the activation scales in another order: some values round to the next int8 step
        assert cosine(out, expected) >= 0.9999
    assert cosine(out, torchao_eager) >= 0.9999  # the attention's quantization error only; measured 0.99998


def test_torchao_fp8_skips_linears_the_fp8_matmul_cannot_take():
    pytest.importorskip("torchao")
    model, _ = tiny_models.wan()  # widths 24 (2 heads x 12), 16, 32: only 16 x 32 and 32 x 16 linears qualify
    eligible = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    assert [n for n, m in model.named_modules() if stack._fp8_shape_ok(m, n)] == eligible
    with pytest.raises(ValueError, match="linears='int4' is invalid; valid: fp8, fp8static, int8wo, int8dq"):
        stack.linears_config("int4")
    with pytest.raises(ValueError, match="cache='tea' is invalid; valid: none, fbc"):
        stack.enable_cache(model, "tea")
    assert stack.quantize_linears(model, "bf16") == 0


@pytest.mark.slow
def test_fp8static_linears_calibrate_then_compile_with_qattn_in_one_graph():
    """``fp8static``: observers record each linear's input range over the calibration calls (which return the
    model's own output), each linear then becomes FP8 with one activation scale, ``amax / 448``, and one weight
    scale; under the backend, in one graph, Inductor writes the activation's cast in the kernel of the op before the
    linear (the GELU, the layer norm; ``fp8``'s per-row scales need a reduction over the activation first), and the
    output matches the same TorchAO model eagerly."""
    pytest.importorskip("torchao")

    model, inputs = tiny_models.wan(head_dim=16)  # widths 32 and 16: every linear can be FP8
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = max(seen.get(name, 0.0), args[0].abs().amax().item())
        return hook

    with torch.no_grad():
        dense = model(**inputs)[0]
        plain = qattn_fx.explain(model, **inputs, emulate=True)
        other = dict(inputs, hidden_states=torch.randn_like(inputs["hidden_states"]))
        with stack.calibrate_linears(model) as calibration:
            handles = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in linears]
            observed = model(**inputs)[0]
            model(**other)
            for h in handles:
                h.remove()
        assert calibration == stack.LinearsCalibration("fp8static", quantized=len(linears), unseen=[])
        torch.testing.assert_close(observed, dense, rtol=0, atol=0)  # the observers change nothing
        q = model.blocks[0].attn1.to_q.weight
        assert type(q).__name__ == "PrototypeFloat8Tensor" and q.qdata.dtype == torch.float8_e4m3fn
        scale = q.act_quant_scale.item()
        assert scale == pytest.approx(seen["blocks.0.attn1.to_q"] / 448, rel=1e-6)
        eager = model(**inputs)[0]

        backend, out, again, code = inductor_twice(model, inputs)

    assert len(backend.graph_modules) == 1, "one graph: no graph break"
    assert site_rows(backend.report) == site_rows(plain)
    assert [s.rewritten for s in backend.report.sites] == [True] * 4
    kernels = set(re.findall(r"cpp_fused_\w+", "\n".join(code)))
    assert any("gelu" in k and "_to_copy" in k and "clamp" in k for k in kernels), sorted(kernels)
    assert any("layer_norm" in k or "native_layer_norm" in k or "var_mean" in k for k in kernels
               if "_to_copy" in k and "clamp" in k), sorted(kernels)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert cosine(out, eager) >= 0.9998  # the attention's quantization error only
    assert cosine(eager, dense) >= 0.998  # FP8 linears (per-tensor scales) on a random fp32 model


def test_fp8static_leaves_unreached_linears_and_undoes_a_failed_calibration():
    pytest.importorskip("torchao")
    model, inputs = tiny_models.wan(head_dim=16)
    weight = model.blocks[0].attn1.to_q.weight
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="calibration failed"):
            with stack.calibrate_linears(model):
                model(**inputs)
                raise RuntimeError("calibration failed")
        assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert model.blocks[0].attn1.to_q.weight is weight  # the same parameter, nothing copied or lost

        with pytest.warns(UserWarning, match=r"linear\(s\) saw no calibration call and stay in their own "
                                             r"precision: .*blocks\.0\.attn1\.to_k"):
            with stack.calibrate_linears(model) as calibration:
                for block in model.blocks:  # the blocks' FFNs and query projections only
                    block.ffn(torch.randn(1, 8, 32))
                    block.attn1.to_q(torch.randn(1, 8, 32))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    reached = [n for n in linears if n.startswith("blocks.") and (".ffn." in n or n.endswith("attn1.to_q"))]
    assert calibration.quantized == len(reached) == 6
    assert calibration.unseen == [n for n in linears if n not in reached]
    for name in linears:
        kind = type(model.get_submodule(name).weight).__name__
        assert kind == ("PrototypeFloat8Tensor" if name in reached else "Parameter"), name
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in calibration.unseen)


def test_fp8static_errors_name_the_way_to_calibrate():
    pytest.importorskip("torchao")
    model, _ = tiny_models.wan(head_dim=16)
    with pytest.raises(ValueError, match=r"linears='fp8static' measures its activation scales on calibration calls: "
                                         r"quantize with `with qattn_fx.stack.calibrate_linears\(model, "):
        stack.quantize_linears(model, "fp8static")
    with pytest.raises(ValueError, match="kind='fp8' is invalid for calibrate_linears; valid: fp8static"):
        with stack.calibrate_linears(model, kind="fp8"):
            pass
    with pytest.raises(ValueError, match="step='observe' is invalid for linears='fp8static'; valid: 'prepare' or "
                                         "'convert'"):
        stack.linears_config("fp8static", "observe")
    with pytest.raises(ValueError, match=r"step='prepare' is invalid for linears='fp8'; valid: None \(it is not "):
        stack.linears_config("fp8", "prepare")
    assert stack.inductor_config("fp8static") == {"max_autotune_gemm_backends": "ATEN"}


STEPS = 5


def denoise(model, step, inputs):
    """``STEPS`` Euler steps from noise level 1 to 0 in the cache's context; the final latents and whether each step
    recomputed the blocks after the first (First Block Cache's decisions)."""
    stack.reset_cache(model)
    latents, recomputed = inputs["hidden_states"], []
    sigmas = [1 - i / STEPS for i in range(STEPS + 1)]
    for sigma, sigma_next in zip(sigmas, sigmas[1:]):
        with stack.cache_context(model):
            velocity = step(**dict(inputs, hidden_states=latents, timestep=torch.tensor([1000 * sigma])))[0]
            recomputed.append(stack.fbc_recomputed(model))
        latents = latents + (sigma_next - sigma) * velocity
    return latents, recomputed


def compiled_graphs(model, inputs, backend, runs=3):
    """Over ``runs`` denoising runs of ``model`` compiled with ``backend`` (None: Dynamo's graphs run as they are):
    the SDPA calls of each graph Dynamo compiled, how many graphs each run compiled, the first run's output (the
    others give the same bits) and the cache's decisions."""
    torch._dynamo.reset()
    graphs, per_run = [], []

    def counting(gm, example_inputs):
        graphs.append(len(match.find_sdpa(gm)))
        return backend(gm, example_inputs) if backend is not None else gm.forward

    compiled = torch.compile(model, backend=counting)
    for run in range(runs):
        before = len(graphs)
        latents, decisions = denoise(model, compiled, inputs)
        per_run.append(len(graphs) - before)
        if run == 0:
            out, recomputed = latents, decisions
        else:
            torch.testing.assert_close(latents, out, rtol=0, atol=0)
    return graphs, per_run, out, recomputed


@pytest.mark.parametrize("linears", ["fp8", "int8wo", "int8dq"])
def test_torchao_configs_leave_the_process_inductor_config_alone(linears):
    """TorchAO's configs default to ``set_inductor_config=True``, which turns on coordinate-descent tuning for the
    whole process (a compile of Wan2.1-14B, 4 blocks, with ``fp8`` linears spent most of its minutes there); the
    stack's configs set it off, and quantizing a model's linears changes no Inductor setting."""
    pytest.importorskip("torchao")
    assert stack.linears_config(linears).set_inductor_config is False
    before = torch._inductor.config.save_config_portable()
    model, _ = tiny_models.wan()
    if linears != "fp8":  # FP8 matmuls need a GPU; the config object is what differs
        assert stack.quantize_linears(model, linears) > 0
    assert torch._inductor.config.save_config_portable() == before
    assert not torch._inductor.config.coordinate_descent_tuning


@pytest.mark.slow
def test_first_block_cache_compiles_only_the_caches_graphs_and_reports_every_site():
    model, inputs = tiny_models.wan(num_layers=3)
    stack.enable_cache(model, "fbc", threshold=0.5)
    with torch.no_grad():
        eager, eager_recomputed = denoise(model, model, inputs)
        plain_graphs, plain_runs, plain, plain_recomputed = compiled_graphs(model, inputs, None)
        backend = qattn_fx.backend(emulate=True, compiler="eager")
        graphs, runs, out, recomputed = compiled_graphs(model, inputs, backend)

    assert eager_recomputed == plain_recomputed == recomputed == [True, False, False, False, False]
    # the cache's own graphs (module docstring), the same under any backend: 7 in the first run, 1 in the second
    # (the head block's forward as a frame of its own), none after
    assert runs == plain_runs == [7, 1, 0]
    assert graphs == plain_graphs and sum(graphs) == 10  # 3 blocks of 2 sites; the head block's in 2 more graphs
    assert [s.graph for s in backend.report.sites] == [g for g, n in enumerate(graphs) for _ in range(n)]
    assert {(s.module, s.role, s.rewritten) for s in backend.report.sites} == \
        {("attn1", "self", True), ("attn2", "cross", True)}
    torch.testing.assert_close(plain, eager, rtol=1e-5, atol=1e-5)
    assert cosine(out, eager) >= 0.9999  # quantization error only; measured 0.999999


#: Where Dynamo breaks the graph in First Block Cache's hook: its host-side decision (torch 2.13), or earlier, at the
#: ``inspect.signature`` it reads its arguments with (torch 2.11, in first_block_cache.py).
BREAK = r"_should_compute_remaining|hooks/first_block_cache\.py"


def test_first_block_cache_breaks_fullgraph():
    """The cache's decision is a graph break by design: ``fullgraph=True`` fails, naming it."""
    model, inputs = tiny_models.wan(num_layers=3)
    stack.enable_cache(model, "fbc")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=qattn_fx.backend(emulate=True, compiler="eager"), fullgraph=True)
    with torch.no_grad(), stack.cache_context(model), pytest.raises(Exception, match=BREAK):
        compiled(**inputs)


def other_caches():
    """diffusers 0.42.1's other step caches at settings that skip work on a 5-step loop (FasterCache is left out:
    it serves classifier-free guidance, which this loop has not)."""
    from diffusers import hooks

    timestep = lambda: 500  # noqa: E731 - inside every skip range
    return {
        "pab": hooks.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, cross_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(0, 1000), cross_attention_timestep_skip_range=(0, 1000),
            current_timestep_callback=timestep),
        "taylorseer": hooks.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
        "text_kv": hooks.TextKVCacheConfig(),
        "sea": hooks.SeaCacheConfig(),
        "mag": hooks.MagCacheConfig(num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS),
    }


#: Per cache: whether ``fullgraph=True`` compiles, the graphs of the first and the second run (the same under any
#: backend), and the attention sites in them of the 6 calls a step makes (3 blocks: ``attn1``, ``attn2``).
#: SeaCache runs its first block's hook under ``torch.compiler.disable`` (its 2 calls stay dense, outside every
#: graph); MagCache every block's: the backend sees no attention at all. Measured on torch 2.13.
OTHER_CACHES = {"pab": (True, [5, 0], 18), "taylorseer": (True, [1, 0], 6), "text_kv": (True, [2, 0], 12),
                "sea": (False, [5, 0], 4), "mag": (False, [3, 0], 0)}


@pytest.mark.slow
@pytest.mark.parametrize("cache", list(OTHER_CACHES))
def test_other_diffusers_caches_compose_or_say_why_not(cache):
    fullgraph, runs_expected, sites = OTHER_CACHES[cache]
    model, inputs = tiny_models.wan(num_layers=3)
    model.enable_cache(other_caches()[cache])
    with torch.no_grad():
        eager, _ = denoise(model, model, inputs)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        if fullgraph:
            denoise(model, compiled, inputs)
        else:
            with pytest.raises(Exception, match=r"torch.compiler.disable\(\)`d function"):
                denoise(model, compiled, inputs)
        plain_graphs, plain_runs, _, _ = compiled_graphs(model, inputs, None, runs=2)
        backend = qattn_fx.backend(emulate=True, compiler="eager")
        graphs, runs, out, _ = compiled_graphs(model, inputs, backend, runs=2)
        if cache == "sea":
            stack.reset_cache(model)
            torch._dynamo.reset()
            with stack.cache_context(model):
                explained = qattn_fx.explain(model, **inputs, emulate=True)
    assert runs == plain_runs == runs_expected and graphs == plain_graphs
    assert len(backend.report.sites) == sum(graphs) == sites
    assert all(s.rewritten for s in backend.report.sites)
    assert cosine(out, eager) >= 0.9999
    if cache == "sea":  # the calls outside every graph are named by explain
        assert "2 of the call's 6 attention calls ran outside every traced graph" in explained.notes[0]


def test_cublas_fp8_gemms_keep_inductor_from_autotuning_triton_templates():
    """Inductor autotunes Triton templates for ``_scaled_mm`` even in the default mode (``tuned_scaled_mm``);
    ``inductor_config("fp8", "cublas")`` leaves it ATen alone, which is what Inductor's template check reads."""
    from torch._inductor.utils import _use_autotune_backend

    assert stack.inductor_config("fp8") == {"max_autotune_gemm_backends": "ATEN"}
    assert stack.inductor_config("fp8", "autotune") == {} and stack.inductor_config("bf16") == {}
    with torch._inductor.config.patch(stack.inductor_config("fp8", "cublas")):
        assert _use_autotune_backend("ATEN") and not _use_autotune_backend("TRITON")
    assert _use_autotune_backend("TRITON")  # Inductor's default: FP8 matmuls autotune Triton templates
    with pytest.raises(ValueError, match="fp8_gemms='triton' is invalid; valid: cublas, autotune"):
        stack.inductor_config("fp8", "triton")
    with pytest.raises(ValueError, match="linears='int4' is invalid; valid: bf16, fp8, fp8static, int8wo, int8dq"):
        stack.inductor_config("int4")
