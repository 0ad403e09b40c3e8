"""Spec parsing: canonical form round trips, TensorRT-LLM and vLLM-Omni seed formats, unknown keys, layers."""

from __future__ import annotations

import json
import warnings

import pytest

from qattn_fx.recipes import Recipe, SkipSoftmax
from qattn_fx.spec import (DEFAULT_RECIPE, DENSE, AttentionSpec, Match, Rule, Spec, SpecWarning, dense_spec,
                            layer_selected)

RECIPE_KEYS = "['k_block_size', 'q_block_size', 'qk_dtype', 'scale_scope', 'smooth_k', 'v_block_size', 'v_dtype']"
MATCH_KEYS = "['head_dim', 'layers', 'min_kv_len', 'min_q_len', 'module', 'role']"

CANONICAL = {
    "default": {
        "backend": "auto",
        "recipe": {"qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": 1, "k_block_size": 4, "v_block_size": 1,
                   "smooth_k": True, "scale_scope": "tensor"},
    },
    "rules": [
        {"match": {"role": ["cross"]}, "use": "dense"},
        {"match": {"module": "transformer_blocks.*.attn1", "layers": [0, -1, "2:5", "-4:", ":1"]}, "use": "dense"},
        {"match": {"role": ["self", "joint"], "head_dim": [64, 128], "min_q_len": 1024, "min_kv_len": 256},
         "use": {"backend": "CUDNN",
                 "recipe": {"qk_dtype": "fp8", "v_dtype": "fp8", "q_block_size": 0, "k_block_size": 0,
                            "v_block_size": 0, "smooth_k": False, "scale_scope": "tensor"}}},
        {"match": {"layers": [3]},
         "use": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"target_sparsity": 0.5}}},
        {"match": {},
         "use": {"backend": "FLASHINFER",
                 "recipe": {"qk_dtype": "fp8", "v_dtype": "fp8", "q_block_size": 0, "k_block_size": 0,
                            "v_block_size": 0, "smooth_k": True, "scale_scope": "head"}}},
    ],
}


# ----------------------------------------------------------------------------------------------------------------
# Canonical form
# ----------------------------------------------------------------------------------------------------------------


def test_canonical_round_trip_is_exact():
    spec = Spec.from_dict(CANONICAL)
    assert spec.to_dict() == CANONICAL
    again = Spec.from_dict(spec.to_dict())
    assert again == spec
    assert Spec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json(indent=2)) == CANONICAL


def test_canonical_parses_into_the_right_objects():
    spec = Spec.from_dict(CANONICAL)
    assert spec.default == AttentionSpec("auto", Recipe("int8", "fp8", 1, 4, 1, smooth_k=True))
    r0, r1, r2, r3, r4 = spec.rules
    assert r0 == Rule(Match(role="cross"), DENSE)
    assert r0.match.role == ("cross",)
    assert r1.match.module == "transformer_blocks.*.attn1"
    assert r1.match.layers == (0, -1, "2:5", "-4:", ":1")
    assert r2.match.head_dim == (64, 128) and r2.match.min_q_len == 1024 and r2.match.min_kv_len == 256
    assert r2.use.backend == "CUDNN" and r2.use.recipe == Recipe("fp8", "fp8", smooth_k=False)
    assert r3.use == AttentionSpec("TRTLLM_ATTN", None, SkipSoftmax(target_sparsity=0.5))
    assert r4.match == Match() and r4.match.describe() == "any site"
    assert r4.use.recipe.scale_scope == "head"


