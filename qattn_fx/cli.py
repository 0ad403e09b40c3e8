"""``qattn-fx``: look at recipes and decisions from the shell.

    qattn-fx recipes                                   # the accepted (backend, recipe) table (markdown)
    qattn-fx resolve --arch sm_90 --q 1,12,32760,128   # what the default spec does for one site on an arch
    qattn-fx resolve --arch sm_100 --spec spec.json --q 1,40,75600,128 --kv 1,40,512,128 --role cross
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import recipes
from .hardware import Hardware, detect
from .policy import Site, resolve
from .spec import Spec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is invalid; valid: B,H,S,D such as 1,12,32760,128")
    if len(shape) != 4:
        raise argparse.ArgumentTypeError(f"shape {text!r} has {len(shape)} dims; valid: B,H,S,D")
    return shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qattn-fx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("recipes", help="print the accepted (backend, recipe) table")
    r = sub.add_parser("resolve", help="resolve a spec for one attention site")
    r.add_argument("--spec", help="spec file (.json/.yaml, any accepted format); default: the auto spec")
    r.add_argument("--arch", help="cpu or sm_XY (default: this machine)")
    r.add_argument("--lib", action="append", default=[], metavar="NAME=VERSION",
                   help="a library on the hypothetical machine, e.g. flashinfer-python=0.7.4 (repeatable)")
    r.add_argument("--q", type=_shape, required=True, help="query shape B,H,S,D")
    r.add_argument("--kv", type=_shape, help="key/value shape B,H,S,D (default: as --q)")
    r.add_argument("--role", choices=("self", "cross", "joint"), default=None)
    r.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    r.add_argument("--module", default="")
    r.add_argument("--layer", type=int)
    r.add_argument("--num-layers", type=int)
    r.add_argument("--emulate", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "recipes":
        print(recipes.recipe_table_markdown())
        return 0
    libs = dict(item.split("=", 1) for item in args.lib)
    hardware = Hardware.for_arch(args.arch, libs) if args.arch else detect()
    kv = args.kv or args.q
    role = args.role or ("self" if kv[2] == args.q[2] else "cross")
    site = Site(name="cli", module=args.module, layer=args.layer, num_layers=args.num_layers, role=role,
                q_shape=args.q, k_shape=kv, v_shape=kv, dtype=_DTYPES[args.dtype])
    spec = Spec.from_file(args.spec) if args.spec else Spec()
    try:
        decision = resolve(site, hardware, spec, emulate=args.emulate)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"hardware": hardware.describe(), "quantized": decision.quantized,
                      "recipe": decision.recipe.to_dict() if decision.recipe else None, "kernel": decision.kernel,
                      "backend": decision.backend, "reason": decision.reason, "notes": list(decision.notes)},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
