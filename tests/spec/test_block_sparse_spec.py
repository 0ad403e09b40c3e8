"""The spec key ``block_sparse``: its values and their errors, the canonical JSON/YAML round trip, the CLI, and the
policy's decisions (where it applies, which kernel serves it, what is refused and why)."""

from __future__ import annotations

import json
import math

import pytest

from qattn_fx import BlockSparse, recipes
from qattn_fx.cli import main
from qattn_fx.hardware import Hardware
from qattn_fx.policy import Site, resolve
from qattn_fx.recipes import Recipe, SkipSoftmax
from qattn_fx.serving import unmet
from qattn_fx.spec import DENSE, AttentionSpec, Match, Rule, Spec

SAGE = Recipe("int8", "fp8", 1, 16, 1)
SM90 = Hardware.for_arch("sm_90", {"triton": "3.6.0", "flashinfer-python": "0.7.2.post1", "cudnn": "9.19.0"})
CPU = Hardware.for_arch("cpu")


def site(**kwargs) -> Site:
    kwargs.setdefault("module", "blocks.3.attn1")
    kwargs.setdefault("layer", 3)
    kwargs.setdefault("num_layers", 10)
    return Site(name="attn", q_shape=(1, 24, 4096, 128), k_shape=(1, 24, 4096, 128), v_shape=(1, 24, 4096, 128),
                **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# BlockSparse
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(cdf=0.9), dict(cdf=1), dict(top_k=0.25), dict(top_k=1.0), dict(target_sparsity=0.0),
    dict(target_sparsity=0.7), dict(cdf=0.5, sink_tiles=0, diagonal=False, similarity=0),
    dict(top_k=0.5, disabled_until_timestep=0.8), dict(cdf=0.9, similarity=1.0, disabled_until_timestep=0),
])
def test_accepted_values_round_trip(kwargs):
    bs = BlockSparse(**kwargs)
    assert BlockSparse.from_dict(bs.to_dict()) == bs
    assert recipes.BlockSparse is BlockSparse


def test_defaults_and_names():
    bs = BlockSparse(cdf=0.9)
    assert (bs.sink_tiles, bs.diagonal, bs.similarity, bs.disabled_until_timestep) == (1, True, 0.6, None)
    assert (bs.mode, bs.keep, bs.gated) == ("cdf", 0.9, False)
    assert bs.to_dict() == {"cdf": 0.9, "sink_tiles": 1, "diagonal": True, "similarity": 0.6}
    assert bs.describe() == "block-sparse cdf 0.9, sinks 1, diag, sim 0.6"
    assert bs.short_name == "bs cdf 0.9"
    gated = BlockSparse(top_k=0.5, sink_tiles=0, diagonal=False, similarity=0, disabled_until_timestep=0.8)
    assert (gated.mode, gated.keep, gated.gated) == ("top_k", 0.5, True)
    assert gated.describe() == "block-sparse top_k 0.5, sinks 0, no diag, no sim guard, dense while t > 0.8"
    assert gated.short_name == "bs top_k 0.5 t<=0.8"
    target = BlockSparse(target_sparsity=0.6)
    assert (target.keep, target.short_name) == (None, "bs target 0.6")


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "block_sparse needs exactly one of cdf / top_k / target_sparsity (they are mutually exclusive); got "
             "cdf=None, top_k=None, target_sparsity=None"),
    (dict(cdf=0.9, top_k=0.5), "block_sparse needs exactly one of cdf / top_k / target_sparsity (they are mutually "
                               "exclusive); got cdf=0.9, top_k=0.5, target_sparsity=None"),
    (dict(cdf=0), "block_sparse.cdf=0 is out of range; valid: finite, (0.0, 1.0]"),
    (dict(cdf=1.5), "block_sparse.cdf=1.5 is out of range; valid: finite, [0.0, 1.0]"),
    (dict(top_k=0.0), "block_sparse.top_k=0.0 is out of range; valid: finite, (0.0, 1.0]"),
    (dict(top_k=math.nan), "block_sparse.top_k=nan is invalid; valid: a finite number, [0.0, 1.0]"),
    (dict(top_k="0.5"), "block_sparse.top_k='0.5' is invalid; valid: a finite number, [0.0, 1.0]"),
    (dict(target_sparsity=1.0), "block_sparse.target_sparsity=1.0 is out of range; valid: finite, [0.0, 1.0) (1 "
                                "would skip every block)"),
    (dict(target_sparsity=-0.1), "block_sparse.target_sparsity=-0.1 is out of range; valid: finite, [0.0, 1.0]"),
    (dict(cdf=0.9, sink_tiles=-1), "block_sparse.sink_tiles=-1 is invalid; valid: an int >= 0"),
    (dict(cdf=0.9, sink_tiles=1.0), "block_sparse.sink_tiles=1.0 is invalid; valid: an int >= 0"),
    (dict(cdf=0.9, diagonal=1), "block_sparse.diagonal=1 is invalid; valid: true, false"),
    (dict(cdf=0.9, similarity=1.2), "block_sparse.similarity=1.2 is out of range; valid: finite, [0.0, 1.0]"),
    (dict(cdf=0.9, disabled_until_timestep=2), "block_sparse.disabled_until_timestep=2 is out of range; valid: "
                                               "finite, [0.0, 1.0]"),
])
def test_bad_values_name_the_path_the_value_and_the_choices(kwargs, message):
    with pytest.raises(ValueError) as e:
        BlockSparse(**kwargs)
    assert str(e.value) == message


