"""qattn_fx in a diffusers pipeline: compile the pipeline's transformer, run the denoising loop dense and quantized.

    python examples/pipeline.py                     # CPU: a tiny random WanPipeline, recipes emulated
    python examples/pipeline.py --steps 4 --spec my.json
    python examples/pipeline.py --real-size         # GPU: Wan2.1-1.3B transformer (published config, random
                                                    # weights, bf16) at 480p, real kernels
    python examples/pipeline.py --experts 2         # Wan2.2-A14B's layout: two transformers, each compiled
    python examples/pipeline.py --real-size --linears fp8 --cache fbc   # the whole stack: TorchAO FP8 linears,
                                                    # First Block Cache and quantized attention in one compile

This is how a DiT is used in practice::

    pipe = WanPipeline(...)                           # or WanPipeline.from_pretrained(...), FluxPipeline, ...
    pipe.transformer = torch.compile(pipe.transformer, backend=qattn_fx.backend())
    video = pipe(prompt, ...)

Wan2.2-T2V-A14B's pipeline has two transformers (experts): ``transformer`` denoises while the timestep is at or
above ``boundary_ratio · 1000``, ``transformer_2`` after it. Each is compiled, with a backend of its own so that each
report is its expert's (``--experts 2`` builds that layout; ``--real-size`` then gives both experts Wan2.1-14B's
config, which Wan2.2-A14B's experts have).

Everything is built from configs with random weights, nothing is downloaded: the transformer, a tiny Wan VAE,
the flow-matching scheduler, and a tiny UMT5 text encoder with a word-level tokenizer made in memory
(``--real-size`` feeds random ``prompt_embeds`` of the real text width instead). The script prints the site
table of the compiled transformer, the time of every denoising step (the first one includes the compile), and
how far the quantized output is from the dense one.

The whole stack (:mod:`qattn_fx.stack`): ``--linears fp8`` quantizes the transformers' linears with TorchAO (FP8
dynamic activation and weight, per-row; ``int8wo``, int8 weight-only, runs on a CPU) and ``--cache fbc`` turns on
diffusers' First Block Cache, both before the compile; the dense run they are compared with has neither. The cache
breaks the graph by design (its decision is read on the host), so the transformers are then compiled without
``fullgraph``.
"""

from __future__ import annotations

import argparse
import time

import torch

import qattn_fx
from qattn_fx import stack

#: Wan2.1-T2V-1.3B's transformer config (diffusers ``WanTransformer3DModel``), as published.
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
#: Wan2.1-T2V-14B's transformer config, also that of each of Wan2.2-T2V-A14B's two experts.
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
#: Wan2.2-T2V-A14B's switch between its experts: ``transformer`` while the timestep is >= 0.875 · 1000.
BOUNDARY_RATIO = 0.875
#: A tiny transformer of the same kind (diffusers' own Wan pipeline test), head_dim 12 on CPU.
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
PROMPT = "a cat walks on the grass in the sun"


def tiny_tokenizer():
    """A word-level tokenizer built in memory (no hub): enough for the pipeline's padding and attention mask."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", *dict.fromkeys(PROMPT.split())]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_pipeline(config: dict, device: torch.device, dtype: torch.dtype, experts: int = 1):
    """A ``WanPipeline`` from configs: ``config``'s transformer, a tiny VAE, UMT5 text encoder and tokenizer;
    ``experts=2``: Wan2.2-A14B's layout, a second transformer of the same config (other weights) as
    ``transformer_2`` for the steps below :data:`BOUNDARY_RATIO`."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4)).eval()
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    transformers = []
    for _ in range(experts):  # built on the device and cast one at a time: two 14B experts in float32 on the host
        with torch.device(device):  # would take 112 GB and minutes of initialization
            transformers.append(WanTransformer3DModel(**config).to(dtype).eval())
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformers[0],
                       transformer_2=transformers[1] if experts == 2 else None,
                       boundary_ratio=BOUNDARY_RATIO if experts == 2 else None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)  # the transformers in ``dtype`` as pipelines run them; VAE and text encoder stay float32
    return pipe


