"""Write the cost data that ``auto`` predicts from (:mod:`qattn_fx.cost`) out of ``benchmarks.attention_ops`` results.

    python -m benchmarks.cost_table RESULT.json[:METHOD,...] ... > qattn_fx/cost_data.py

Each argument is a JSON file written by ``python -m benchmarks.attention_ops --out``, optionally followed by
``:`` and the methods to take from it (``gluon_sage/int8-1-16-1``, ``cudnn_fp8``; default: every qattn_fx method
in the file). A point is one row of a qattn_fx kernel: its shape, and its ``speedup``: the cuDNN bf16 SDPA time of
the same run divided by the kernel's time with its quantize passes (``ms_total``). A later argument's point for the
same (method, shape) on the same GPU replaces an earlier one, so list older runs first; runs on different GPUs of
one architecture (an H100 and an H200) each keep their points, and ``auto`` uses the running GPU's
(:func:`qattn_fx.cost.predict`). The file's date is the ``YYYY-MM-DD`` its
name starts with (``benchmarks/results/`` naming), the device and architecture come from its ``env``.

A file written by ``benchmarks.attention_ops --block-sparse`` gives block-sparse points (:mod:`qattn_fx.sparse_cost`)
instead, after ``:`` the kernels or configs to take (``triton_sage``, ``WS_BN128_s3_ahead_permk_mmasum``; default:
every row): per row of a keep fraction below 1, the fraction of blocks visited (``1 - sparsity_pred``) and
``ms_both / ms_dense``; a later argument replaces the point of the same (kernel, shape, keep) on the same GPU.

The output is a Python module that records this command; ``tests/spec/test_cost.py`` re-runs it and checks that the
shipped ``qattn_fx/cost_data.py`` is what it prints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})_")

HEADER = '''"""Measured speed of qattn_fx's kernels against torch SDPA (cuDNN, bf16), the data of :mod:`qattn_fx.cost`.

Generated from ``benchmarks.attention_ops`` results by the command in :data:`COMMAND`; do not edit: re-run it.
``SOURCES``: one entry per result file (its path, device, architecture, date, timer). ``POINTS``: ``(kernel,
source, shape, batch_heads, q_len, kv_len, head_dim, speedup)`` per measured call, where ``batch_heads`` is B·H
of Q and ``speedup`` is the cuDNN bf16 SDPA time of the same run divided by the kernel's time with its quantize
passes (Inductor-compiled; ``ms_total`` in the result file). ``SPARSE_POINTS``: ``(kernel, source, shape,
batch_heads, q_len, kv_len, head_dim, visited, ratio)`` per measured block-sparse call (:mod:`qattn_fx.sparse_cost`):
the fraction of blocks visited and the predictor and kernel's time over the kernel's dense time.
"""
'''


def parse_argument(text: str) -> tuple[Path, tuple[str, ...] | None]:
    """``FILE[:METHOD,...]`` → (file, methods or None for every qattn_fx method)."""
    path, _, methods = text.partition(":")
    chosen = tuple(m for m in methods.split(",") if m) if methods else None
    if methods and not chosen:
        raise ValueError(f"argument {text!r}: no method after ':'; valid: FILE or FILE:METHOD,METHOD")
    return Path(path), chosen


def _arch(capability: list[int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _block_sparse_points(data: dict, key: str, path: Path, configs: tuple[str, ...] | None,
                         device: str) -> dict[tuple, tuple]:
    """A ``--block-sparse`` result's points by (kernel, shape, keep, device)."""
    rows = [r for r in data["rows"] if r.get("keep") is not None and r["keep"] < 1 and r.get("ms_both")]
    names = lambda r: {r["kernel"], r.get("config")} - {None}  # noqa: E731
    found = set().union(*map(names, rows)) if rows else set()
    missing = sorted(set(configs or ()) - found)
    if missing:
        raise ValueError(f"{path}: no row of kernel or config(s) {', '.join(missing)}; valid: "
                         f"{', '.join(sorted(found))}")
    points = {}
    for r in rows:
        if configs is None or names(r) & set(configs):
            points[(r["kernel"], r["shape"], r["keep"], device)] = (
                r["kernel"], key, r["shape"], r["B"] * r["H"], r["Sq"], r["Skv"], r["D"],
                round(1.0 - r["sparsity_pred"], 4), round(r["ms_both"] / r["ms_dense"], 4))
    return points