def test_defaults_and_dense():
    assert Spec().default == AttentionSpec() == AttentionSpec("auto", DEFAULT_RECIPE)
    assert DEFAULT_RECIPE == Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)
    assert Spec.from_dict({}) == Spec()
    assert Spec.from_dict({"default": "dense"}) == dense_spec() == Spec(default=DENSE)
    assert dense_spec().to_dict() == {"default": "dense", "rules": []}
    # a default given as a mapping without a recipe uses the default recipe
    assert Spec.from_dict({"default": {"backend": "TRITON"}}).default == AttentionSpec("TRITON", DEFAULT_RECIPE)
    # objects are accepted as well as mappings
    assert Spec(default={"backend": "auto"}, rules=[{"match": {"role": "cross"}, "use": "dense"}]).rules == (
        Rule(Match(role=("cross",)), "dense"),
    )


def test_layer_items_normalised_and_described():
    m = Match(layers=[" 2 : 5", 0, "-2:"], role="self")
    assert m.layers == ("2:5", 0, "-2:")
    assert m.describe() == "role=self, layers=2:5,0,-2:"
    assert Match(layers=3).layers == (3,)
    assert Match(layers="1:").layers == ("1:",)
    assert Match(head_dim=128).head_dim == (128,)


@pytest.mark.parametrize("item", [True, 1.5, "1:2:3", "a:b", "1", "x:", None])
def test_bad_layer_items(item):
    with pytest.raises(ValueError) as e:
        Match(layers=[item])
    assert str(e.value) == (
        f"match.layers: layer {item!r} is invalid; valid: an int or a slice string like '2:5' or '-4:'"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(role="text"), "match.role='text' is invalid; valid: self, cross, joint"),
        (dict(role=["self", "video"]), "match.role='video' is invalid; valid: self, cross, joint"),
        (dict(min_q_len=-1), "match.min_q_len=-1 is invalid; valid: an int >= 0"),
        (dict(min_kv_len=True), "match.min_kv_len=True is invalid; valid: an int >= 0"),
        (dict(min_kv_len=2.0), "match.min_kv_len=2.0 is invalid; valid: an int >= 0"),
        (dict(module=3), "match.module=3 is invalid; valid: a glob string like 'blocks.*.attn1'"),
    ],
)
def test_bad_match_fields(kwargs, message):
    with pytest.raises(ValueError) as e:
        Match(**kwargs)
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------

CANONICAL_YAML = """\
default:
  backend: auto
  recipe: {qk_dtype: int8, v_dtype: fp8, q_block_size: 1, k_block_size: 4, v_block_size: 1,
           smooth_k: true, scale_scope: tensor}
rules:
  - match: {role: [cross]}
    use: dense
  - match: {module: "transformer_blocks.*.attn1", layers: [0, -1, "2:5", "-4:", ":1"]}
    use: dense
  - match: {role: [self, joint], head_dim: [64, 128], min_q_len: 1024, min_kv_len: 256}
    use:
      backend: CUDNN
      recipe: {qk_dtype: fp8, v_dtype: fp8, q_block_size: 0, k_block_size: 0, v_block_size: 0,
               smooth_k: false, scale_scope: tensor}
  - match: {layers: [3]}
    use: {backend: TRTLLM_ATTN, recipe: null, skip_softmax: {target_sparsity: 0.5}}
  - match: {}
    use:
      backend: FLASHINFER
      recipe: {qk_dtype: fp8, v_dtype: fp8, q_block_size: 0, k_block_size: 0, v_block_size: 0,
               smooth_k: true, scale_scope: head}
"""


def test_from_yaml_and_json_agree():
    assert Spec.from_yaml(CANONICAL_YAML).to_dict() == CANONICAL
    assert Spec.from_json(json.dumps(CANONICAL)).to_dict() == CANONICAL


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_from_file(tmp_path, suffix):
    path = tmp_path / f"spec{suffix}"
    path.write_text(json.dumps(CANONICAL) if suffix == ".json" else CANONICAL_YAML)
    assert Spec.from_file(path).to_dict() == CANONICAL
    assert Spec.from_file(str(path)).to_dict() == CANONICAL


