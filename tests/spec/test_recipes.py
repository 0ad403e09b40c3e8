"""The accepted (backend, recipe) table: seed rows accepted, neighbours rejected with precise messages."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from qattn_fx import hardware, recipes
from qattn_fx.hardware import Hardware, parse_version
from qattn_fx.recipes import TABLE, Recipe, SkipSoftmax, recipe_table_markdown, validate

FIELDS = ("q_block_size", "k_block_size", "v_block_size")

# ----------------------------------------------------------------------------------------------------------------
# The seed tables, written out by hand from TensorRT-LLM VisualGen's and vLLM-Omni's documentation (not derived
# from TABLE).
# ----------------------------------------------------------------------------------------------------------------

#: TensorRT-LLM VisualGen quantized attention, "Recipes" table.
VISUALGEN = [
    ("TRTLLM", "int8", "fp8", [(1, 1, 1), (1, 4, 1), (1, 16, 1)]),
    ("TRTLLM", "fp8", "fp8", [(1, 1, 1), (1, 4, 1)]),
    ("CUDNN", "fp8", "fp8", [(0, 0, 0)]),
    ("CUDNN", "mxfp8", "mxfp8", [(0, 0, 0)]),
    ("CUTEDSL", "bf16", "fp8", [(0, 0, 0)]),
    ("CUTEDSL", "mxfp8", "fp8", [(0, 0, 0), (0, 0, 1)]),
    ("CUTEDSL", "nvfp4", "fp8", [(0, 0, 0), (0, 0, 1)]),
    ("FLASHINFER", "mxfp8", "fp8", [(0, 0, 0)]),
    ("FLASHINFER", "nvfp4", "fp8", [(0, 0, 0)]),
    ("FLASHINFER", "nvfp4", "nvfp4", [(0, 0, 0)]),
]
#: vLLM-Omni TRTLLM_ATTN: dtype_qk int8 | fp8_e4m3, q/k block 1 | 4 | 16, V always per-channel fp8.
VLLM = [
    ("TRTLLM_ATTN", qk, "fp8", [(q, k, 1) for q in (1, 4, 16) for k in (1, 4, 16)]) for qk in ("int8", "fp8")
]

SEED_CASES = [
    (backend, Recipe(qk, v, *blocks)) for backend, qk, v, all_blocks in VISUALGEN + VLLM for blocks in all_blocks
]


def _id(case) -> str:
    backend, r = case
    return f"{backend}-{r.qk_dtype}-{r.v_dtype}-{r.q_block_size}.{r.k_block_size}.{r.v_block_size}"


@pytest.mark.parametrize("case", SEED_CASES, ids=_id)
def test_every_seed_recipe_is_accepted(case):
    backend, recipe = case
    validate(backend, recipe)
    # auto and REFERENCE accept everything some backend accepts
    validate("auto", recipe)
    validate("REFERENCE", recipe)
    assert recipes.matching_rows(backend, recipe)


def test_flashinfer_fp8_per_head_row_is_accepted_only_with_head_scope():
    validate("FLASHINFER", Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head"))
    with pytest.raises(ValueError) as e:
        validate("FLASHINFER", Recipe("fp8", "fp8", 0, 0, 0))
    assert str(e.value) == "scale_scope='tensor' is not accepted for FLASHINFER fp8 Q/K; valid: head"


def test_seed_rows_are_exactly_the_table_rows_of_seed_backends():
    """Nothing beyond the seed tables is accepted for the seed backends (apart from our documented Hopper row)."""
    table = {}
    for row in TABLE:
        if row.source == recipes.OURS:
            continue
        table[(row.backend, row.qk_dtype, row.v_dtype)] = set(row.blocks.all())
    seeds = {(b, q, v): set(blocks) for b, q, v, blocks in VISUALGEN + VLLM}
    assert table == seeds
    ours = {(r.backend, r.qk_dtype, r.v_dtype) for r in TABLE if r.source == recipes.OURS}
    assert ours == {("TRITON", "int8", "fp8"), ("TRITON", "fp8", "fp8"), ("TRITON", "bf16", "fp8"),
                    ("FLASHINFER", "fp8", "fp8")}


def test_one_row_per_backend_and_dtype_pair():
    keys = [(r.backend, r.qk_dtype, r.v_dtype) for r in TABLE]
    assert len(keys) == len(set(keys))


# ----------------------------------------------------------------------------------------------------------------
# Neighbouring invalid combinations
# ----------------------------------------------------------------------------------------------------------------


#: Our own Hopper row on a seed backend (FlashInfer FA3 FP8 with per-head scales).
OURS_ON_SEED_BACKENDS = [("FLASHINFER", "fp8", "fp8", [(0, 0, 0)], ("head",))]


def _hand_rows(backend):
    rows = [(b, q, v, blocks, ("tensor",)) for b, q, v, blocks in VISUALGEN + VLLM]
    return [r for r in rows + OURS_ON_SEED_BACKENDS if r[0] == backend]


def _expected_error(backend: str, r: Recipe) -> str | None:
    """The message prefix ``validate`` must raise with (None: accepted), from the hand-written tables.

    Fields are checked in order: qk_dtype, v_dtype, block sizes, scale_scope; the first one no accepted
    combination allows is named.
    """
    rows = _hand_rows(backend)
    if r.qk_dtype not in {q for _, q, _, _, _ in rows}:
        return f"qk_dtype={r.qk_dtype!r} is not accepted for {backend}; valid: "
    rows = [row for row in rows if row[1] == r.qk_dtype]
    v_choices = {v for _, _, v, _, _ in rows}
    if r.v_dtype not in v_choices:
        return f"v_dtype={r.v_dtype!r} is not accepted for {backend} {r.qk_dtype} Q/K; valid: "
    rows = [row for row in rows if row[2] == r.v_dtype]
    # with several V formats for this Q/K format, the message says which V it means
    what = f"{backend} {r.qk_dtype} Q/K" + ("" if len(v_choices) == 1 else f" with {r.v_dtype} V")
    blocks = {t for row in rows for t in row[3]}
    if r.blocks not in blocks:
        for i, name in enumerate(FIELDS):
            if r.blocks[i] not in {t[i] for t in blocks}:
                return f"{name}={r.blocks[i]} is not accepted for {what}"
        return "block sizes (q,k,v)=(%d,%d,%d) are not accepted for %s" % (*r.blocks, what)
    scopes = {s for row in rows for s in row[4]}
    scope_matters = (r.qk_dtype in ("int8", "fp8") and 0 in r.blocks[:2]) or (r.v_dtype == "fp8" and r.blocks[2] == 0)
    if scope_matters and r.scale_scope not in scopes:
        return f"scale_scope={r.scale_scope!r} is not accepted for {what}; valid: "
    return None


def _check(backend: str, candidate: Recipe) -> bool:
    expected = _expected_error(backend, candidate)
    if expected is None:
        validate(backend, candidate)
        return False
    with pytest.raises(ValueError) as e:
        validate(backend, candidate)
    msg = str(e.value)
    assert msg.startswith(expected), (msg, expected)
    assert "; valid: " in msg
    return True


@pytest.mark.parametrize("case", SEED_CASES, ids=_id)
def test_block_size_neighbours_are_rejected_naming_the_field(case):
    backend, recipe = case
    rejected = 0
    for i, name in enumerate(FIELDS):
        for value in {recipe.blocks[i] - 1, recipe.blocks[i] + 1, 0, 1, 2, 8, 16, 32}:
            if value < 0 or value == recipe.blocks[i]:
                continue
            new = list(recipe.blocks)
            new[i] = value
            rejected += _check(backend, Recipe(recipe.qk_dtype, recipe.v_dtype, *new))
    assert rejected > 0


@pytest.mark.parametrize("case", SEED_CASES, ids=_id)
def test_dtype_and_scope_neighbours_are_rejected_naming_the_first_bad_field(case):
    backend, recipe = case
    rejected = 0
    for qk in recipes.QK_DTYPES:
        for v in recipes.V_DTYPES:
            for scope in recipes.SCALE_SCOPES:
                if (qk, v, scope) == (recipe.qk_dtype, recipe.v_dtype, recipe.scale_scope):
                    continue
                rejected += _check(backend, Recipe(qk, v, *recipe.blocks, scale_scope=scope))
    assert rejected > 0


def test_the_valid_choices_list_every_accepted_tuple():
    with pytest.raises(ValueError) as e:
        validate("CUTEDSL", Recipe("nvfp4", "fp8", 0, 0, 7))
    assert str(e.value).endswith("; valid: (0,0,0), (0,0,1)")
    with pytest.raises(ValueError) as e:
        validate("TRTLLM_ATTN", Recipe("fp8", "fp8", 2, 16, 1))
    assert str(e.value).endswith("; valid: q 1, 4, 16; k 1, 4, 16; v 1")


@pytest.mark.parametrize(
    "backend, recipe, message",
    [
        ("TRTLLM", Recipe("fp8", "fp8", 1, 16, 1),
         "k_block_size=16 is not accepted for TRTLLM fp8 Q/K; valid: (1,1,1), (1,4,1)"),
        ("TRTLLM", Recipe("int8", "fp8", 1, 16, 0),
         "v_block_size=0 is not accepted for TRTLLM int8 Q/K; valid: (1,1,1), (1,4,1), (1,16,1)"),
        ("TRTLLM", Recipe("int8", "fp8", 4, 4, 1),
         "q_block_size=4 is not accepted for TRTLLM int8 Q/K; valid: (1,1,1), (1,4,1), (1,16,1)"),
        ("TRTLLM", Recipe("bf16", "fp8", 0, 0, 0),
         "qk_dtype='bf16' is not accepted for TRTLLM; valid: int8, fp8"),
        ("CUDNN", Recipe("int8", "fp8", 0, 0, 0), "qk_dtype='int8' is not accepted for CUDNN; valid: fp8, mxfp8"),
        ("CUDNN", Recipe("fp8", "mxfp8", 0, 0, 0), "v_dtype='mxfp8' is not accepted for CUDNN fp8 Q/K; valid: fp8"),
        ("CUDNN", Recipe("mxfp8", "fp8", 0, 0, 0), "v_dtype='fp8' is not accepted for CUDNN mxfp8 Q/K; valid: mxfp8"),
        ("CUDNN", Recipe("fp8", "fp8", 0, 0, 1), "v_block_size=1 is not accepted for CUDNN fp8 Q/K; valid: (0,0,0)"),
        ("CUDNN", Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head"),
         "scale_scope='head' is not accepted for CUDNN fp8 Q/K; valid: tensor"),
        ("CUTEDSL", Recipe("bf16", "fp8", 0, 0, 1),
         "v_block_size=1 is not accepted for CUTEDSL bf16 Q/K; valid: (0,0,0)"),
        ("CUTEDSL", Recipe("mxfp8", "fp8", 0, 0, 2),
         "v_block_size=2 is not accepted for CUTEDSL mxfp8 Q/K; valid: (0,0,0), (0,0,1)"),
        ("CUTEDSL", Recipe("nvfp4", "nvfp4", 0, 0, 0),
         "v_dtype='nvfp4' is not accepted for CUTEDSL nvfp4 Q/K; valid: fp8"),
        ("CUTEDSL", Recipe("mxfp8", "fp8", 32, 0, 0),
         "q_block_size=32 is not accepted for CUTEDSL mxfp8 Q/K; valid: (0,0,0), (0,0,1)"),
        ("FLASHINFER", Recipe("nvfp4", "nvfp4", 0, 0, 1),
         "v_block_size=1 is not accepted for FLASHINFER nvfp4 Q/K with nvfp4 V; valid: (0,0,0)"),
        ("FLASHINFER", Recipe("nvfp4", "mxfp8", 0, 0, 0),
         "v_dtype='mxfp8' is not accepted for FLASHINFER nvfp4 Q/K; valid: fp8, nvfp4"),
        ("FLASHINFER", Recipe("mxfp8", "fp8", 0, 0, 1),
         "v_block_size=1 is not accepted for FLASHINFER mxfp8 Q/K; valid: (0,0,0)"),
        ("FLASHINFER", Recipe("int8", "fp8", 1, 16, 1),
         "qk_dtype='int8' is not accepted for FLASHINFER; valid: mxfp8, nvfp4, fp8"),
        ("TRTLLM_ATTN", Recipe("int8", "fp8", 1, 32, 1),
         "k_block_size=32 is not accepted for TRTLLM_ATTN int8 Q/K; valid: q 1, 4, 16; k 1, 4, 16; v 1"),
        ("TRTLLM_ATTN", Recipe("fp8", "fp8", 1, 16, 0),
         "v_block_size=0 is not accepted for TRTLLM_ATTN fp8 Q/K; valid: q 1, 4, 16; k 1, 4, 16; v 1"),
        ("TRTLLM_ATTN", Recipe("mxfp8", "fp8", 0, 0, 0),
         "qk_dtype='mxfp8' is not accepted for TRTLLM_ATTN; valid: int8, fp8"),
        ("auto", Recipe("nvfp4", "mxfp8", 0, 0, 0),
         "v_dtype='mxfp8' is not accepted for any backend nvfp4 Q/K; valid: fp8, nvfp4"),
        # several backends: each is named before its set
        ("auto", Recipe("bf16", "fp8", 0, 0, 2),
         "v_block_size=2 is not accepted for any backend bf16 Q/K; valid: TRITON [(0,0,0), (0,0,1)], CUTEDSL [(0,0,0)]"),
        ("REFERENCE", Recipe("fp8", "fp8", 0, 1, 0),
         "block sizes (q,k,v)=(0,1,0) are not accepted for any backend fp8 Q/K; valid: TRITON [q 1, 4, 16, 32, 64, "
         "128; k 1, 4, 16, 32, 64, 128; v 0, 1], TRTLLM [(1,1,1), (1,4,1)], CUDNN [(0,0,0)], FLASHINFER [(0,0,0)], "
         "TRTLLM_ATTN [q 1, 4, 16; k 1, 4, 16; v 1]"),
    ],
)
def test_exact_rejection_messages(backend, recipe, message):
    with pytest.raises(ValueError) as e:
        validate(backend, recipe)
    assert str(e.value) == message


def test_unknown_backend_lists_every_backend():
    with pytest.raises(ValueError) as e:
        validate("TENSORRT", Recipe("int8", "fp8", 1, 16, 1))
    assert str(e.value) == (
        "backend='TENSORRT' is invalid; valid: auto, TRITON, TRTLLM, CUDNN, CUTEDSL, FLASHINFER, TRTLLM_ATTN, REFERENCE"
    )


@pytest.mark.parametrize(
    "ok_backend, bad_backend, recipe, bad_field",
    [
        # vLLM-Omni accepts k_block 16 for FP8 Q/K; VisualGen's TRTLLM does not.
        ("TRTLLM_ATTN", "TRTLLM", Recipe("fp8", "fp8", 1, 16, 1), "k_block_size=16"),
        # vLLM-Omni's q_block 4 / 16 exist only there.
        ("TRTLLM_ATTN", "TRTLLM", Recipe("int8", "fp8", 4, 4, 1), "q_block_size=4"),
        ("TRTLLM_ATTN", "TRTLLM", Recipe("int8", "fp8", 16, 16, 1), "q_block_size=16"),
        # CUDNN's per-tensor FP8 vs FlashInfer's per-head FP8.
        ("CUDNN", "FLASHINFER", Recipe("fp8", "fp8", 0, 0, 0), "scale_scope='tensor'"),
        ("FLASHINFER", "CUDNN", Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head"), "scale_scope='head'"),
        # block-scaled formats: CUDNN pairs mxfp8 with mxfp8 V, CUTEDSL/FLASHINFER with fp8 V.
        ("CUDNN", "CUTEDSL", Recipe("mxfp8", "mxfp8", 0, 0, 0), "v_dtype='mxfp8'"),
        ("CUTEDSL", "CUDNN", Recipe("mxfp8", "fp8", 0, 0, 0), "v_dtype='fp8'"),
        ("CUTEDSL", "FLASHINFER", Recipe("mxfp8", "fp8", 0, 0, 1), "v_block_size=1"),
        ("FLASHINFER", "CUTEDSL", Recipe("nvfp4", "nvfp4", 0, 0, 0), "v_dtype='nvfp4'"),
        ("CUTEDSL", "CUDNN", Recipe("bf16", "fp8", 0, 0, 0), "qk_dtype='bf16'"),
        ("TRTLLM", "CUDNN", Recipe("int8", "fp8", 1, 16, 1), "qk_dtype='int8'"),
        ("CUDNN", "TRTLLM_ATTN", Recipe("fp8", "fp8", 0, 0, 0), "q_block_size=0"),
    ],
)
def test_values_for_one_backend_are_rejected_by_another(ok_backend, bad_backend, recipe, bad_field):
    validate(ok_backend, recipe)
    with pytest.raises(ValueError) as e:
        validate(bad_backend, recipe)
    assert str(e.value).startswith(f"{bad_field} is not accepted for {bad_backend}")


def test_scale_scope_is_ignored_when_every_operand_is_block_scaled():
    # Sage recipes have no 0-block int8/fp8 operand, so the scope changes nothing and either value is accepted.
    validate("TRTLLM", Recipe("fp8", "fp8", 1, 1, 1, scale_scope="head"))
    validate("CUTEDSL", Recipe("mxfp8", "fp8", 0, 0, 1, scale_scope="head"))
    # ...but matters for a per-tensor fp8 V
    with pytest.raises(ValueError, match=r"^scale_scope='head' is not accepted for CUTEDSL mxfp8 Q/K; valid: tensor$"):
        validate("CUTEDSL", Recipe("mxfp8", "fp8", 0, 0, 0, scale_scope="head"))


# ----------------------------------------------------------------------------------------------------------------
# Field validation
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(qk_dtype="int8", q_block_size=-1), "q_block_size=-1 is invalid; valid: an int >= 0"),
        (dict(qk_dtype="int8", k_block_size=-16), "k_block_size=-16 is invalid; valid: an int >= 0"),
        (dict(v_block_size=-1), "v_block_size=-1 is invalid; valid: an int >= 0"),
        (dict(qk_dtype="int8", q_block_size=1.5), "q_block_size=1.5 is invalid; valid: an int >= 0"),
        (dict(qk_dtype="int8", q_block_size=True), "q_block_size=True is invalid; valid: an int >= 0"),
        (dict(qk_dtype="int8", k_block_size="16"), "k_block_size='16' is invalid; valid: an int >= 0"),
        (dict(qk_dtype="int4"), "qk_dtype='int4' is invalid; valid: bf16, int8, fp8, mxfp8, nvfp4"),
        (dict(qk_dtype="fp16"), "qk_dtype='fp16' is invalid; valid: bf16, int8, fp8, mxfp8, nvfp4"),
        (dict(v_dtype="bf16"), "v_dtype='bf16' is invalid; valid: fp8, mxfp8, nvfp4"),
        (dict(v_dtype="fp8_e4m3"), "v_dtype='fp8_e4m3' is invalid; valid: fp8, mxfp8, nvfp4"),
        (dict(scale_scope="block"), "scale_scope='block' is invalid; valid: tensor, head"),
        (dict(qk_dtype="bf16", smooth_k=True),
         "smooth_k=True is invalid with qk_dtype='bf16' (K is not quantized); valid: false"),
        (dict(qk_dtype="int8", smooth_k=1), "smooth_k=1 is invalid; valid: true, false"),
        (dict(qk_dtype="int8", smooth_k="yes"), "smooth_k='yes' is invalid; valid: true, false"),
    ],
)
def test_recipe_field_validation(kwargs, message):
    with pytest.raises(ValueError) as e:
        Recipe(**kwargs)
    assert str(e.value) == message


def test_recipe_defaults_and_smooth_k_default():
    r = Recipe()
    assert (r.qk_dtype, r.v_dtype, r.blocks, r.smooth_k, r.scale_scope) == ("bf16", "fp8", (0, 0, 0), False, "tensor")
    assert Recipe("int8", "fp8", 1, 16, 1).smooth_k is True
    assert Recipe("nvfp4", "nvfp4").smooth_k is True
    assert Recipe("int8", "fp8", 1, 16, 1, smooth_k=False).smooth_k is False
    assert Recipe("bf16", "fp8", smooth_k=False).smooth_k is False


def test_recipe_dict_round_trip_and_unknown_keys():
    r = Recipe("fp8", "fp8", 0, 0, 0, smooth_k=False, scale_scope="head")
    d = r.to_dict()
    assert d == {"qk_dtype": "fp8", "v_dtype": "fp8", "q_block_size": 0, "k_block_size": 0, "v_block_size": 0,
                 "smooth_k": False, "scale_scope": "head"}
    assert Recipe.from_dict(d) == r
    with pytest.raises(ValueError) as e:
        Recipe.from_dict({"qk_dtype": "int8", "dtype_qk": "int8"}, where="rules[0].use.recipe")
    assert str(e.value) == (
        "unknown key(s) ['dtype_qk'] in rules[0].use.recipe; valid: ['k_block_size', 'q_block_size', 'qk_dtype', "
        "'scale_scope', 'smooth_k', 'v_block_size', 'v_dtype']"
    )
    with pytest.raises(ValueError, match=r"^recipe must be a mapping, got str: 'int8'$"):
        Recipe.from_dict("int8")


@pytest.mark.parametrize(
    "recipe, family, name",
    [
        (Recipe("int8", "fp8", 1, 16, 1), "scaled", "int8 Q/K 1/16, fp8 V per-channel, smooth K"),
        (Recipe("fp8", "fp8", 1, 4, 1, smooth_k=False), "scaled", "fp8 Q/K 1/4, fp8 V per-channel"),
        (Recipe("fp8", "fp8"), "scaled", "fp8 Q/K per-tensor, fp8 V per-tensor, smooth K"),
        (Recipe("fp8", "fp8", scale_scope="head"), "scaled", "fp8 Q/K per-head, fp8 V per-head, smooth K"),
        (Recipe("bf16", "fp8"), "scaled", "bf16 Q/K, fp8 V per-tensor"),
        (Recipe("mxfp8", "mxfp8"), "block_scaled", "mxfp8 Q/K, mxfp8 V, smooth K"),
        (Recipe("mxfp8", "fp8", 0, 0, 1), "block_scaled", "mxfp8 Q/K, fp8 V per-channel, smooth K"),
        (Recipe("nvfp4", "nvfp4"), "block_scaled", "nvfp4 Q/K, nvfp4 V, smooth K"),
    ],
)
def test_family_and_name(recipe, family, name):
    assert recipe.family == family
    assert recipe.name == name


# ----------------------------------------------------------------------------------------------------------------
# SkipSoftmax
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(target_sparsity=0.65, disabled_until_timestep=0.86),
        dict(target_sparsity=0.0),
        dict(target_sparsity=1.0),
        dict(target_sparsity=1),
        dict(threshold=0.0),
        dict(threshold=1e6),
        dict(threshold=3, disabled_until_timestep=0),
        dict(threshold=0.5, disabled_until_timestep=1.0),
    ],
)
def test_skip_softmax_accepts_the_documented_ranges(kwargs):
    s = SkipSoftmax(**kwargs)
    assert s.to_dict() == kwargs
    assert SkipSoftmax.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_sparsity=1.01), "skip_softmax.target_sparsity=1.01 is out of range; valid: finite, [0.0, 1.0]"),
        (dict(target_sparsity=-0.1), "skip_softmax.target_sparsity=-0.1 is out of range; valid: finite, [0.0, 1.0]"),
        (dict(threshold=-1e-9), "skip_softmax.threshold=-1e-09 is out of range; valid: finite, >= 0.0"),
        (dict(target_sparsity=0.5, disabled_until_timestep=1.5),
         "skip_softmax.disabled_until_timestep=1.5 is out of range; valid: finite, [0.0, 1.0]"),
        (dict(target_sparsity=0.5, disabled_until_timestep=-0.5),
         "skip_softmax.disabled_until_timestep=-0.5 is out of range; valid: finite, [0.0, 1.0]"),
    ],
)
def test_skip_softmax_out_of_range(kwargs, message):
    with pytest.raises(ValueError) as e:
        SkipSoftmax(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_sparsity=math.nan),
         "skip_softmax.target_sparsity=nan is invalid; valid: a finite number, [0.0, 1.0]"),
        (dict(target_sparsity=math.inf),
         "skip_softmax.target_sparsity=inf is invalid; valid: a finite number, [0.0, 1.0]"),
        (dict(threshold=math.inf), "skip_softmax.threshold=inf is invalid; valid: a finite number, >= 0.0"),
        (dict(threshold=-math.inf), "skip_softmax.threshold=-inf is invalid; valid: a finite number, >= 0.0"),
        (dict(threshold=math.nan), "skip_softmax.threshold=nan is invalid; valid: a finite number, >= 0.0"),
        (dict(threshold=0.1, disabled_until_timestep=math.nan),
         "skip_softmax.disabled_until_timestep=nan is invalid; valid: a finite number, [0.0, 1.0]"),
        (dict(target_sparsity=True),
         "skip_softmax.target_sparsity=True is invalid; valid: a finite number, [0.0, 1.0]"),
        (dict(target_sparsity="0.5"),
         "skip_softmax.target_sparsity='0.5' is invalid; valid: a finite number, [0.0, 1.0]"),
        (dict(target_sparsity=[0.5]),
         "skip_softmax.target_sparsity=[0.5] is invalid; valid: a finite number, [0.0, 1.0]"),
    ],
)
def test_skip_softmax_rejects_non_finite_and_non_numbers(kwargs, message):
    with pytest.raises(ValueError) as e:
        SkipSoftmax(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("kwargs", [dict(), dict(target_sparsity=0.5, threshold=0.1),
                                    dict(disabled_until_timestep=0.5)])
def test_skip_softmax_target_sparsity_and_threshold_are_mutually_exclusive(kwargs):
    with pytest.raises(ValueError) as e:
        SkipSoftmax(**kwargs)
    assert str(e.value).startswith(
        "skip_softmax needs exactly one of target_sparsity / threshold / threshold_scale_factor (they are mutually "
        "exclusive); got "
    )


def test_skip_softmax_unknown_keys():
    with pytest.raises(ValueError) as e:
        SkipSoftmax.from_dict({"target_sparsity": 0.5, "sparsity": 0.5})
    assert str(e.value) == (
        "unknown key(s) ['sparsity'] in skip_softmax; valid: ['disabled_until_timestep', 'target_sparsity', "
        "'threshold', 'threshold_scale_factor']"
    )


# ----------------------------------------------------------------------------------------------------------------
# Requirements data (where rows run), from the seed documents
# ----------------------------------------------------------------------------------------------------------------


def _row(backend, qk, v):
    (row,) = [r for r in TABLE if (r.backend, r.qk_dtype, r.v_dtype) == (backend, qk, v)]
    return row


def test_requirements_trtllm_sage():
    int8 = _row("TRTLLM", "int8", "fp8").implementations
    fp8 = _row("TRTLLM", "fp8", "fp8").implementations
    assert [r.archs for r in int8] == [("sm_100",)]  # INT8 Q/K cubins: sm_100 only
    assert [r.archs for r in fp8] == [("sm_100", "sm_103")]
    for req in int8 + fp8:
        assert req.kernel == "flashinfer_trtllm_sage"
        assert req.library == ("flashinfer-python", "0.6.16rc1")
        assert req.head_dims.accepts(128) and not req.head_dims.accepts(64)
        assert req.skip_softmax  # VisualGen's sparse_attention_config: trtllm-gen's Skip-Softmax
    for qk in ("int8", "fp8"):
        (req,) = _row("TRTLLM_ATTN", qk, "fp8").implementations
        assert req.skip_softmax and req.library == ("flashinfer-python", "0.6.16rc1")
        assert req.head_dims.describe() == "128"
    assert _row("TRTLLM_ATTN", "int8", "fp8").implementations[0].archs == ("sm_100",)
    assert _row("TRTLLM_ATTN", "fp8", "fp8").implementations[0].archs == ("sm_100", "sm_103")


def test_requirements_cudnn():
    blackwell, hopper = _row("CUDNN", "fp8", "fp8").implementations
    assert blackwell.archs == ("sm_100", "sm_103") and blackwell.library == ("cudnn", "9.1.0")
    assert [d for d in range(8, 300, 8) if blackwell.head_dims.accepts(d)] == [32, 64, 96, 128]
    assert hopper.archs == ("sm_90",) and hopper.kernel == "cudnn_fp8"
    assert hopper.head_dims.accepts(80) and hopper.head_dims.accepts(256) and not hopper.head_dims.accepts(264)
    assert not hopper.head_dims.accepts(72)
    (mx,) = _row("CUDNN", "mxfp8", "mxfp8").implementations
    assert mx.library == ("cudnn", "9.21.0") and mx.kernel == "cudnn_mxfp8"


def test_requirements_flashinfer_and_cutedsl():
    (nv,) = _row("FLASHINFER", "nvfp4", "nvfp4").implementations
    assert nv.archs == ("sm_120", "sm_121")
    assert nv.head_dims.describe() == "64/128"
    assert nv.seq_multiple_of == 128
    assert nv.self_attention_only_equal_shapes and not nv.cross_attention and not nv.gqa
    assert nv.kernel is None
    for qk in ("mxfp8", "nvfp4"):
        (req,) = _row("FLASHINFER", qk, "fp8").implementations
        assert req.archs == ("sm_100", "sm_103") and req.head_dims.describe() == "128"
    for qk in ("bf16", "mxfp8", "nvfp4"):
        (req,) = _row("CUTEDSL", qk, "fp8").implementations
        assert req.kernel is None and req.head_dims.describe() == "128"
    (fa3,) = _row("FLASHINFER", "fp8", "fp8").implementations
    assert fa3.archs == ("sm_90",) and fa3.kernel == "flashinfer_fa3_fp8"
    assert _row("FLASHINFER", "fp8", "fp8").scale_scopes == ("head",)


def test_every_kernel_named_in_the_table_is_registered():
    from qattn_fx import kernels

    for row in TABLE:
        for req in row.implementations:
            if req.kernel is not None:
                entry = kernels.info(req.kernel)
                family = Recipe(row.qk_dtype, row.v_dtype).family
                assert getattr(entry, family) is not None, (row, req.kernel)


def test_head_dims_describe():
    assert recipes.HeadDims(allowed=(64, 128)).describe() == "64/128"
    assert recipes.HeadDims(multiple_of=16, max=256).describe() == "multiple of 16, <= 256"
    assert recipes.ANY_HEAD_DIM.accepts(7)


# ----------------------------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------------------------


def test_parse_version_ordering():
    ordered = ["0.6.0", "0.6.16.dev1", "0.6.16a1", "0.6.16b2", "0.6.16rc1", "0.6.16rc2", "0.6.16", "0.6.16.post1",
               "0.7.2", "0.7.2.post1", "0.7.4", "0.10.0", "9.1.0", "9.19.0", "9.21.0", "10.0"]
    keys = [parse_version(v) for v in ordered]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert parse_version("0.6.16rc1") < parse_version("0.6.16") < parse_version("0.7.2.post1")
    assert parse_version("9.1") == parse_version("9.1.0") == parse_version("9.1.0.0")
    assert parse_version("2.13.0+cpu") == parse_version("2.13.0")
    assert parse_version(" 3.6.0 ") == parse_version("3.6.0")
    with pytest.raises(ValueError, match=r"^version='nightly' is not a version number$"):
        parse_version("nightly")


def test_has_library():
    hw = Hardware.for_arch("sm_100", {"flashinfer-python": "0.6.16rc1", "cudnn": "9.19.0"})
    assert hw.has_library("flashinfer-python", "0.6.16rc1")
    assert not hw.has_library("flashinfer-python", "0.6.16")
    assert hw.has_library("flashinfer-python", "0.6.0")
    assert hw.has_library("cudnn", "9.1.0") and not hw.has_library("cudnn", "9.21.0")
    assert not hw.has_library("triton", "3.0.0")


def test_hardware_for_arch():
    assert Hardware.for_arch("sm_90").capability == (9, 0)
    assert Hardware.for_arch("sm_100").capability == (10, 0)
    assert Hardware.for_arch("sm_103").arch == "sm_103"
    assert Hardware.for_arch("sm_121").capability == (12, 1)
    cpu = Hardware.for_arch("cpu")
    assert cpu.arch == "cpu" and cpu.capability is None and cpu.device == "cpu"
    assert Hardware.for_arch("sm_90", {"triton": "3.6.0"}).describe() == "sm_90 (triton 3.6.0)"
    with pytest.raises(ValueError, match=r"^arch='hopper' is invalid; valid: 'cpu' or 'sm_XY'"):
        Hardware.for_arch("hopper")
    detected = hardware.detect("cpu")
    assert detected.arch == "cpu"


# ----------------------------------------------------------------------------------------------------------------
# docs/spec.md
# ----------------------------------------------------------------------------------------------------------------


def test_docs_recipe_table_is_generated_from_the_table():
    table = recipe_table_markdown()
    lines = table.splitlines()
    assert len(lines) == 2 + len(TABLE)
    assert lines[0].startswith("| backend | qk_dtype | v_dtype |")
    doc = Path(__file__).resolve().parents[2] / "docs" / "spec.md"
    assert doc.exists(), "docs/spec.md is missing; it must contain recipe_table_markdown() verbatim"
    text = doc.read_text()
    assert table in text, "docs/spec.md's recipe table differs from qattn_fx.recipes.recipe_table_markdown()"
    # exactly: the table block in docs/spec.md ends where the generated one ends
    readme_lines = text.splitlines()
    start = readme_lines.index(lines[0])
    block = []
    for line in readme_lines[start:]:
        if not line.startswith("|"):
            break
        block.append(line)
    assert block == lines


def test_every_kernel_fact_is_declared_once_in_the_registry():
    """The table's implementations are the kernel registry's requirements (or, for VisualGen's trtllm-gen rows,
    the same with skip-softmax off), and each kernel module reads its limits from them."""
    from dataclasses import replace

    from qattn_fx import kernels
    from qattn_fx.kernels import cudnn, flashinfer, gluon_sage, triton_sage

    for row in TABLE:
        for req in row.implementations:
            if req.kernel is None:
                continue
            declared = kernels.info(req.kernel).requirements
            assert req in declared or replace(req, skip_softmax=True) in declared, (row.backend, req)
    (ts_req,) = kernels.requirements("triton_sage")
    assert triton_sage.HEAD_DIMS == ts_req.head_dims.allowed and triton_sage.CAPABILITIES == ts_req.capabilities
    (gs_req,) = kernels.requirements("gluon_sage")
    assert (gluon_sage.CAPABILITY,) == gs_req.capabilities
    assert flashinfer.FA3_HEAD_DIMS == kernels.requirements("flashinfer_fa3_fp8")[0].head_dims.allowed
    assert cudnn.MXFP8_HEAD_DIMS == kernels.requirements("cudnn_mxfp8")[0].head_dims.allowed
    assert set(cudnn.FP8_ARCHS) == {c for r in kernels.requirements("cudnn_fp8") for c in r.capabilities}
    assert {k for k, i in kernels.KERNELS.items() if i.key_bias} == {"reference", "triton_sage", "gluon_sage"}