def run(pipe, call: dict, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, list[float]]:
    """The pipeline's output for ``call`` (from ``seed``'s noise) and the seconds of each denoising step."""
    marks = []

    def on_step_end(pipe, step, timestep, callback_kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        return callback_kwargs

    generator = torch.Generator("cpu").manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = pipe(**call, generator=generator, callback_on_step_end=on_step_end).frames
    steps = [b - a for a, b in zip([start] + marks[:-1], marks)]
    return out.float(), steps


def fmt_steps(steps: list[float], compiled: bool) -> str:
    first, rest = steps[0], steps[1:]
    text = f"step 1 {first:.2f} s (with text encoding{' and the compile' if compiled else ''})"
    if rest:
        text += f", then {sum(rest) / len(rest) * 1e3:.1f} ms/step (" + ", ".join(f"{s * 1e3:.0f}" for s in rest) + ")"
    return text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", help="spec file (.json/.yaml, any accepted format); default: the auto spec")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps (default 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--real-size", action="store_true",
                        help="the Wan2.1-1.3B transformer (random weights, bf16) at --height x --width x --frames "
                        "(default 480x832x81), on a GPU")
    parser.add_argument("--height", type=int, help="pixels (default 64; 480 with --real-size)")
    parser.add_argument("--width", type=int, help="pixels (default 64; 832 with --real-size)")
    parser.add_argument("--frames", type=int, help="video frames, 4k+1 (default 9; 81 with --real-size)")
    parser.add_argument("--experts", type=int, default=1, choices=(1, 2),
                        help="transformers: 1 (Wan2.1), or 2 as Wan2.2-A14B (--real-size: Wan2.1-14B's config each)")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"),
                        help="what compiles the rewritten graph (default inductor)")
    parser.add_argument("--linears", choices=stack.LINEARS, default="bf16",
                        help="TorchAO linears in the compiled run: fp8 (dynamic, per-row; a GPU), fp8static "
                             "(per-tensor scales, the activations' calibrated on a run from other noise first), "
                             "int8wo (int8 weight-only); default: the model's own")
    parser.add_argument("--fp8-gemms", choices=stack.FP8_GEMMS, default="cublas",
                        help="with --linears fp8: cublas (default, no autotuning) or autotune (Inductor's default: "
                             "minutes of compile; qattn_fx.stack)")
    parser.add_argument("--cache", choices=stack.CACHES, default="none",
                        help="a step cache in the compiled run: fbc (diffusers' First Block Cache)")
    parser.add_argument("--cache-threshold", type=float, default=0.05, help="First Block Cache's threshold")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if args.linears == "fp8" and not on_gpu:
        parser.error("--linears fp8 needs a CUDA GPU (FP8 matmuls); on a CPU use --linears int8wo")
    if args.real_size and not on_gpu:
        parser.error("--real-size runs Wan's published transformer config at 480p: it needs a CUDA GPU")
    if args.real_size:
        config, size = WAN_14B if args.experts == 2 else WAN_1_3B, (480, 832, 81)
    else:  # on a GPU, head_dim 128 so that the kernels could serve it (`auto` keeps such short sequences dense: too
        # small to gain; --real-size or a --spec with an explicit backend runs the kernels); on CPU recipes are emulated
        config, size = dict(WAN_TINY, attention_head_dim=128 if on_gpu else 12), (64, 64, 9)
    height, width, frames = args.height or size[0], args.width or size[1], args.frames or size[2]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    pipe = build_pipeline(config, device, dtype, args.experts)

    call = dict(height=height, width=width, num_frames=frames, num_inference_steps=args.steps, guidance_scale=5.0)
    if args.real_size:  # the real text encoder (UMT5-XXL) is 5.7B parameters: random embeddings of its width
        g = torch.Generator("cpu").manual_seed(1)
        embeds = [torch.randn(1, 512, config["text_dim"], generator=g).to(device, dtype) for _ in range(2)]
        call.update(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], output_type="latent")
    else:
        call.update(prompt=PROMPT, negative_prompt="", max_sequence_length=16, output_type="pt")

    dense, dense_steps = run(pipe, call, device)
    names = ("transformer", "transformer_2")[:args.experts]
    backends = {name: qattn_fx.backend(args.spec, emulate=not on_gpu, compiler=args.compiler) for name in names}
    if args.linears in stack.CALIBRATED:  # activation scales from a run the compared run does not repeat
        with stack.calibrate_linears(*(getattr(pipe, name) for name in names), kind=args.linears) as calibration:
            run(pipe, call, device, seed=1)
        print(f"calibrated {calibration.quantized} linears as {args.linears} on a run from seed 1")
    for name, backend in backends.items():  # every transformer of the pipeline, each with its own report
        transformer = getattr(pipe, name)
        if args.linears not in stack.CALIBRATED:
            stack.quantize_linears(transformer, args.linears)
        stack.enable_cache(transformer, args.cache, args.cache_threshold)
        setattr(pipe, name, torch.compile(transformer, backend=backend, fullgraph=args.cache == "none"))
    with torch._inductor.config.patch(stack.inductor_config(args.linears, args.fp8_gemms)):  # Inductor compiles here
        quantized, quantized_steps = run(pipe, call, device)

    where = qattn_fx.detect(device).describe() + ("" if on_gpu else "; recipes emulated by the reference kernel")
    layout = "transformer" if args.experts == 1 else f"2 experts (boundary_ratio {BOUNDARY_RATIO}), each"
    stacked = "".join(f", {k} {v}" for k, v in (("linears", args.linears), ("cache", args.cache)) if v not in (
        "bf16", "none"))
    print(f"qattn_fx {qattn_fx.__version__}: WanPipeline, {layout} {config['num_layers']} blocks, head_dim "
          f"{config['attention_head_dim']}, {dtype}, {frames}x{height}x{width}, {args.steps} steps{stacked}; {where}")
    for name, backend in backends.items():
        print(f"\n{name}:" if args.experts == 2 else "")
        print(backend.report)
    cos = torch.nn.functional.cosine_similarity(quantized.flatten(), dense.flatten(), dim=0).item()
    rel = ((quantized - dense).norm() / dense.norm()).item()
    if on_gpu and not any(b.report.quantized for b in backends.values()):
        print("\nThese tiny sequences stay dense under `auto` (the reasons above): a quantized kernel is predicted "
              "slower than dense at them. --real-size runs the published config at 480p, where `auto` quantizes "
              "the self-attention; a --spec with an explicit backend runs the kernels at any size.")
    print(f"\ndense:     {fmt_steps(dense_steps, False)}")
    print(f"quantized: {fmt_steps(quantized_steps, True)}")
    print(f"output ({'latents' if args.real_size else 'video frames'} {tuple(dense.shape)}) vs dense: "
          f"cosine {cos:.8f}, relative L2 error {rel:.2e}")
    return {"cosine": cos, "relative_l2": rel, "sites": sum(len(b.report.sites) for b in backends.values()),
            "quantized": sum(b.report.quantized for b in backends.values()), "steps": len(quantized_steps),
            "sites_per_transformer": {name: len(b.report.sites) for name, b in backends.items()}}


if __name__ == "__main__":
    main()
