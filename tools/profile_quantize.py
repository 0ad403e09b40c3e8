"""GPU time of each kernel of the Inductor-compiled quantize + attention graph, per benchmark shape.

When to use: when the quantize nodes' share of an attention call matters (short sequences such as flux-1024, where
they cost about a third of the kernel's time) or after changing a quantize op, to see which Inductor kernel takes
the time and how fast it streams its bytes::

    python -m tools.profile_quantize --shapes flux-1024,wan1.3b-480p [--method gluon_sage/int8-1-16-1] [--calls 10]

Compiles ``quantized_attention`` as ``benchmarks.attention_ops`` does (``torch.compile(fullgraph=True)``), runs it
under ``torch.profiler`` and prints, per shape, every CUDA kernel with its mean time per call (Inductor's kernels
carry the names of the ops they fuse). ``TORCH_LOGS=output_code`` shows the generated Triton code.

``--fused-kv on,off`` compiles each shape once per setting of ``qattn_fx.config.fused_kv_quantize`` (the fused K/V
quantize, ``_kv_quantize`` after Inductor's ``kv_stats`` reductions, against the separate ops) and prints both
tables and each setting's GPU time per call in quantize kernels (Inductor's and ``_kv_quantize``: ``quantize`` in
the summary line);
``--fused-kv as-set`` (the default) keeps the setting as it is (``$QATTN_FUSED_KV_QUANTIZE``)::

    python -m tools.profile_quantize --shapes flux-1024,d64,wan1.3b-480p --fused-kv on,off
"""
from __future__ import annotations

import argparse
import sys

import torch

import qattn_fx
from benchmarks import attention_ops as ao
from benchmarks.shapes import SHAPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_quantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="flux-1024,wan1.3b-480p", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--method", default="gluon_sage/int8-1-16-1", help="an attention_ops method name")
    parser.add_argument("--calls", type=int, default=10, help="profiled calls per shape (default 10)")
    parser.add_argument("--fused-kv", default="as-set",
                        help="comma-separated settings of qattn_fx.config.fused_kv_quantize to compile each shape "
                             "with: on, off; as-set (default): as it is")
    args = parser.parse_args(argv)
    settings = args.fused_kv.split(",")
    if args.fused_kv != "as-set" and not set(settings) <= set(FUSED_KV):
        raise SystemExit(f"--fused-kv {args.fused_kv!r} is invalid; valid: as-set, or a comma-separated list of "
                         f"{', '.join(FUSED_KV)}")
    methods = {m.name: m for m in ao.METHODS if m.kind == "qattn"}
    if args.method not in methods:
        raise SystemExit(f"--method {args.method!r} is not a qattn method; valid: {', '.join(methods)}")
    method = methods[args.method]
    if not torch.cuda.is_available():
        print("tools.profile_quantize needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is unknown; valid: {', '.join(SHAPES)}")
        shape = SHAPES[name]
        q, k, v = ao.make_inputs(*shape, outliers=False)
        for setting in settings:
            patch = {} if setting == "as-set" else {"fused_kv_quantize": FUSED_KV[setting]}
            # profiled under the setting it compiled with: calls outside it compiled again inside the profile
            with qattn_fx.config.patch(**patch):
                fn = ao.compiled_recipe(method.recipe, method.kernel)
                for _ in range(3):
                    fn(q, k, v)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.calls):
                        fn(q, k, v)
                    torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            events.sort(key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events) / args.calls
            quantize = sum(e.device_time_total for e in events if is_quantize(e.key)) / args.calls
            label = "" if setting == "as-set" else f" fused_kv={setting}"
            print(f"\n## {name} {method.name}{label}: {shape}; GPU time per call {total / 1e3:.4f} ms, quantize "
                  f"{quantize:.1f} us")
            print(f"  {'us/call':>9}  {'calls':>5}  kernel")
            for e in events:
                print(f"  {e.device_time_total / args.calls:9.1f}  {e.count // args.calls:5d}  {e.key[:110]}")
    return 0


#: ``--fused-kv`` words and the settings they stand for.
FUSED_KV = {"on": True, "off": False}


def is_quantize(kernel: str) -> bool:
    """Whether a profiled kernel quantizes (one of Inductor's, ``triton_...``, or the fused K/V quantize)."""
    return kernel.startswith("triton_") or kernel == "_kv_quantize"


if __name__ == "__main__":
    sys.exit(main())
