"""``qattn-fx``: look at recipes and decisions from the shell (also ``python -m qattn_fx``).

    qattn-fx recipes                                   # the accepted (backend, recipe) table (markdown)
    qattn-fx resolve --arch sm_90 --q 1,12,32760,128   # what the default spec does for one site on an arch
    qattn-fx resolve --arch sm_100 --spec spec.json --q 1,40,75600,128 --kv 1,40,512,128 --role cross
    qattn-fx inspect qattn_fx.tiny_models:wan --emulate              # every site of a model, as the backend sees it
    qattn-fx inspect --config config.json --class WanTransformer3DModel --arch sm_90 --frames 21 --height 60
    qattn-fx calibrate --model qattn_fx.tiny_models:wan --calls 3 --budget cos=0.9999 --emulate --out spec.json
    qattn-fx calibrate --model qattn_fx.tiny_models:wan --calls 3 --block-sparse-target 0.5 --out spec.json

A named --arch is a supported install of that architecture: every library that qattn_fx's kernels for it need,
at the minimum version the recipe table names (shown in the output); --lib NAME=VERSION overrides one, --bare
assumes none.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

from . import recipes
from .version import __version__
from .hardware import Hardware, detect, supported_libraries
from .policy import resolve
from .site import Site
from .spec import Spec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class UsageError(Exception):
    """A bad command-line value: printed as one ``qattn-fx: error: ...`` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + line: the valid choices are in the message or --help
        raise UsageError(f"{message} (see {self.prog} --help)")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is invalid; valid: B,H,S,D such as 1,12,32760,128")
    if len(shape) != 4:
        raise argparse.ArgumentTypeError(f"shape {text!r} has {len(shape)} dims; valid: B,H,S,D")
    return shape


def _lib(text: str) -> tuple[str, str]:
    name, sep, version = text.partition("=")
    if not sep or not name or not version:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; valid: NAME=VERSION such as flashinfer-python=0.7.4")
    return name, version


def _supported_installs() -> str:
    archs = dict.fromkeys(a for row in recipes.TABLE for req in row.implementations if req.kernel
                          for a in req.archs or ())
    return "; ".join(f"{a}: " + (", ".join(f"{k} {v}" for k, v in supported_libraries(a).items()) or "none")
                     for a in sorted(archs))