def test_unknown_key_is_named():
    with pytest.raises(ValueError) as e:
        BlockSparse.from_dict({"cdf": 0.9, "topk": 0.5}, where="spec.default.block_sparse")
    assert str(e.value) == ("unknown key(s) ['topk'] in spec.default.block_sparse; valid: ['cdf', "
                            "'diagonal', 'disabled_until_timestep', 'similarity', 'sink_tiles', 'target_sparsity', "
                            "'top_k']")


# ----------------------------------------------------------------------------------------------------------------
# AttentionSpec and the spec
# ----------------------------------------------------------------------------------------------------------------

CANONICAL = {
    "default": {"backend": "auto", "recipe": SAGE.to_dict(),
                "skip_softmax": {"threshold": 0.01},
                "block_sparse": {"cdf": 0.9, "sink_tiles": 1, "diagonal": True, "similarity": 0.6,
                                 "disabled_until_timestep": 0.8}},
    "rules": [
        {"match": {"layers": [0, -1]}, "use": {"backend": "auto", "recipe": SAGE.to_dict()}},
        {"match": {"role": ["cross"]}, "use": "dense"},
        {"match": {"module": "blocks.*.attn1"},
         "use": {"backend": "REFERENCE", "recipe": Recipe("bf16", "fp8", 0, 0, 1).to_dict(),
                 "block_sparse": {"top_k": 0.5, "sink_tiles": 0, "diagonal": False, "similarity": 0.0}}},
    ],
}

CANONICAL_YAML = """
default:
  recipe: {qk_dtype: int8, v_dtype: fp8, q_block_size: 1, k_block_size: 16, v_block_size: 1}
  skip_softmax: {threshold: 0.01}
  block_sparse: {cdf: 0.9, disabled_until_timestep: 0.8}
rules:
  - match: {layers: [0, -1]}        # first and last blocks: quantized, dense blocks
    use: {recipe: {qk_dtype: int8, v_dtype: fp8, q_block_size: 1, k_block_size: 16, v_block_size: 1}}
  - match: {role: cross}
    use: dense
  - match: {module: "blocks.*.attn1"}
    use:
      backend: REFERENCE
      recipe: {qk_dtype: bf16, v_dtype: fp8, v_block_size: 1}
      block_sparse: {top_k: 0.5, sink_tiles: 0, diagonal: false, similarity: 0}
"""


