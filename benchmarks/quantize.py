"""The quantize passes per operand: the fused Triton kernels against Inductor's kernels of the aten definitions.

    python -m benchmarks.quantize --shapes flux-1024,wan1.3b-480p [--timer graph] [--out bench_out/quantize.json]
    python -m benchmarks.quantize --shapes flux-1024 --sweep "BLOCK_ROWS=32,64;SMOOTH_TILES=1,2,4"

Per shape and operand of the default recipe (Q: int8 per token; K: smoothed, int8 per 16 tokens; V: e4m3 per
channel, sequence-major), on bf16 ``(B, H, S, D)`` views of ``(B, S, H, D)`` buffers, times

* ``fused``: the op a graph runs with ``qattn_fx.config.triton_quantize`` naming the operand
  (``qattn::fused_quantize_*``, :mod:`qattn_fx.kernels.triton_quantize`);
* ``inductor``: ``torch.compile`` of the aten ops (``smooth_k`` + ``quantize_per_block``, ``quantize_per_channel``),
  what a graph with the setting empty runs when nothing else fuses with them;

checks the fused outputs against the eager aten ops (bit for bit; K's data may differ by one unit where its mean,
summed in another order, moves a value across a rounding boundary: mismatches are counted), and reports µs and the
bandwidth over the bytes each operand must move at least (bf16 read once, 8-bit data and scales written once).
``--sweep NAME=v1,v2;...`` times the fused ops again with each value of a launch constant of
:mod:`qattn_fx.kernels.triton_quantize.launch` (one constant at a time, the others at their defaults).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from . import common
from .shapes import select as select_shapes

FP8 = torch.float8_e4m3fn
SWEEPABLE = ("BLOCK_ROWS", "SMOOTH_ROWS", "SMOOTH_TILES", "CHANNEL_ROWS", "TARGET_PROGRAMS", "MAX_PARTIALS",
             "WARP_ELEMENTS")


def operands(q, k, v) -> dict[str, tuple[Callable, Callable]]:
    """Operand name → (fused call, aten call) on the given tensors."""
    ops = torch.ops.qattn
    return {
        "Q int8/token": (lambda: ops.fused_quantize_per_block(q, 1, torch.int8, False),
                         lambda: ops.quantize_per_block(q, 1, torch.int8)),
        "K smooth int8/16": (lambda: ops.fused_quantize_per_block(k, 16, torch.int8, True),
                             lambda: ops.quantize_per_block(ops.smooth_k(k), 16, torch.int8)),
        "V e4m3/channel": (lambda: ops.fused_quantize_per_channel(v, FP8, True),
                           lambda: ops.quantize_per_channel(v, FP8, True)),
    }


def compiled(fn: Callable) -> Callable:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False)


def compare(got, want) -> dict:
    """``exact`` (scales and data bit-identical) or the count and largest size of data mismatches."""
    (data, scale), (ref_data, ref_scale) = got, want
    bits = (lambda t: t.view(torch.uint8).int()) if data.dtype == FP8 else (lambda t: t.int())
    diff = (bits(data) - bits(ref_data)).abs()
    return {"scales_equal": bool(torch.equal(scale, ref_scale)), "data_mismatches": int((diff > 0).sum()),
            "data_max_diff": int(diff.max()), "elements": data.numel()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="flux-1024,wan1.3b-480p", help="comma-separated preset names")
    parser.add_argument("--shape", action="append", default=[], help="extra shape name:B:H:Sq:Skv:D (repeatable)")
    parser.add_argument("--timer", choices=("events", "do_bench", "graph"), default="graph")
    parser.add_argument("--sweep", default="", help=f"NAME=v1,v2;... over {', '.join(SWEEPABLE)}")
    parser.add_argument("--out", default="bench_out/quantize.json", help="JSON output path")
    args = parser.parse_args(argv)
    sweep = []
    for item in filter(None, args.sweep.split(";")):
        name, _, values = item.partition("=")
        if name not in SWEEPABLE or not values:
            raise SystemExit(f"--sweep {item!r} is invalid; valid: NAME=v1,v2 with NAME one of {', '.join(SWEEPABLE)}")
        sweep += [(name, int(x)) for x in values.split(",")]
    shapes = select_shapes(args.shapes, args.shape)
    if not torch.cuda.is_available():
        print("benchmarks.quantize needs a CUDA GPU", file=sys.stderr)
        return 2
    import qattn_fx.ops  # noqa: F401,PLC0415  (registers qattn::*)
    from qattn_fx.kernels.triton_quantize import launch  # noqa: PLC0415

    rows = []
    for shape_name, (b, h, _, skv, d) in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, skv, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
        k = k + 3 * torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)  # channel offsets (smoothing)
        elements = b * h * skv * d
        min_bytes = {"Q int8/token": 3 * elements + 4 * b * h * skv, "K smooth int8/16": 3 * elements,
                     "V e4m3/channel": 3 * elements}
        for name, (fused, aten) in operands(q, k, v).items():
            row = {"shape": shape_name, "operand": name, **compare(fused(), aten())}
            inductor = compiled(aten)
            row["inductor_vs_eager"] = compare(inductor(), aten())
            row["us_fused"] = 1e3 * common.time_ms(fused, method=args.timer)
            row["us_inductor"] = 1e3 * common.time_ms(inductor, method=args.timer)
            row["gbps_fused"] = min_bytes[name] / row["us_fused"] / 1e3
            row["gbps_inductor"] = min_bytes[name] / row["us_inductor"] / 1e3
            for const, value in sweep:
                default = getattr(launch, const)
                setattr(launch, const, value)
                try:
                    row[f"us_fused_{const}={value}"] = 1e3 * common.time_ms(fused, method=args.timer)
                finally:
                    setattr(launch, const, default)
            rows.append(row)
            common.log(f"{shape_name} {name}: fused {row['us_fused']:.1f} us ({row['gbps_fused']:.0f} GB/s), "
                       f"inductor {row['us_inductor']:.1f} us ({row['gbps_inductor']:.0f} GB/s); mismatches "
                       f"{row['data_mismatches']}/{row['elements']} (max {row['data_max_diff']}), scales equal "
                       f"{row['scales_equal']}; inductor vs eager: {row['inductor_vs_eager']}"
                       + "".join(f"; {key[9:]}: {val:.1f} us" for key, val in row.items()
                                 if key.startswith("us_fused_")))
        del q, k, v
    for shape_name, _ in shapes:
        mine = [r for r in rows if r["shape"] == shape_name]
        common.log(f"{shape_name} total: fused {sum(r['us_fused'] for r in mine):.1f} us, inductor "
                   f"{sum(r['us_inductor'] for r in mine):.1f} us")
    common.write_json(args.out, {"env": common.environment(), "timer": args.timer, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
