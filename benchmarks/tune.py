"""Sweep the launch configs of one of qattn_fx's Sage kernels on a CUDA GPU: ``triton_sage`` (sm_89 / sm_90) or
``gluon_sage`` (sm_90).

For each shape, quantizes random bf16 Q/K/V once with the recipe's ops (the layouts the compiled graph feeds the
kernel: BSHD Q/K views, sequence-major V; :func:`benchmarks.common.quantized_inputs`), then times the kernel alone
with every config (``triton.testing.do_bench``, median ms; ``--timer graph``: CUDA-graph replays, for calls short
enough that the host's per-call work would be timed, e.g. flux-1024), checks each config's output against a
reference output, and prints a table (config, ms, TFLOP/s with 4·B·H·Sq·Skv·D flops) plus the best config per
shape. ``--out`` writes everything as JSON. Use it to rank configs before changing a kernel's defaults or tuned
list, or to measure a new config flag (the autotuner itself times ``TUNED_CONFIGS`` per problem key at run time)::

    python -m benchmarks.tune --kernel gluon_sage --out bench_out/tune_gluon.json
    python -m benchmarks.tune --kernel gluon_sage --shapes wan1.3b-480p,d64 \\
        --configs "128,3,ahead,permk;128,3,trio,permk,mmasum"
    python -m benchmarks.tune --kernel triton_sage --recipe fp8-1-16 --configs "128,128,8,3,pipe;128,64,8,3"
    python -m benchmarks.tune --kernel triton_sage --shape mine:2:24:8192:8192:128 --shapes none

Configs (``--configs``, ``;``-separated; default: the kernel's ``CONFIGS``, every config its GPU tests run):
``triton_sage`` ``BLOCK_M,BLOCK_N,warps,stages[,pipe]`` (:class:`qattn_fx.kernels.triton_sage.KernelConfig`);
``gluon_sage`` ``BLOCK_N,STAGES[,flags]`` (:class:`qattn_fx.kernels.gluon_sage.GluonConfig`). The reference output
is the first config's for ``triton_sage``, and triton_sage's ``128,128,8,3,pipe`` for ``gluon_sage`` (both kernels
have the same numerics; ``permk`` and ``mmasum`` differ by a summation order or the e4m3-rounded denominator).

``--masked-keys N`` masks the last ``N`` keys of every row (a key-padding mask, as HunyuanVideo's text padding): the
kernels get it as ``qattn::key_bias`` and the SDPA baseline as a boolean ``(B, 1, 1, Skv)`` mask; with
``--mask-spread`` the ``N`` masked keys are spread evenly over the keys instead (every key tile then has some).

Shapes: ``--shapes`` names presets of :mod:`benchmarks.shapes` (default: the self-attention ones), ``--shape
name:B:H:Sq:Skv:D`` adds others. About 2-4 minutes on an H200 with the defaults (compiles dominate;
``--budget-s`` stops the sweep early).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from . import common
from .shapes import SELF_ATTENTION
from .shapes import select as select_shapes

KERNELS = ("triton_sage", "gluon_sage")

#: Configs must agree with the reference output to this max error (relative to max |output|): different tiles
#: round P against different running maxima (~1-3 % element differences); a broken config is off by O(1).
AGREE = 0.1

#: triton_sage's config whose output the gluon_sage configs are checked against.
TRITON_REFERENCE_CONFIG = "128,128,8,3,pipe"


def log(msg: str) -> None:
    print(msg, flush=True)


def bench(fn, warmup_ms: int, rep_ms: int, timer: str = "do_bench") -> float:
    """Median ms of ``fn()``: ``do_bench`` (Triton's: calls queued from the host, L2 flushed between them) or
    ``graph`` (replays of a CUDA graph of one call, :func:`benchmarks.common.time_ms`: the GPU's time alone, for
    calls short enough that the host's per-call work would be timed instead, e.g. gluon_sage at flux-1024 with its
    tail split's two launches)."""
    if timer == "graph":
        return float(common.time_ms(fn, method="graph", iters=1000, budget_ms=rep_ms, warmup=2))
    import triton  # noqa: PLC0415

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", required=True, choices=KERNELS, help="the kernel whose configs are swept")
    parser.add_argument("--shapes", default=",".join(SELF_ATTENTION),
                        help="comma-separated presets of benchmarks/shapes.py, 'all' or 'none' "
                             f"(default {','.join(SELF_ATTENTION)})")
    parser.add_argument("--shape", action="append", default=[], help="extra shape name:B:H:Sq:Skv:D (repeatable)")
    parser.add_argument("--recipe", default="int8-1-16", choices=sorted(common.KERNEL_RECIPES))
    parser.add_argument("--configs", help="';'-separated configs: triton_sage 'BM,BN,warps,stages[,pipe]', "
                        "gluon_sage 'BLOCK_N,STAGES[,flags]' (default: the kernel's CONFIGS)")
    parser.add_argument("--masked-keys", type=int, default=0, metavar="N",
                        help="mask the last N keys of every row (a key-padding mask, passed as key_bias)")
    parser.add_argument("--mask-spread", action="store_true",
                        help="spread the --masked-keys evenly over the keys instead of masking the last ones")
    parser.add_argument("--bf16-q", action="store_true",
                        help="gluon_sage: pass Q in bf16, which the kernel quantizes itself (what int8 recipes with "
                             "a scale per token run in a graph); default: the pre-quantized Q")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--timer", default="do_bench", choices=("do_bench", "graph"),
                        help="do_bench: Triton's, from the host (L2 flushed); graph: CUDA-graph replays, the GPU's "
                             "time without the host's per-call work (L2 not flushed)")
    parser.add_argument("--budget-s", type=float, default=220.0, help="stop starting new configs after this")
    parser.add_argument("--no-baseline", action="store_true", help="skip timing torch SDPA (bf16) per shape")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shapes = select_shapes(args.shapes, args.shape, default=SELF_ATTENTION)
    except ValueError as exc:
        log(f"benchmarks.tune: {exc}")
        return 2
    if not torch.cuda.is_available():
        log("benchmarks.tune: needs a CUDA GPU")
        return 2
    import triton  # noqa: PLC0415

    from qattn_fx.kernels import triton_sage  # noqa: PLC0415

    if args.bf16_q and args.kernel != "gluon_sage":
        log(f"benchmarks.tune: --bf16-q needs --kernel gluon_sage (it quantizes Q itself); got {args.kernel}")
        return 2
    if args.kernel == "gluon_sage":
        from qattn_fx.kernels import gluon_sage as kernel  # noqa: PLC0415

        parse = kernel.GluonConfig.parse
    else:
        kernel = triton_sage
        parse = kernel.KernelConfig.parse
    cap = tuple(torch.cuda.get_device_capability())
    configs = [parse(c) for c in args.configs.split(";")] if args.configs else list(kernel.CONFIGS)
    if args.kernel == "triton_sage" and cap != (9, 0) and not args.configs:  # sm_89: the spill-free subset
        configs = [c for c in configs if c.block_n <= 64 and c.num_warps == 8 and not c.pipe] or configs
    t_start = time.time()
    report = {
        "device": torch.cuda.get_device_name(), "capability": f"sm_{cap[0]}{cap[1]}",
        "torch": torch.__version__, "triton": triton.__version__, "recipe": args.recipe, "kernel": args.kernel,
        "masked_keys": args.masked_keys, "mask_spread": args.mask_spread, "bf16_q": args.bf16_q,
        "flops": "4*B*H*Sq*Skv*D",
        "timing": (f"do_bench median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms" if args.timer == "do_bench"
                   else f"CUDA-graph replay median, {args.rep_ms} ms of replays"),
        "command": "python -m benchmarks.tune " + " ".join(sys.argv[1:] if argv is None else argv),
        "shapes": [],
    }
    log(f"# {args.kernel} tuning on {report['device']} ({report['capability']}), torch {torch.__version__}, "
        f"triton {triton.__version__}, recipe {args.recipe}, {len(configs)} configs x {len(shapes)} shapes")
    stopped = False
    for name, shape in shapes:
        b, h, sq, skv, d = shape
        flops = shape.flops
        log(f"\n## {name}: {shape} ({flops / 1e12:.1f} TFLOP per call)")
        if args.bf16_q:  # the bf16 Q timed; the reference gets it quantized as the kernel does (int8 per token)
            timed = common.quantized_inputs(shape, args.recipe, bf16_q=True)
            inputs = (*torch.ops.qattn.quantize_per_block(timed[0], 1, torch.int8), *timed[2:])
        else:
            inputs = timed = common.quantized_inputs(shape, args.recipe)
        sm_scale = 1.0 / math.sqrt(d)
        mask, extra = None, {}
        if args.masked_keys:
            mask = torch.ones(b, 1, 1, skv, dtype=torch.bool, device="cuda")
            if args.mask_spread:
                mask[..., torch.linspace(0, skv - 1, args.masked_keys, device="cuda").long()] = False
            else:
                mask[..., skv - args.masked_keys:] = False
            extra["key_bias"] = torch.ops.qattn.key_bias(mask, inputs[2])
        entry = {"name": name, "B": b, "H": h, "Sq": sq, "Skv": skv, "D": d, "results": []}
        if not args.no_baseline:
            q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(b, h, skv, d, device="cuda", dtype=torch.bfloat16)
            try:
                ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask),
                           args.warmup_ms, args.rep_ms, args.timer)
                entry["sdpa_bf16_ms"] = ms
                log(f"  torch SDPA bf16 (default backend): {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
            except Exception as exc:  # noqa: BLE001 - informational only
                log(f"  torch SDPA bf16: failed ({exc!r})")
            del q, kv
        first = None
        if args.kernel == "gluon_sage":
            with triton_sage.use_config(TRITON_REFERENCE_CONFIG):
                first = triton_sage.scaled_attention(*inputs, sm_scale, torch.bfloat16, **extra).float()
        log(f"  {'config':<26} {'ms':>9} {'TFLOP/s':>9} {'max|Δ| vs first':>16}  compile+first call")
        for config in configs:
            if time.time() - t_start > args.budget_s:
                log(f"  -- time budget ({args.budget_s:.0f} s) reached: skipping remaining configs/shapes")
                stopped = True
                break
            row = {"config": str(config)}
            try:
                with kernel.use_config(config):
                    t0 = time.time()
                    out = kernel.scaled_attention(*timed, sm_scale, torch.bfloat16, **extra)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.time() - t0, 2)
                    if first is None:
                        first = out.float()
                        row["max_rel_vs_first"] = 0.0
                    else:
                        diff = (out.float() - first).abs().max() / first.abs().max()
                        row["max_rel_vs_first"] = float(diff)
                    del out
                    ms = bench(lambda: kernel.scaled_attention(*timed, sm_scale, torch.bfloat16, **extra),
                               args.warmup_ms, args.rep_ms, args.timer)
                row["ms"] = ms
                row["tflops"] = flops / ms / 1e9
                flag = "" if row["max_rel_vs_first"] < AGREE else "  <-- DIFFERS"
                log(f"  {str(config):<26} {ms:9.3f} {row['tflops']:9.1f} {row['max_rel_vs_first']:16.2e}  "
                    f"{row['first_call_s']:.1f} s{flag}")
            except Exception as exc:  # noqa: BLE001 - report and go on to the next config
                row["error"] = repr(exc)[:500]
                log(f"  {str(config):<26} FAILED: {row['error'][:200]}")
            entry["results"].append(row)
        ok = [r for r in entry["results"] if "ms" in r and r.get("max_rel_vs_first", 1.0) < AGREE]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            entry["best"] = best
            log(f"  best: {best['config']}  {best['ms']:.3f} ms  {best['tflops']:.1f} TFLOP/s")
        report["shapes"].append(entry)
        del inputs, timed, first
        torch.cuda.empty_cache()
        if stopped:
            break
    log("\n# summary (best per shape)")
    for entry in report["shapes"]:
        best = entry.get("best")
        sdpa = entry.get("sdpa_bf16_ms")
        extra = f"  (torch SDPA bf16 {sdpa:.3f} ms, x{sdpa / best['ms']:.2f})" if best and sdpa else ""
        log(f"  {entry['name']:<14} " + (f"{best['config']:<26} {best['ms']:9.3f} ms {best['tflops']:8.1f} TFLOP/s"
                                         if best else "no result") + extra)
    report["wall_s"] = round(time.time() - t_start, 1)
    log(f"# total {report['wall_s']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        log(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