def test_from_file_seed_formats(tmp_path):
    (tmp_path / "trt.yaml").write_text(VISUALGEN_YAML["TRTLLM int8"])
    (tmp_path / "vllm.json").write_text(VLLM_SAGE_JSON)
    assert Spec.from_file(tmp_path / "trt.yaml").default == AttentionSpec("TRTLLM", Recipe("int8", "fp8", 1, 16, 1))
    assert Spec.from_file(tmp_path / "vllm.json").default == AttentionSpec(
        "TRTLLM_ATTN", Recipe("fp8", "fp8", 1, 16, 1, smooth_k=True))


def test_from_json_invalid_top_level():
    with pytest.raises(ValueError, match=r"^a spec must be a mapping; got list$"):
        Spec.from_json("[1, 2]")


# ----------------------------------------------------------------------------------------------------------------
# TensorRT-LLM VisualGen attention_config (YAML examples of the seed document, verbatim)
# ----------------------------------------------------------------------------------------------------------------

VISUALGEN_YAML = {
    "CUTEDSL bf16": """\
attention_config:
  backend: CUTEDSL
  quant_attention_config:
    qk_dtype: bf16
    v_dtype: fp8
    q_block_size: 0
    k_block_size: 0
    v_block_size: 0
""",
    "TRTLLM int8": """\
attention_config:
  backend: TRTLLM
  quant_attention_config:
    qk_dtype: int8
    v_dtype: fp8
    q_block_size: 1
    k_block_size: 16
    v_block_size: 1
""",
    "CUDNN mxfp8": """\
attention_config:
  backend: CUDNN
  quant_attention_config:
    qk_dtype: mxfp8
    v_dtype: mxfp8
    q_block_size: 0
    k_block_size: 0
    v_block_size: 0
""",
    "CUTEDSL mxfp8": """\
attention_config:
  backend: CUTEDSL
  quant_attention_config:
    qk_dtype: mxfp8
    v_dtype: fp8
    q_block_size: 0
    k_block_size: 0
    v_block_size: 1
""",
    "FLASHINFER nvfp4": """\
attention_config:
  backend: FLASHINFER
  quant_attention_config:
    qk_dtype: nvfp4
    v_dtype: nvfp4
    q_block_size: 0
    k_block_size: 0
    v_block_size: 0
""",
}
VISUALGEN_EXPECTED = {
    "CUTEDSL bf16": AttentionSpec("CUTEDSL", Recipe("bf16", "fp8", 0, 0, 0, smooth_k=False)),
    "TRTLLM int8": AttentionSpec("TRTLLM", Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)),
    "CUDNN mxfp8": AttentionSpec("CUDNN", Recipe("mxfp8", "mxfp8", 0, 0, 0, smooth_k=True)),
    "CUTEDSL mxfp8": AttentionSpec("CUTEDSL", Recipe("mxfp8", "fp8", 0, 0, 1, smooth_k=True)),
    "FLASHINFER nvfp4": AttentionSpec("FLASHINFER", Recipe("nvfp4", "nvfp4", 0, 0, 0, smooth_k=True)),
}


@pytest.mark.parametrize("name", list(VISUALGEN_YAML))
def test_visualgen_yaml_examples_verbatim(name):
    spec = Spec.from_yaml(VISUALGEN_YAML[name])
    assert spec.default == VISUALGEN_EXPECTED[name]
    assert spec.rules == ()
    # the same config without the attention_config wrapper
    import yaml

    bare = yaml.safe_load(VISUALGEN_YAML[name])["attention_config"]
    assert Spec.from_dict(bare) == spec
    # and the canonical form of the result round-trips
    assert Spec.from_dict(spec.to_dict()) == spec


def test_visualgen_defaults_fill_missing_fields():
    # VisualGen's defaults: qk_dtype bf16, v_dtype fp8, block sizes 0.
    spec = Spec.from_dict({"backend": "CUDNN", "quant_attention_config": {"qk_dtype": "fp8"}})
    assert spec.default == AttentionSpec("CUDNN", Recipe("fp8", "fp8", 0, 0, 0))
    spec = Spec.from_dict({"backend": "CUTEDSL", "quant_attention_config": {}})
    assert spec.default == AttentionSpec("CUTEDSL", Recipe("bf16", "fp8", 0, 0, 0, smooth_k=False))


