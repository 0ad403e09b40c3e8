"""Fuzzing the spec parser (hypothesis, derandomized so CI is reproducible).

* Valid specs in the three formats (canonical, TensorRT-LLM VisualGen ``attention_config``, vLLM-Omni
  ``--diffusion-attention-config``) parse, round-trip through ``to_dict`` / ``from_dict`` to an equal spec, and
  ``to_json`` is valid JSON of the canonical form.
* The same specs with one value (at any depth) replaced by a value of another type parse or raise ``ValueError``
  naming the replaced key, never another exception.
* Arbitrary JSON-like values as a whole spec parse or raise ``ValueError``.
* The entry points that take a spec (``qattn_fx.backend`` given a mapping, JSON or YAML text, a ``.json`` or
  ``.yaml`` file, any value or any text; ``pre_grad_pass``; ``explain``) make a backend or raise ``ValueError``
  (``TypeError`` only for a value of a type no spec is), never ``OSError``, ``AttributeError``, ``OverflowError``
  or ``KeyError``; a spec that parses holds no number beyond float's range.
"""

from __future__ import annotations

import copy
import itertools
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qattn_fx
from qattn_fx import recipes
from qattn_fx.recipes import SCALE_SCOPES, TABLE, Recipe
from qattn_fx.spec import DENSE, ROLES, AttentionSpec, Spec, SpecWarning
from qattn_fx.spec_seeds import TRTLLM_BACKENDS, VLLM_DENSE, VLLM_DTYPE_QK

FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _parse(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpecWarning)  # {"backend": "TRTLLM_ATTN"} is read with a warning
        return Spec.from_dict(data)


# ----------------------------------------------------------------------------------------------------------------
# Valid specs
# ----------------------------------------------------------------------------------------------------------------


def _maybe_omit(draw, data: dict, defaults: dict) -> dict:
    """``data`` without some of the keys whose value equals the format's default."""
    return {k: v for k, v in data.items() if not (k in defaults and defaults[k] == v and draw(st.booleans()))}


@st.composite
def recipe_dicts(draw, rows=TABLE, scope_fixed: bool = False):
    """(row, recipe mapping accepted by ``row``); ``scope_fixed``: only the five TensorRT-LLM keys (scale_scope
    'tensor' and smooth_k derived, so ``rows`` must accept the tensor scope)."""
    row = draw(st.sampled_from(rows))
    q, k, v = draw(st.sampled_from(row.blocks.all()))
    data = {"qk_dtype": row.qk_dtype, "v_dtype": row.v_dtype, "q_block_size": q, "k_block_size": k,
            "v_block_size": v}
    if not scope_fixed:
        matters = recipes._scope_matters(Recipe(row.qk_dtype, row.v_dtype, q, k, v))
        data["scale_scope"] = draw(st.sampled_from(row.scale_scopes if matters else SCALE_SCOPES))
        if draw(st.booleans()):
            data["smooth_k"] = False if row.qk_dtype == "bf16" else draw(st.booleans())
        data = _maybe_omit(draw, data, {"qk_dtype": "bf16", "v_dtype": "fp8", "q_block_size": 0, "k_block_size": 0,
                                        "v_block_size": 0, "scale_scope": "tensor"})
    return row, data


unit_numbers = st.floats(0.0, 1.0) | st.sampled_from([0, 1])
skip_softmax_dicts = st.one_of(
    st.fixed_dictionaries({"target_sparsity": unit_numbers}, optional={"disabled_until_timestep": unit_numbers}),
    st.fixed_dictionaries({"threshold": st.floats(0.0, 1e6) | st.integers(0, 100)},
                          optional={"disabled_until_timestep": unit_numbers}),
)

