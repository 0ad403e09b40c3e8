"""gluon_sage with and without the tail split (``qattn_fx/kernels/gluon_sage/tail_split.py``), timed in one process, in
turns.

When to use: after changing the tail-split planner, its cost model or the split path of the kernel, to see whether
splitting the partial last wave still pays at a shape. The gain (1-8 %) is smaller than the spread between two
benchmark processes (about 2 %), so the two variants are timed in the same process, alternately::

    python -m tools.ab_tail_split --shapes wan1.3b-480p,flux-1024 [--rounds 5] [--config 128,3,trio,permk,mmasum]

Per shape: each variant captured in a CUDA graph of one call, then ``--rounds`` rounds that replay each variant
(10 replays, CUDA events, median) in turn; prints the per-variant median over rounds, the plan, and a
torch.profiler breakdown of eager split calls (main kernel vs merge kernel). Inputs: the int8 1/16/1 recipe,
quantized as the compiled graph feeds the kernel (:func:`benchmarks.common.quantized_inputs`).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks import common
from benchmarks.shapes import SHAPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.ab_tail_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="wan1.3b-480p,flux-1024", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--config", default=None, help="gluon_sage config (default: the default)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools.ab_tail_split needs an sm_90 GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from qattn_fx import config as qattn_config  # noqa: PLC0415
    from qattn_fx.kernels import gluon_sage as gs  # noqa: PLC0415

    for name in a.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is unknown; valid: {', '.join(SHAPES)}")
        shape = SHAPES[name]
        args = common.quantized_inputs(shape, "int8-1-16")
        sm_scale = shape.d ** -0.5
        config = gs.GluonConfig.parse(a.config) if a.config else gs.DEFAULT_CONFIGS[shape.d]
        replays, plans = {}, {}
        for split in ("1", "0"):
            with gs.use_config(config), qattn_config.patch(gluon_tail_split=split == "1"):
                call = lambda: gs.scaled_attention(*args, sm_scale, torch.bfloat16)  # noqa: E731
                call()
                plans[split] = gs.last_tail_plan()
                replays[split] = common.capture_graph(call, warmup=1)
        times = {s: [] for s in replays}
        for _ in range(a.rounds):
            for s, r in replays.items():
                times[s].append(common.time_ms(r, warmup=1, iters=10, min_iters=10))
        med = {s: statistics.median(t) for s, t in times.items()}
        print(f"{name} {config}: split {med['1']:.4f} ms ({plans['1']}), whole {med['0']:.4f} ms, "
              f"split/whole {med['1'] / med['0']:.4f}; rounds split {['%.4f' % t for t in times['1']]} "
              f"whole {['%.4f' % t for t in times['0']]}", flush=True)
        with (gs.use_config(config), qattn_config.patch(gluon_tail_split=True),
              profile(activities=[ProfilerActivity.CUDA]) as prof):
            for _ in range(3):
                gs.scaled_attention(*args, sm_scale, torch.bfloat16)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                print(f"    {e.device_time_total / 3:10.1f} us/call  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