def test_canonical_json_and_yaml_round_trip():
    spec = Spec.from_dict(CANONICAL)
    assert spec.to_dict() == CANONICAL
    assert Spec.from_json(spec.to_json()) == spec
    assert Spec.from_yaml(CANONICAL_YAML).to_dict() == CANONICAL
    assert spec.default.block_sparse == BlockSparse(cdf=0.9, disabled_until_timestep=0.8)
    assert spec.default.describe() == ("int8 Q/K 1/16, fp8 V per-channel, smooth K, skip-softmax λ=0.01, block-sparse "
                                       "cdf 0.9, sinks 1, diag, sim 0.6, dense while t > 0.8 via auto")
    assert "block_sparse" not in Spec().to_dict()["default"]  # not asked: not written


def test_rules_compose_first_and_last_layers_dense_blocks():
    spec = Spec.from_dict(CANONICAL)
    first = resolve(site(layer=0), CPU, spec, emulate=True)
    middle = resolve(site(layer=4, module="blocks.4.attn2"), CPU, spec, emulate=True)
    last = resolve(site(layer=9), CPU, spec, emulate=True)
    attn1 = resolve(site(layer=4), CPU, spec, emulate=True)
    cross = resolve(site(layer=4, role="cross", module="blocks.4.attn2"), CPU, spec, emulate=True)
    assert first.quantized and first.block_sparse is None and last.block_sparse is None
    assert middle.block_sparse == BlockSparse(cdf=0.9, disabled_until_timestep=0.8)
    assert middle.skip_softmax == SkipSoftmax(threshold=0.01)
    assert attn1.block_sparse == BlockSparse(top_k=0.5, sink_tiles=0, diagonal=False, similarity=0)
    assert not cross.quantized


@pytest.mark.parametrize("data, message", [
    ({"default": {"backend": "CUDNN", "recipe": {"qk_dtype": "fp8", "v_dtype": "fp8"}, "block_sparse": {"cdf": 0.9}}},
     f"spec.default.block_sparse is not accepted for backend='CUDNN'; valid: "
     f"{', '.join(recipes.block_sparse_backends())} (backends with a kernel that visits block lists: "
     f"{recipes.kernels.names_with('block_sparse')})"),
    ({"default": {"backend": "CUDNN", "recipe": {"qk_dtype": "mxfp8", "v_dtype": "mxfp8"},
                  "block_sparse": {"cdf": 0.9}}},
     "spec.default.block_sparse is not accepted with recipe 'mxfp8 Q/K, mxfp8 V, smooth K' (block_scaled family); "
     "valid: recipes of the scaled family (int8/fp8/bf16 Q/K, fp8 V)"),
    ({"default": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"threshold": 0.1},
                  "block_sparse": {"cdf": 0.9}}},
     "spec.default.block_sparse is invalid with spec.default.recipe=None (bf16 attention with skip_softmax has no "
     "block lists); valid: a recipe of the scaled family (int8/fp8/bf16 Q/K, fp8 V), e.g. {qk_dtype: bf16, v_dtype: "
     "fp8}"),
    ({"default": {"block_sparse": 0.9}},
     "spec.default.block_sparse=0.9 is invalid; valid: a block_sparse mapping, or null"),
    ({"rules": [{"match": {}, "use": {"block_sparse": {"cdf": 2}}}]},
     "spec.rules[0].use.block_sparse.cdf=2 is out of range; valid: finite, [0.0, 1.0]"),
    ({"default": {"blocksparse": {"cdf": 0.9}}},
     "unknown key(s) ['blocksparse'] in spec.default; valid: ['backend', 'block_sparse', 'kernel', 'recipe', "
     "'skip_softmax']"),
])
def test_spec_errors_name_the_path(data, message):
    with pytest.raises(ValueError) as e:
        Spec.from_dict(data)
    assert str(e.value) == message