@pytest.mark.parametrize("backend", ["TRTLLM", "CUDNN", "CUTEDSL", "FLASHINFER"])
def test_visualgen_without_quant_config_is_dense(backend):
    assert Spec.from_dict({"attention_config": {"backend": backend}}) == dense_spec()
    assert Spec.from_dict({"backend": backend}) == dense_spec()
    assert Spec.from_yaml(f"attention_config:\n  backend: {backend}\n") == dense_spec()
    assert Spec.from_dict({"backend": backend, "quant_attention_config": None}) == dense_spec()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"attention_config": {"backend": "TRTLLM"}, "model": "x"},
         "unknown key(s) ['model'] in spec; valid: ['attention_config']"),
        ({"attention_config": {"backend": "TRTLLM", "sparse": True}},
         "unknown key(s) ['sparse'] in attention_config; valid: ['backend', 'quant_attention_config']"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "int8", "smooth_k": True}},
         "unknown key(s) ['smooth_k'] in attention_config.quant_attention_config; valid: ['k_block_size', "
         "'q_block_size', 'qk_dtype', 'v_block_size', 'v_dtype']"),
        ({"backend": "TRITON", "quant_attention_config": {"qk_dtype": "int8"}},
         "attention_config.backend='TRITON' is invalid; valid: TRTLLM, CUDNN, CUTEDSL, FLASHINFER"),
        ({"attention_config": {"quant_attention_config": {"qk_dtype": "int8"}}},
         "attention_config.backend=None is invalid; valid: TRTLLM, CUDNN, CUTEDSL, FLASHINFER"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "fp8", "v_dtype": "fp8", "q_block_size": 1,
                                                          "k_block_size": 16, "v_block_size": 1}},
         "k_block_size=16 is not accepted for TRTLLM fp8 Q/K; valid: (1,1,1), (1,4,1)"),
        ({"backend": "CUDNN", "quant_attention_config": {"qk_dtype": "nvfp4", "v_dtype": "fp8"}},
         "qk_dtype='nvfp4' is not accepted for CUDNN; valid: fp8, mxfp8"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "int8", "q_block_size": -1}},
         "q_block_size=-1 is invalid; valid: an int >= 0"),
    ],
)
def test_visualgen_errors(data, message):
    with pytest.raises(ValueError) as e:
        Spec.from_dict(data)
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------------------------
# vLLM-Omni --diffusion-attention-config (the two JSON examples of the TRTLLM_ATTN document, verbatim)
# ----------------------------------------------------------------------------------------------------------------

# The document breaks the CLI string over lines with a shell continuation; the JSON is the joined text.
VLLM_SKIP_JSON = ('{"default":{"backend":"TRTLLM_ATTN",'
                  '"skip_softmax":{"target_sparsity":0.65,"disabled_until_timestep":0.86}}}')
VLLM_SAGE_JSON = ('{"default":{"backend":"TRTLLM_ATTN",'
                  '"quant":{"dtype_qk":"fp8_e4m3","q_block_size":1,"k_block_size":16}}}')


def test_vllm_skip_softmax_example():
    spec = Spec.from_json(VLLM_SKIP_JSON)
    assert spec.default == AttentionSpec(
        "TRTLLM_ATTN", None, SkipSoftmax(target_sparsity=0.65, disabled_until_timestep=0.86)
    )
    assert spec.rules == ()
    assert spec.to_dict() == {
        "default": {"backend": "TRTLLM_ATTN", "recipe": None,
                    "skip_softmax": {"target_sparsity": 0.65, "disabled_until_timestep": 0.86}},
        "rules": [],
    }
    assert Spec.from_dict(spec.to_dict()) == spec
    assert spec.default.describe() == "bf16, skip-softmax via TRTLLM_ATTN"