block_sparse_dicts = st.builds(
    lambda control, extra: {**control, **extra},
    st.one_of(st.fixed_dictionaries({"cdf": st.floats(0.01, 1.0)}),
              st.fixed_dictionaries({"top_k": st.floats(0.01, 1.0)}),
              st.fixed_dictionaries({"target_sparsity": st.floats(0.0, 0.99)})),
    st.fixed_dictionaries({}, optional={"sink_tiles": st.integers(0, 4), "diagonal": st.booleans(),
                                        "similarity": unit_numbers, "disabled_until_timestep": unit_numbers}),
)


@st.composite
def attention_spec_dicts(draw):
    if draw(st.integers(0, 5)) == 0:  # bf16 + skip-softmax, no recipe
        return {"backend": "TRTLLM_ATTN", "recipe": None, "skip_softmax": draw(skip_softmax_dicts)}
    row, recipe = draw(recipe_dicts())
    backend = draw(st.sampled_from([row.backend, "auto", "REFERENCE"]))
    data = {"backend": backend, "recipe": recipe}  # always a recipe: without one TRTLLM_ATTN reads as vLLM-Omni
    if backend == "auto" and draw(st.booleans()):
        del data["backend"]
    if backend in ("TRTLLM_ATTN", "auto") and draw(st.booleans()):
        data["skip_softmax"] = draw(skip_softmax_dicts)
    if backend in recipes.block_sparse_backends() and Recipe(**recipe).family == "scaled" and draw(st.booleans()):
        data["block_sparse"] = draw(block_sparse_dicts)
    kernels = AttentionSpec(backend, Recipe(**recipe)).kernels()
    if kernels and draw(st.booleans()):
        data["kernel"] = draw(st.sampled_from(kernels))
    return data


uses = st.just(DENSE) | attention_spec_dicts()


def _one_or_list(items, max_size=3):
    return items | st.lists(items, min_size=1, max_size=max_size)


slices = st.tuples(st.none() | st.integers(-40, 40), st.none() | st.integers(-40, 40)).map(
    lambda t: ":".join("" if x is None else str(x) for x in t))
match_dicts = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(ROLES) | st.lists(st.sampled_from(ROLES), min_size=1, max_size=3, unique=True),
    "module": st.text("abc.*_01", min_size=1, max_size=12),
    "layers": _one_or_list(st.integers(-40, 40) | slices, 4),
    "head_dim": _one_or_list(st.integers(1, 512)),
    "min_q_len": st.integers(0, 1 << 20),
    "min_kv_len": st.integers(0, 1 << 20),
})
rule_dicts = st.fixed_dictionaries({"use": uses}, optional={"match": match_dicts})
canonical_specs = st.fixed_dictionaries({}, optional={"default": uses, "rules": st.lists(rule_dicts, max_size=4)})


@st.composite
def trtllm_specs(draw):
    backend = draw(st.sampled_from(TRTLLM_BACKENDS))
    data = {"backend": backend}
    rows = tuple(r for r in TABLE if r.backend == backend and "tensor" in r.scale_scopes)
    choice = draw(st.integers(0, 3))
    if choice == 1:
        data["quant_attention_config"] = None
    elif choice > 1:
        _, quant = draw(recipe_dicts(rows, scope_fixed=True))
        data["quant_attention_config"] = _maybe_omit(draw, quant, {"qk_dtype": "bf16", "v_dtype": "fp8",
                                                                   "q_block_size": 0, "k_block_size": 0,
                                                                   "v_block_size": 0})
    return {"attention_config": data} if draw(st.booleans()) else data


quant_dicts = st.fixed_dictionaries({"dtype_qk": st.sampled_from(list(VLLM_DTYPE_QK))}, optional={
    "q_block_size": st.sampled_from([1, 4, 16]), "k_block_size": st.sampled_from([1, 4, 16])})
vllm_entries = st.one_of(
    st.sampled_from(VLLM_DENSE + ("TRTLLM_ATTN",)),
    st.builds(lambda b: {"backend": b}, st.sampled_from(VLLM_DENSE + ("TRTLLM_ATTN",))),
    st.fixed_dictionaries({"backend": st.just("TRTLLM_ATTN"), "quant": quant_dicts},
                          optional={"skip_softmax": skip_softmax_dicts}),
    st.fixed_dictionaries({"backend": st.just("TRTLLM_ATTN"), "skip_softmax": skip_softmax_dicts}),
)


