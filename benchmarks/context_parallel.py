"""A Wan transformer split over GPUs with diffusers' context parallelism (Ulysses, ring), dense vs qattn_fx.

    torchrun --nproc-per-node 2 -m benchmarks.context_parallel --out bench_out/context_parallel.json
    torchrun --nproc-per-node 2 -m benchmarks.context_parallel --variants dense-ulysses,qattn-ulysses --blocks 2
    python -m benchmarks.context_parallel --variants dense-1,qattn-1            # one GPU, no torchrun
    torchrun --nproc-per-node 2 -m benchmarks.context_parallel --model tiny --device cpu \\
        --variants qattn-1,qattn-ulysses,qattn-ring --reference qattn-1          # CPU (gloo), emulated: a check

The model (``--model wan14b``): ``WanTransformer3DModel`` at Wan2.1-14B's published config (40 heads, d128, FFN
13,824, text_dim 4,096) with ``--blocks`` blocks (default 4; blocks are identical, so per-block times scale), random
weights in bf16, at ``--height`` x ``--width`` pixels and ``--frames`` frames (default 720 x 1280, 81 frames:
latents ``(1, 16, 21, 90, 160)``, 75,600 tokens) with a 512-token text embedding. ``--model tiny`` is two heads of
12 channels on 128 tokens for CPU runs. Every rank builds the same weights and inputs from one seed.

Variants (``--variants``, default all six on 2+ ranks, the 1-GPU ones alone):

* ``dense-1`` / ``qattn-1``: the whole sequence on one GPU, ``torch.compile(model)`` with Inductor, or with
  ``backend=qattn_fx.backend(spec)``; under torchrun every rank runs its own copy at once (a rank compiling alone
  while the others wait in a barrier hung on CPU/gloo: compiling under an initialized process group is done by all
  ranks together here);
* ``dense-ulysses`` / ``qattn-ulysses``: every rank, ``ContextParallelConfig(ulysses_degree=world)`` with attention
  backend ``--ulysses-backend`` (default ``native``: a local ``F.scaled_dot_product_attention`` between the
  all-to-alls);
* ``dense-ring`` / ``qattn-ring``: every rank, ``ContextParallelConfig(ring_degree=world)`` with
  ``--ring-backend`` (default ``_native_cudnn`` on GPUs, ``_native_flash`` on CPU: the local attention returns the
  LSE the ring merges by; qattn_fx serves it with ``qattn::scaled_attention_lse``).

Whole-model compile (``torch.compile(model, backend=...)``, after diffusers' hooks are in place:
:mod:`benchmarks.parallel`). Timing: the compiling call, ``--warmup`` calls, then ``--iters`` calls; each rank's
median (CUDA events; wall clock on CPU), the slowest rank's reported, and the graphs Dynamo compiled (1 without
graph breaks; ``--fullgraph`` makes a break an error). Accuracy: each variant's output (rank 0, the gathered full
sequence) against ``--reference`` (default ``dense-1``): cosine, relative L2, max |diff|, and the relative L2 to
every variant run before it (JSON ``rel_l2_vs``); a variant below ``--min-cosine`` makes the exit status 1. qattn
variants print rank 0's site table (the local shapes each rank attends over, and the context-parallel notes); the
JSON also counts the collectives in their rewritten graphs (``collectives``). Writes JSON (``--out``) and prints one
table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import qattn_fx
from benchmarks import common, parallel
from benchmarks.dit_step import CONFIGS

VARIANTS = ("dense-1", "qattn-1", "dense-ulysses", "qattn-ulysses", "dense-ring", "qattn-ring")
MODELS = ("wan14b", "tiny")
#: Wan2.1-14B without its block count (``--blocks`` sets it) and the CPU model.
DIMS = {
    "wan14b": dict(CONFIGS["14b"], in_channels=16, out_channels=16, text_dim=4096, rope_max_seq_len=1024),
    "tiny": dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, in_channels=4, out_channels=4,
                 text_dim=16, rope_max_seq_len=32),
}


def _latent(frames: int, height: int, width: int) -> tuple[int, int, int]:
    return 1 + (frames - 1) // 4, height // 8, width // 8


def describe(args) -> str:
    """``Wan wan14b config (4 blocks, 40 heads, d128), 81 frames 720x1280 = 75600 tokens, text 512, bfloat16``."""
    dims = DIMS[args.model]
    f, h, w = _latent(args.frames, args.height, args.width)
    text = 512 if args.model == "wan14b" else 12
    tokens = f * (h // 2) * (w // 2)
    return (f"Wan {args.model} config ({args.blocks} blocks, {dims['num_attention_heads']} heads, "
            f"d{dims['attention_head_dim']}), {args.frames} frames {args.height}x{args.width} = {tokens} tokens, "
            f"text {text}, {str(args.dtype).removeprefix('torch.')}")


def build(model: str, blocks: int, frames: int, height: int, width: int, device: torch.device,
          dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """(model, keyword inputs): the same weights and inputs on every rank (seed 0)."""
    from diffusers import WanTransformer3DModel

    dims = dict(DIMS[model], num_layers=blocks)
    torch.manual_seed(0)
    with torch.device(device):
        net = WanTransformer3DModel(patch_size=(1, 2, 2), freq_dim=256, cross_attn_norm=True,
                                    qk_norm="rms_norm_across_heads", eps=1e-6, **dims).to(dtype).eval()
    latent = _latent(frames, height, width)
    text = 512 if model == "wan14b" else 12
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, dims["in_channels"], *latent, generator=g).to(device, dtype),
        timestep=torch.tensor([500.0], device=device),
        encoder_hidden_states=torch.randn(1, text, dims["text_dim"], generator=g).to(device, dtype),
        return_dict=False,
    )
    return net, inputs


class Timer:
    """Per-call times in ms: CUDA events on a GPU, the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: list[float] = []

    def __call__(self, fn) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            self.times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            self.times.append((time.perf_counter() - t0) * 1e3)


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _slowest(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks (the step ends when the slowest rank's does)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_variant(name: str, args, device: torch.device) -> tuple[dict | None, torch.Tensor | None]:
    """Build, (maybe) parallelize, compile and time one variant; (row, output) on rank 0, else (None, None)."""
    rank, world = _world()
    kind = name.split("-")[1]
    quantized = name.startswith("qattn")
    torch._dynamo.reset()
    counters.clear()
    model, inputs = build(args.model, args.blocks, args.frames, args.height, args.width, device, args.dtype)
    if kind != "1":
        backend_name = args.ulysses_backend if kind == "ulysses" else args.ring_backend
        parallel.enable(model, kind, world, backend_name)
    backend = qattn_fx.backend(args.spec, emulate=args.emulate, compiler=args.compiler) if quantized else \
        args.compiler
    step = torch.compile(model, backend=backend, fullgraph=args.fullgraph)
    timer = Timer(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = step(**inputs)[0]
        compile_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            step(**inputs)
        for _ in range(args.iters):
            timer(lambda: step(**inputs))
    step_ms = _slowest(statistics.median(timer.times), device) if timer.times else None
    if rank != 0:
        return None, None
    row = {"variant": name, "ranks": 1 if kind == "1" else world, "step_ms": step_ms, "compile_s": compile_s,
           "graphs": counters["stats"]["unique_graphs"]}
    if quantized:
        report = backend.report
        row["sites"] = report.summary()
        row["site_table"] = [{k: s[k] for k in ("module", "role", "q_shape", "kv_shape", "kernel", "reason", "notes")}
                             for s in report.to_dict()["sites"]]
        row["collectives"] = collectives(backend.graph_modules)
        common.log(f"{name}: site table (rank 0)\n{report}")
    return row, out.float().cpu()


def collectives(graph_modules) -> dict[str, int]:
    """How many nodes of each ``_c10d_functional`` op the rewritten graphs hold (the pass leaves them as they are)."""
    counts: dict[str, int] = {}
    for gm in graph_modules:
        for node in gm.graph.nodes:
            name = str(node.target) if node.op == "call_function" else ""
            if name.startswith("_c10d_functional."):
                op = name.split(".")[1]
                counts[op] = counts.get(op, 0) + 1
    return counts


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    a, b = out.flatten().double(), ref.flatten().double()
    return {"cos_vs_ref": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
            "rel_l2_vs_ref": ((a - b).norm() / b.norm()).item(), "max_abs_vs_ref": (a - b).abs().max().item()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="wan14b")
    parser.add_argument("--blocks", type=int, default=None, help="transformer blocks (default: 4 for wan14b, 1 for "
                                                                 "tiny)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (default 81; tiny: 5)")
    parser.add_argument("--height", type=int, default=None, help="pixels, a multiple of 16 (default 720; tiny: 128)")
    parser.add_argument("--width", type=int, default=None, help="pixels, a multiple of 16 (default 1280; tiny: 128)")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join(VARIANTS)} (default: all "
                                                         "six with 2+ ranks, dense-1,qattn-1 alone)")
    parser.add_argument("--reference", default="dense-1", choices=VARIANTS, help="the variant outputs are compared "
                                                                                 "with (it runs first)")
    parser.add_argument("--min-cosine", type=float, default=0.99, help="exit 1 when a variant's cosine to the "
                                                                       "reference is below this")
    parser.add_argument("--ulysses-backend", default="native", help="diffusers attention backend under Ulysses")
    parser.add_argument("--ring-backend", default=None, help="diffusers attention backend under ring attention "
                                                             "(default _native_cudnn on GPUs, _native_flash on CPU)")
    parser.add_argument("--spec", default=None, help="qattn_fx spec file (default: the default spec)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="what compiles the graphs after qattn_fx's pass (and the dense variants)")
    parser.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench_out/context_parallel.json")
    args = parser.parse_args(argv)
    tiny = args.model == "tiny"
    defaults = dict(blocks=1 if tiny else 4, frames=5 if tiny else 81, height=128 if tiny else 720,
                    width=128 if tiny else 1280)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("height", "width"):
        if getattr(args, key) % 16:
            parser.error(f"--{key}={getattr(args, key)} is invalid; valid: a multiple of 16 (8x VAE, 2x2 patches)")
    for key in ("blocks", "iters", "frames"):
        if getattr(args, key) < (1 if key != "iters" else 0):
            parser.error(f"--{key}={getattr(args, key)} is invalid; valid: an int >= {1 if key != 'iters' else 0}")
    if args.variants is not None:
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in chosen if v not in VARIANTS]
        if bad or not chosen:
            parser.error(f"--variants={args.variants!r} is invalid; valid: comma-separated of {', '.join(VARIANTS)}")
        args.variants = chosen
    if args.ring_backend is None:
        args.ring_backend = "_native_cudnn" if args.device == "cuda" else "_native_flash"
    args.emulate = args.device == "cpu"
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return args


def _setup(args) -> torch.device:
    """The process group (when launched by torchrun) and this rank's device."""
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=60))  # rank 0 compiles alone in the 1-GPU variants
    rank, world = _world()
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks.context_parallel: error: --device cuda needs a CUDA GPU (--device cpu runs "
                 "the tiny model emulated)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = _setup(args)
    rank, world = _world()
    variants = args.variants or (list(VARIANTS) if world > 1 else ["dense-1", "qattn-1"])
    needs = [v for v in variants if not v.endswith("-1")]
    if needs and world < 2:
        sys.exit(f"python -m benchmarks.context_parallel: error: {', '.join(needs)} need 2+ ranks; launch with "
                 "torchrun --nproc-per-node 2")
    if args.reference not in variants:
        variants.insert(0, args.reference)
    variants.sort(key=lambda v: v != args.reference)  # the reference first, the rest in the given order
    rows, outputs = [], {}
    for name in variants:
        if rank == 0:
            common.log(f"{name} ...")
        row, out = run_variant(name, args, device)
        if rank != 0:
            continue
        if outputs:
            row.update(compare(out, outputs[args.reference]))
            row["rel_l2_vs"] = {other: compare(out, ref)["rel_l2_vs_ref"] for other, ref in outputs.items()}
        outputs[name] = out
        rows.append(row)
        common.log(json.dumps({k: v for k, v in row.items() if k != "site_table"}))
    status = 0
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (emulated)"
        header = (f"{describe(args)}; {world} rank(s) on {device_name}, torch {torch.__version__}, whole-model compile "
                  f"({args.compiler}), {args.iters} timed calls")
        status = _finish(rows, header, args, world)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status


def _finish(rows: list[dict], header: str, args, world: int) -> int:
    """Speedups, the table, the JSON; 1 when a variant's output is further from the reference than allowed."""
    base = {r["variant"]: r["step_ms"] for r in rows if r.get("step_ms")}
    for r in rows:
        if r.get("step_ms"):
            for ref in ("dense-1", "dense-ulysses", "dense-ring"):
                if ref in base and ref != r["variant"]:
                    r[f"x_vs_{ref}"] = base[ref] / r["step_ms"]
    columns = [("variant", "variant", ""), ("ranks", "ranks", "d"), ("step_ms", "step ms", ".1f"),
               ("x_vs_dense-1", "x dense-1", ".2f"), ("x_vs_dense-ulysses", "x dense-ulysses", ".2f"),
               ("x_vs_dense-ring", "x dense-ring", ".2f"), ("cos_vs_ref", f"cos vs {args.reference}", ".6f"),
               ("rel_l2_vs_ref", "rel L2", ".2e"), ("compile_s", "compile s", ".0f"), ("graphs", "graphs", "d")]
    print(f"\n{header}\n{common.format_table(rows, columns)}")
    for r in rows:
        if "sites" in r:
            print(f"{r['variant']}: {r['sites']}")
    failed = [r["variant"] for r in rows if r.get("cos_vs_ref", 1.0) < args.min_cosine]
    if failed:
        print(f"FAILED: cosine to {args.reference} below {args.min_cosine}: {', '.join(failed)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "dtype")}
    settings["dtype"] = str(args.dtype)
    common.write_json(str(out), {"header": header, "rows": rows, "settings": settings, "world": world,
                                 "date": time.strftime("%Y-%m-%d"), "environment": common.environment(),
                                 "command": "torchrun -m benchmarks.context_parallel " + " ".join(sys.argv[1:])})
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