def test_vllm_sage_example():
    spec = Spec.from_json(VLLM_SAGE_JSON)
    # V is always per-channel FP8 and K-smoothing is internal
    assert spec.default == AttentionSpec("TRTLLM_ATTN", Recipe("fp8", "fp8", 1, 16, 1, smooth_k=True))
    assert Spec.from_dict(spec.to_dict()) == spec


def test_vllm_quant_defaults_and_dtype_names():
    spec = Spec.from_dict({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8"}}})
    assert spec.default.recipe == Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)  # q default 1, k default 16
    spec = Spec.from_dict({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "q_block_size": 16,
                                                                           "k_block_size": 4},
                                       "skip_softmax": {"threshold": 2.5}}})
    assert spec.default == AttentionSpec("TRTLLM_ATTN", Recipe("int8", "fp8", 16, 4, 1), SkipSoftmax(threshold=2.5))


@pytest.mark.parametrize("entry", ["TRTLLM_ATTN", {"backend": "TRTLLM_ATTN"}, {"backend": "TRTLLM_ATTN", "quant": {}},
                                   {"backend": "TRTLLM_ATTN", "quant": None}])
def test_vllm_trtllm_attn_without_quant_is_dense(entry):
    if not isinstance(entry, dict) or "quant" in entry:  # unmistakably vLLM-Omni: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert Spec.from_dict({"default": entry}) == dense_spec()
        return
    # {"backend": "TRTLLM_ATTN"} could also be meant canonically (default recipe): read as vLLM-Omni, said aloud
    with pytest.warns(SpecWarning, match=r"read as a vLLM-Omni entry: TRTLLM_ATTN without quant is dense BF16"):
        assert Spec.from_dict({"default": entry}) == dense_spec()


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "FLASH_ATTN", "CUDNN_ATTN", "FLASHINFER_ATTN"])
def test_vllm_dense_backends(backend):
    assert Spec.from_dict({"default": backend}) == dense_spec()
    assert Spec.from_dict({"default": {"backend": backend}}) == dense_spec()
    with pytest.raises(ValueError) as e:
        Spec.from_dict({"default": {"backend": backend, "quant": {"dtype_qk": "fp8_e4m3"}}})
    assert str(e.value) == f"default: quant/skip_softmax are not accepted for {backend}; valid: TRTLLM_ATTN"


