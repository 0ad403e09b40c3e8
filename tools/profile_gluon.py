"""Launch gluon_sage a few times at one benchmark shape, for Nsight Compute (or a quick timing without it).

When to use: to see where a gluon_sage config's cycles go (speed of light, warp stall reasons, stalls per SASS
instruction) after a kernel change or before choosing a schedule to try. On the GPU machine
``tools/device_session.sh ncu-gluon`` runs it under ``ncu`` (``PROFILE_ARGS`` passes its arguments, ``NCU_SECTIONS``
the sections); by hand::

    ncu --clock-control none -k regex:_sage_fwd_ws --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        python3 -m tools.profile_gluon --shape wan1.3b-480p --config 128,3,trio,permk,tarrive,mmasum

Three launches per config (two warm-up, one to profile), inputs quantized as the compiled graph feeds them
(:func:`benchmarks.common.quantized_inputs`). Prints the median time of the launches (host-timed; a profiler
slows them).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import common
from benchmarks.shapes import SHAPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_gluon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="wan1.3b-480p", choices=sorted(SHAPES))
    parser.add_argument("--recipe", default="int8-1-16", choices=sorted(common.KERNEL_RECIPES))
    parser.add_argument("--config", action="append", help="gluon_sage config (repeatable); default: the default")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools.profile_gluon needs an sm_90 GPU", file=sys.stderr)
        return 2
    from qattn_fx.kernels import gluon_sage as gs  # noqa: PLC0415

    shape = SHAPES[args.shape]
    inputs = common.quantized_inputs(shape, args.recipe)
    sm_scale = shape.d ** -0.5
    for text in args.config or [str(gs.current_config(shape.d))]:
        config = gs.GluonConfig.parse(text)
        times = []
        with gs.use_config(config):
            for _ in range(3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                gs.scaled_attention(*inputs, sm_scale, torch.bfloat16)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        print(f"{args.shape} {config}: {sorted(times)[1] * 1e3:.3f} ms (median of 3, host-timed)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
