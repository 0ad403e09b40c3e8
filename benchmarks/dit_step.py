"""One denoising forward of a diffusers video transformer under torch.compile: dense vs each qattn_fx kernel.

    python -m benchmarks.dit_step --out bench_out/dit_step.json                # Wan2.1-1.3B config, 480p, 81 frames
    python -m benchmarks.dit_step --config 14b --frames 21 --blocks 4          # fewer frames / blocks, stated in output
    python -m benchmarks.dit_step --model hunyuan_video --blocks 2 --single-blocks 4 --compile whole

Models (random weights at the published configs, bf16, built on the GPU):

* ``wan``: ``WanTransformer3DModel`` (Wan2.1 ``--config 1.3b`` / ``14b``), 480p latents
  ``(1, 16, 1 + (frames-1)/4, 60, 104)`` → 32,760 tokens at 81 frames, a 512-token text embedding.
* ``hunyuan_video``: ``HunyuanVideoTransformer3DModel`` (HunyuanVideo's config: 24 heads, d128, 20 dual- and 40
  single-stream blocks), 480p latents ``(1, 16, 1 + (frames-1)/4, 60, 106)`` and 256 text tokens of which
  ``--text-tokens`` are valid: its joint attention masks the padding with a ``(B, 1, 1, N)`` key mask.

``--compile regional`` (default) compiles the repeated blocks (``compile_repeated_blocks``: one block graph reused
by every layer); ``--compile whole`` compiles the whole model as a user would
(``torch.compile(model, backend=...)``). Variants: compiled dense (torch SDPA, cuDNN on Hopper), "no attention"
(every SDPA returns its query: the step time without attention, giving attention's share), and qattn_fx with each
kernel that runs here. For each: median step time (CUDA events), speedup over compiled dense, output cosine and
relative L2 vs dense, compile time, and the site summary. Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import qattn_fx
from qattn_fx import AttentionSpec, Match, Recipe, Rule, Spec
from qattn_fx.fx import match

CONFIGS = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
}
SAGE = Recipe("int8", "fp8", 1, 16, 1)
#: The TRITON rows name their kernel: on sm_90 the backend's first choice is gluon_sage, on sm_89 triton_sage.
VARIANTS = {
    "qattn gluon_sage int8 1/16/1": Spec(default=AttentionSpec("TRITON", SAGE, kernel="gluon_sage")),
    "qattn gluon_sage, cross dense": Spec(default=AttentionSpec("TRITON", SAGE, kernel="gluon_sage"),
                                          rules=(Rule(Match(role=("cross",)), "dense"),)),
    "qattn triton_sage int8 1/16/1": Spec(default=AttentionSpec("TRITON", SAGE, kernel="triton_sage")),
    "qattn triton_sage, cross dense": Spec(default=AttentionSpec("TRITON", SAGE, kernel="triton_sage"),
                                           rules=(Rule(Match(role=("cross",)), "dense"),)),
    "qattn cudnn_fp8 per-tensor": Spec(default=AttentionSpec("CUDNN", Recipe("fp8", "fp8"))),
    "qattn flashinfer_fa3_fp8 per-head": Spec(default=AttentionSpec("FLASHINFER", Recipe("fp8", "fp8",
                                                                                         scale_scope="head"))),
}


def build_wan(config: str, blocks: int | None, frames: int, device: str, **_):
    from diffusers import WanTransformer3DModel

    cfg = dict(CONFIGS[config])
    if blocks:
        cfg["num_layers"] = blocks
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **cfg,
        ).to(torch.bfloat16).eval()
    latent_frames = 1 + (frames - 1) // 4
    inputs = dict(
        hidden_states=torch.randn(1, 16, latent_frames, 60, 104, device=device, dtype=torch.bfloat16),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn(1, 512, 4096, device=device, dtype=torch.bfloat16),
        return_dict=False,
    )
    tokens = latent_frames * 30 * 52
    header = (f"Wan2.1-{config} config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {frames} frames 480p = {tokens} tokens, text 512")
    return model, inputs, header


def build_hunyuan_video(config: str, blocks: int | None, frames: int, device: str, single_blocks: int | None = None,
                        text_tokens: int = 120, **_):
    from diffusers import HunyuanVideoTransformer3DModel

    cfg = dict(num_attention_heads=24, attention_head_dim=128, num_layers=blocks or 20,
               num_single_layers=single_blocks if single_blocks is not None else 40, num_refiner_layers=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = HunyuanVideoTransformer3DModel(
            in_channels=16, out_channels=16, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
            guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
            rope_axes_dim=(16, 56, 56), **cfg,
        ).to(torch.bfloat16).eval()
    latent_frames = 1 + (frames - 1) // 4
    text = 256
    mask = torch.zeros(1, text, device=device)
    mask[:, :text_tokens] = 1
    inputs = dict(
        hidden_states=torch.randn(1, 16, latent_frames, 60, 106, device=device, dtype=torch.bfloat16),
        timestep=torch.tensor([500.0], device=device),
        encoder_hidden_states=torch.randn(1, text, 4096, device=device, dtype=torch.bfloat16),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(1, 768, device=device, dtype=torch.bfloat16),
        guidance=torch.tensor([6000.0], device=device, dtype=torch.bfloat16),
        return_dict=False,
    )
    tokens = latent_frames * 30 * 53
    header = (f"HunyuanVideo config ({cfg['num_layers']} dual + {cfg['num_single_layers']} single blocks, 24 heads, "
              f"d128), {frames} frames 480p = {tokens} video tokens + {text} text ({text_tokens} valid, the rest "
              "masked)")
    return model, inputs, header


MODELS = {"wan": build_wan, "hunyuan_video": build_hunyuan_video}


def no_attention_backend(gm, example_inputs, **kwargs):
    """Inductor on the graph with every SDPA replaced by its query (the step without attention)."""
    from torch._inductor.compile_fx import compile_fx

    for call in match.find_sdpa(gm):
        call.node.replace_all_uses_with(call.q)
        call.graph.erase_node(call.node)
    gm.recompile()
    return compile_fx(gm, example_inputs)


def time_step(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_variant(name, model, inputs, backend, dense_out, iters, warmup, how="regional"):
    torch._dynamo.reset()
    if how == "regional":
        model.compile_repeated_blocks(backend=backend, fullgraph=True)
        step = model
    else:
        step = torch.compile(model, backend=backend)
    print(f"{name}: compiling ({how}) ...", flush=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = step(**inputs)[0]
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        print(f"{name}: compiled in {compile_s:.0f} s; timing {warmup} + {iters} steps", flush=True)
        ms = time_step(lambda: step(**inputs), iters, warmup)
    row = {"variant": name, "step_ms": ms, "compile_s": compile_s}
    if dense_out is not None:
        a, b = out.float().flatten(), dense_out.float().flatten()
        row["cos_vs_dense"] = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        row["rel_l2_vs_dense"] = ((a - b).norm() / b.norm()).item()
    report = getattr(backend, "report", None)
    if report is not None:
        row["sites"] = report.summary()
    for module in model.modules():  # undo regional compilation (nn.Module.compile) for the next variant
        module._compiled_call_impl = None
    return row, out


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks.dit_step needs a CUDA GPU")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dit_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODELS), default="wan")
    parser.add_argument("--config", choices=tuple(CONFIGS), default="1.3b", help="Wan2.1 size")
    parser.add_argument("--blocks", type=int, help="transformer blocks (default: all of the config; HunyuanVideo: "
                                                   "dual-stream blocks)")
    parser.add_argument("--single-blocks", type=int, help="HunyuanVideo single-stream blocks (default 40)")
    parser.add_argument("--text-tokens", type=int, default=120, help="HunyuanVideo: valid text tokens of 256")
    parser.add_argument("--compile", choices=("regional", "whole"), default="regional")
    parser.add_argument("--frames", type=int, default=81, help="video frames (latent frames = 1 + (f-1)/4)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="substrings of variant names to run")
    parser.add_argument("--out", default="bench_out/dit_step.json")
    args = parser.parse_args(argv)
    require_cuda()

    model, inputs, what = MODELS[args.model](args.config, args.blocks, args.frames, "cuda",
                                             single_blocks=args.single_blocks, text_tokens=args.text_tokens)
    hw = qattn_fx.detect("cuda")
    header = (f"{what}, bf16, {args.compile} compile, {torch.cuda.get_device_name()} ({hw.arch}), "
              f"torch {torch.__version__}")
    print(header, flush=True)
    rows = []
    with torch.no_grad():
        torch._dynamo.reset()
        dense_row, dense_out = run_variant("compiled dense (torch SDPA)", model, inputs, "inductor", None,
                                           args.iters, args.warmup, args.compile)
        rows.append(dense_row)
        print(json.dumps(dense_row), flush=True)
        row, _ = run_variant("compiled, no attention", model, inputs, no_attention_backend, None, args.iters,
                             args.warmup, args.compile)
        rows.append(row)
        print(json.dumps(row), flush=True)
        for name, spec in VARIANTS.items():
            if args.only and not any(s in name for s in args.only):
                continue
            try:
                row, _ = run_variant(name, model, inputs, qattn_fx.backend(spec), dense_out, args.iters,
                                     args.warmup, args.compile)
            except Exception as e:  # noqa: BLE001 - report and go on to the next kernel
                row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)

    dense_ms = rows[0]["step_ms"]
    no_attn = rows[1]["step_ms"]
    share = (dense_ms - no_attn) / dense_ms
    print(f"\n{header}\nattention share of the compiled dense step: {share:.1%}")
    print(f"{'variant':38} {'step ms':>9} {'speedup':>8} {'cos':>9} {'rel L2':>8} {'compile s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:38} error: {r['error']}")
            continue
        cos = f"{r['cos_vs_dense']:.5f}" if "cos_vs_dense" in r else "-"
        rel = f"{r['rel_l2_vs_dense']:.4f}" if "rel_l2_vs_dense" in r else "-"
        print(f"{r['variant']:38} {r['step_ms']:9.1f} {dense_ms / r['step_ms']:7.2f}x {cos:>9} {rel:>8} "
              f"{r['compile_s']:9.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": header, "attention_share": share, "rows": rows,
                               "date": time.strftime("%Y-%m-%d"),
                               "command": "python -m benchmarks.dit_step " + " ".join(sys.argv[1:])}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