def _add_hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", help="cpu or sm_XY such as sm_90, sm_100 (default: this machine). A named arch is "
                   "assumed to have a supported install, every library its kernels need at the minimum version: "
                   + _supported_installs())
    p.add_argument("--lib", action="append", default=[], type=_lib, metavar="NAME=VERSION",
                   help="a library version on the --arch machine, replacing the assumed one, e.g. cudnn=9.19.0 "
                   "(repeatable)")
    p.add_argument("--bare", action="store_true", help="with --arch: assume no libraries but those of --lib")
    p.add_argument("--spec", help="spec file (.json/.yaml, any accepted format); default: the auto spec")
    p.add_argument("--emulate", action="store_true",
                   help="run every recipe on the reference kernel, and say what the deployment target would do")
    p.add_argument("--target", action="append", default=None, metavar="ARCH",
                   help="with --emulate: the arch the emulated sites deploy on, as a supported install "
                   "(repeatable; default: the archs of the recipe's backend)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qattn-fx", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"qattn-fx {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("recipes", help="print the accepted (backend, recipe) table")

    r = sub.add_parser("resolve", help="resolve a spec for one attention site")
    _add_hardware_args(r)
    r.add_argument("--q", type=_shape, required=True, help="query shape B,H,S,D")
    r.add_argument("--kv", type=_shape, help="key/value shape B,H,S,D (default: as --q)")
    r.add_argument("--role", choices=("self", "cross", "joint"), default=None)
    r.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    r.add_argument("--module", default="")
    r.add_argument("--layer", type=int)
    r.add_argument("--num-layers", type=int)

    i = sub.add_parser("inspect", help="trace a model once and print the site table the backend would produce",
                       description="Build a model, trace it once with qattn_fx.explain (under torch.no_grad(), "
                       "nothing is compiled) and print every attention site with its decision.")
    i.add_argument("model", nargs="?", help="module:factory, e.g. qattn_fx.tiny_models:wan; the factory returns "
                   "(model, inputs) with inputs a dict of keyword arguments or a tuple of positional ones, or a "
                   "model with an example_inputs attribute (a dict/tuple, or a callable returning one)")
    i.add_argument("--config", help="a diffusers model config.json (random weights, no download); with --class")
    i.add_argument("--class", dest="cls", metavar="CLASS",
                   help=f"the diffusers class of --config; inputs are made for {', '.join(_known_classes())}")
    i.add_argument("--batch", type=int, default=1, help="--config inputs: batch size (default 1)")
    i.add_argument("--frames", type=int, default=2, help="--config inputs: latent frames (video models; default 2)")
    i.add_argument("--height", type=int, default=16, help="--config inputs: latent height (default 16)")
    i.add_argument("--width", type=int, default=16, help="--config inputs: latent width (default 16)")
    i.add_argument("--text-len", type=int, default=12, help="--config inputs: text tokens (default 12)")
    i.add_argument("--dtype", choices=tuple(_DTYPES),
                   help="the model's dtype (default: bf16 for a GPU arch, as pipelines run; else fp32)")
    _add_hardware_args(i)
    i.add_argument("--json", action="store_true", help="print report.to_dict() as JSON (every field, full text)")
    i.add_argument("--markdown", action="store_true", help="print the full site table as markdown")
    i.add_argument("--width-chars", type=int, default=120, metavar="N", help="table width (default 120)")

    c = sub.add_parser("calibrate", help="measure every attention site under candidate recipes on a model's calls "
                       "and write the fastest plan inside an error budget as a spec",
                       description="Run the model's calls densely with every attention site intercepted, run each "
                       "candidate recipe on each site's real Q/K/V (emulated, or on this machine's kernels), and "
                       "write per site the fastest candidate inside the budget (dense when none is) as a spec; "
                       "prints a line per site and call, then the table and the plan.")
    c.add_argument("--model", help="module:factory. The factory returns (model, calls): calls is a callable taking "
                   "the number of calls and returning that many call inputs, a list of call inputs, or one call's "
                   "inputs for a diffusers model of a known class (then --calls calls are made, noise levels from "
                   "high to low). Call inputs: a dict of keyword arguments, a tuple of positional ones, or an "
                   "(args, kwargs) pair")
    c.add_argument("--config", help="a diffusers model config.json (random weights); with --class")
    c.add_argument("--class", dest="cls", metavar="CLASS", help="the diffusers class of --config")
    c.add_argument("--calls", type=int, default=4, help="how many calls to calibrate on (default 4)")
    c.add_argument("--budget", help="per-site and/or end-to-end bounds: cos=0.999, rel_l1=0.05, "
                   "max_abs=..., e2e_cos=0.995, e2e_rel_l1=0.02 (comma-separated); required unless "
                   "--block-sparse-target is given")
    c.add_argument("--candidates", help="comma-separated recipe ids to try, e.g. int8-1-16-1,bf16-0-0-1 (default: "
                   "int8-1-16-1,fp8-1-16-1,bf16-0-0-1); block-sparse ones with +cdfM, +top_kF or +targetS, e.g. "
                   "int8-1-16-1+cdf0.9")
    c.add_argument("--block-sparse-target", type=float, metavar="S", help="block sparsity's target_sparsity: "
                   "without --budget, fit cdf (or top_k) per site so that each skips the fraction S of its blocks on "
                   "the calls (qattn_fx.calibrate_block_sparse, the recipe of the first --candidates id, default the "
                   "default recipe) and write that spec; with --budget, each candidate is also tried with +targetS")
    c.add_argument("--block-sparse-mode", choices=("cdf", "top_k"), default="cdf",
                   help="--block-sparse-target without --budget: what is fitted (default cdf)")
    c.add_argument("--per", choices=("site", "model"), default="site",
                   help="--block-sparse-target without --budget: one value per site (default) or for the model")
    c.add_argument("--emulate", action="store_true", help="run candidates on the reference kernel (any device)")
    c.add_argument("--arch", help="where the plan deploys (speed lookups; without --emulate also the kernels' "
                   "machine), e.g. sm_90; default: this machine, or each recipe's first arch when emulated")
    c.add_argument("--out", required=True, help="where to write the spec (JSON)")
    c.add_argument("--table", help="where to write the whole calibration (JSON; Calibration.save)")
    c.add_argument("--plot", help="where to write the plot (PNG; needs matplotlib)")
    for name, default in (("--batch", 1), ("--frames", 2), ("--height", 16), ("--width", 16), ("--text-len", 12)):
        c.add_argument(name, type=int, default=default, help=f"--config inputs (default {default})")
    return parser


def _known_classes() -> tuple[str, ...]:
    from .tiny_models import KNOWN_CLASSES

    return KNOWN_CLASSES


def _hardware(args) -> tuple[Hardware, str | None]:
    """The machine to resolve for, and a line saying which libraries were assumed (None: detected)."""
    libs = dict(args.lib)
    if not args.arch:
        if args.lib or args.bare:
            raise UsageError("--lib and --bare describe the --arch machine; add --arch (e.g. --arch sm_90)")
        return detect(), None
    if args.bare:
        hardware = Hardware.for_arch(args.arch, libs)
        return hardware, f"assumed libraries: {_libs(hardware.libraries)} (--bare)"
    hardware = Hardware.supported_install(args.arch, libs)
    what = (f"a supported install of {args.arch} (each library at the minimum version its kernels need)"
            if supported_libraries(args.arch) else f"no libraries (no kernel of qattn_fx targets {args.arch})")
    overridden = f", with --lib {_libs(libs)}" if libs else ""
    return hardware, f"assumed {what}{overridden}"


def _libs(libs: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(libs.items())) or "none"


def _spec(args) -> Spec:
    if not args.spec:
        return Spec()
    if not Path(args.spec).exists():
        raise UsageError(f"--spec {args.spec!r}: no such file")
    try:
        return Spec.from_file(args.spec)
    except (ValueError, TypeError) as e:  # a bad spec, a directory, an unreadable file
        raise UsageError(f"--spec {args.spec!r}: {e}")


def _target(args, hardware: Hardware):
    """Where emulated sites deploy: --target, else the --arch machine, else (None) the recipe backend's archs."""
    if args.target is None:
        return [hardware] if args.emulate and args.arch else None
    if not args.emulate:
        raise UsageError("--target names where emulated sites deploy; add --emulate (or use --arch to resolve "
                         "for another machine)")
    return [Hardware.supported_install(a) for a in args.target]


def _resolve(args) -> int:
    hardware, assumed = _hardware(args)
    spec, target = _spec(args), _target(args, hardware)
    kv = args.kv or args.q
    role = args.role or ("self" if kv[2] == args.q[2] else "cross")
    site = Site(name="cli", module=args.module, layer=args.layer, num_layers=args.num_layers, role=role,
                q_shape=args.q, k_shape=kv, v_shape=kv, dtype=_DTYPES[args.dtype])
    decision = resolve(site, hardware, spec, emulate=args.emulate, target=target)
    out = {"hardware": hardware.describe(), "libraries": assumed or "detected on this machine",
           "quantized": decision.quantized, "recipe": decision.recipe.to_dict() if decision.recipe else None,
           "kernel": decision.kernel, "backend": decision.backend, "reason": decision.reason,
           "notes": list(decision.notes)}
    if decision.block_sparse is not None:
        out["block_sparse"] = decision.block_sparse.to_dict()
    if decision.deployment:
        out["deployment"] = str(decision.deployment)
    print(json.dumps(out, indent=1))
    return 0


def _load_factory(ref: str):
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"model {ref!r} is invalid; valid: module:factory such as qattn_fx.tiny_models:wan")
    sys.path.insert(0, os.getcwd())  # a factory in a file of the current directory, as `python -m` finds it
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"model {ref!r}: cannot import {module_name!r}: {e}")
    finally:
        sys.path.pop(0)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n)))
            raise UsageError(f"model {ref!r}: {module_name} has no {part!r}; callables there: {', '.join(names)}")
        obj = getattr(obj, part)
    return obj


