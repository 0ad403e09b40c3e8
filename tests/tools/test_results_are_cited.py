"""Every file under ``benchmarks/results/`` is cited from the docs, the code or the tools, so none is left behind
when the text that used it moves on (history keeps what was removed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
#: A run of characters that can spell a result file's name, brace alternatives and ``...`` continuations included.
TOKEN = re.compile(r"[\w.{},*\-]+")
#: How :func:`cited_names` marks a glob (``2026-12-02_h200_ab_*``): its names start with what is before it.
GLOB = "<glob>"


def expand(token: str) -> list[str]:
    """A shell-style brace pattern's names: ``a_{b,c}.json`` -> ``a_b.json``, ``a_c.json``."""
    match = re.search(r"\{([^{}]*)\}", token)
    if match is None:
        return [token]
    return [name for alt in match.group(1).split(",")
            for name in expand(token[:match.start()] + alt + token[match.end():])]


def cited_names(text: str) -> tuple[set[str], set[str]]:
    """(names, tails): what ``text`` spells in full (``2026-12-07_h100_x.json``, ``2026-12-07_h100_x.*``'s stem; a
    glob ``2026-12-07_h100_ab*`` as its prefix and :data:`GLOB`) and the tails of ``..._tail`` continuations, which
    abbreviate the date and GPU of the name before them."""
    names, tails = set(), set()
    for token in TOKEN.findall(text):
        for name in expand(token):
            if re.match(r"20\d\d-\d\d-\d\d_.*[^.]\*$", name):  # a glob: every name it starts
                names.add(name[:-1] + GLOB)
                continue
            name = name.rstrip(".*,")
            if name.startswith("..."):
                tails.add(name.lstrip("._"))
            elif re.match(r"20\d\d-\d\d-\d\d_", name):
                names.add(name)
    return names, tails


#: The kinds of result file (a name such as ``wan1.3b-480p`` has dots of its own).
SUFFIXES = (".json", ".log", ".png", ".csv", ".txt")


def stem(name: str) -> str:
    """``name`` without its kind of result file: a run's ``.json``, ``.log`` and ``.png`` share it."""
    return next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)


def is_cited(path: Path, names: set[str], tails: set[str]) -> bool:
    """Whether ``path`` or a sibling of the same stem is cited."""
    own = stem(path.name)
    if own in {stem(name) for name in names}:
        return True
    if any(name.endswith(GLOB) and path.name.startswith(name[: -len(GLOB)]) for name in names):
        return True
    return any(tail and own.endswith("_" + stem(tail)) for tail in tails)


def test_every_result_file_is_cited():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names: set[str] = set()
    tails: set[str] = set()
    for rel in listed.decode().split("\0"):
        path = ROOT / rel
        if not rel or rel.startswith("benchmarks/results/") or path.suffix in (".png", ".pt") or not path.is_file():
            continue
        found = cited_names(path.read_text(errors="ignore"))
        names |= found[0]
        tails |= found[1]
    uncited = [p.name for p in sorted(RESULTS.iterdir()) if not is_cited(p, names, tails)]
    assert not uncited, f"{len(uncited)} result files nothing cites (cite them or git rm them): {uncited}"


def test_citations_are_read_as_written():
    names, tails = cited_names("`benchmarks/results/2026-12-07_h100_x_{on,off}.json`; `..._y_z.*`; "
                               "`2026-12-01_h200_w.`, `2026-12-02_h200_ab*`")
    assert names == {"2026-12-07_h100_x_on.json", "2026-12-07_h100_x_off.json", "2026-12-01_h200_w",
                     "2026-12-02_h200_ab" + GLOB}
    assert is_cited(Path("2026-12-02_h200_ab_r1.json"), names, tails)
    assert tails == {"y_z"}
    assert is_cited(Path("2026-12-07_h100_x_on.log"), names, tails)  # the sibling of a cited run
    assert is_cited(Path("2026-12-01_h200_a_y_z.json"), names, tails)  # a continuation's tail
    assert not is_cited(Path("2026-12-07_h100_x.log"), names, tails)
    assert stem("2026-11-30_h200_wan1.3b-480p_d64.png") == "2026-11-30_h200_wan1.3b-480p_d64"