def test_vllm_per_role_strings_and_dicts():
    spec = Spec.from_dict({
        "default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "q_block_size": 1, "k_block_size": 4}},
        "per_role": {
            "cross": "TORCH_SDPA",
            "joint": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.1}},
            "self": {"backend": "FLASH_ATTN"},
        },
    })
    assert spec.default == AttentionSpec("TRTLLM_ATTN", Recipe("int8", "fp8", 1, 4, 1))
    assert spec.rules == (
        Rule(Match(role=("cross",)), DENSE),
        Rule(Match(role=("joint",)), AttentionSpec("TRTLLM_ATTN", None, SkipSoftmax(threshold=0.1))),
        Rule(Match(role=("self",)), DENSE),
    )
    assert Spec.from_dict(spec.to_dict()) == spec
    # per_role alone: default dense
    assert Spec.from_dict({"per_role": {"cross": "TRTLLM_ATTN"}}) == Spec(DENSE, (Rule(Match(role="cross"), DENSE),))
    assert Spec.from_dict({"default": "FLASH_ATTN", "per_role": {}}) == dense_spec()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"default": "TRTLLM_ATTN", "rules": []},
         "unknown key(s) ['rules'] in diffusion attention config; valid: ['default', 'per_role']"),
        ({"default": {"backend": "TRTLLM_ATTN", "quantization": {}}},
         "unknown key(s) ['quantization'] in default; valid: ['backend', 'quant', 'skip_softmax']"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "v_block_size": 1}}},
         "unknown key(s) ['v_block_size'] in default.quant; valid: ['dtype_qk', 'k_block_size', 'q_block_size']"),
        ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 0.6, "sparsity": 1}}},
         "unknown key(s) ['sparsity'] in default.skip_softmax; valid: ['disabled_until_timestep', "
         "'target_sparsity', 'threshold']"),
        ({"per_role": {"cross": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8"}, "extra": 1}}},
         "unknown key(s) ['extra'] in per_role['cross']; valid: ['backend', 'quant', 'skip_softmax']"),
        ({"per_role": {"text": "TORCH_SDPA"}}, "per_role role='text' is invalid; valid: self, cross, joint"),
        ({"per_role": ["cross"]}, "per_role must be a mapping of role to entry; got list"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "fp8"}}},
         "default.quant.dtype_qk='fp8' is invalid; valid: int8, fp8_e4m3"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"q_block_size": 4}}},
         "default.quant has block sizes but no dtype_qk (absent dtype_qk means dense)"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "k_block_size": 32}}},
         "k_block_size=32 is not accepted for TRTLLM_ATTN int8 Q/K; valid: q 1, 4, 16; k 1, 4, 16; v 1"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "q_block_size": 2}}},
         "q_block_size=2 is not accepted for TRTLLM_ATTN fp8 Q/K; valid: q 1, 4, 16; k 1, 4, 16; v 1"),
        ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 1.5}}},
         "skip_softmax.target_sparsity=1.5 is out of range; valid: finite, [0.0, 1.0]"),
        ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 0.5, "threshold": 1}}},
         "skip_softmax needs exactly one of target_sparsity / threshold (they are mutually exclusive); got "
         "target_sparsity=0.5, threshold=1"),
        ({"default": "XFORMERS"},
         "default.backend='XFORMERS' is invalid; valid: TORCH_SDPA, FLASH_ATTN, CUDNN_ATTN, FLASHINFER_ATTN, "
         "TRTLLM_ATTN"),
    ],
)
def test_vllm_errors(data, message):
    with pytest.raises(ValueError) as e:
        Spec.from_dict(data)
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------------------------
# Unknown keys in the canonical form, at every level
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        ({"default": "dense", "rule": []}, "unknown key(s) ['rule'] in spec; valid: ['default', 'rules']"),
        ({"default": {"backend": "auto", "recipes": {}}},
         "unknown key(s) ['recipes'] in spec.default; valid: ['backend', 'kernel', 'recipe', 'skip_softmax']"),
        ({"default": {"backend": "auto", "recipe": {"qk_dtype": "int8", "kblock": 4}}},
         f"unknown key(s) ['kblock'] in spec.default.recipe; valid: {RECIPE_KEYS}"),
        ({"default": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"thresh": 1}}},
         "unknown key(s) ['thresh'] in spec.default.skip_softmax; valid: ['disabled_until_timestep', "
         "'target_sparsity', 'threshold']"),
        ({"rules": [{"match": {}, "use": "dense", "when": 1}]},
         "unknown key(s) ['when'] in spec.rules[0]; valid: ['match', 'use']"),
        ({"rules": [{"match": {"role": "cross"}, "use": "dense"}, {"match": {"layer": 1}, "use": "dense"}]},
         f"unknown key(s) ['layer'] in spec.rules[1].match; valid: {MATCH_KEYS}"),
        ({"rules": [{"match": {}, "use": {"backend": "auto", "recipe": {"qk_dtype": "int8", "foo": 1, "bar": 2}}}]},
         f"unknown key(s) ['bar', 'foo'] in spec.rules[0].use.recipe; valid: {RECIPE_KEYS}"),
        ({"rules": [{"match": {}, "use": {"backend": "auto", "skipsoftmax": {}}}]},
         "unknown key(s) ['skipsoftmax'] in spec.rules[0].use; valid: ['backend', 'kernel', 'recipe', 'skip_softmax']"),
        ({"rules": [{"match": {"role": "cross"}}]}, "spec.rules[0] needs 'use' (\"dense\" or an attention spec)"),
        ({"rules": [{"match": {}, "use": "sparse"}]},
         "spec.rules[0].use='sparse' is invalid; valid: \"dense\" or an attention spec mapping"),
        ({"rules": {"match": {}}}, "spec.rules must be a list; got dict"),
        ({"rules": [{"match": [], "use": "dense"}]}, "spec.rules[0].match must be a mapping, got list: []"),
        ({"default": {"backend": "CUDNN", "recipe": {"qk_dtype": "int8", "v_dtype": "fp8"}}},
         "qk_dtype='int8' is not accepted for CUDNN; valid: fp8, mxfp8"),
        ({"default": {"backend": "CUDNN", "recipe": None}},
         "an attention spec without a recipe needs skip_softmax; use \"dense\" for dense"),
        ({"default": {"backend": "CUDNN", "recipe": {"qk_dtype": "fp8"}, "skip_softmax": {"threshold": 1}}},
         "skip_softmax is not accepted for backend='CUDNN'; valid: TRTLLM_ATTN, auto"),
        ({"default": {"backend": "auto", "recipe": None, "skip_softmax": {"threshold": 1}}},
         "backend='auto' is invalid; valid: TRTLLM_ATTN"),
    ],
)
def test_canonical_errors(data, message):
    with pytest.raises(ValueError) as e:
        Spec.from_dict(data)
    assert str(e.value) == message


