"""GPU time of each kernel of the Inductor-compiled quantize + attention graph, per benchmark shape.

When to use: when the quantize nodes' share of an attention call matters (short sequences such as flux-1024, where
they cost about a third of the kernel's time) or after changing a quantize op, to see which Inductor kernel takes
the time and how fast it streams its bytes::

    python -m tools.profile_quantize --shapes flux-1024,wan1.3b-480p [--method gluon_sage/int8-1-16-1] [--calls 10]
    python -m tools.profile_quantize --triton-quantize qkv,none     # fused Triton kernels, then Inductor's

Compiles ``quantized_attention`` as ``benchmarks.attention_ops`` does (``torch.compile(fullgraph=True)``), runs it
under ``torch.profiler`` and prints, per shape, every CUDA kernel with its mean time per call (Inductor's kernels
carry the names of the ops they fuse; the fused quantize kernels are ``_column_pass``, ``_quantize_blocks`` (Q, then K)
and ``_quantize_channels``). ``--triton-quantize`` profiles each listed ``qattn_fx.config.triton_quantize`` setting
(``none`` for ``""``) in turn. ``TORCH_LOGS=output_code`` shows the generated Triton code.
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import attention_ops as ao
from benchmarks.shapes import SHAPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_quantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="flux-1024,wan1.3b-480p", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--method", default="gluon_sage/int8-1-16-1", help="an attention_ops method name")
    parser.add_argument("--calls", type=int, default=10, help="profiled calls per shape (default 10)")
    parser.add_argument("--triton-quantize", default=None,
                        help="comma-separated qattn_fx.config.triton_quantize settings to profile in turn ('none': "
                             "'', Inductor's kernels only; default: the setting as it is)")
    args = parser.parse_args(argv)
    settings = [None] if args.triton_quantize is None else [
        "" if t == "none" else t for t in args.triton_quantize.split(",")]
    methods = {m.name: m for m in ao.METHODS if m.kind == "qattn"}
    if args.method not in methods:
        raise SystemExit(f"--method {args.method!r} is not a qattn method; valid: {', '.join(methods)}")
    method = methods[args.method]
    if not torch.cuda.is_available():
        print("tools.profile_quantize needs a CUDA GPU", file=sys.stderr)
        return 2
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is unknown; valid: {', '.join(SHAPES)}")
        for setting in settings:
            _profile(name, method, setting, args.calls)
    return 0


def _profile(name: str, method, setting: str | None, calls: int) -> None:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    shape = SHAPES[name]
    q, k, v = ao.make_inputs(*shape, outliers=False)
    fn = ao.compiled_recipe(method.recipe, method.kernel, setting)
    for _ in range(3):
        fn(q, k, v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(q, k, v)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / calls
    label = "" if setting is None else f" triton_quantize={setting!r}"
    print(f"\n## {name} {method.name}{label}: {shape}; GPU time per call {total / 1e3:.4f} ms")
    print(f"  {'us/call':>9}  {'calls':>5}  kernel")
    for e in events:
        print(f"  {e.device_time_total / calls:9.1f}  {e.count // calls:5d}  {e.key[:110]}")


if __name__ == "__main__":
    sys.exit(main())