def test_block_sparse_backends_follow_the_table():
    with_lists = {r.backend for r in recipes.TABLE if any(i.block_sparse for i in r.implementations)}
    assert set(recipes.block_sparse_backends()) == with_lists | {"auto", "REFERENCE"}


def test_cli_resolve_reads_it_from_a_spec_file(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(CANONICAL_YAML)
    assert main(["resolve", "--spec", str(path), "--emulate", "--q", "1,2,512,64", "--module", "blocks.4.attn2",
                 "--layer", "4", "--num-layers", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantized"] and out["kernel"] == "reference"
    assert out["block_sparse"] == CANONICAL["default"]["block_sparse"]
    assert "block-sparse cdf 0.9, sinks 1, diag, sim 0.6, dense while t > 0.8" in out["reason"]
    assert main(["resolve", "--spec", str(path), "--emulate", "--q", "1,2,512,64", "--layer", "0",
                 "--num-layers", "10"]) == 0
    assert "block_sparse" not in json.loads(capsys.readouterr().out)


# ----------------------------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------------------------


def spec(backend="auto", recipe=SAGE, **kwargs) -> Spec:
    return Spec(default=AttentionSpec(backend, recipe, **kwargs))


def test_emulated_sites_carry_it_and_say_what_deployment_lacks():
    bs = BlockSparse(cdf=0.9)
    d = resolve(site(), CPU, spec(block_sparse=bs), emulate=True)
    assert d.quantized and d.kernel == "reference" and d.block_sparse == bs
    assert d.reason == ("quantized (emulated): int8 Q/K 1/16, fp8 V per-channel, smooth K, block-sparse cdf 0.9, "
                        "sinks 1, diag, sim 0.6 on reference (cpu)")
    assert str(d.deployment) == (
        "on sm_90: gluon_sage (no prediction: bs cdf 0.9 visits a data-dependent share of blocks (qattn_fx.calibrate "
        "measures it)); on sm_100: dense (TRTLLM, TRTLLM_ATTN: no block sparsity (kernels with it: reference, "
        "triton_sage, gluon_sage))")
    ref = resolve(site(), CPU, spec("REFERENCE", block_sparse=bs))
    assert ref.quantized and ref.block_sparse == bs


def test_auto_applies_it_only_where_asked():
    plain = resolve(site(), CPU, spec(), emulate=True)
    assert plain.quantized and plain.block_sparse is None
    rules = Spec(default=AttentionSpec(recipe=SAGE),
                 rules=(Rule(Match(layers=(3,)), AttentionSpec(recipe=SAGE, block_sparse=BlockSparse(top_k=0.5))),))
    assert resolve(site(layer=3), CPU, rules, emulate=True).block_sparse == BlockSparse(top_k=0.5)
    assert resolve(site(layer=4), CPU, rules, emulate=True).block_sparse is None
    assert resolve(site(layer=4), SM90, rules).block_sparse is None


def test_auto_picks_a_kernel_with_the_ability_and_keeps_dense_where_none_has_it():
    bs = BlockSparse(cdf=0.9)
    d = resolve(site(), SM90, spec(block_sparse=bs))
    assert d.quantized and d.block_sparse == bs and d.kernel == "gluon_sage"
    blackwell = Hardware.supported_install("sm_100")  # its Sage kernels (trtllm-gen) take no block lists
    d = resolve(site(), blackwell, spec(block_sparse=bs))
    assert not d.quantized and d.block_sparse is None
    assert "no block sparsity (kernels with it: reference, triton_sage, gluon_sage)" in d.reason


def test_the_cost_rule_weighs_the_blocks_top_k_visits():
    """At a shape where the dense kernel is predicted slower than cuDNN bf16, top_k 0.25 is predicted faster (the
    measured time of block-sparse calls at a quarter of the blocks, :mod:`qattn_fx.sparse_cost`), top_k 1 is not
    (the predictor and the listed launch add to a dense run), and cdf predicts nothing (its share of blocks depends
    on the data)."""
    from qattn_fx import sparse_cost
    from qattn_fx.cost_rule import cost_rule

    dense_kernel, said = cost_rule("gluon_sage", site(), SM90)
    assert dense_kernel, "the shape must be one the cost data keep dense"
    speedup = float(said.split(" predicted ")[1].split("x")[0])
    time = sparse_cost.sparse_time("gluon_sage", "sm_90", kv_len=4096, head_dim=128, gpu=SM90.gpu)
    assert time.data != sparse_cost.UNMEASURED.data
    assert resolve(site(), SM90, spec(block_sparse=BlockSparse(top_k=0.25))).quantized
    full = resolve(site(), SM90, spec(block_sparse=BlockSparse(top_k=1.0)))
    assert not full.quantized
    bound = "at most " if time.lower_bound else ""  # (4096 keys: below the measured lengths, the line held)
    assert f"gluon_sage with bs top_k 1 predicted {bound}{speedup / time.ratio(1.0):.2f}x" in full.reason
    assert f"block-sparse: {time.data})" in full.reason
    assert cost_rule("gluon_sage", site(), SM90, BlockSparse(cdf=0.9)) == (
        False, "no prediction: bs cdf 0.9 visits a data-dependent share of blocks (qattn_fx.calibrate measures it)")


def test_a_backend_without_block_lists_is_refused_naming_those_with_them():
    with pytest.raises(ValueError, match=r"^block_sparse is not accepted for backend='CUDNN'; valid: TRITON, auto, "
                                         r"REFERENCE \(backends with a kernel that visits block lists: reference, "
                                         r"triton_sage, gluon_sage\)"):
        spec("CUDNN", recipe=Recipe("fp8", "fp8", 0, 0, 0), block_sparse=BlockSparse(cdf=0.9))


def test_target_sparsity_needs_a_calibration():
    with pytest.raises(ValueError) as e:
        resolve(site(), CPU, spec(block_sparse=BlockSparse(target_sparsity=0.6)), emulate=True)
    assert str(e.value) == (
        "default asks for block_sparse.target_sparsity=0.6, which needs a calibration that turns it into a cdf or "
        "top_k per site: run qattn_fx.calibrate_block_sparse(model, calls, target_sparsity=...) and compile with the "
        "spec it returns, or give block_sparse.cdf (the predicted attention mass to keep, e.g. 0.9) or "
        "block_sparse.top_k (the fraction of key tiles to keep)")


def test_lse_sites_are_refused_with_the_reason():
    bs = BlockSparse(cdf=0.9)
    ring = site(lse=True)
    d = resolve(ring, CPU, spec(block_sparse=bs), emulate=True)
    assert not d.quantized and d.reason == ("dense: reference: no block sparsity with LSE (the call's log-sum-exp, "
                                            "which ring attention merges by)")
    with pytest.raises(ValueError) as e:
        resolve(ring, CPU, spec("REFERENCE", block_sparse=bs))
    assert str(e.value) == (
        "default asks for int8 Q/K 1/16, fp8 V per-channel, smooth K, block-sparse cdf 0.9, sinks 1, diag, sim 0.6 via "
        "REFERENCE but site 'attn' (blocks.3.attn1) also returns its log-sum-exp (ring attention merges partial "
        "results by it), which block sparsity does not serve; give the site a rule without block_sparse (match its "
        "module), or use backend='auto' to keep it dense")
    assert unmet(recipes.REFERENCE_REQUIREMENTS, ring, CPU, AttentionSpec(recipe=SAGE)) is None


def test_dense_rules_stay_dense():
    s = Spec(default=AttentionSpec(recipe=SAGE, block_sparse=BlockSparse(cdf=0.9)),
             rules=(Rule(Match(layers=(0,)), DENSE),))
    assert not resolve(site(layer=0), CPU, s, emulate=True).quantized