@st.composite
def vllm_specs(draw):
    data = {}
    per_role = draw(st.none() | st.dictionaries(st.sampled_from(ROLES), vllm_entries, max_size=3))
    if per_role is not None or draw(st.booleans()):
        data["per_role"] = per_role
    if "per_role" not in data or draw(st.booleans()):
        data["default"] = draw(vllm_entries | st.none()) if "per_role" in data else draw(vllm_entries)
    return data


valid_specs = canonical_specs | trtllm_specs() | vllm_specs()


@FUZZ
@given(data=valid_specs)
def test_valid_specs_parse_and_round_trip(data):
    written = copy.deepcopy(data)
    spec = _parse(data)
    assert data == written  # the input is not modified
    canonical = spec.to_dict()
    assert Spec.from_dict(canonical) == spec
    text = spec.to_json()
    assert json.loads(text) == canonical
    assert Spec.from_json(text) == spec


# ----------------------------------------------------------------------------------------------------------------
# Mutated specs: one value replaced by a value of another type
# ----------------------------------------------------------------------------------------------------------------

REPLACEMENTS = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": st.integers(0, 1 << 70),
    "huge int": st.integers(10**309, 10**400),  # beyond float's range: rejected where a float is read, at parse time
    "negative int": st.integers(-(1 << 70), -1),
    "float": st.floats(allow_nan=True, allow_infinity=True),
    "str": st.text(max_size=8),
    "list": st.lists(st.integers() | st.text(max_size=4) | st.none(), min_size=1, max_size=3),
    "empty list": st.just([]),
    "dict": st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=4), min_size=1, max_size=2),
    "empty dict": st.just({}),
}