def test_auto_with_skip_softmax_is_accepted():
    spec = Spec.from_dict({"default": {"backend": "auto", "skip_softmax": {"threshold": 0.2}}})
    assert spec.default == AttentionSpec("auto", DEFAULT_RECIPE, SkipSoftmax(threshold=0.2))


# ----------------------------------------------------------------------------------------------------------------
# layer_selected
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "items, num_layers, selected",
    [
        ((0,), 10, {0}),
        ((0, 3), None, {0, 3}),
        ((-1,), 10, {9}),
        ((-1, -2), 10, {8, 9}),
        ((-11,), 10, set()),  # out of range: nothing
        ((12,), 10, set()),
        ((-1,), None, set()),  # negative needs the layer count
        (("2:5",), 10, {2, 3, 4}),
        (("2:5",), None, {2, 3, 4}),
        ((":3",), 10, {0, 1, 2}),
        ((":3",), None, {0, 1, 2}),
        (("7:",), 10, {7, 8, 9}),
        (("7:",), None, set()),  # open at the end needs the layer count
        (("-3:",), 10, {7, 8, 9}),
        (("-3:",), None, set()),
        (("1:-1",), 5, {1, 2, 3}),
        (("1:-1",), None, set()),
        (("5:2",), 10, set()),
        ((":",), 4, {0, 1, 2, 3}),
        ((0, "-2:", "4:6"), 10, {0, 4, 5, 8, 9}),
        ((), 10, set()),
    ],
)
def test_layer_selected(items, num_layers, selected):
    layers = range(num_layers if num_layers is not None else 12)
    assert {layer for layer in layers if layer_selected(items, layer, num_layers)} == selected


def test_pinned_kernel_round_trips_and_is_described():
    use = AttentionSpec("TRITON", Recipe("int8", "fp8", 1, 16, 1), kernel="triton_sage")
    data = Spec(default=use).to_dict()
    assert data["default"]["kernel"] == "triton_sage"
    assert Spec.from_dict(data).default == use
    assert use.describe() == "int8 Q/K 1/16, fp8 V per-channel, smooth K via TRITON (kernel triton_sage)"
    assert "kernel" not in AttentionSpec().to_dict()  # absent unless pinned: existing specs print as before
