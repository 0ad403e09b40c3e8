"""Spec parsing: canonical form round trips, TensorRT-LLM and vLLM-Omni seed formats, unknown keys, layers."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

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
        f"match.layers[0]={item!r} is invalid; valid: an int or a slice string like '2:5' or '-4:'"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(role="text"), "match.role='text' is invalid; valid: self, cross, joint"),
        (dict(role=["self", "video"]), "match.role[1]='video' is invalid; valid: self, cross, joint"),
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


def test_missing_or_unreadable_spec_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^no such spec file: 'no/such/spec\.json'$"):
        Spec.from_file("no/such/spec.json")
    with pytest.raises(ValueError, match=r"^spec path '' is empty; "):
        Spec.from_file("")  # Path("") is the working directory
    with pytest.raises(ValueError, match=r" is a directory; valid: the path of a \.json, \.yaml or \.yml spec file$"):
        Spec.from_file(tmp_path)
    with pytest.raises(ValueError, match=r" cannot be read: "):
        Spec.from_file("s" * 5000 + ".json")


@pytest.mark.parametrize("text", [json.dumps(CANONICAL), json.dumps(CANONICAL, indent=2), CANONICAL_YAML])
def test_spec_text_is_coerced_like_a_file(text):
    assert Spec.from_text(text).to_dict() == CANONICAL
    assert Spec.coerce(text).to_dict() == CANONICAL
    assert Spec.coerce(CANONICAL) == Spec.coerce(Spec.from_dict(CANONICAL)) == Spec.from_dict(CANONICAL)
    assert Spec.coerce(None) == Spec()


def test_from_json_invalid_top_level():
    with pytest.raises(ValueError, match=r"^spec must be a mapping \(canonical, TensorRT-LLM attention_config or "
                                         r"vLLM-Omni diffusion attention config\), got list: \[1, 2\]$"):
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
         "unknown key(s) ['sparse'] in attention_config; valid: ['backend', 'quant_attention_config', "
         "'sparse_attention_config']"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "int8", "smooth_k": True}},
         "unknown key(s) ['smooth_k'] in attention_config.quant_attention_config; valid: ['k_block_size', "
         "'q_block_size', 'qk_dtype', 'v_block_size', 'v_dtype']"),
        ({"backend": "TRITON", "quant_attention_config": {"qk_dtype": "int8"}},
         "attention_config.backend='TRITON' is invalid; valid: TRTLLM, CUDNN, CUTEDSL, FLASHINFER"),
        ({"attention_config": {"quant_attention_config": {"qk_dtype": "int8"}}},
         "attention_config.backend=None is invalid; valid: TRTLLM, CUDNN, CUTEDSL, FLASHINFER"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "fp8", "v_dtype": "fp8", "q_block_size": 1,
                                                          "k_block_size": 16, "v_block_size": 1}},
         "attention_config.quant_attention_config.k_block_size=16 is not accepted for TRTLLM fp8 Q/K; "
         "valid: (1,1,1), (1,4,1)"),
        ({"backend": "CUDNN", "quant_attention_config": {"qk_dtype": "nvfp4", "v_dtype": "fp8"}},
         "attention_config.quant_attention_config.qk_dtype='nvfp4' is not accepted for CUDNN; valid: fp8, mxfp8"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "int8", "q_block_size": -1}},
         "attention_config.quant_attention_config.q_block_size=-1 is invalid; valid: an int >= 0"),
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
    assert spec.default.describe() == "bf16, skip-softmax target 0.65, dense while t > 0.86 via TRTLLM_ATTN"


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
         "'target_sparsity', 'threshold', 'threshold_scale_factor']"),
        ({"per_role": {"cross": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8"}, "extra": 1}}},
         "unknown key(s) ['extra'] in per_role['cross']; valid: ['backend', 'quant', 'skip_softmax']"),
        ({"per_role": {"text": "TORCH_SDPA"}}, "per_role role='text' is invalid; valid: self, cross, joint"),
        ({"per_role": ["cross"]}, "per_role must be a mapping of role to entry, got list: ['cross']"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "fp8"}}},
         "default.quant.dtype_qk='fp8' is invalid; valid: int8, fp8_e4m3"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"q_block_size": 4}}},
         "default.quant has block sizes but no dtype_qk (absent dtype_qk means dense); valid: add dtype_qk: int8, "
         "fp8_e4m3"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "k_block_size": 32}}},
         "default.quant.k_block_size=32 is not accepted for TRTLLM_ATTN int8 Q/K; valid: q 1, 4, 16; k 1, 4, 16; v 1"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "q_block_size": 2}}},
         "default.quant.q_block_size=2 is not accepted for TRTLLM_ATTN fp8 Q/K; valid: q 1, 4, 16; k 1, 4, 16; v 1"),
        ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 1.5}}},
         "default.skip_softmax.target_sparsity=1.5 is out of range; valid: finite, [0.0, 1.0]"),
        ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 0.5, "threshold": 1}}},
         "default.skip_softmax needs exactly one of target_sparsity / threshold / threshold_scale_factor (they are "
         "mutually exclusive); got target_sparsity=0.5, threshold=1, threshold_scale_factor=None"),
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
         "unknown key(s) ['recipes'] in spec.default; valid: ['backend', 'block_sparse', 'kernel', 'recipe', 'skip_softmax']"),
        ({"default": {"backend": "auto", "recipe": {"qk_dtype": "int8", "kblock": 4}}},
         f"unknown key(s) ['kblock'] in spec.default.recipe; valid: {RECIPE_KEYS}"),
        ({"default": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"thresh": 1}}},
         "unknown key(s) ['thresh'] in spec.default.skip_softmax; valid: ['disabled_until_timestep', "
         "'target_sparsity', 'threshold', 'threshold_scale_factor']"),
        ({"rules": [{"match": {}, "use": "dense", "when": 1}]},
         "unknown key(s) ['when'] in spec.rules[0]; valid: ['match', 'use']"),
        ({"rules": [{"match": {"role": "cross"}, "use": "dense"}, {"match": {"layer": 1}, "use": "dense"}]},
         f"unknown key(s) ['layer'] in spec.rules[1].match; valid: {MATCH_KEYS}"),
        ({"rules": [{"match": {}, "use": {"backend": "auto", "recipe": {"qk_dtype": "int8", "foo": 1, "bar": 2}}}]},
         f"unknown key(s) ['bar', 'foo'] in spec.rules[0].use.recipe; valid: {RECIPE_KEYS}"),
        ({"rules": [{"match": {}, "use": {"backend": "auto", "skipsoftmax": {}}}]},
         "unknown key(s) ['skipsoftmax'] in spec.rules[0].use; valid: ['backend', 'block_sparse', 'kernel', 'recipe', 'skip_softmax']"),
        ({"rules": [{"match": {"role": "cross"}}]}, "spec.rules[0] needs 'use' (\"dense\" or an attention spec)"),
        ({"rules": [{"match": {}, "use": "sparse"}]},
         "spec.rules[0].use='sparse' is invalid; valid: \"dense\" or an attention spec mapping"),
        ({"rules": {"match": {}}}, "spec.rules must be a list, got dict: {'match': {}}"),
        ({"rules": [{"match": [], "use": "dense"}]}, "spec.rules[0].match must be a mapping, got list: []"),
        ({"default": {"backend": "CUDNN", "recipe": {"qk_dtype": "int8", "v_dtype": "fp8"}}},
         "spec.default.recipe.qk_dtype='int8' is not accepted for CUDNN; valid: fp8, mxfp8"),
        ({"default": {"backend": "CUDNN", "recipe": None}},
         "spec.default.recipe=None is invalid without skip_softmax; valid: a recipe, or null with skip_softmax on "
         "TRTLLM_ATTN (use \"dense\" for dense attention)"),
        ({"default": {"backend": "CUDNN", "recipe": {"qk_dtype": "fp8"}, "skip_softmax": {"threshold": 1}}},
         "spec.default.skip_softmax is not accepted for backend='CUDNN'; valid: TRITON, TRTLLM, TRTLLM_ATTN, auto, "
         "REFERENCE"),
        ({"default": {"backend": "CUDNN", "recipe": None, "skip_softmax": {"threshold": 1}}},
         "spec.default.backend='CUDNN' is invalid with spec.default.recipe=None; valid: TRTLLM_ATTN, TRTLLM, auto, "
         "REFERENCE (the backends running bf16 + skip_softmax without a recipe)"),
    ],
)
def test_canonical_errors(data, message):
    with pytest.raises(ValueError) as e:
        Spec.from_dict(data)
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------------------------
# Wrong types anywhere: a ValueError naming the path, the value and what is valid (never AttributeError/TypeError)
# ----------------------------------------------------------------------------------------------------------------

SPEC_MAPPING = ("spec must be a mapping (canonical, TensorRT-LLM attention_config or vLLM-Omni diffusion attention "
                "config)")
VLLM_ENTRY = ("a backend name (TORCH_SDPA, FLASH_ATTN, CUDNN_ATTN, FLASHINFER_ATTN, TRTLLM_ATTN) or a mapping with "
              "backend, quant, skip_softmax")


def _rule(**match):
    return {"rules": [{"match": match, "use": "dense"}]}


@pytest.mark.parametrize(
    "data, message",
    [
        # canonical: the attention spec
        ({"default": {"recipe": "int8"}},
         "spec.default.recipe='int8' is invalid; valid: a recipe mapping, or null with skip_softmax"),
        ({"default": {"recipe": [1]}}, "spec.default.recipe=[1] is invalid; valid: a recipe mapping, or null with "
                                       "skip_softmax"),
        ({"default": {"backend": 3}},
         "spec.default.backend=3 is invalid; valid: auto, TRITON, TRTLLM, CUDNN, CUTEDSL, FLASHINFER, TRTLLM_ATTN, "
         "REFERENCE"),
        ({"default": {"backend": None}},
         "spec.default.backend=None is invalid; valid: auto, TRITON, TRTLLM, CUDNN, CUTEDSL, FLASHINFER, TRTLLM_ATTN, "
         "REFERENCE"),
        ({"default": {"skip_softmax": 0.5}}, "spec.default.skip_softmax=0.5 is invalid; valid: a skip_softmax mapping, "
                                             "or null"),
        ({"default": {"kernel": 3}},
         "spec.default.kernel=3 is invalid; valid: a kernel name (gluon_sage, triton_sage, flashinfer_trtllm_sage)"),
        ({"default": {"kernel": ["triton_sage"]}},
         "spec.default.kernel=['triton_sage'] is invalid; valid: a kernel name (gluon_sage, triton_sage, "
         "flashinfer_trtllm_sage)"),
        ({"rules": [{"use": {"backend": "TRITON", "recipe": {"qk_dtype": "bf16"}, "kernel": "cudnn_fp8"}}]},
         "spec.rules[0].use.kernel='cudnn_fp8' does not implement bf16 Q/K, fp8 V per-tensor via backend 'TRITON'; "
         "valid: gluon_sage, triton_sage (the kernels of this backend and recipe)"),
        # canonical: recipe fields
        ({"default": {"recipe": {"qk_dtype": 8}}},
         "spec.default.recipe.qk_dtype=8 is invalid; valid: bf16, int8, fp8, mxfp8, nvfp4"),
        ({"default": {"recipe": {"qk_dtype": "int8", "q_block_size": 1.0}}},
         "spec.default.recipe.q_block_size=1.0 is invalid; valid: an int >= 0"),
        ({"default": {"recipe": {"qk_dtype": "int8", "k_block_size": "16"}}},
         "spec.default.recipe.k_block_size='16' is invalid; valid: an int >= 0"),
        ({"default": {"recipe": {"qk_dtype": "int8", "v_block_size": False}}},
         "spec.default.recipe.v_block_size=False is invalid; valid: an int >= 0"),
        ({"default": {"recipe": {"qk_dtype": "int8", "smooth_k": "true"}}},
         "spec.default.recipe.smooth_k='true' is invalid; valid: true, false"),
        ({"default": {"recipe": {"qk_dtype": "int8", "scale_scope": ["head"]}}},
         "spec.default.recipe.scale_scope=['head'] is invalid; valid: tensor, head"),
        ({"rules": [{"use": {"recipe": {"qk_dtype": "int8", "q_block_size": 1, "k_block_size": 2}}}]},
         "spec.rules[0].use.recipe.k_block_size=2 is not accepted for any backend int8 Q/K; valid: TRITON [q 1, 4, "
         "16, 32, 64, 128; k 1, 4, 16, 32, 64, 128; v 0, 1], TRTLLM [(1,1,1), (1,4,1), (1,16,1)], TRTLLM_ATTN [q 1, 4, "
         "16; k 1, 4, 16; v 1]"),
        ({"default": {"recipe": {"qk_dtype": "bf16", "smooth_k": True}}},
         "spec.default.recipe.smooth_k=True is invalid with qk_dtype='bf16' (K is not quantized); valid: false"),
        # canonical: skip_softmax fields
        ({"default": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"threshold": "1"}}},
         "spec.default.skip_softmax.threshold='1' is invalid; valid: a finite number, >= 0.0"),
        ({"default": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"target_sparsity": None}}},
         "spec.default.skip_softmax needs exactly one of target_sparsity / threshold / threshold_scale_factor (they "
         "are mutually exclusive); got target_sparsity=None, threshold=None, threshold_scale_factor=None"),
        ({"default": {"backend": "TRTLLM_ATTN", "recipe": None,
                      "skip_softmax": {"threshold": 1, "disabled_until_timestep": [0.5]}}},
         "spec.default.skip_softmax.disabled_until_timestep=[0.5] is invalid; valid: a finite number, [0.0, 1.0]"),
        ({"default": {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": {"target_sparsity": 10 ** 400}}},
         f"spec.default.skip_softmax.target_sparsity={'1' + '0' * 116}... is out of range; valid: finite, "
         "[0.0, 1.0]"),  # an int too large for a float: compared exactly, shown shortened
        # canonical: match fields
        (_rule(role=0), "spec.rules[0].match.role=0 is invalid; valid: self, cross, joint"),
        (_rule(role=[]), "spec.rules[0].match.role=[] is invalid; valid: self, cross, joint, or a non-empty list of "
                         "them"),
        (_rule(role=["self", None]), "spec.rules[0].match.role[1]=None is invalid; valid: self, cross, joint"),
        (_rule(role={"self": 1}), "spec.rules[0].match.role={'self': 1} is invalid; valid: self, cross, joint"),
        (_rule(layers=3.5),
         "spec.rules[0].match.layers=3.5 is invalid; valid: an int or a slice string like '2:5' or '-4:'"),
        (_rule(layers=[]), "spec.rules[0].match.layers=[] is invalid; valid: an int or a slice string like '2:5' or "
                           "'-4:', or a non-empty list of them"),
        (_rule(layers=[0, [1]]),
         "spec.rules[0].match.layers[1]=[1] is invalid; valid: an int or a slice string like '2:5' or '-4:'"),
        (_rule(head_dim=64.0), "spec.rules[0].match.head_dim=64.0 is invalid; valid: an int >= 1"),
        (_rule(head_dim="64"), "spec.rules[0].match.head_dim='64' is invalid; valid: an int >= 1"),
        (_rule(head_dim=[64, 0]), "spec.rules[0].match.head_dim[1]=0 is invalid; valid: an int >= 1"),
        (_rule(head_dim=[True]), "spec.rules[0].match.head_dim[0]=True is invalid; valid: an int >= 1"),
        (_rule(head_dim=[]), "spec.rules[0].match.head_dim=[] is invalid; valid: an int >= 1, or a non-empty list of "
                             "them"),
        (_rule(module=["blocks.*"]),
         "spec.rules[0].match.module=['blocks.*'] is invalid; valid: a glob string like 'blocks.*.attn1'"),
        (_rule(min_q_len="1024"), "spec.rules[0].match.min_q_len='1024' is invalid; valid: an int >= 0"),
        # canonical: structure
        ({"default": None}, "spec.default=None is invalid; valid: \"dense\" or an attention spec mapping"),
        ({"default": "sparse", "rules": []},
         "spec.default='sparse' is invalid; valid: \"dense\" or an attention spec mapping"),
        ({"rules": None}, "spec.rules must be a list, got NoneType: None"),
        ({"rules": "dense"}, "spec.rules must be a list, got str: 'dense'"),
        ({"rules": [3]}, "spec.rules[0] must be a mapping, got int: 3"),
        ({"rules": [{"match": None, "use": "dense"}]}, "spec.rules[0].match must be a mapping, got NoneType: None"),
        ({"rules": [{"match": {}, "use": 1}]},
         "spec.rules[0].use=1 is invalid; valid: \"dense\" or an attention spec mapping"),
        ({"default": "dense", 1: 2, "x": 3}, "unknown key(s) [1, 'x'] in spec; valid: ['default', 'rules']"),
        # TensorRT-LLM attention_config
        ({"attention_config": None}, "attention_config must be a mapping, got NoneType: None"),
        ({"attention_config": ["TRTLLM"]}, "attention_config must be a mapping, got list: ['TRTLLM']"),
        ({"backend": ["TRTLLM"]},
         "attention_config.backend=['TRTLLM'] is invalid; valid: TRTLLM, CUDNN, CUTEDSL, FLASHINFER"),
        ({"backend": "TRTLLM", "quant_attention_config": "int8"},
         "attention_config.quant_attention_config must be a mapping, got str: 'int8'"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": "int8", "q_block_size": 1.0}},
         "attention_config.quant_attention_config.q_block_size=1.0 is invalid; valid: an int >= 0"),
        ({"backend": "TRTLLM", "quant_attention_config": {"qk_dtype": None}},
         "attention_config.quant_attention_config.qk_dtype=None is invalid; valid: bf16, int8, fp8, mxfp8, nvfp4"),
        ({"backend": "TRTLLM", "quant_attention_config": {}},
         "attention_config.quant_attention_config.qk_dtype='bf16' is not accepted for TRTLLM; valid: int8, fp8"),
        # vLLM-Omni
        ({"default": 3, "per_role": {}}, f"default=3 is invalid; valid: {VLLM_ENTRY}"),
        ({"per_role": {"cross": None}}, f"per_role['cross']=None is invalid; valid: {VLLM_ENTRY}"),
        ({"per_role": {"cross": ["TORCH_SDPA"]}}, f"per_role['cross']=['TORCH_SDPA'] is invalid; valid: {VLLM_ENTRY}"),
        ({"per_role": []}, "per_role must be a mapping of role to entry, got list: []"),
        ({"per_role": "cross"}, "per_role must be a mapping of role to entry, got str: 'cross'"),
        ({"per_role": {0: "TORCH_SDPA"}}, "per_role role=0 is invalid; valid: self, cross, joint"),
        ({"default": {"backend": "TRTLLM_ATTN", "quant": []}}, "default.quant must be a mapping, got list: []"),
        ({"default": {"backend": "FLASH_ATTN", "quant": []}}, "default.quant must be a mapping, got list: []"),
        ({"default": {"backend": "FLASH_ATTN", "skip_softmax": {}}},
         "default: quant/skip_softmax are not accepted for FLASH_ATTN; valid: TRTLLM_ATTN"),
        ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": []}},
         "default.skip_softmax must be a mapping, got list: []"),
        ({"per_role": {"cross": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": 8}}}},
         "per_role['cross'].quant.dtype_qk=8 is invalid; valid: int8, fp8_e4m3"),
        ({"per_role": {"cross": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "q_block_size": True}}}},
         "per_role['cross'].quant.q_block_size=True is invalid; valid: an int >= 0"),
        ({"per_role": {"cross": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "k_block_size": None}}}},
         "per_role['cross'].quant.k_block_size=None is invalid; valid: an int >= 0"),
        ({"per_role": {"joint": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": -1}}}},
         "per_role['joint'].skip_softmax.threshold=-1 is out of range; valid: finite, >= 0.0"),
    ],
)
def test_wrong_types_name_the_path(data, message):
    with pytest.raises(ValueError) as e:
        Spec.from_dict(data)
    assert str(e.value) == message


@pytest.mark.parametrize("value", [[], ["default"], "dense", None, 3, 2.5, True])
def test_top_level_non_mapping(value):
    message = f"^{re.escape(SPEC_MAPPING)}, got {type(value).__name__}: {re.escape(repr(value))}$"
    with pytest.raises(ValueError, match=message):
        Spec.from_dict(value)
    with pytest.raises(ValueError, match=message):
        Spec.from_json(json.dumps(value))
    with pytest.raises(ValueError, match=message):
        Spec.from_yaml(json.dumps(value))  # JSON is YAML


@pytest.mark.parametrize("text", ["", "# nothing\n", "- default: dense\n", "dense\n"])
def test_yaml_text_that_is_not_a_mapping(text):
    with pytest.raises(ValueError, match=f"^{re.escape(SPEC_MAPPING)}, got "):
        Spec.from_yaml(text)


def test_unparsable_text_is_a_value_error():
    with pytest.raises(ValueError, match=r"^spec YAML does not parse: "):
        Spec.from_yaml("default: [dense\n")
    with pytest.raises(ValueError):
        Spec.from_json("{default: dense}")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Match(role=0), "match.role=0 is invalid; valid: self, cross, joint"),
        (lambda: Match(head_dim=(64, "128")), "match.head_dim[1]='128' is invalid; valid: an int >= 1"),
        (lambda: Match(layers=()), "match.layers=() is invalid; valid: an int or a slice string like '2:5' or '-4:', "
                                   "or a non-empty list of them"),
        (lambda: Rule(5, DENSE), "rule.match must be a mapping, got int: 5"),
        (lambda: Rule(Match(), "sparse"),
         "rule.use='sparse' is invalid; valid: \"dense\" or an attention spec mapping"),
        (lambda: Spec(rules=5), "spec.rules must be a list, got int: 5"),
        (lambda: Spec(default=3), "spec.default=3 is invalid; valid: \"dense\" or an attention spec mapping"),
        (lambda: AttentionSpec(recipe="int8"), "recipe='int8' is invalid; valid: a recipe mapping, or null with "
                                               "skip_softmax"),
        (lambda: AttentionSpec(backend=None), "backend=None is invalid; valid: auto, TRITON, TRTLLM, CUDNN, CUTEDSL, "
                                              "FLASHINFER, TRTLLM_ATTN, REFERENCE"),
        (lambda: AttentionSpec("CUDNN", Recipe("int8", "fp8")),
         "recipe.qk_dtype='int8' is not accepted for CUDNN; valid: fp8, mxfp8"),
        (lambda: Match.from_dict({"role": 0}, where="rules[2].match"), "rules[2].match.role=0 is invalid; valid: self, "
                                                                        "cross, joint"),
    ],
)
def test_direct_construction_errors_use_a_generic_path(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert str(e.value) == message


def test_mappings_are_accepted_where_objects_are():
    use = AttentionSpec("TRITON", {"qk_dtype": "int8", "q_block_size": 1, "k_block_size": 16, "v_block_size": 1})
    assert use == AttentionSpec("TRITON", Recipe("int8", "fp8", 1, 16, 1))
    assert AttentionSpec("TRTLLM_ATTN", None, {"threshold": 1}) == AttentionSpec("TRTLLM_ATTN", None,
                                                                                  SkipSoftmax(threshold=1))
    assert Rule({"role": "cross"}, DENSE) == Rule(Match(role="cross"), DENSE)


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


def test_the_argument_checks_are_a_leaf_module():
    """spec, recipes, policy, backend and calibration share their checks through qattn_fx.validate, which imports
    nothing of qattn_fx (so none of them reaches into another for a private helper)."""
    import ast

    import qattn_fx.validate

    tree = ast.parse(Path(qattn_fx.validate.__file__).read_text())
    imported = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imported and not any(isinstance(node, ast.ImportFrom) and (node.level or "qattn_fx" in (node.module or ""))
                                or isinstance(node, ast.Import) and any("qattn_fx" in a.name for a in node.names)
                                for node in imported)
    for path in ("spec.py", "recipes.py", "policy.py", "calibration/budget.py", "calibration/candidates.py"):
        text = (Path(qattn_fx.validate.__file__).parent / path).read_text()
        assert "recipes import _" not in text and "recipes._check" not in text, path