def _as_call(inputs) -> tuple[tuple, dict]:
    if callable(inputs):
        inputs = inputs()
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _model_and_inputs(args, dtype: torch.dtype | None):
    """(model, args, kwargs, description) from ``module:factory`` or ``--config`` + ``--class``."""
    if bool(args.model) == bool(args.config):
        raise UsageError("give a model as module:factory (e.g. qattn_fx.tiny_models:wan) or --config PATH --class "
                         "NAME, not both or neither")
    if args.config:
        if not args.cls:
            raise UsageError(f"--config needs --class; classes with example inputs: {', '.join(_known_classes())}")
        import diffusers

        from .tiny_models import example_inputs

        cls = getattr(diffusers, args.cls, None)
        if args.cls not in _known_classes() or cls is None:
            raise UsageError(f"--class {args.cls!r} is invalid; valid: {', '.join(_known_classes())} (other models: "
                             "module:factory returning (model, inputs))")
        try:
            config = json.loads(Path(args.config).read_text())
        except FileNotFoundError:
            raise UsageError(f"--config {args.config!r}: no such file")
        except json.JSONDecodeError as e:
            raise UsageError(f"--config {args.config!r} is not JSON: {e}")
        torch.manual_seed(0)
        model = cls.from_config(config).eval()
        if dtype is not None:
            model = model.to(dtype)
        kwargs = example_inputs(model, batch=args.batch, frames=args.frames, height=args.height, width=args.width,
                                text_len=args.text_len)
        return model, (), kwargs, f"{args.cls} from {args.config} (random weights)"
    made = _load_factory(args.model)
    made = made() if callable(made) and not isinstance(made, torch.nn.Module) else made
    if isinstance(made, tuple) and len(made) == 2:
        model, inputs = made
    elif hasattr(made, "example_inputs"):
        model, inputs = made, made.example_inputs
    else:
        raise UsageError(f"model {args.model!r} gave {type(made).__name__}; valid: (model, inputs) or a model with "
                         "an example_inputs attribute")
    call_args, kwargs = _as_call(inputs)
    if dtype is not None:
        model = model.to(dtype)
        cast = lambda v: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
        call_args, kwargs = tuple(map(cast, call_args)), {k: cast(v) for k, v in kwargs.items()}
    return model, call_args, kwargs, f"{type(model).__name__} from {args.model}"


