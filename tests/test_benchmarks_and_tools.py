"""The benchmarks package and the tools: one shape table, and every command line answers --help without a GPU."""

from __future__ import annotations

import importlib

import pytest

from benchmarks import common, shapes

COMMANDS = ["benchmarks.attention_ops", "benchmarks.dit_step", "benchmarks.tune", "tools.ab_tail_split",
            "tools.gluon_probe", "tools.profile_gluon", "tools.profile_quantize"]


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_answers_help(module, capsys):
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--help"])
    assert exit_.value.code == 0
    assert f"usage: python -m {module}" in capsys.readouterr().out


def test_one_shape_table_serves_the_benchmarks_and_the_tools():
    from benchmarks import attention_ops
    from tools import profile_quantize  # noqa: F401  (imports benchmarks.attention_ops and benchmarks.shapes)

    assert not hasattr(attention_ops, "SHAPES")  # no second table
    assert shapes.SHAPES["wan1.3b-480p"] == (1, 12, 32760, 32760, 128)
    assert shapes.SHAPES["cross-512"].skv == 512
    assert shapes.SELF_ATTENTION == ("flux-1024", "wan1.3b-480p", "wan14b-720p", "d64")
    assert shapes.SHAPES["d64"].flops == 4.0 * 2 * 16 * 16384 * 16384 * 64


def test_shape_selection():
    assert [n for n, _ in shapes.select("all")] == list(shapes.SHAPES)
    assert [n for n, _ in shapes.select("all", default=shapes.SELF_ATTENTION)] == list(shapes.SELF_ATTENTION)
    assert [n for n, _ in shapes.select("wan1.3b-480p;d64")] == ["wan1.3b-480p", "d64"]  # the tuner's old separator
    (name, shape), = shapes.select("none", ["mine:2:24:4096:1024:64"])
    assert name == "mine" and shape == shapes.Shape(2, 24, 4096, 1024, 64)
    with pytest.raises(ValueError, match=r"--shapes: 'bogus' is unknown; valid: flux-1024, .*, all, none"):
        shapes.select("bogus")
    with pytest.raises(ValueError, match=r"valid: name:B:H:Sq:Skv:D"):
        shapes.select("none", ["mine:1:2:3"])
    with pytest.raises(ValueError, match="no shape selected"):
        shapes.select("none")


def test_tune_takes_one_kernel():
    from benchmarks import tune

    assert tune.parse_args(["--kernel", "gluon_sage"]).shapes == ",".join(shapes.SELF_ATTENTION)
    with pytest.raises(SystemExit):
        tune.parse_args([])  # --kernel is required
    with pytest.raises(SystemExit):
        tune.parse_args(["--kernel", "gluon"])


def test_quantized_inputs_names_the_valid_recipes():
    with pytest.raises(ValueError, match=r"recipe 'int4' is invalid; valid: int8-1-16, "):
        common.quantized_inputs(shapes.SHAPES["flux-1024"], "int4")
