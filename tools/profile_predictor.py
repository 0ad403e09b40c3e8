"""GPU time of each kernel of the block-sparse predictor (``qattn::predict_blocks``), per benchmark shape.

When to use: when the predictor's share of the dense kernel's time matters (issue #44's 4 % at Wan lengths) or after
changing the pooling or the selection kernel, to see which of them takes the time and how fast the pooling streams
Q and K::

    python -m tools.profile_predictor --shapes wan1.3b-480p,flux-1024 [--keep 0.5] [--mode top_k] [--calls 20]

Runs the op on ``benchmarks.attention_ops``' Gaussian inputs (bf16, ``(B, H, S, D)``) under ``torch.profiler`` and
prints, per shape, every CUDA kernel with its mean time per call and, for the pooling kernel (two launches a call:
Q's tiles, K's tiles), the bandwidth it reads Q and K at (their bytes over its time).
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.shapes import SHAPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_predictor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="wan1.3b-480p,flux-1024", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--keep", type=float, default=0.5, help="the predictor's keep (default 0.5)")
    parser.add_argument("--mode", default="top_k", choices=("top_k", "cdf"), help="the predictor's mode")
    parser.add_argument("--calls", type=int, default=20, help="profiled calls per shape (default 20)")
    parser.add_argument("--pool-launch", default=None, metavar="WARPS,ROWS",
                        help="the pooling kernel's warps per program and tokens per step, in place of "
                             "qattn_fx.kernels.predict_blocks.triton's NUM_WARPS and ROWS (e.g. 8,32)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: {unknown[0]!r} is unknown; valid: {', '.join(SHAPES)}")
    launch = args.pool_launch.split(",") if args.pool_launch else None
    if launch is not None and (len(launch) != 2 or not all(n.isdigit() and int(n) > 0 for n in launch)):
        parser.error(f"--pool-launch {args.pool_launch!r} is invalid; valid: two positive integers WARPS,ROWS, "
                     "e.g. 8,32")
    if not torch.cuda.is_available():
        print("tools.profile_predictor needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    import qattn_fx.ops  # noqa: F401,PLC0415  (registers qattn::*)
    from benchmarks import attention_ops as ao  # noqa: PLC0415
    from qattn_fx.kernels.predict_blocks import triton as fused_pool  # noqa: PLC0415

    if launch is not None:
        fused_pool.NUM_WARPS, fused_pool.ROWS = (int(n) for n in launch)
    print(f"pooling: {fused_pool.NUM_WARPS} warps, {fused_pool.ROWS} tokens per step")

    for name in args.shapes.split(","):
        shape = SHAPES[name]
        q, k, _ = ao.make_inputs(*shape, outliers=False)
        keep = torch.tensor([args.keep], dtype=torch.float32)  # on the CPU: read without a device sync

        def predict():
            return torch.ops.qattn.predict_blocks(q, k, None, q.shape[-1] ** -0.5, None, keep, args.mode, 0, False,
                                                  0.0, "")

        for _ in range(3):
            predict()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                predict()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / args.calls
        print(f"\n## {name}: {shape}; keep {args.keep:g} {args.mode}; GPU time per call {total:.1f} us")
        print(f"  {'us/call':>9}  {'launches':>8}  kernel")
        for e in events:
            us = e.device_time_total / args.calls
            note = ""
            if "_pool_tiles" in e.key:
                gbs = (q.numel() * q.element_size() + k.numel() * k.element_size()) / (us * 1e-6) / 1e9
                note = f"  (reads Q and K at {gbs:.0f} GB/s)"
            print(f"  {us:9.1f}  {e.count // args.calls:8d}  {e.key[:90]}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