def _inspect(args) -> int:
    from .explain import explain

    try:  # diffusers warns about casting a model with float32 modules to bf16: not the point here
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    except ImportError:
        pass
    hardware, assumed = _hardware(args)
    spec, target = _spec(args), _target(args, hardware)
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if hardware.device == "cuda" else None)
    model, call_args, kwargs, what = _model_and_inputs(args, dtype)
    with torch.no_grad():
        report = explain(model, *call_args, spec=spec, emulate=args.emulate, hardware=hardware, target=target,
                         **kwargs)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in kwargs.items() if torch.is_tensor(v))
    print(f"qattn_fx {__version__}: {what}")
    print(f"inputs: {shapes or ', '.join(str(tuple(a.shape)) for a in call_args if torch.is_tensor(a))}")
    print(f"hardware: {hardware.describe()}" + (f"; {assumed}" if assumed else " (this machine)")
          + ("; emulated (reference kernel)" if args.emulate else ""))
    print()
    print(report.markdown() if args.markdown else report.table(width=args.width_chars))
    print(report.summary())
    return 0


def _as_call_pair(item) -> tuple[tuple, dict]:
    """One call's inputs as ``(args, kwargs)``: a pair, a dict of keyword arguments, a tuple/list of positional ones,
    or one tensor."""
    if (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (tuple, list))
            and isinstance(item[1], dict)):
        return tuple(item[0]), dict(item[1])
    return _as_call(item)


def _calibration_calls(args) -> tuple[object, list, list[str] | None, str]:
    """(model, calls, labels or None, description) for ``qattn-fx calibrate``."""
    from .tiny_models import example_calls

    if args.calls < 1:
        raise UsageError(f"--calls {args.calls} is invalid; valid: an int >= 1")
    if args.config:
        model, _, _, what = _model_and_inputs(args, None)
        calls, labels = example_calls(model, args.calls, batch=args.batch, frames=args.frames, height=args.height,
                                      width=args.width, text_len=args.text_len)
        return model, calls, labels, what
    if not args.model:
        raise UsageError("give a model as --model module:factory or --config PATH --class NAME")
    made = _load_factory(args.model)
    made = made() if callable(made) and not isinstance(made, torch.nn.Module) else made
    if not (isinstance(made, tuple) and len(made) == 2):
        raise UsageError(f"model {args.model!r} gave {type(made).__name__}; valid: (model, calls)")
    model, calls = made
    what = f"{type(model).__name__} from {args.model}"
    if callable(calls):
        return model, [_as_call_pair(c) for c in calls(args.calls)], None, what
    if isinstance(calls, list):
        if len(calls) < args.calls:
            raise UsageError(f"model {args.model!r} gave {len(calls)} calls; --calls {args.calls} needs as many")
        return model, [_as_call_pair(c) for c in calls[:args.calls]], None, what
    if args.calls == 1:
        return model, [_as_call_pair(calls)], None, what
    if type(model).__name__ in _known_classes():
        base = _as_call_pair(calls)[1]
        sizes = {k: v for k, v in (("dtype", next(model.parameters()).dtype),)}
        made_calls, labels = example_calls(model, args.calls, **sizes)
        for _, kwargs in made_calls:  # the factory's sizes win: same shapes, new noise and timestep
            for key, value in base.items():
                if key not in kwargs or not torch.is_tensor(value) or kwargs[key].shape != value.shape:
                    kwargs[key] = value
        return model, made_calls, labels, what
    raise UsageError(f"model {args.model!r} gave one call's inputs; --calls {args.calls} needs (model, calls) with "
                     "calls a callable n -> n call inputs or a list of call inputs")


