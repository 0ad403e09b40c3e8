"""Launch gluon_sage a few times at one benchmark shape, for Nsight Compute (or a quick timing without it).

    ncu --clock-control none -k regex:_sage_fwd_ws --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        python3 tools/profile_gluon.py --shape wan1.3b-480p --config 128,2,ahead

Three launches per config (two warm-up, one to profile), inputs quantized as the compiled graph feeds them
(benchmarks/tune_triton_sage.make_inputs). Prints the median time of the launches when run without a profiler.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from tune_triton_sage import DEFAULT_SHAPES, RECIPES, make_inputs  # noqa: E402

from qattn_fx.kernels import gluon_sage as gs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="wan1.3b-480p", choices=sorted(DEFAULT_SHAPES))
    parser.add_argument("--recipe", default="int8-1-16", choices=sorted(RECIPES))
    parser.add_argument("--config", action="append", help="gluon_sage config (repeatable); default: the default")
    args = parser.parse_args()
    shape = DEFAULT_SHAPES[args.shape]
    inputs = make_inputs(shape, args.recipe)
    sm_scale = shape[-1] ** -0.5
    for text in args.config or [str(gs.current_config(shape[-1]))]:
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
