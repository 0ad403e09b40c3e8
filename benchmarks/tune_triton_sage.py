"""Sweep the launch configs of qattn_fx's Triton SageAttention kernel on a CUDA GPU (sm_89 / sm_90).

For each shape, quantizes random bf16 Q/K/V once with the recipe's ops (the layouts the compiled graph feeds
the kernel: BSHD Q/K views, sequence-major V), then times the kernel alone with every config in
``qattn_fx.kernels.triton_sage.CONFIGS`` (``triton.testing.do_bench``, median ms), checks each config's output
against the first config's, and prints a table (config, ms, TFLOP/s with 4·B·H·Sq·Skv·D flops) plus the best
config per shape. ``--out`` writes everything as JSON.

    python benchmarks/tune_triton_sage.py --out tune.json
    python benchmarks/tune_triton_sage.py --shapes "mine=2,24,8192,128" --recipe fp8-1-16 --configs "128,64,8,3,pipe"

Finishes in about 2-3 minutes on an H200 with the defaults (compiles dominate; ``--budget-s`` stops the sweep early).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

DEFAULT_SHAPES = {
    "wan1.3b-480p": (1, 12, 32760, 128),
    "wan14b-720p": (1, 40, 75600, 128),
    "flux-1024": (1, 24, 4608, 128),
    "d64": (2, 16, 16384, 64),
}

#: Configs must agree with the first one to this max error (relative to max |output|): different tiles round P
#: against different running maxima (~1-3 % element differences); a broken config is off by O(1).
AGREE = 0.1

RECIPES = {  # name: (qk dtype, q_block, k_block, v scale)
    "int8-1-16": ("int8", 1, 16, "channel"),
    "int8-1-1": ("int8", 1, 1, "channel"),
    "int8-0-0": ("int8", 0, 0, "tensor"),
    "fp8-1-16": ("fp8", 1, 16, "channel"),
    "bf16": ("bf16", 0, 0, "channel"),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_shapes(text: str | None) -> dict[str, tuple[int, int, int, int]]:
    if not text:
        return dict(DEFAULT_SHAPES)
    shapes = {}
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            name, dims = item.split("=", 1)
            shapes[name.strip()] = tuple(int(x) for x in dims.split(","))
        elif item in DEFAULT_SHAPES:
            shapes[item] = DEFAULT_SHAPES[item]
        else:
            raise SystemExit(f"shape {item!r} is invalid; valid: name=B,H,S,D or one of {', '.join(DEFAULT_SHAPES)}")
    return shapes


def make_inputs(shape, recipe):
    """Quantized op-level arguments for one shape: BSHD Q/K views, sequence-major V (as the graph produces)."""
    import qattn_fx.ops  # noqa: F401  (registers qattn::*)
    from qattn_fx import formats

    ops = torch.ops.qattn
    b, h, s, d = shape
    qk, q_block, k_block, v_scale = RECIPES[recipe]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    fp8 = torch.float8_e4m3fn
    if qk == "bf16":
        qd, qs, kd, ks = q, None, k, None
    else:
        dtype = formats.torch_dtype(qk)
        k = ops.smooth_k(k)
        if q_block:
            qd, qs = ops.quantize_per_block(q, q_block, dtype)
            kd, ks = ops.quantize_per_block(k, k_block, dtype)
        else:
            qd, qs = ops.quantize_per_tensor(q, dtype)
            kd, ks = ops.quantize_per_tensor(k, dtype)
    quant_v = ops.quantize_per_channel if v_scale == "channel" else ops.quantize_per_tensor
    vd, vs = quant_v(v, fp8, True)
    del q, k, v
    return qd, qs, kd, ks, vd, vs, q_block, k_block


def bench(fn, warmup_ms: int, rep_ms: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", help="';'-separated name=B,H,S,D (or default names); default: the four "
                        "reference shapes")
    parser.add_argument("--recipe", default="int8-1-16", choices=sorted(RECIPES))
    parser.add_argument("--kernel", default="triton", choices=["triton", "gluon"],
                        help="triton: kernels/triton_sage.py; gluon: kernels/gluon_sage.py (warp-specialized, "
                        "sm_90 only; each shape is first run with triton_sage's 128,128,8,3,pipe config and every "
                        "gluon config is checked against that output)")
    parser.add_argument("--configs", help="';'-separated configs: triton 'BM,BN,warps,stages[,pipe]', "
                        "gluon 'BLOCK_N,STAGES[,flags]' (default: the module's CONFIGS)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--budget-s", type=float, default=220.0, help="stop starting new configs after this")
    parser.add_argument("--no-baseline", action="store_true", help="skip timing torch SDPA (bf16) per shape")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        log("tune_triton_sage: needs a CUDA GPU")
        return 2
    import triton

    from qattn_fx.kernels import triton_sage

    if args.kernel == "gluon":
        from qattn_fx.kernels import gluon_sage as ts

        parse = ts.GluonConfig.parse
    else:
        ts = triton_sage
        parse = ts.KernelConfig.parse
    cap = tuple(torch.cuda.get_device_capability())
    configs = [parse(c) for c in args.configs.split(";")] if args.configs else list(ts.CONFIGS)
    if args.kernel == "triton" and cap != (9, 0) and not args.configs:  # sm_89: the spill-free subset (see triton_sage._prune)
        configs = [c for c in configs if c.block_n <= 64 and c.num_warps == 8 and not c.pipe] or configs
    shapes = parse_shapes(args.shapes)
    t_start = time.time()
    report = {
        "device": torch.cuda.get_device_name(), "capability": f"sm_{cap[0]}{cap[1]}",
        "torch": torch.__version__, "triton": triton.__version__, "recipe": args.recipe, "kernel": args.kernel,
        "flops": "4*B*H*Sq*Skv*D", "timing": f"do_bench median, warmup {args.warmup_ms} ms, rep {args.rep_ms} ms",
        "shapes": [],
    }
    log(f"# {args.kernel} kernel tuning on {report['device']} ({report['capability']}), torch {torch.__version__}, "
        f"triton {triton.__version__}, recipe {args.recipe}, {len(configs)} configs x {len(shapes)} shapes")
    stopped = False
    for name, shape in shapes.items():
        b, h, s, d = shape
        flops = 4.0 * b * h * s * s * d
        log(f"\n## {name}: B{b} H{h} S{s} D{d} ({flops / 1e12:.1f} TFLOP per call)")
        inputs = make_inputs(shape, args.recipe)
        sm_scale = 1.0 / math.sqrt(d)
        entry = {"name": name, "B": b, "H": h, "S": s, "D": d, "results": []}
        if not args.no_baseline:
            q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
            try:
                ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), args.warmup_ms,
                           args.rep_ms)
                entry["sdpa_bf16_ms"] = ms
                log(f"  torch SDPA bf16 (default backend): {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
            except Exception as exc:  # pragma: no cover - informational only
                log(f"  torch SDPA bf16: failed ({exc!r})")
            del q
        first = None
        if args.kernel == "gluon":  # the reference output: triton_sage's best config from the 2026-11-29 sweep
            with triton_sage.use_config("128,128,8,3,pipe"):
                first = triton_sage.scaled_attention(*inputs, sm_scale, torch.bfloat16).float()
        log(f"  {'config':<26} {'ms':>9} {'TFLOP/s':>9} {'max|Δ| vs first':>16}  compile+first call")
        for config in configs:
            if time.time() - t_start > args.budget_s:
                log(f"  -- time budget ({args.budget_s:.0f} s) reached: skipping remaining configs/shapes")
                stopped = True
                break
            row = {"config": str(config)}
            try:
                with ts.use_config(config):
                    t0 = time.time()
                    out = ts.scaled_attention(*inputs, sm_scale, torch.bfloat16)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.time() - t0, 2)
                    if first is None:
                        first = out.float()
                        row["max_rel_vs_first"] = 0.0
                    else:
                        diff = (out.float() - first).abs().max() / first.abs().max()
                        row["max_rel_vs_first"] = float(diff)
                    del out
                    ms = bench(lambda: ts.scaled_attention(*inputs, sm_scale, torch.bfloat16), args.warmup_ms,
                               args.rep_ms)
                row["ms"] = ms
                row["tflops"] = flops / ms / 1e9
                flag = "" if row["max_rel_vs_first"] < AGREE else "  <-- DIFFERS"
                log(f"  {str(config):<26} {ms:9.3f} {row['tflops']:9.1f} {row['max_rel_vs_first']:16.2e}  "
                    f"{row['first_call_s']:.1f} s{flag}")
            except Exception as exc:
                row["error"] = repr(exc)[:500]
                log(f"  {str(config):<26} FAILED: {row['error'][:200]}")
            entry["results"].append(row)
        ok = [r for r in entry["results"] if "ms" in r and r.get("max_rel_vs_first", 1.0) < AGREE]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            entry["best"] = best
            log(f"  best: {best['config']}  {best['ms']:.3f} ms  {best['tflops']:.1f} TFLOP/s")
        report["shapes"].append(entry)
        del inputs, first
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