def read_points(arguments: list[str]) -> tuple[dict[str, dict], dict[tuple, tuple], dict[tuple, tuple]]:
    """(sources by key, points by (method, shape, device), block-sparse points by (kernel, shape, keep, device)) from
    the arguments, later arguments replacing earlier points."""
    sources: dict[str, dict] = {}
    points: dict[tuple[str, str, str], tuple] = {}
    sparse: dict[tuple, tuple] = {}
    for argument in arguments:
        path, methods = parse_argument(argument)
        date = _DATE.match(path.name)
        if date is None:
            raise ValueError(f"{path}: the file name must start with its date (YYYY-MM-DD_), as benchmarks/results/ "
                             "names them")
        data = json.loads(path.read_text())
        key = path.stem
        source = {"file": path.as_posix(), "device": data["env"]["device"], "arch": _arch(data["env"]["capability"]),
                  "date": date.group(1), "timer": data["settings"].get("timer", "events")}
        if "keep" in data["settings"]:  # a --block-sparse result
            sources[key] = source
            sparse.update(_block_sparse_points(data, key, path, methods, source["device"]))
            continue
        rows = [r for r in data["rows"] if r.get("kernel") and r.get("speedup")]
        found = {r["method"] for r in rows}
        missing = sorted(set(methods or ()) - found)
        if missing:
            raise ValueError(f"{path}: no row of method(s) {', '.join(missing)}; valid: {', '.join(sorted(found))}")
        sources[key] = source
        for r in rows:
            if methods is not None and r["method"] not in methods:
                continue
            point = (r["kernel"], key, r["shape"], r["B"] * r["H"], r["Sq"], r["Skv"], r["D"], round(r["speedup"], 4))
            points[(r["method"], r["shape"], sources[key]["device"])] = point
    return sources, points, sparse


def _literal(value: object) -> str:
    """A Python literal of a str, int, float or tuple of them, strings in double quotes."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_literal(v) for v in value) + ")"
    return repr(value)


def render(arguments: list[str]) -> str:
    """The text of ``qattn_fx/cost_data.py`` for these arguments."""
    sources, points, sparse = read_points(arguments)
    used = {p[1] for p in [*points.values(), *sparse.values()]}
    words = ["python -m benchmarks.cost_table", *(f" {a}" for a in arguments), " > qattn_fx/cost_data.py"]
    lines = [HEADER, "COMMAND = (", *(f"    {_literal(w)}" for w in words), ")", "", "SOURCES = {"]
    for key, source in sources.items():
        if key in used:
            lines.append(f"    {_literal(key)}: {{")
            lines += [f"        {_literal(name)}: {_literal(value)}," for name, value in source.items()]
            lines.append("    },")
    lines += ["}", "", "#: (kernel, source, shape, batch_heads, q_len, kv_len, head_dim, speedup)", "POINTS = ("]
    # by kernel, head_dim, Skv, Sq, B·H, then source (the runs of several GPUs side by side)
    for point in sorted(points.values(), key=lambda p: (p[0], p[6], p[5], p[4], p[3], p[1])):
        lines.append(f"    {_literal(point)},")
    lines += [")", "", "#: (kernel, source, shape, batch_heads, q_len, kv_len, head_dim, visited, ratio)",
              "SPARSE_POINTS = ("]
    for point in sorted(sparse.values(), key=lambda p: (p[0], p[6], p[5], p[4], p[3], p[1], p[7])):
        lines.append(f"    {_literal(point)},")
    lines.append(")")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", metavar="RESULT.json[:METHOD,...]")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render(args.results))
    except (OSError, ValueError, KeyError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
