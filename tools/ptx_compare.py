"""Compare gluon_sage's PTX between two source trees, launch class by launch class, without a GPU.

When to use: after a change to the Gluon kernel that should not change what it compiles to (a refactor, a rename,
moved code), or to see which launch classes a change touches. Each tree's ``gluon_sage.compile_for`` builds every
case of :data:`CASES` (the GPU-tested configs on int8 Q/K with K scales per 16 keys, then the other launch classes:
K scales per key, bf16 Q quantized in the kernel, bf16 Q/K, fp8, key bias, LSE, tail split, Skip-Softmax with and
without counting, head_dim 64, block lists, persistent launches dense and block-sparse, ``pair``) for sm_90 in a
process of its own (``PYTHONPATH`` set to the tree, so each side imports its own ``qattn_fx``); the PTX is compared
with debug sections stripped and parameter numbers normalized::

    git worktree add /tmp/gluon-before main          # (or: git archive main qattn_fx | tar -x -C /tmp/gluon-before)
    python tools/ptx_compare.py /tmp/gluon-before . --out /tmp/ptx  # a table; exit status 1 if a case differs
    python tools/ptx_compare.py /tmp/ptx/before .   # again, reusing the before side's compiles

Run it as a script (not ``python -m``) so that the working directory does not shadow ``PYTHONPATH``. Each row gives
the case, whether the normalized PTX is identical, and ptxas' registers and spill stores on both sides.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

#: ``(name, config, options)``: options of :func:`_inputs` and ``compile_for`` (``d``, ``qk``: ``int8`` / ``fp8`` /
#: ``bf16`` Q and K / ``bf16q`` (bf16 Q beside int8 K, quantized in the kernel) / ``tensor`` (int8, one Q and one K
#: scale per tensor), ``k_block``, ``bias``, ``lse``, ``tail``, ``skip``, ``sparse``: block lists; trees before
#: them report those cases as errors, as trees before persistent block-sparse launches report theirs).
_SERIAL_CONFIGS = ("128,3,ahead", "128,2,ahead", "128,2", "64,3,ahead", "128,3,ahead,permk", "128,2,ahead,permk",
                   "128,3,ahead,tarrive", "128,3,ahead,permk,mmasum", "128,2,ahead,permk,mmasum",
                   "128,3,ahead,mmasum", "128,3,ahead,tarrive,mmasum", "128,2,mmasum", "64,3,ahead,mmasum",
                   "128,2,trio", "128,3,trio,permk", "128,3,trio,permk,tarrive", "128,3,trio,permk,mmasum",
                   "128,3,trio,permk,tarrive,mmasum")
TRIO = "128,3,trio,permk,tarrive,mmasum"
AHEAD = "128,3,ahead,mmasum"
SERIAL = "128,3,mmasum"
QUAD = ("128,2,quad,permk,mmasum", "128,4,quad,permk,tarrive,mmasum")
PAIR = "128,3,permk,tarrive,mmasum,pair"
CASES = ([(f"{c} int8 k16", c, {}) for c in _SERIAL_CONFIGS] + [
    (f"{TRIO} int8 k1", TRIO, dict(k_block=1)),
    (f"{TRIO} bf16q k16", TRIO, dict(qk="bf16q")),
    (f"{TRIO} fp8 k16", TRIO, dict(qk="fp8")),
    (f"{TRIO} int8 k16 bias", TRIO, dict(bias=1)),
    (f"{TRIO} int8 k16 lse", TRIO, dict(lse=1)),
    (f"{TRIO} int8 k16 tail", TRIO, dict(tail=1)),
    (f"{TRIO} int8 k16 tail lse", TRIO, dict(tail=1, lse=1)),
    (f"{TRIO} int8 k16 skip1", TRIO, dict(skip=1)),
    (f"{TRIO} int8 k16 skip2", TRIO, dict(skip=2)),
    (f"{TRIO} bf16q k16 d64 bias", TRIO, dict(qk="bf16q", d=64, bias=1)),
    (f"{TRIO} tensor", TRIO, dict(qk="tensor")),
    (f"{AHEAD} tensor", AHEAD, dict(qk="tensor")),
    (f"{AHEAD} int8 k1", AHEAD, dict(k_block=1)),
    (f"{AHEAD} int8 k4", AHEAD, dict(k_block=4)),
    (f"{AHEAD} bf16 k0", AHEAD, dict(qk="bf16")),
    (f"{AHEAD} bf16 k0 d64", AHEAD, dict(qk="bf16", d=64)),
    (f"{AHEAD} bf16q k16", AHEAD, dict(qk="bf16q")),
    (f"{AHEAD} int8 k1 bias", AHEAD, dict(k_block=1, bias=1)),
    (f"{AHEAD} int8 k1 bias d64", AHEAD, dict(k_block=1, bias=1, d=64)),
    (f"{AHEAD} int8 k1 lse tail", AHEAD, dict(k_block=1, lse=1, tail=1)),
    (f"{AHEAD} int8 k16 permk tail", "128,3,ahead,permk", dict(tail=1)),
    (f"{SERIAL} int8 k4 skip1", SERIAL, dict(k_block=4, skip=1)),
    (f"{SERIAL} int8 k1 bias skip2", SERIAL, dict(k_block=1, bias=1, skip=2)),
    (f"{SERIAL} bf16 k0 skip2", "128,3,tarrive,mmasum", dict(qk="bf16", skip=2)),
    ("128,3,permk,mmasum int8 k16 skip2", "128,3,permk,mmasum", dict(skip=2)),
] + [(f"{c} {qk} k16 d64", c, dict(d=64, qk=qk)) for c in QUAD for qk in ("int8", "bf16q")]
    + [(f"{QUAD[0]} fp8 k16 d64 lse tail", QUAD[0], dict(d=64, qk="fp8", lse=1, tail=1))]
    + [("128,3,ahead,permk,mmasum int8 k16 sparse", "128,3,ahead,permk,mmasum", dict(sparse=1)),
       ("128,3,ahead,permk,mmasum int8 k16 bias lse tail sparse", "128,3,ahead,permk,mmasum",
        dict(bias=1, lse=1, tail=1, sparse=1)),
       ("128,3,permk,mmasum fp8 k16 skip2 sparse", "128,3,permk,mmasum", dict(qk="fp8", skip=2, sparse=1)),
       (f"{AHEAD} int8 k1 bias sparse", AHEAD, dict(k_block=1, bias=1, sparse=1)),
       ("128,3,ahead,permk,mmasum bf16q k16 tail sparse", "128,3,ahead,permk,mmasum",
        dict(qk="bf16q", tail=1, sparse=1))]
    + [(f"{TRIO},persist int8 k16", f"{TRIO},persist", {}),
       (f"{TRIO},persist int8 k16 tail lse", f"{TRIO},persist", dict(tail=1, lse=1)),
       (f"{TRIO},persist int8 k16 skip2", f"{TRIO},persist", dict(skip=2)),
       (f"{AHEAD},persist int8 k1 bias", f"{AHEAD},persist", dict(k_block=1, bias=1)),
       ("128,3,ahead,permk,mmasum,persist int8 k16 sparse", "128,3,ahead,permk,mmasum,persist", dict(sparse=1)),
       ("128,3,ahead,permk,mmasum,persist int8 k16 bias lse tail sparse", "128,3,ahead,permk,mmasum,persist",
        dict(bias=1, lse=1, tail=1, sparse=1)),
       ("128,3,ahead,permk,mmasum,persist bf16q k16 tail sparse", "128,3,ahead,permk,mmasum,persist",
        dict(qk="bf16q", tail=1, sparse=1)),
       ("128,3,permk,mmasum,persist fp8 k16 skip2 sparse", "128,3,permk,mmasum,persist",
        dict(qk="fp8", skip=2, sparse=1)),
       (f"{AHEAD},persist int8 k1 bias sparse", f"{AHEAD},persist", dict(k_block=1, bias=1, sparse=1))]
    + [(f"{PAIR} int8 k16", PAIR, {}), (f"{PAIR} int8 k16 lse tail sparse", PAIR, dict(lse=1, tail=1, sparse=1)),
       (f"{PAIR},persist bf16q k16 sparse", f"{PAIR},persist", dict(qk="bf16q", sparse=1)),
       ("128,3,mmasum,pair int8 k1", "128,3,mmasum,pair", dict(k_block=1))])


def _inputs(d=128, s=4096, h=4, qk="int8", k_block=16):
    """Meta tensors of one launch (BSHD Q/K as diffusers writes them, sequence-major V) and its blocks."""
    import torch

    dtype = {"int8": torch.int8, "bf16q": torch.int8, "tensor": torch.int8, "fp8": torch.float8_e4m3fn,
             "bf16": torch.bfloat16}[qk]
    q = torch.empty(1, s, h, d, dtype=torch.bfloat16 if qk == "bf16q" else dtype, device="meta").transpose(1, 2)
    k = torch.empty(1, s, h, d, dtype=dtype, device="meta").transpose(1, 2)
    v = torch.empty(1, h, d, s, dtype=torch.float8_e4m3fn, device="meta").transpose(-1, -2)
    qs = None if qk in ("bf16q", "bf16") else torch.empty(1, h, s, device="meta")
    ks = None if qk == "bf16" else torch.empty(1, h, -(-s // k_block), device="meta")
    vs = torch.empty(1, h, d, device="meta")
    blocks = (0, 0) if qk in ("bf16", "tensor") else (1, k_block)
    if qk == "tensor":
        qs, ks = torch.empty(1, 1, 1, device="meta"), torch.empty(1, 1, 1, device="meta")
    return (q, qs, k, ks, v, vs, *blocks)


def normalize(ptx: str) -> str:
    """PTX without debug information (``.loc``, ``.file``, ``$L__tmpN`` labels, ``.section .debug...``) and with
    ``_param_N`` renumbered in order of first use (a new kernel argument renumbers the rest)."""
    ptx = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    # (``$L__tmpN:`` labels mark inlined functions' scopes for the debug sections only)
    lines = [ln for ln in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b|\$L__tmp\d+:$", ln)]
    text = "\n".join(lines)
    names: dict[str, str] = {}
    return re.sub(r"_param_\d+\b", lambda m: names.setdefault(m.group(0), f"_param_{len(names)}"), text)


def dump(out_dir: str, only: list[str]) -> None:
    """Compile every case with the ``qattn_fx`` on ``sys.path``; write each normalized PTX and ``index.json``."""
    import torch

    from qattn_fx.kernels import gluon_sage as gs
    from qattn_fx.kernels._offline import ptxas_report

    index = {}
    for name, config, opt in CASES:
        if only and not any(o in name for o in only):
            continue
        try:
            cfg = gs.GluonConfig.parse(config)
            q, qs, k, ks, v, vs, qb, kb = _inputs(d=opt.get("d", 128), qk=opt.get("qk", "int8"),
                                                  k_block=opt.get("k_block", 16))
            bias = torch.empty(1, k.shape[2], device="meta") if opt.get("bias") else None
            tail = gs.tail_split.TailPlan(ctas=100, main=60, splits=4, kv_split=1024) if opt.get("tail") else None
            extra = dict(sparse=True) if opt.get("sparse") else {}  # (older trees take no sparse=)
            compiled = gs.compile_for(cfg, q, qs, k, ks, v, vs, qb, kb, return_lse=bool(opt.get("lse")), tail=tail,
                                      key_bias=bias, skip=opt.get("skip", 0), **extra)
            ptx = normalize(compiled.asm["ptx"])
            rep = ptxas_report(compiled, (9, 0))
            file = hashlib.sha1(name.encode()).hexdigest()[:12] + ".ptx"
            with open(os.path.join(out_dir, file), "w") as f:
                f.write(ptx)
            index[name] = dict(sha=hashlib.sha256(ptx.encode()).hexdigest(), file=file, registers=rep["registers"],
                               spills=rep["spill_stores"])
        except Exception as exc:  # noqa: BLE001 - reported per case
            index[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        print(name, index[name].get("sha", index[name].get("error"))[:16], flush=True)
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


def _run_tree(tree: str, out_dir: str, only: list[str]) -> dict:
    """Compile :data:`CASES` from ``tree`` into ``out_dir``; ``tree`` itself if it is an earlier ``--out`` side (a
    directory with an ``index.json``)."""
    if os.path.exists(os.path.join(tree, "index.json")):
        with open(os.path.join(tree, "index.json")) as f:
            index = {k: v for k, v in json.load(f).items() if not only or any(o in k for o in only)}
        for entry in index.values():  # (normalized again: the rules may have grown since)
            if "file" in entry:
                with open(os.path.join(tree, entry["file"])) as f:
                    entry["sha"] = hashlib.sha256(normalize(f.read()).encode()).hexdigest()
        return index
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree),
               TRITON_CACHE_DIR=os.path.join(out_dir, "triton-cache"))
    subprocess.run([sys.executable, os.path.abspath(__file__), "--dump", out_dir,
                    *(f"--only={o}" for o in only)], env=env,
                   cwd=os.path.abspath(tree), check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "index.json")) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", nargs="?", help="the tree compiled first (its directory holds qattn_fx/)")
    parser.add_argument("after", nargs="?", default=".", help="the tree compared with it (default: .)")
    parser.add_argument("--only", action="append", default=[], help="cases whose name contains this (repeatable)")
    parser.add_argument("--out", help="keep each side's normalized PTX here (default: a temporary directory)")
    parser.add_argument("--dump", help=argparse.SUPPRESS)  # (one side, in its own process)
    args = parser.parse_args(argv)
    if args.dump:
        dump(args.dump, args.only)
        return 0
    if not args.before:
        parser.error("give the tree to compare against")
    out = args.out or tempfile.mkdtemp(prefix="ptx_compare.")
    sides = [_run_tree(tree, os.path.join(out, side), args.only)
             for tree, side in ((args.before, "before"), (args.after, "after"))]
    differ = 0
    print(f"{'case':<58} {'PTX':<10} {'regs':>9} {'spills':>11}")
    for name in sides[0]:
        b, a = sides[0][name], sides[1].get(name, dict(error="missing"))
        if "error" in b or "error" in a:
            status = "error"
            differ += 1
            print(f"{name:<58} {status:<10} {b.get('error', '')[:60]} | {a.get('error', '')[:60]}")
            continue
        same = a["sha"] == b["sha"]
        differ += not same
        print(f"{name:<58} {'identical' if same else 'DIFFERS':<10} {b['registers']:>4}/{a['registers']:<4} "
              f"{b['spills']:>5}/{a['spills']:<5}")
    print(f"{len(sides[0]) - differ} of {len(sides[0])} cases identical; PTX under {out}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