def _calibrate(args) -> int:
    from .calibration import calibrate

    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    except ImportError:
        pass
    candidates = args.candidates.split(",") if args.candidates else None
    if args.budget is None and args.block_sparse_target is None:
        raise UsageError("give --budget (an error budget), --block-sparse-target (a block sparsity to fit), or both")
    hardware = Hardware.supported_install(args.arch) if args.arch else None
    model, calls, labels, what = _calibration_calls(args)
    if args.budget is None:
        return _calibrate_block_sparse(args, model, calls, candidates, what)
    if args.block_sparse_target is not None:
        from .calibration.candidates import DEFAULT_CANDIDATES, make_candidates

        plain = [c.name for c in make_candidates(candidates or DEFAULT_CANDIDATES) if c.use.block_sparse is None]
        candidates = (candidates or plain) + [f"{n}+target{args.block_sparse_target:g}" for n in plain]
    print(f"qattn_fx {__version__}: calibrating {what} on {len(calls)} call(s), budget {args.budget}"
          + (" (emulated)" if args.emulate else ""), flush=True)
    result = calibrate(model, calls, budget=args.budget, candidates=candidates, emulate=args.emulate,
                       hardware=hardware, labels=labels, progress=lambda line: print(line, flush=True))
    print()
    print(result)
    _write_spec(result.spec, args.out)
    if args.table:
        print(f"wrote the calibration to {result.save(args.table)}")
    if args.plot:
        print(f"wrote the plot to {result.plot(args.plot)}")
    return 0


def _write_spec(spec, path: str) -> None:
    """Write a calibrated spec as JSON to ``path`` (creating its folder) and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(spec.to_json(indent=1) + "\n")
    print(f"wrote the spec to {out}")


def _calibrate_block_sparse(args, model, calls, candidates, what) -> int:
    """``qattn-fx calibrate --block-sparse-target S`` without a budget: :func:`qattn_fx.calibrate_block_sparse`."""
    from .calibration import calibrate_block_sparse
    from .calibration.candidates import parse_id
    from .spec import Spec

    spec = Spec(default=parse_id(candidates[0])) if candidates else Spec()
    print(f"qattn_fx {__version__}: fitting block sparsity ({args.block_sparse_mode}, per {args.per}) to skip "
          f"{args.block_sparse_target:g} of the blocks of {what} on {len(calls)} call(s)", flush=True)
    result = calibrate_block_sparse(model, calls, args.block_sparse_target, spec=spec, per=args.per,
                                    mode=args.block_sparse_mode)
    print(result)
    _write_spec(result.spec, args.out)
    if args.table:
        table = Path(args.table)
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"wrote the fit to {table}")
    if args.plot:
        print("--plot: no plot for a block-sparsity fit without --budget (the fit per site is in --table)")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = _parser().parse_args(argv)
            if args.command == "recipes":
                print(recipes.recipe_table_markdown())
                code = 0
            elif args.command == "resolve":
                code = _resolve(args)
            elif args.command == "calibrate":
                code = _calibrate(args)
            else:
                code = _inspect(args)
            sys.stdout.flush()
            return code
        except UsageError as e:
            print(f"qattn-fx: error: {e}", file=sys.stderr)
            return 2
        except ValueError as e:  # a spec or arch the policy refuses: its message names the value and the choices
            print(f"qattn-fx: error: {e}", file=sys.stderr)
            return 2
    except BrokenPipeError:  # `qattn-fx recipes | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