def _kind(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if value >= 0 else "negative int"
    if isinstance(value, (list, dict)):
        return ("empty " if not value else "") + ("list" if isinstance(value, list) else "dict")
    return type(value).__name__


def _paths(value, path=()):
    """Every path (tuple of keys / indices) below the root."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield path + (key,)
        yield from _paths(child, path + (key,))


def _replace(data, path, new):
    data = copy.deepcopy(data)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return data


def _name(path) -> str:
    """How an error message names the replaced value: its key, or ``parent[i]`` for a list item."""
    if isinstance(path[-1], int):
        return f"{path[-2]}[{path[-1]}]"
    return str(path[-1])


@st.composite
def mutated_specs(draw):
    data = draw(valid_specs.filter(lambda d: len(d) > 0))
    path = draw(st.sampled_from(list(_paths(data))))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    kind = draw(st.sampled_from([k for k in REPLACEMENTS if k != _kind(parent[path[-1]])]))
    return _replace(data, path, draw(REPLACEMENTS[kind])), path


@FUZZ
@given(case=mutated_specs())
def test_mutated_specs_parse_or_raise_value_error_naming_the_key(case):
    data, path = case
    try:
        spec = _parse(data)
    except ValueError as e:
        assert _name(path) in str(e), (path, str(e))
    else:
        assert Spec.from_dict(spec.to_dict()) == spec
        _assert_numbers_are_floats(spec)


def _assert_numbers_are_floats(spec: Spec) -> None:
    """Every float-valued field of a parsed spec (Skip-Softmax's) converts to a finite float: what a kernel or a
    division reads at compile time cannot overflow."""
    uses = [spec.default] + [rule.use for rule in spec.rules]
    for use in uses:
        skip = None if use == DENSE else use.skip_softmax
        for name in ("target_sparsity", "threshold", "threshold_scale_factor", "disabled_until_timestep"):
            value = None if skip is None else getattr(skip, name)
            if value is not None:
                assert float(value) < float("inf"), (name, value)


# ----------------------------------------------------------------------------------------------------------------
# Anything at all
# ----------------------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
    | st.sampled_from(["dense", "auto", "TRTLLM", "TRTLLM_ATTN", "TORCH_SDPA", "cross", "int8", "2:5"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["default", "rules", "match", "use", "recipe", "backend", "per_role", "quant", "role",
                         "layers", "attention_config", "quant_attention_config", "skip_softmax", "x"]),
        children, max_size=3),
    max_leaves=12,
)


@FUZZ
@given(data=json_values)
def test_any_value_parses_or_raises_value_error(data):
    try:
        _parse(data)
    except ValueError:
        pass


# ----------------------------------------------------------------------------------------------------------------
# The entry points: backend(), pre_grad_pass(), explain()
# ----------------------------------------------------------------------------------------------------------------

#: What no bad spec may raise: the exceptions a parser leaks when it reads a path, a number or a key it did not check.
LEAKS = (OSError, AttributeError, OverflowError, KeyError, IndexError)
_FILES = itertools.count()


def _through(entry: str, data, folder):
    """Make a backend from ``data`` the way ``entry`` passes it."""
    if entry == "mapping":
        return qattn_fx.backend(data)
    if entry == "json text":
        return qattn_fx.backend(json.dumps(data, indent=1))  # a mapping or list spans lines: read as text
    if entry == "yaml text":
        return qattn_fx.backend(yaml.safe_dump(data))
    suffix = ".json" if entry == "json file" else ".yaml"
    path = folder / f"spec{next(_FILES)}{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    return qattn_fx.backend(str(path) if next(_FILES) % 2 else path)


ENTRIES = ("mapping", "json text", "yaml text", "json file", "yaml file")
any_specs = valid_specs | mutated_specs().map(lambda case: case[0]) | json_values


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("specs")


@FUZZ
@given(data=any_specs, entry=st.sampled_from(ENTRIES))
def test_backend_makes_a_backend_or_raises_value_error(folder, data, entry):
    if entry == "mapping" and not isinstance(data, dict):
        return  # a value of another type: test_backend_rejects_other_types
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SpecWarning)
            backend = _through(entry, data, folder)
    except ValueError:
        pass
    except LEAKS as e:  # pragma: no cover - the failure being tested for
        raise AssertionError(f"{entry}: {type(e).__name__} leaked for {data!r}") from e
    else:
        assert isinstance(backend, qattn_fx.Backend)
        _assert_numbers_are_floats(backend.spec)


@FUZZ
@given(data=json_values)
def test_backend_rejects_other_types(data):
    """A value of a type no spec is raises TypeError; ``None`` is the default spec, a str a path or spec text."""
    try:
        qattn_fx.backend(data)
        qattn_fx.pre_grad_pass(data)
    except TypeError:
        assert not isinstance(data, (dict, str, type(None)))
    except ValueError:
        assert isinstance(data, (dict, str))


@FUZZ
@given(text=st.text(max_size=40) | st.text("{}[]:,- \n\"'abdefltu0129.e", max_size=40))
def test_any_text_makes_a_backend_or_raises_value_error(text):
    try:
        qattn_fx.backend(text)
    except ValueError:
        pass


@settings(FUZZ, max_examples=40)
@given(data=valid_specs | mutated_specs().map(lambda case: case[0]))
def test_pre_grad_pass_and_explain_make_a_report_or_raise_value_error(data):
    """``pre_grad_pass`` and ``explain`` take the spec as ``backend`` does; ``explain`` also runs the rewrite (the
    policy's decisions: an explicit backend that cannot serve a site here, a target_sparsity without a
    calibration raise ValueError)."""
    q = torch.ones(1, 2, 8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpecWarning)
        for entry in (lambda: qattn_fx.pre_grad_pass(data),
                      lambda: qattn_fx.explain(F.scaled_dot_product_attention, q, q, q, spec=data)):
            try:
                entry()
            except ValueError:
                pass
