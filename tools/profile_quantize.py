"""GPU time of each kernel of the Inductor-compiled quantize + attention graph, per benchmark shape.

    python3 tools/profile_quantize.py --shapes flux-1024,wan1.3b-480p [--method gluon_sage/int8-1-16-1] [--calls 10]

Compiles ``quantized_attention`` as benchmarks/attention_ops.py does (``torch.compile(fullgraph=True)``), runs it
under ``torch.profiler`` and prints, per shape, every CUDA kernel with its mean time per call (Inductor's kernels
carry the names of the ops they fuse). ``TORCH_LOGS=output_code`` shows the generated Triton code.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
import attention_ops as ao  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="flux-1024,wan1.3b-480p", help=f"comma-separated: {', '.join(ao.SHAPES)}")
    parser.add_argument("--method", default="gluon_sage/int8-1-16-1", help="an attention_ops method name")
    parser.add_argument("--calls", type=int, default=10, help="profiled calls per shape (default 10)")
    args = parser.parse_args()
    methods = {m.name: m for m in ao.METHODS if m.kind == "qattn"}
    if args.method not in methods:
        raise SystemExit(f"--method {args.method!r} is not a qattn method; valid: {', '.join(methods)}")
    method = methods[args.method]
    for name in args.shapes.split(","):
        if name not in ao.SHAPES:
            raise SystemExit(f"--shapes: {name!r} is unknown; valid: {', '.join(ao.SHAPES)}")
        b, h, sq, skv, d = ao.SHAPES[name]
        q, k, v = ao.make_inputs(b, h, sq, skv, d, outliers=False)
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
        print(f"\n## {name} {method.name}: B{b} H{h} Sq{sq} Skv{skv} D{d}; GPU time per call {total / 1e3:.4f} ms")
        print(f"  {'us/call':>9}  {'calls':>5}  kernel")
        for e in events:
            print(f"  {e.device_time_total / args.calls:9.1f}  {e.count // args.calls:5d}  {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
