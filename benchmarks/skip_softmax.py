"""Skip-Softmax speed vs sparsity: gluon_sage with the tile test at a sweep of thresholds, against the same kernel
without it (``python -m benchmarks.attention_ops --skip-softmax``; ``--shapes`` picks the shapes, default
wan14b-720p).

Inputs are structured so that attention maps concentrate: **local attention** along the token order
(:func:`benchmarks.common.local_qkv`: Q and K share random Fourier features of the position, so each query's logits
fall off over ``--width`` tokens from its own position; ``--sharpness`` sets the peak's height) plus an **attention
sink** (``--sink`` keys at the start that every query attends to as strongly as to its neighbours). Per threshold λ
it reports the fraction of tiles the kernel skipped (its own count, a separate launch), the kernel time (CUDA-graph
replays, the config forced so every row times the same schedule), the speedup over the same config without the test
and over the autotuned launch without it (tail split on), and cos / rel-L1 of the output against fp32 dense
attention and against the kernel without skipping, on ``--acc-rows`` query rows. λ = 0 runs the test and skips
nothing: its speedup is the test's cost.
"""

from __future__ import annotations

import argparse
import math

import torch

from . import common
from .shapes import select as select_shapes

#: λ values swept by default (0: the test's cost; the others log-spaced, to span few to most tiles on local_qkv).
THRESHOLDS = (0.0, 1e-7, 3e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 1e-3, 1e-2, 0.1)
COLUMNS = [("shape", "shape", "s"), ("config", "config", "s"), ("lambda", "λ", ".0e"), ("sparsity", "skipped", ".3f"),
           ("ms", "ms", ".3f"), ("speedup", "x same cfg", ".3f"), ("speedup_auto", "x autotuned", ".3f"),
           ("cos", "cos fp32", ".6f"), ("rel_l1", "rel-L1 fp32", ".4f"), ("cos_dense", "cos no-skip", ".6f"),
           ("rel_l1_dense", "rel-L1 no-skip", ".4f")]


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_ops --skip-softmax",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="wan14b-720p", help="comma-separated preset names (default wan14b-720p)")
    p.add_argument("--shape", action="append", default=[], help="extra shape name:B:H:Sq:Skv:D (repeatable)")
    p.add_argument("--configs", default="128,3,trio,permk,tarrive,mmasum;128,3,permk,mmasum",
                   help="gluon_sage configs to time, ';'-separated (serial schedules)")
    p.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)), help="λ values, comma-separated")
    p.add_argument("--recipe", default="int8-1-16", help="Q/K recipe (benchmarks.common.KERNEL_RECIPES)")
    p.add_argument("--sharpness", type=float, default=4.0, help="local_qkv sharpness (default 4)")
    p.add_argument("--width", type=float, default=2048.0, help="local_qkv width in tokens (default 2048)")
    p.add_argument("--sink", type=int, default=128, help="local_qkv attention-sink keys (default 128: one tile)")
    p.add_argument("--acc-rows", type=int, default=2048, help="query rows for accuracy (default 2048)")
    p.add_argument("--budget-ms", type=float, default=600.0, help="timed-call budget per measurement (ms)")
    p.add_argument("--out", default="bench_out/skip_softmax.json", help="JSON output path")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.attention_ops --skip-softmax needs a CUDA device")
        return 2

    from qattn_fx import config as qattn_config  # noqa: PLC0415
    from qattn_fx import skip_softmax  # noqa: PLC0415
    from qattn_fx.kernels import gluon_sage  # noqa: PLC0415

    thresholds = [float(t) for t in a.thresholds.split(",")]
    rows_out: list[dict] = []
    env = common.environment()
    common.log(f"skip_softmax: {env.get('device')}, recipe {a.recipe}, local_qkv sharpness {a.sharpness} "
               f"width {a.width} sink {a.sink}")
    for name, dims in select_shapes(a.shapes, a.shape):
        q, k, v = common.local_qkv(dims.b, dims.h, dims.sq, dims.skv, dims.d, sharpness=a.sharpness, width=a.width,
                                   sink=a.sink)
        sm_scale = 1.0 / math.sqrt(dims.d)
        args = (*common.quantize_qkv(q, k, v, a.recipe), sm_scale, torch.bfloat16)
        acc_rows = common.reference_rows(dims.sq, a.acc_rows, device="cuda")
        ref = common.fp32_attention_rows(q, k, v, acc_rows, sm_scale)
        n_rows, n_keys = skip_softmax.tiles(dims.sq, dims.skv)
        total = dims.b * dims.h * n_rows * n_keys
        auto_ms = common.time_ms(lambda: gluon_sage.attention(*args), method="graph", budget_ms=a.budget_ms)
        common.log(f"{name}: autotuned without skip ({gluon_sage.last_config()}, tail "
                   f"{gluon_sage.last_tail_plan()}): {auto_ms:.3f} ms")
        for cfg in a.configs.split(";"):
            with gluon_sage.use_config(cfg), qattn_config.patch(gluon_tail_split=False):
                plain = gluon_sage.attention(*args)
                plain_ms = common.time_ms(lambda: gluon_sage.attention(*args), method="graph",
                                          budget_ms=a.budget_ms)
                common.log(f"{name} {cfg}: without skip {plain_ms:.3f} ms ({auto_ms / plain_ms:.3f}x autotuned)")
                base = dict(shape=name, config=cfg, lambda_=None, sparsity=0.0, ms=plain_ms, speedup=1.0,
                            speedup_auto=auto_ms / plain_ms, **common.accuracy(plain, ref, acc_rows))
                base.update(cos_dense=1.0, rel_l1_dense=0.0)
                rows_out.append(base)
                for lam in thresholds:
                    thr = torch.tensor([lam], device="cuda")
                    count = torch.zeros(1, dtype=torch.int32, device="cuda")
                    out = gluon_sage.attention(*args, skip_threshold=thr, skip_count=count)
                    ms = common.time_ms(lambda: gluon_sage.attention(*args, skip_threshold=thr), method="graph",
                                        budget_ms=a.budget_ms)
                    acc = common.accuracy(out, ref, acc_rows)
                    vs_plain = common.accuracy(out, plain.float() if acc_rows is None else
                                               plain.float().index_select(2, acc_rows), acc_rows)
                    row = dict(shape=name, config=cfg, lambda_=lam, sparsity=int(count) / total, ms=ms,
                               speedup=plain_ms / ms, speedup_auto=auto_ms / ms, cos=acc["cos"],
                               rel_l1=acc["rel_l1"], cos_dense=vs_plain["cos"], rel_l1_dense=vs_plain["rel_l1"])
                    rows_out.append(row)
                    common.log(f"  λ={lam:.0e}: skipped {row['sparsity']:.3f}, {ms:.3f} ms, {row['speedup']:.3f}x "
                               f"same config, {row['speedup_auto']:.3f}x autotuned, cos {acc['cos']:.6f}, "
                               f"rel-L1 {acc['rel_l1']:.4f} (vs no-skip cos {vs_plain['cos']:.6f})")
    for row in rows_out:
        row["lambda"] = "-" if row["lambda_"] is None else row.pop("lambda_")
        row.pop("lambda_", None)
    print(common.format_table(rows_out, COLUMNS), flush=True)
    common.write_json(a.out, {"env": env, "settings": vars(a), "rows": rows_out})
    print(f"wrote {a.out}")
    return 0
