"""Policy: which kernel (or dense) serves a hand-built attention site on a hand-described machine, and why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qattn_fx import recipes
from qattn_fx.hardware import Hardware
from qattn_fx.policy import Decision, Site, match_site, resolve
from qattn_fx.serving import unmet
from qattn_fx.recipes import TABLE, Recipe, Requirements, SkipSoftmax
from qattn_fx.spec import DENSE, AttentionSpec, Match, Rule, Spec

SM90 = Hardware.for_arch("sm_90", {"triton": "3.6.0", "flashinfer-python": "0.7.2.post1", "cudnn": "9.19.0"})
SM90_BARE = Hardware.for_arch("sm_90")
SM100 = Hardware.for_arch("sm_100", {"flashinfer-python": "0.7.4", "cudnn": "9.21.0"})
SM103 = Hardware.for_arch("sm_103", {"flashinfer-python": "0.7.4", "cudnn": "9.21.0"})
SM120 = Hardware.for_arch("sm_120", {"flashinfer-python": "0.7.4"})
CPU = Hardware.for_arch("cpu", {"triton": "3.6.0"})
SM90_TRITON_3_5 = Hardware.for_arch("sm_90", {"triton": "3.5.0", "flashinfer-python": "0.7.2.post1", "cudnn": "9.19.0"})
SM89 = Hardware.for_arch("sm_89", {"triton": "3.6.0"})

SAGE_INT8 = Recipe("int8", "fp8", 1, 16, 1)
CUDNN_FP8 = Recipe("fp8", "fp8", 0, 0, 0)
FA3_FP8 = Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head")


def site(d=128, hq=24, hk=24, sq=32760, skv=32760, **kwargs) -> Site:
    kwargs.setdefault("name", "attn")
    kwargs.setdefault("module", "transformer_blocks.3.attn1")
    kwargs.setdefault("layer", 3)
    kwargs.setdefault("num_layers", 10)
    return Site(q_shape=(1, hq, sq, d), k_shape=(1, hk, skv, d), v_shape=(1, hk, skv, d), **kwargs)


def spec(backend="auto", recipe=SAGE_INT8, **kwargs) -> Spec:
    return Spec(default=AttentionSpec(backend, recipe, **kwargs))


def quantized(decision: Decision, kernel: str, backend: str) -> None:
    assert decision.quantized, decision.reason
    assert (decision.kernel, decision.backend) == (kernel, backend), decision


# ----------------------------------------------------------------------------------------------------------------
# auto picks the kernel
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [SAGE_INT8, Recipe("int8", "fp8", 1, 4, 1), Recipe("int8", "fp8", 1, 1, 1), Recipe("fp8", "fp8", 1, 4, 1),
     Recipe("int8", "fp8", 64, 128, 0), Recipe("bf16", "fp8", 0, 0, 1), Recipe("bf16", "fp8", 0, 0, 0)],
)
@pytest.mark.parametrize("d", [64, 128])
def test_auto_picks_gluon_sage_on_sm90(recipe, d):
    decision = resolve(site(d=d), SM90, spec("auto", recipe))
    quantized(decision, "gluon_sage", "TRITON")
    assert decision.recipe == recipe
    assert decision.reason == f"quantized: {recipe.name} on gluon_sage (sm_90)"
    assert decision.source == "default"
    # an explicit TRITON backend takes the same kernel
    assert resolve(site(d=d), SM90, spec("TRITON", recipe)).kernel == "gluon_sage"


@pytest.mark.parametrize(
    "recipe",
    [SAGE_INT8, Recipe("fp8", "fp8", 1, 4, 1), Recipe("int8", "fp8", 64, 128, 0), Recipe("bf16", "fp8", 0, 0, 1)],
)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hw", [SM90_TRITON_3_5, SM89], ids=["sm90-triton3.5", "sm89-triton3.6"])
def test_auto_picks_triton_sage_without_gluon(hw, recipe, d):
    """gluon_sage needs sm_90 and triton >= 3.6; elsewhere the TRITON rows fall through to triton_sage (which
    ``auto`` keeps dense where it was measured slower than cuDNN bf16: head_dim 64 on sm_90)."""
    for backend in ("auto", "TRITON"):
        decision = resolve(site(d=d), hw, spec(backend, recipe))
        if backend == "auto" and hw.arch == "sm_90" and d == 64:
            assert decision.reason.startswith("dense: triton_sage predicted 0.92x of cuDNN bf16 at Sq 32760, Skv 32760")
            continue
        quantized(decision, "triton_sage", "TRITON")
        assert decision.recipe == recipe
        plain = f"quantized: {recipe.name} on triton_sage ({hw.arch})"
        if hw.arch == "sm_90" and d == 64:  # the explicit backend runs it, saying what auto would do
            assert decision.reason == (f"{plain}; slower than dense: triton_sage predicted 0.92x of cuDNN bf16 at "
                                       "Sq 32760, Skv 32760 (cost data: H200 2026-11-30); auto would keep it dense")
        else:
            assert decision.reason == plain


def test_default_spec_on_sm90():
    decision = resolve(site(), SM90)
    assert decision.reason == "quantized: int8 Q/K 1/16, fp8 V per-channel, smooth K on gluon_sage (sm_90)"


def test_triton_needs_the_triton_library():
    decision = resolve(site(), SM90_BARE, spec())
    assert not decision.quantized
    assert ("TRITON: needs triton >= 3.6.0, have none (gluon_sage); needs triton >= 3.0.0, have none (triton_sage)"
            in decision.reason)


@pytest.mark.parametrize("backend", ["auto", "CUDNN"])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_cudnn_fp8_on_sm90(backend, d):
    decision = resolve(site(d=d), SM90, spec(backend, CUDNN_FP8))
    quantized(decision, "cudnn_fp8", "CUDNN")
    assert decision.reason == "quantized: fp8 Q/K per-tensor, fp8 V per-tensor, smooth K on cudnn_fp8 (sm_90)"


def test_cudnn_fp8_on_blackwell_head_dims():
    quantized(resolve(site(d=96), SM100, spec("CUDNN", CUDNN_FP8)), "cudnn_fp8", "CUDNN")
    quantized(resolve(site(d=128), SM103, spec("auto", CUDNN_FP8)), "cudnn_fp8", "CUDNN")
    with pytest.raises(ValueError) as e:
        resolve(site(d=80), SM100, spec("CUDNN", CUDNN_FP8))
    msg = str(e.value)
    assert "backend 'CUDNN' cannot serve site 'attn' (transformer_blocks.3.attn1) on sm_100" in msg
    assert "CUDNN: head_dim 80 not in 32/64/96/128" in msg
    assert "; needs sm_90, have sm_100" in msg  # the same kernel's row for sm_90


def test_cudnn_needs_its_library_version():
    old = Hardware.for_arch("sm_100", {"cudnn": "9.0.0"})
    decision = resolve(site(), old, spec("auto", CUDNN_FP8))
    assert not decision.quantized
    assert "CUDNN: needs cudnn >= 9.1.0, have 9.0.0" in decision.reason
    mx = Recipe("mxfp8", "mxfp8")
    quantized(resolve(site(), SM100, spec("CUDNN", mx)), "cudnn_mxfp8", "CUDNN")
    with pytest.raises(ValueError, match=r"CUDNN: needs cudnn >= 9.21.0, have 9.19.0"):
        resolve(site(), Hardware.for_arch("sm_100", {"cudnn": "9.19.0"}), spec("CUDNN", mx))


@pytest.mark.parametrize("backend", ["auto", "FLASHINFER"])
def test_flashinfer_fa3_fp8_for_per_head_fp8_on_sm90(backend):
    decision = resolve(site(d=64), SM90, spec(backend, FA3_FP8))
    quantized(decision, "flashinfer_fa3_fp8", "FLASHINFER")
    assert decision.reason == "quantized: fp8 Q/K per-head, fp8 V per-head, smooth K on flashinfer_fa3_fp8 (sm_90)"
    no_lib = resolve(site(), SM90_BARE, spec("auto", FA3_FP8))
    assert not no_lib.quantized
    assert no_lib.reason == (
        "dense: no kernel serves fp8 Q/K per-head, fp8 V per-head, smooth K via auto here "
        "(FLASHINFER: needs flashinfer-python >= 0.6.0, have none)"
    )


def test_flashinfer_trtllm_sage_on_sm100():
    # VisualGen TRTLLM row for int8 1/16/1
    quantized(resolve(site(), SM100, spec("auto", SAGE_INT8)), "flashinfer_trtllm_sage", "TRTLLM")
    quantized(resolve(site(), SM100, spec("TRTLLM", SAGE_INT8)), "flashinfer_trtllm_sage", "TRTLLM")
    quantized(resolve(site(), SM100, spec("TRTLLM_ATTN", SAGE_INT8)), "flashinfer_trtllm_sage", "TRTLLM_ATTN")
    # FP8 Q/K with a 16-token K block exists only in vLLM-Omni's table
    quantized(resolve(site(), SM100, spec("auto", Recipe("fp8", "fp8", 1, 16, 1))), "flashinfer_trtllm_sage",
              "TRTLLM_ATTN")
    # INT8 cubins are sm_100 only; FP8 runs on sm_103 as well
    quantized(resolve(site(), SM103, spec("auto", Recipe("fp8", "fp8", 1, 4, 1))), "flashinfer_trtllm_sage", "TRTLLM")
    decision = resolve(site(), SM103, spec("auto", SAGE_INT8))
    assert not decision.quantized
    assert decision.reason == (
        "dense: no kernel serves int8 Q/K 1/16, fp8 V per-channel, smooth K via auto here "
        "(TRITON: needs sm_90, have sm_103 (gluon_sage); needs sm_89/sm_90, have sm_103 (triton_sage); "
        "TRTLLM: needs sm_100, have sm_103; TRTLLM_ATTN: needs sm_100, have sm_103)"
    )


def test_trtllm_sage_needs_flashinfer_0_6_16rc1_and_head_dim_128():
    for version, ok in [("0.6.15", False), ("0.6.16rc1", True), ("0.6.16", True), ("0.7.2.post1", True)]:
        hw = Hardware.for_arch("sm_100", {"flashinfer-python": version})
        decision = resolve(site(), hw, spec("auto", SAGE_INT8))
        assert decision.quantized is ok, (version, decision.reason)
        if not ok:
            assert f"TRTLLM: needs flashinfer-python >= 0.6.16rc1, have {version}" in decision.reason
    with pytest.raises(ValueError) as e:
        resolve(site(d=64), SM100, spec("TRTLLM", SAGE_INT8))
    assert "TRTLLM: head_dim 64 not in 128" in str(e.value)


def test_sm120_has_no_kernel():
    decision = resolve(site(), SM120, spec())
    assert not decision.quantized
    with pytest.raises(ValueError) as e:
        resolve(site(), SM120, spec("FLASHINFER", Recipe("nvfp4", "nvfp4")))
    msg = str(e.value)
    assert "backend 'FLASHINFER' cannot serve site 'attn'" in msg and "on sm_120" in msg
    assert "FLASHINFER: no kernel in qattn_fx (emulate=True to measure it)" in msg


def test_auto_on_cpu_is_dense_with_what_each_backend_needs():
    decision = resolve(site(), CPU, spec())
    assert decision == Decision(
        False,
        "dense: no kernel serves int8 Q/K 1/16, fp8 V per-channel, smooth K via auto here "
        "(TRITON: needs sm_90, have cpu (gluon_sage); needs sm_89/sm_90, have cpu (triton_sage); TRTLLM: needs "
        "sm_100, have cpu; TRTLLM_ATTN: needs sm_100, have cpu)",
        SAGE_INT8, None, None, "default", (),
    )
    mx = resolve(site(), CPU, spec("auto", Recipe("mxfp8", "fp8", 0, 0, 1)))
    assert mx.reason == (
        "dense: no kernel serves mxfp8 Q/K, fp8 V per-channel, smooth K via auto here "
        "(CUTEDSL: no kernel in qattn_fx (emulate=True to measure it))"
    )
    fp8 = resolve(site(), CPU, spec("auto", CUDNN_FP8))
    assert "CUDNN: needs sm_100/sm_103, have cpu; needs sm_90, have cpu" in fp8.reason


# ----------------------------------------------------------------------------------------------------------------
# explicit backends raise
# ----------------------------------------------------------------------------------------------------------------


def test_explicit_backend_the_hardware_cannot_serve_raises():
    with pytest.raises(ValueError) as e:
        resolve(site(), SM90, spec("TRTLLM", SAGE_INT8))
    assert str(e.value) == (
        "default asks for int8 Q/K 1/16, fp8 V per-channel, smooth K via TRTLLM but backend 'TRTLLM' cannot serve "
        "site 'attn' (transformer_blocks.3.attn1) on sm_90: TRTLLM: needs sm_100, have sm_90. Use backend='auto' "
        "to pick what runs here, or emulate=True to measure the recipe with the reference kernel"
    )
    # never a silent switch to another backend that could run it
    with pytest.raises(ValueError, match=r"backend 'TRITON' cannot serve .* on sm_100: TRITON: needs sm_90, have "
                                         r"sm_100 \(gluon_sage\); needs sm_89/sm_90, have sm_100 \(triton_sage\)\."):
        resolve(site(), SM100, spec("TRITON", SAGE_INT8))
    with pytest.raises(ValueError, match=r"backend 'CUDNN' cannot serve .* on cpu"):
        resolve(site(), CPU, spec("CUDNN", CUDNN_FP8))


def test_explicit_backend_from_a_rule_names_the_rule():
    s = Spec(default=DENSE, rules=(Rule(Match(role="self"), AttentionSpec("TRTLLM", SAGE_INT8)),))
    with pytest.raises(ValueError, match=r"^rule 1 \(role=self\) asks for int8 Q/K 1/16"):
        resolve(site(), SM90, s)


@pytest.mark.parametrize("d", [80, 96, 256])
def test_head_dim_not_supported(d):
    auto = resolve(site(d=d), SM90, spec())
    assert not auto.quantized
    assert f"TRITON: head_dim {d} not in 64/128" in auto.reason
    with pytest.raises(ValueError) as e:
        resolve(site(d=d), SM90, spec("TRITON", SAGE_INT8))
    assert f"backend 'TRITON' cannot serve site 'attn' (transformer_blocks.3.attn1) on sm_90: " \
           f"TRITON: head_dim {d} not in 64/128." in str(e.value)


def test_nvfp4_head_dim_not_multiple_of_16():
    nv = Recipe("nvfp4", "fp8", 0, 0, 1)
    decision = resolve(site(d=72), CPU, spec("auto", nv), emulate=True)
    assert decision == Decision(False, "dense: nvfp4 Q/K needs head_dim % 16 == 0, got 72", source="default")
    assert not resolve(site(d=72), CPU, spec("auto", nv)).quantized
    for backend, emulate in [("CUTEDSL", True), ("CUTEDSL", False), ("REFERENCE", False)]:
        with pytest.raises(ValueError) as e:
            resolve(site(d=72), CPU, spec(backend, nv), emulate=emulate)
        assert str(e.value) == (
            f"default asks for nvfp4 Q/K, fp8 V per-channel, smooth K via {backend} but site 'attn' "
            "(transformer_blocks.3.attn1) cannot run it: nvfp4 Q/K needs head_dim % 16 == 0, got 72"
        )
    assert resolve(site(d=80), CPU, spec("CUTEDSL", nv), emulate=True).quantized


def test_input_dtype():
    assert resolve(site(dtype=torch.float16), SM90, spec()).quantized
    fp32 = resolve(site(dtype=torch.float32), SM90, spec())
    assert not fp32.quantized
    assert "TRITON: inputs are torch.float32, not bfloat16/float16; TRTLLM:" in fp32.reason  # once for both kernels
    # the reference kernel takes bf16/fp16/fp32, not float64
    assert resolve(site(dtype=torch.float32), CPU, spec(), emulate=True).quantized
    fp64 = resolve(site(dtype=torch.float64), CPU, spec(), emulate=True)
    assert fp64.reason == "dense: reference: inputs are torch.float64, not bfloat16/float16/float32"


# ----------------------------------------------------------------------------------------------------------------
# emulation
# ----------------------------------------------------------------------------------------------------------------


def _every_valid_recipe():
    for row in TABLE:
        for blocks in row.blocks.all():
            for scope in row.scale_scopes:
                yield row.backend, Recipe(row.qk_dtype, row.v_dtype, *blocks, scale_scope=scope)


def test_emulate_runs_every_valid_recipe_on_the_reference_kernel_on_cpu():
    seen = 0
    for backend, recipe in _every_valid_recipe():
        for b in (backend, "auto"):
            decision = resolve(site(), CPU, spec(b, recipe), emulate=True)
            assert decision.quantized and decision.kernel == "reference" and decision.backend == "REFERENCE"
            assert decision.recipe == recipe
            assert decision.reason == f"quantized (emulated): {recipe.name} on reference (cpu)"
        decision = resolve(site(), CPU, spec("REFERENCE", recipe))
        assert decision.reason == f"quantized (backend REFERENCE): {recipe.name} on reference (cpu)"
        seen += 1
    assert seen > 100


def test_emulate_also_overrides_a_real_kernel():
    decision = resolve(site(), SM90, spec(), emulate=True)
    assert decision.kernel == "reference" and decision.reason.endswith("on reference (sm_90)")


# ----------------------------------------------------------------------------------------------------------------
# skip-softmax
# ----------------------------------------------------------------------------------------------------------------


def test_skip_softmax_on_gluon_sage_and_trtllm_gen():
    skip = SkipSoftmax(threshold=0.01, disabled_until_timestep=0.86)
    hopper = resolve(site(), SM90, spec("auto", SAGE_INT8, skip_softmax=skip))
    quantized(hopper, "gluon_sage", "TRITON")
    assert hopper.skip_softmax == skip
    assert hopper.reason == ("quantized: int8 Q/K 1/16, fp8 V per-channel, smooth K, skip-softmax λ=0.01, dense while "
                             "t > 0.86 on gluon_sage (sm_90)")
    blackwell = resolve(site(), SM100, spec("auto", SAGE_INT8, skip_softmax=skip))
    quantized(blackwell, "flashinfer_trtllm_sage", "TRTLLM")
    assert blackwell.skip_softmax == skip
    # a pinned kernel without Skip-Softmax raises, naming why
    with pytest.raises(ValueError, match=r"kernel 'triton_sage' cannot serve .* TRITON: no skip-softmax"):
        resolve(site(), SM90, spec("TRITON", SAGE_INT8, skip_softmax=skip, kernel="triton_sage"))
    # without Gluon (triton < 3.6) auto keeps the site dense rather than drop the skip
    old = resolve(site(), SM90_TRITON_3_5, spec("auto", SAGE_INT8, skip_softmax=skip))
    assert not old.quantized and "; no skip-softmax (triton_sage)" in old.reason


def test_bf16_skip_softmax_has_no_kernel_and_says_so():
    skip = SkipSoftmax(threshold=0.05)
    with pytest.raises(ValueError, match="no kernel in qattn_fx runs bf16 attention with skip-softmax"):
        resolve(site(), SM100, spec("TRTLLM_ATTN", None, skip_softmax=skip))
    auto = resolve(site(), SM90, spec("auto", None, skip_softmax=skip))
    assert not auto.quantized and "no kernel in qattn_fx runs bf16 attention with skip-softmax" in auto.reason


@pytest.mark.parametrize("recipe", [None, SAGE_INT8])
def test_skip_softmax_is_emulated_on_the_reference(recipe):
    s = spec("TRTLLM_ATTN", recipe, skip_softmax=SkipSoftmax(threshold=0.5))
    d = resolve(site(), CPU, s, emulate=True)
    assert d.quantized and d.kernel == "reference" and d.skip_softmax == SkipSoftmax(threshold=0.5)
    assert "skip-softmax λ=0.5" in d.reason


def test_target_sparsity_needs_a_calibration():
    s = spec("auto", SAGE_INT8, skip_softmax=SkipSoftmax(target_sparsity=0.6))
    with pytest.raises(ValueError) as e:
        resolve(site(), SM90, s)
    assert str(e.value) == (
        "default asks for skip_softmax.target_sparsity=0.6, which needs a calibration: run "
        "qattn_fx.calibrate_skip_softmax(model, calls, target_sparsity=...) and compile with the spec it returns (a "
        "threshold per site), or give skip_softmax.threshold (λ) or threshold_scale_factor")


# ----------------------------------------------------------------------------------------------------------------
# Site facts no quantized kernel serves: one-line reasons
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(mask="float", mask_shape=(1, 24, 4608, 4608)),
         "dense: attn_mask is a float bias of shape (1, 24, 4608, 4608) that varies per query or head; per-key "
         "biases are served"),
        (dict(mask="bool"), "dense: attn_mask is a boolean mask that varies per query or head; per-key masks are "
                            "served"),
        (dict(dropout=0.1), "dense: dropout_p=0.1 > 0; quantized kernels do not implement dropout"),
        (dict(dropout=0.1, runtime_args=("dropout_p",)),
         "dense: dropout_p is a value computed in the graph (0.1 when compiled); quantized kernels do not implement "
         "dropout"),
        (dict(dropout=float("nan"), runtime_args=("dropout_p",)),
         "dense: dropout_p is a value computed in the graph (not known at compile time); quantized kernels do not "
         "implement dropout"),
        (dict(causal=True), "dense: is_causal=True; qattn_fx's quantized attention ops are non-causal"),
        (dict(grad_enabled=True),
         "dense: autograd is enabled (training graph); the quantized attention ops have no backward"),
        (dict(dtype=torch.int32), "dense: inputs are torch.int32, not floating point"),
        (dict(kv_dtypes=(torch.bfloat16, torch.float16)),
         "dense: q, k, v dtypes differ (torch.bfloat16, torch.bfloat16, torch.float16)"),
        (dict(skv=0), "dense: zero-length keys"),
        (dict(hq=24, hk=8), "dense: 24 query heads and 8 key heads without enable_gqa: neither is 1, so they do "
                            "not broadcast (SDPA itself rejects it)"),
        (dict(hq=24, hk=9, enable_gqa=True),
         "dense: 24 query heads are not a multiple of 9 key heads (SDPA with enable_gqa rejects it too)"),
        (dict(hq=1, hk=8), "dense: 1 query head and 8 key heads: SDPA broadcasts the query head (the output has 8 "
                           "heads); the ops need query heads that are a multiple of the key heads"),
    ],
)
@pytest.mark.parametrize("emulate", [False, True])
def test_site_blockers(kwargs, reason, emulate):
    decision = resolve(site(**kwargs), SM90, spec(), emulate=emulate)
    assert decision == Decision(False, reason, source="default")
    assert "\n" not in decision.reason
    # even an explicit backend goes dense on these facts (the recipe is fine, the call site is not)
    assert not resolve(site(**kwargs), SM100, spec("TRTLLM", SAGE_INT8)).quantized


@pytest.mark.parametrize(
    "shapes, mask_shape, reason",
    [
        (((8, 64), (8, 64), (8, 64)), None,
         "2-D operands; qattn_fx serves 3-D (N, S, E), 4-D (B, H, S, D) and higher (..., H, S, D)"),
        (((1, 8, 64, 128), (8, 64, 128), (8, 64, 128)), None,
         "q, k, v have 4, 3, 3 dims; the ops need equal ranks"),
        (((2, 3, 4, 64, 128),) * 3, (2, 3, 1, 1, 64), "attn_mask with 5-D operands; masks are served with 3-D and "
                                                       "4-D operands"),
        (((2, 3, 4, 64, 128), (2, 1, 4, 64, 128), (2, 3, 4, 64, 128)), None,
         "leading dims of 5-D operands differ (q (2, 3, 4, 64, 128), k (2, 1, 4, 64, 128), v (2, 3, 4, 64, 128)); "
         "they are served when equal"),
        (((3, 8, 64, 128), (2, 8, 64, 128), (2, 8, 64, 128)), None,
         "batch sizes 3, 2, 2 (q, k, v, mask) do not broadcast"),
        (((1, 8, 64, 128), (1, 8, 64, 128), (1, 4, 64, 128)), None, "k and v head counts differ (8 vs 4)"),
        (((1, 8, 64, 128), (1, 8, 64, 64), (1, 8, 64, 128)), None, "q and k head dims differ (128 vs 64)"),
    ],
)
def test_call_forms_the_ops_do_not_serve(shapes, mask_shape, reason):
    q, k, v = shapes
    kind = "none" if mask_shape is None else "key_padding"
    s = Site(q_shape=q, k_shape=k, v_shape=v, mask=kind, mask_shape=mask_shape)
    assert resolve(s, CPU, spec(), emulate=True).reason == f"dense: {reason}"
    assert resolve(s, SM90, spec()).reason == f"dense: {reason}"


@pytest.mark.parametrize(
    "q, k, mask_shape",
    [
        ((3, 64, 128), (3, 80, 128), None),  # (N, S, E)
        ((3, 64, 128), (3, 80, 128), (3, 1, 80)),  # (N, S, E) with a key-padding mask
        ((2, 3, 8, 64, 128), (2, 3, 8, 80, 128), None),  # leading batch dims
        ((3, 8, 64, 128), (1, 8, 80, 128), None),  # K/V broadcast over Q's batch
        ((1, 8, 64, 128), (1, 8, 80, 128), (3, 1, 1, 80)),  # the mask's batch broadcasts Q/K/V
        ((1, 24, 64, 128), (1, 1, 80, 128), None),  # one key head broadcast (no enable_gqa needed)
    ],
)
def test_other_sdpa_call_forms_are_served(q, k, mask_shape):
    kind = "none" if mask_shape is None else "key_padding"
    s = Site(q_shape=q, k_shape=k, v_shape=k, mask=kind, mask_shape=mask_shape, role="cross")
    quantized(resolve(s, SM90, spec("TRITON")), "gluon_sage", "TRITON")  # (auto: dense by the cost rule at 64 x 80)
    assert resolve(s, CPU, spec(), emulate=True).quantized


@pytest.mark.parametrize("mask", ["key_padding", "key_bias"])
def test_per_key_masks_run_on_the_sage_kernels_and_the_reference(mask):
    masked = site(mask=mask, mask_shape=(1, 1, 1, 32760))
    quantized(resolve(masked, SM90, spec()), "gluon_sage", "TRITON")
    quantized(resolve(masked, SM89, spec()), "triton_sage", "TRITON")
    assert resolve(masked, CPU, spec(), emulate=True).quantized
    # cuDNN FP8 and FA3 FP8 take no masks: auto stays dense with the reason, an explicit backend raises
    fp8 = Recipe("fp8", "fp8", 0, 0, 0)
    dense = resolve(masked, SM90, spec("auto", fp8))
    assert not dense.quantized and f"; no masks ({mask} attn_mask))" in dense.reason
    with pytest.raises(ValueError, match=rf"backend 'CUDNN' cannot serve .*no masks \({mask} attn_mask\)"):
        resolve(masked, SM90, spec("CUDNN", fp8))
    # Blackwell's trtllm-gen Sage kernels neither
    assert "TRTLLM: no masks" in resolve(masked, SM100, spec()).reason


def test_gqa():
    g = site(hq=24, hk=8, enable_gqa=True)
    assert g.gqa and not site().gqa
    quantized(resolve(g, SM90, spec()), "gluon_sage", "TRITON")
    quantized(resolve(g, SM90_TRITON_3_5, spec()), "triton_sage", "TRITON")
    quantized(resolve(g, SM89, spec()), "triton_sage", "TRITON")
    quantized(resolve(g, SM100, spec()), "flashinfer_trtllm_sage", "TRTLLM")
    assert resolve(g, CPU, spec(), emulate=True).quantized
    use = AttentionSpec()
    no_gqa = Requirements("k", None, gqa=False)
    assert unmet(no_gqa, g, CPU, use) == "no GQA"
    assert unmet(no_gqa, site(), CPU, use) is None


def test_unmet_other_requirements():
    use = AttentionSpec()
    req = Requirements("k", None, cross_attention=False)
    assert unmet(req, site(role="cross"), CPU, use) == "no cross-attention"
    req = Requirements("k", None, self_attention_only_equal_shapes=True)
    assert unmet(req, site(sq=256, skv=512), CPU, use) == "needs equal Q/K/V shapes (self-attention)"
    req = Requirements("k", None, seq_multiple_of=128)
    assert unmet(req, site(sq=4608, skv=4600), CPU, use) == "sequence lengths must be multiples of 128"
    assert unmet(req, site(sq=4608, skv=4608), CPU, use) is None
    req = Requirements("k", ("sm_90",))
    assert unmet(req, site(), CPU, use) == "needs sm_90, have cpu"
    assert unmet(Requirements(None, None), site(), SM90, use) == "no kernel in qattn_fx (emulate=True to measure it)"
    (nv,) = [r for r in TABLE if (r.backend, r.qk_dtype, r.v_dtype) == ("FLASHINFER", "nvfp4", "nvfp4")]
    assert unmet(dataclasses.replace(nv.implementations[0], kernel="x"), site(sq=300, skv=300), SM120, use) == \
        "sequence lengths must be multiples of 128"


# ----------------------------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------------------------

RULES = Spec.from_dict({
    "default": {"backend": "auto"},
    "rules": [
        {"match": {"role": "joint"}, "use": {"backend": "auto", "recipe": {"qk_dtype": "int8", "q_block_size": 1,
                                                                          "k_block_size": 4, "v_block_size": 1}}},
        {"match": {"role": "cross"}, "use": "dense"},
        {"match": {"layers": [0, -1]}, "use": "dense"},
        {"match": {"layers": ["-4:-1"], "module": "*.attn1"}, "use": {"backend": "CUDNN", "recipe": {
            "qk_dtype": "fp8", "v_dtype": "fp8"}}},
        {"match": {"min_kv_len": 1024, "head_dim": 64}, "use": "dense"},
        {"match": {"layers": [5]}, "use": "dense"},
    ],
})


def test_rule_reasons_and_sources():
    cross = resolve(site(role="cross"), SM90, RULES)
    assert cross == Decision(False, "dense: rule 2 (role=cross)", source="rule 2 (role=cross)")
    assert resolve(site(layer=0), SM90, RULES).reason == "dense: rule 3 (layers=0,-1)"
    assert resolve(site(d=64), SM90, RULES).reason == "dense: rule 5 (head_dim=64, min_kv_len=1024)"
    short = resolve(site(d=64, skv=512), SM90, RULES)  # rule 5 does not match: the default's auto decides
    assert short.source == "default" and short.reason.startswith("dense: gluon_sage predicted at most 0.88x")
    assert resolve(site(d=64, skv=512), SM90, RULES, apply_cost_rule=False).quantized
    joint = resolve(site(role="joint"), SM90, RULES)
    assert joint.source == "rule 1 (role=joint)" and joint.recipe == Recipe("int8", "fp8", 1, 4, 1)
    default = resolve(site(layer=4), SM90, RULES)
    assert default.source == "default" and default.recipe == SAGE_INT8


def test_dense_rule_wins_over_site_blockers():
    # the rule decides first; the reason names the rule, not the mask
    assert resolve(site(role="cross", mask="float"), SM90, RULES).reason == "dense: rule 2 (role=cross)"


def test_rule_order_first_match_wins():
    s = Spec(default=DENSE, rules=(
        Rule(Match(module="transformer_blocks.*"), AttentionSpec("auto", Recipe("fp8", "fp8", 1, 4, 1))),
        Rule(Match(role="self"), AttentionSpec("auto", SAGE_INT8)),
    ))
    assert resolve(site(), SM90, s).recipe == Recipe("fp8", "fp8", 1, 4, 1)
    assert resolve(site(), SM90, s).source == "rule 1 (module=transformer_blocks.*)"
    swapped = Spec(default=DENSE, rules=tuple(reversed(s.rules)))
    assert resolve(site(), SM90, swapped).recipe == SAGE_INT8
    assert resolve(site(module="other.attn"), SM90, s).source == "rule 2 (role=self)"
    assert resolve(site(role="cross", module="x"), SM90, s).reason == "dense: default"


def test_negative_layer_indices_need_num_layers():
    assert resolve(site(layer=9, num_layers=10), SM90, RULES).reason == "dense: rule 3 (layers=0,-1)"
    assert resolve(site(layer=9, num_layers=12), SM90, RULES).source == "rule 4 (module=*.attn1, layers=-4:-1)"
    assert resolve(site(layer=11, num_layers=12), SM90, RULES).reason == "dense: rule 3 (layers=0,-1)"
    # without a layer count, -1 selects nothing and the -4:-1 slice cannot be placed
    assert resolve(site(layer=9, num_layers=None), SM90, RULES).source == "default"
    assert resolve(site(layer=5, num_layers=None), SM90, RULES).source == "rule 6 (layers=5)"
    # a site without a layer index never matches a per-layer rule
    assert resolve(site(layer=None, num_layers=None), SM90, RULES).source == "default"


def test_shared_block_graph_notes_per_layer_rules():
    decision = resolve(site(layer=None, layer_shared=True), SM90, RULES)
    assert decision.quantized and decision.source == "default"
    assert len(decision.notes) == 3
    for note, rule in zip(decision.notes, ("rule 3 (layers=0,-1)", "rule 4 (module=*.attn1, layers=-4:-1)",
                                           "rule 6 (layers=5)")):
        assert note.startswith(f"{rule} cannot be honoured: ")
        assert "per-layer rules are not applied" in note
        assert "\n" not in note
    # not shared: no notes
    assert resolve(site(layer=None), SM90, RULES).notes == ()
    # a non-layer rule still applies to the shared graph
    cross = resolve(site(layer=None, layer_shared=True, role="cross"), SM90, RULES)
    assert cross.reason == "dense: rule 2 (role=cross)"


def test_match_site_fields():
    s = site(sq=4096, skv=512)
    assert match_site(Match(min_q_len=4096, min_kv_len=512), s)
    assert not match_site(Match(min_q_len=4097), s)
    assert not match_site(Match(min_kv_len=513), s)
    assert match_site(Match(module="transformer_blocks.?.attn1"), s)
    assert not match_site(Match(module="transformer_blocks.?.attn2"), s)
    assert match_site(Match(head_dim=(64, 128)), s)
    assert match_site(Match(role=("self", "joint")), s)
    assert not match_site(Match(layers=("4:",)), s)
    assert match_site(Match(layers=("3:4",)), s)
    symbolic = Site(q_shape=(1, 8, None, 64), k_shape=(1, 8, None, 64), v_shape=(1, 8, None, 64))
    assert not match_site(Match(min_q_len=1), symbolic)


# ----------------------------------------------------------------------------------------------------------------
# Site
# ----------------------------------------------------------------------------------------------------------------


def test_site_from_tensors_and_validation():
    q = torch.empty(2, 8, 64, 32)
    kv = torch.empty(2, 4, 16, 32)
    s = Site.from_tensors(q, kv, kv, enable_gqa=True)
    assert (s.role, s.q_shape, s.k_shape, s.head_dim, s.q_len, s.kv_len, s.gqa, s.dtype) == (
        "cross", (2, 8, 64, 32), (2, 4, 16, 32), 32, 64, 16, True, torch.float32)
    assert Site.from_tensors(q, q, q).role == "self"
    assert Site.from_tensors(q, kv, kv, role="joint").role == "joint"
    with pytest.raises(ValueError, match=r"^site.mask='causal' is invalid; valid: none, key_padding, key_bias, bool, "
                                         r"float$"):
        Site(mask="causal")
    with pytest.raises(ValueError, match=r"^site.role='text' is invalid; valid: self, cross, joint$"):
        Site(role="text")


def test_every_table_kernel_is_reachable_by_auto_somewhere():
    """Each kernel named in the table is chosen by auto on some machine (the table order does not hide a row)."""
    machines = [SM89, SM90, SM100, SM103, SM120]
    kernels = {req.kernel for row in TABLE for req in row.implementations if req.kernel}
    chosen = set()
    for backend, recipe in _every_valid_recipe():
        for hw in machines:
            d = resolve(site(d=128), hw, spec("auto", recipe))
            if d.quantized:
                chosen.add(d.kernel)
    assert chosen == kernels
    assert recipes.REFERENCE not in chosen


# ----------------------------------------------------------------------------------------------------------------
# A spec may pin the kernel
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "TRITON"])
def test_pinned_triton_sage_runs_where_auto_would_take_gluon_sage(backend):
    assert resolve(site(), SM90, spec(backend)).kernel == "gluon_sage"
    decision = resolve(site(), SM90, spec(backend, kernel="triton_sage"))
    quantized(decision, "triton_sage", "TRITON")
    assert decision.reason == "quantized: int8 Q/K 1/16, fp8 V per-channel, smooth K on triton_sage (sm_90)"


@pytest.mark.parametrize("backend", ["auto", "TRITON"])
def test_pinned_kernel_that_cannot_serve_raises_instead_of_falling_back(backend):
    with pytest.raises(ValueError, match=r"kernel 'gluon_sage' cannot serve site 'attn' "
                                         r"\(transformer_blocks\.3\.attn1\) "
                                         r"on sm_89: TRITON: needs sm_90, have sm_89\. Remove 'kernel'"):
        resolve(site(), SM89, spec(backend, kernel="gluon_sage"))
    with pytest.raises(ValueError, match=r"kernel 'triton_sage' cannot serve .* on cpu: TRITON: needs sm_89/sm_90"):
        resolve(site(), CPU, spec(backend, kernel="triton_sage"))


def test_pinned_kernel_must_implement_the_recipe():
    with pytest.raises(ValueError, match=r"kernel='cudnn_fp8' does not implement int8 Q/K 1/16, fp8 V per-channel, "
                                         r"smooth K via backend 'TRITON'; valid: gluon_sage, triton_sage"):
        AttentionSpec("TRITON", SAGE_INT8, kernel="cudnn_fp8")
    with pytest.raises(ValueError, match=r"kernel='flash' does not implement .* via backend 'auto'; valid: gluon_sage, "
                                         r"triton_sage, flashinfer_trtllm_sage"):
        AttentionSpec("auto", SAGE_INT8, kernel="flash")
    assert AttentionSpec("REFERENCE", SAGE_INT8, kernel="reference").kernels() == ("reference",)
