"""Denoising steps of a diffusers transformer under torch.compile, as users run it: dense vs each qattn_fx kernel.

    python -m benchmarks.dit_step --out bench_out/dit_step.json                # Wan2.1-1.3B config, 480p, 81 frames
    python -m benchmarks.dit_step --config 14b --frames 21 --blocks 4          # fewer frames / blocks, stated in output
    python -m benchmarks.dit_step --config 14b --resolution 720 --blocks 4 --compile whole  # 75,600 tokens
    python -m benchmarks.dit_step --config 2.2-5b --frames 121 --blocks 10 --compile whole  # Wan2.2-TI2V-5B 720p
    python -m benchmarks.dit_step --model hunyuan_video --blocks 2 --single-blocks 4 --compile whole
    python -m benchmarks.dit_step --model hunyuan_video15 --blocks 4 --compile whole --steps 3
    python -m benchmarks.dit_step --model ltx_video --blocks 8 --resolution 704 --compile whole --steps 4
    python -m benchmarks.dit_step --model flux --blocks 2 --single-blocks 4 --compile whole --steps 8 --only auto
    python -m benchmarks.dit_step --model flux --compile whole --mode reduce-overhead --steps 8
    python -m benchmarks.dit_step --model qwen_image --blocks 8 --compile whole --steps 4
    python -m benchmarks.dit_step --model sd3 --compile whole --steps 4

Models (random weights at the published configs, bf16, built on the GPU):

* ``wan``: ``WanTransformer3DModel`` (Wan2.1 ``--config 1.3b`` / ``14b``), 480p latents
  ``(1, 16, 1 + (frames-1)/4, 60, 104)`` → 32,760 tokens at 81 frames (``--resolution 720``: ``90, 160`` → 75,600
  tokens), a 512-token text embedding; ``--config 2.2-5b`` (Wan2.2-TI2V-5B): 1280 x 704 latents
  ``(1, 48, 1 + (frames-1)/4, 44, 80)`` → 27,280 tokens at 121 frames, one timestep per token.
* ``hunyuan_video``: ``HunyuanVideoTransformer3DModel`` (HunyuanVideo's config: 24 heads, d128, 20 dual- and 40
  single-stream blocks), 480p latents ``(1, 16, 1 + (frames-1)/4, 60, 106)`` (``--resolution 720``: ``90, 160``)
  and 256 text tokens of which ``--text-tokens`` are valid: its joint attention masks the padding with a
  ``(B, 1, 1, N)`` key mask.
* ``hunyuan_video15``: ``HunyuanVideo15Transformer3DModel`` (HunyuanVideo-1.5's config: 16 heads, d128, 54
  blocks), text-to-video: 480p latents ``(1, 65, 1 + (frames-1)/4, 30, 53)`` through its 16x VAE (33,390 tokens at
  81 frames, 49,290 at its pipeline's 121; ``--resolution 720``: ``45, 80``) and 1,985 conditioning tokens of which
  ``--text-tokens`` are valid: every block's joint attention masks with ``m_i & m_j`` of that padding mask (a graph
  break where its forward reorders the text by the mask).
* ``ltx_video``: ``LTXVideoTransformer3DModel`` (LTX-Video's config: 32 heads, **d64**, 28 blocks), packed latents
  ``(1, N, 128)`` with N = (1 + (frames-1)/8) · 16 · 22 at the default 704 x 512 (3,872 tokens at 81 frames;
  ``--resolution 704``: 1216 x 704, 9,196 tokens) and 128 text tokens of which ``--text-tokens`` are valid (its
  cross-attention masks the padding with a finite bias).
* ``cogvideox``: ``CogVideoXTransformer3DModel`` (CogVideoX-5B's config: 48 heads, **d64**, 42 blocks), latents
  ``(1, 1 + (frames-1)/4, 16, 60, 90)`` at 720 x 480 (17,550 tokens at ``--frames 49``, its length) and 226 text
  tokens: joint attention with 3-D rotary embeddings on the video tokens.
* ``flux``: ``FluxTransformer2DModel`` (Flux.1-dev's config: 24 heads, d128, 19 double- and 38 single-stream
  blocks, guidance embedding), ``--resolution`` pixels square (default 1024: 4,096 packed latent tokens of 64
  channels) and 512 text tokens: joint attention over 4,608 tokens.
* ``qwen_image``: ``QwenImageTransformer2DModel`` (Qwen-Image's config: 24 heads, d128, 60 dual-stream blocks),
  ``--resolution`` pixels square (default 1328: 6,889 packed latent tokens of 64 channels) and ``--text-tokens``
  text tokens under a key mask of ones, as its pipeline passes one prompt: joint attention over 7,009 tokens.
* ``sd3``: ``SD3Transformer2DModel`` (Stable Diffusion 3 Medium's config: 24 heads, **d64**, 24 joint blocks),
  ``--resolution`` pixels square (default 1024: latents ``(1, 16, 128, 128)``, 4,096 tokens in 2 x 2 patches) and
  333 text tokens: joint attention over 4,429 tokens.

``--blocks`` / ``--single-blocks`` keep fewer blocks (the blocks of a kind are identical, so per-block times scale).
``--compile regional`` (default) compiles the repeated blocks (``compile_repeated_blocks``: one block graph reused
by every layer); ``--compile whole`` compiles the whole model as the README's one line does
(``torch.compile(model, backend=qattn_fx.backend(spec))``). ``--mode reduce-overhead`` is torch.compile's mode (CUDA
graphs), for every variant.

Variants: compiled dense (torch SDPA, cuDNN on Hopper), "no attention" (every SDPA returns its query: the step time
without attention, giving attention's share; ``--skip-no-attention`` leaves it out), qattn_fx's default spec (backend
``auto``: what ``qattn_fx.backend()`` does, including its cost rule), and qattn_fx with each kernel that runs here.

Block sparsity (:mod:`qattn_fx.block_sparse`): ``--block-keep F`` (comma-separated fractions in (0, 1)) adds,
after each qattn variant's row, the same variant with ``block_sparse: {"top_k": F, "similarity": 0, "sink_tiles": 0,
"diagonal": false}`` in every attention spec it holds (``... +bs0.5``): a fixed fraction F of the key tiles per
query tile, so that the speed of a sparsity is measured on random weights (whose attention maps a ``cdf`` predictor
would not thin the way a trained model's are). ``--block-dense-steps N`` (or ``P%`` of ``--steps``) runs the first
N denoising steps dense through ``disabled_until_timestep`` (the schedule is data: the ``recompiles`` column must
stay 0; the name says ``+bs0.5 dense2/8``). Each such row also reports the block sparsity its predictor chose on the
first call (timestep 0.5).

The whole stack (:mod:`qattn_fx.stack`): ``--linears fp8`` adds, after those rows, the same model with TorchAO's FP8
linears (dynamic activation and weight, per-row scales), compiled dense and under each variant (``... + fp8
linears``); ``fp8static`` with FP8 linears whose activation scales were calibrated first
(:func:`qattn_fx.stack.calibrate_linears`, over a denoising loop from other noise than the timed one's); several
kinds (``--linears fp8 fp8static``) run one after the other, each on the model built afresh; ``--cache fbc`` adds
each row's variant again with diffusers' First Block Cache on (``... + fbc``, ``--cache-threshold``; it needs
``--steps``: a cache skips work between denoising steps). Every row's cosine is against the first row, compiled
dense with bf16 linears and no cache; with ``--steps`` the final latents of the
loop are compared too (``cos_final_vs_dense``: what a cache changes shows there, not in the first call). One row of
the stack table per command, e.g. ``--linears fp8 --cache fbc --steps 8 --only auto`` runs dense bf16 compiled,
qattn, FP8 linears, FP8 linears + qattn and each of them with the cache; ``--stack-only`` leaves out the rows with
bf16 linears and no cache but the first (each FP8-linears compile takes minutes: the stacked rows then fit one call).

Timing: after the compiling call and ``--warmup`` calls, ``--iters`` calls on one input, or with ``--steps N`` a
denoising loop of N flow-matching Euler steps whose timestep changes every step and whose latents advance with the
model's output, as a pipeline calls the transformer. For each variant: median step time (CUDA events; the JSON also
has every step's time and their mean: under a step schedule the median is a step of the majority), median host
time to issue a step (the call's return, before the GPU finishes: at the step time the step is host-bound), speedup
over compiled dense, with ``--steps`` the loop's time per step and its speedup (``loop_step_ms``: the loop run
again, timed as a whole without synchronizing between steps, so the host issues a step while the GPU runs the last,
as in a pipeline), output cosine and relative L2 vs dense (the first call's output), compile time, the graphs Dynamo
compiled on the first call and the recompiles after it (graphs compiled during warm-up and timed steps), and the
site summary, and ``compile_phases_s``: the compile's slowest phases (Dynamo's and Inductor's timers;
``--stacks-every S`` also prints the Python stacks every S seconds while a row compiles). Prints one table and
writes JSON. ``--profile`` adds, per variant, one call under ``torch.profiler``:
its GPU time by kernel class (:data:`KERNEL_CLASSES`) and its heaviest kernels, to say where a speedup goes.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch._dynamo.utils import counters

import qattn_fx
from qattn_fx import AttentionSpec, Match, Recipe, Rule, Spec, block_sparse, stack
from qattn_fx.backend import inductor_config_patches
from qattn_fx.fx import match

#: Wan transformer configs by ``--config`` (diffusers ``WanTransformer3DModel``, as published): Wan2.1-T2V-1.3B,
#: Wan2.1-T2V-14B (also the config of each of Wan2.2-T2V-A14B's two experts), and Wan2.2-TI2V-5B, whose 16x VAE
#: gives 48 latent channels and whose pipeline passes one timestep per token (``expand_timesteps``).
CONFIGS = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
    "2.2-5b": dict(num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, num_layers=30, in_channels=48,
                   out_channels=48),
}
#: ``--config``s whose VAE compresses 16x per side (else 8x) and whose pipeline passes a ``(B, tokens)`` timestep.
WAN_VAE16 = ("2.2-5b",)
#: Flux.1-dev's published transformer config (``black-forest-labs/FLUX.1-dev``, ``transformer/config.json``).
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
SAGE = Recipe("int8", "fp8", 1, 16, 1)
#: The TRITON rows name their kernel: on sm_90 the backend's first choice is gluon_sage, on sm_89 triton_sage.
VARIANTS = {
    "qattn auto (default spec)": Spec(),
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
MODES = ("default", "reduce-overhead")
#: ``--profile``'s kernel classes: the first whose pattern matches a CUDA kernel's name (case-insensitive) wins.
#: Inductor's kernels (``triton_...``) carry the names of the ops they fuse, attention's among them when they
#: prepare its inputs, so they are never "attention"; those with a reduction or rounding of the quantize ops are
#: "quantize" (K's smoothing: a mean and a subtraction; a per-block scale's expansion: an ``index_select``).
KERNEL_CLASSES = (
    ("attention", r"^(?!triton_).*(_sage_fwd|_attn_fwd|fmha|flash|sdpa|cudnn|attention|merge)"),
    ("quantize", r"^triton_.*(quantize|smooth|amax|round|index_select|key_bias|lse_shift|mean_.*sub)"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|sm90_|wgmma"),
    ("other", r""),
)


@dataclass
class Case:
    """A model and its inputs: ``inputs`` are the keyword arguments of one forward (at noise level 0.5),
    ``timestep(sigma)`` the timestep input at noise level ``sigma`` in [0, 1] as the model's pipeline passes it, and
    the output (``model(**inputs)[0]``) has the shape of ``inputs["hidden_states"]``, the latents it updates (of its
    first ``latent_channels`` channels where those are set)."""

    model: torch.nn.Module
    inputs: dict
    timestep: Callable[[float], torch.Tensor]
    header: str
    #: When set, only the first ``latent_channels`` channels (dim 1) of ``hidden_states`` are the latents the output
    #: updates; the rest are conditioning that every step appends again (HunyuanVideo-1.5's pipeline).
    latent_channels: int | None = None


#: Frame sizes, (height, width) pixels by ``--resolution``; a model's first entry is its default.
#: Wan2.1's published frame sizes (480p, 720p).
WAN_SIZES = {480: (480, 832), 720: (720, 1280)}
#: Wan2.2-TI2V-5B's frame size (720p: 1280 x 704, a multiple of its 16x VAE's 32-pixel patches).
WAN_VAE16_SIZES = {720: (704, 1280)}
#: HunyuanVideo's frame sizes, (height, width) pixels by ``--resolution`` (480p, 720p).
HUNYUAN_SIZES = {480: (480, 848), 720: (720, 1280)}
#: LTX-Video's frame sizes, (height, width) pixels by ``--resolution``: its pipeline's default 704 x 512, and
#: 1216 x 704 (multiples of its VAE's 32).
LTX_SIZES = {512: (512, 704), 704: (704, 1216)}


def frame_size(model: str, sizes: dict, resolution: int | None) -> tuple[int, int]:
    """``(height, width)`` pixels of ``model`` at ``resolution`` from its ``sizes`` (default: their first entry)."""
    resolution = resolution or next(iter(sizes))
    if resolution not in sizes:
        raise ValueError(f"resolution={resolution} is invalid for {model}; valid: {', '.join(map(str, sizes))}")
    return sizes[resolution]


def timestep_x1000(device: str, shape: tuple[int, ...] = (1,),
                   dtype: torch.dtype = torch.float32) -> Callable[[float], torch.Tensor]:
    """The timestep input of Wan's, HunyuanVideo's and LTX-Video's pipelines at noise level ``sigma``: the
    scheduler's timestep, ``sigma · 1000``, of ``shape`` (``(1,)``; Wan2.2-TI2V-5B's pipeline passes one per token,
    ``(1, tokens)``, all equal in text-to-video) and ``dtype`` (HunyuanVideo-1.5's pipeline: the latents', bf16)."""
    return lambda sigma: torch.full(shape, 1000.0 * sigma, device=device, dtype=dtype)


def timestep_sigma(device: str) -> Callable[[float], torch.Tensor]:
    """The timestep input of Flux's and Qwen-Image's pipelines at noise level ``sigma``: the scheduler's timestep
    / 1000, ``sigma`` itself, in the latents' dtype (bf16), of shape ``(1,)``."""
    return lambda sigma: torch.tensor([sigma], device=device, dtype=torch.bfloat16)


def image_side(resolution: int | None, default: int) -> int:
    """A square image's side in pixels (``default`` when None), checked to be a positive multiple of 16."""
    resolution = resolution or default
    if resolution < 16 or resolution % 16:
        raise ValueError(f"resolution={resolution} is invalid; valid: a multiple of 16 (VAE factor 8, 2 x 2 patches)")
    return resolution


def text_mask(length: int, valid: int, device: str) -> torch.Tensor:
    """A ``(1, length)`` text attention mask: 1 for the first ``valid`` tokens, 0 for the padding."""
    mask = torch.zeros(1, length, device=device)
    mask[:, :valid] = 1
    return mask


def build_wan(*, config: str = "1.3b", blocks: int | None = None, frames: int = 81, resolution: int | None = None,
              device: str = "cuda", dims: dict | None = None, **_) -> Case:
    """Wan at ``resolution`` (480 by default, or 720: :data:`WAN_SIZES`; Wan2.2-TI2V-5B: 720,
    :data:`WAN_VAE16_SIZES`, a ``(1, tokens)`` timestep as its pipeline passes it); ``dims`` overrides entries of
    the diffusers config (small models for CPU tests)."""
    from diffusers import WanTransformer3DModel

    vae16 = config in WAN_VAE16
    name = f"Wan{config}" if vae16 else f"Wan2.1-{config}"
    height, width = frame_size(name, WAN_VAE16_SIZES if vae16 else WAN_SIZES, resolution)
    cfg = dict(in_channels=16, out_channels=16)
    cfg.update(CONFIGS[config])
    if blocks:
        cfg["num_layers"] = blocks
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), text_dim=4096, freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=1e-6, rope_max_seq_len=1024, **cfg,
        ).to(torch.bfloat16).eval()
    latent_frames = 1 + (frames - 1) // 4
    vae = 16 if vae16 else 8
    tokens = latent_frames * (height // vae // 2) * (width // vae // 2)
    timestep = timestep_x1000(device, (1, tokens) if vae16 else (1,))

    inputs = dict(
        hidden_states=torch.randn(1, cfg["in_channels"], latent_frames, height // vae, width // vae, device=device,
                                  dtype=torch.bfloat16),
        timestep=timestep(0.5),
        encoder_hidden_states=torch.randn(1, 512, 4096, device=device, dtype=torch.bfloat16),
        return_dict=False,
    )
    header = (f"{name} config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {frames} frames {height}p = {tokens} tokens, text 512"
              + (", a timestep per token" if vae16 else ""))
    return Case(model, inputs, timestep, header)


def build_hunyuan_video(*, blocks: int | None = None, single_blocks: int | None = None, frames: int = 81,
                        text_tokens: int = 120, resolution: int | None = None, device: str = "cuda",
                        dims: dict | None = None, **_) -> Case:
    """HunyuanVideo at ``resolution`` (480 by default, or 720: :data:`HUNYUAN_SIZES`) with 256 text tokens,
    ``text_tokens`` of them valid; ``dims`` as for Wan."""
    height, width = frame_size("HunyuanVideo", HUNYUAN_SIZES, resolution)
    from diffusers import HunyuanVideoTransformer3DModel

    cfg = dict(num_attention_heads=24, attention_head_dim=128, num_layers=blocks or 20,
               num_single_layers=single_blocks if single_blocks is not None else 40, num_refiner_layers=2,
               rope_axes_dim=(16, 56, 56))
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = HunyuanVideoTransformer3DModel(
            in_channels=16, out_channels=16, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
            guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0, **cfg,
        ).to(torch.bfloat16).eval()
    latent_frames = 1 + (frames - 1) // 4
    text = 256
    mask = text_mask(text, text_tokens, device)
    timestep = timestep_x1000(device)

    inputs = dict(
        hidden_states=torch.randn(1, 16, latent_frames, height // 8, width // 8, device=device, dtype=torch.bfloat16),
        timestep=timestep(0.5),
        encoder_hidden_states=torch.randn(1, text, 4096, device=device, dtype=torch.bfloat16),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(1, 768, device=device, dtype=torch.bfloat16),
        guidance=torch.tensor([6000.0], device=device, dtype=torch.bfloat16),
        return_dict=False,
    )
    tokens = latent_frames * (height // 16) * (width // 16)
    header = (f"HunyuanVideo config ({cfg['num_layers']} dual + {cfg['num_single_layers']} single blocks, "
              f"{cfg['num_attention_heads']} heads, d{cfg['attention_head_dim']}), {frames} frames {height}p = "
              f"{tokens} video tokens + {text} text ({text_tokens} valid, the rest masked)")
    return Case(model, inputs, timestep, header)


def build_hunyuan_video15(*, blocks: int | None = None, frames: int = 121, text_tokens: int = 120,
                          resolution: int | None = None, device: str = "cuda", dims: dict | None = None, **_) -> Case:
    """HunyuanVideo-1.5 text-to-video at ``resolution`` (480 by default, or 720: :data:`HUNYUAN_SIZES`; its
    pipeline's 16:9 sizes), inputs as ``HunyuanVideo15Pipeline`` makes them: 65 latent channels (32 noisy, 32
    conditioning zeros, a zero mask) through its 16x VAE, 1000 text tokens of which ``text_tokens`` are valid, 256
    ByT5 tokens and 729 image tokens, none valid (no glyph text, no image). Every block masks its joint attention
    with ``m_i & m_j`` of that padding mask. ``dims`` as for Wan."""
    height, width = frame_size("HunyuanVideo-1.5", HUNYUAN_SIZES, resolution)
    from diffusers import HunyuanVideo15Transformer3DModel

    cfg = dict(num_attention_heads=16, attention_head_dim=128, num_layers=blocks or 54, num_refiner_layers=2,
               text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_axes_dim=(16, 56, 56))
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = HunyuanVideo15Transformer3DModel(in_channels=65, out_channels=32, task_type="t2v",
                                                 **cfg).to(torch.bfloat16).eval()
    latent_frames, text, byt5, image = 1 + (frames - 1) // 4, 1000, 256, 729
    bf16 = dict(device=device, dtype=torch.bfloat16)
    latents = torch.randn(1, 32, latent_frames, height // 16, width // 16, **bf16)
    timestep = timestep_x1000(device, dtype=torch.bfloat16)

    inputs = dict(
        hidden_states=torch.cat([latents, torch.zeros(1, 33, *latents.shape[2:], **bf16)], dim=1),
        timestep=timestep(0.5),
        encoder_hidden_states=torch.randn(1, text, cfg["text_embed_dim"], **bf16),
        encoder_attention_mask=text_mask(text, text_tokens, device).to(torch.int64),
        encoder_hidden_states_2=torch.randn(1, byt5, cfg["text_embed_2_dim"], **bf16),
        encoder_attention_mask_2=torch.zeros(1, byt5, device=device, dtype=torch.int64),
        image_embeds=torch.zeros(1, image, cfg["image_embed_dim"], **bf16),
        return_dict=False,
    )
    tokens = latent_frames * (height // 16) * (width // 16)
    header = (f"HunyuanVideo-1.5 config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {frames} frames {height}p = {tokens} video tokens + {text} text "
              f"({text_tokens} valid) + {byt5} ByT5 + {image} image (none valid), masked m_i & m_j")
    return Case(model, inputs, timestep, header, latent_channels=latents.shape[1])


def build_ltx_video(*, blocks: int | None = None, frames: int = 81, resolution: int | None = None,
                    text_tokens: int = 120, device: str = "cuda", dims: dict | None = None, **_) -> Case:
    """LTX-Video at ``resolution`` (512 by default, or 704: :data:`LTX_SIZES`) with 128 text tokens, ``text_tokens``
    of them valid, inputs as ``LTXPipeline`` makes them (packed latents of 128 channels, 32x spatial and 8x temporal
    compression, RoPE scale ``(8 / 25, 32, 32)`` at 25 fps); its head_dim is 64. ``dims`` as for Wan."""
    from diffusers import LTXVideoTransformer3DModel

    height, width = frame_size("LTX-Video", LTX_SIZES, resolution)
    if (frames - 1) % 8:
        raise ValueError(f"frames={frames} is invalid for LTX-Video; valid: 8·k + 1 (its VAE's temporal factor)")
    cfg = dict(num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048, num_layers=blocks or 28)
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = LTXVideoTransformer3DModel(in_channels=128, out_channels=128, caption_channels=4096,
                                           **cfg).to(torch.bfloat16).eval()
    latent_frames, latent_h, latent_w = 1 + (frames - 1) // 8, height // 32, width // 32
    tokens = latent_frames * latent_h * latent_w
    text = 128
    mask = text_mask(text, text_tokens, device)
    timestep = timestep_x1000(device)

    inputs = dict(
        hidden_states=torch.randn(1, tokens, 128, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, 4096, device=device, dtype=torch.bfloat16),
        timestep=timestep(0.5), encoder_attention_mask=mask, num_frames=latent_frames, height=latent_h,
        width=latent_w, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False,
    )
    header = (f"LTX-Video config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {frames} frames {width}x{height} = {tokens} tokens, text {text} "
              f"({text_tokens} valid)")
    return Case(model, inputs, timestep, header)


def build_flux(*, blocks: int | None = None, single_blocks: int | None = None, resolution: int | None = None,
               device: str = "cuda", dims: dict | None = None, **_) -> Case:
    """Flux.1-dev at ``resolution`` x ``resolution`` pixels (a multiple of 16) with 512 text tokens, inputs as
    ``FluxPipeline`` makes them (packed 2 x 2 latent patches, position ids, guidance 3.5); ``dims`` as for Wan."""
    from diffusers import FluxTransformer2DModel

    resolution = image_side(resolution, 1024)
    cfg = dict(FLUX_DEV)
    if blocks:
        cfg["num_layers"] = blocks
    if single_blocks is not None:
        cfg["num_single_layers"] = single_blocks
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(**cfg).to(torch.bfloat16).eval()
    side = resolution // 16
    tokens, text = side * side, 512
    img_ids = torch.zeros(side, side, 3, device=device)
    img_ids[..., 1] = torch.arange(side, device=device)[:, None]
    img_ids[..., 2] = torch.arange(side, device=device)[None, :]
    timestep = timestep_sigma(device)

    inputs = dict(
        hidden_states=torch.randn(1, tokens, cfg["in_channels"], device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], device=device, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], device=device, dtype=torch.bfloat16),
        timestep=timestep(0.5),
        img_ids=img_ids.reshape(tokens, 3).to(torch.bfloat16),
        txt_ids=torch.zeros(text, 3, device=device, dtype=torch.bfloat16),
        guidance=torch.tensor([3.5], device=device, dtype=torch.float32),
        return_dict=False,
    )
    header = (f"Flux.1-dev config ({cfg['num_layers']} double + {cfg['num_single_layers']} single blocks, "
              f"{cfg['num_attention_heads']} heads, d{cfg['attention_head_dim']}), {resolution}x{resolution} = "
              f"{tokens} image tokens + {text} text")
    return Case(model, inputs, timestep, header)


#: Qwen-Image's published transformer config (``Qwen/Qwen-Image``, ``transformer/config.json``): an MMDiT of 60
#: dual-stream blocks whose joint attention takes a key mask over the text tokens (``encoder_hidden_states_mask``).
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


def build_qwen_image(*, blocks: int | None = None, resolution: int | None = None, text_tokens: int = 120,
                     device: str = "cuda", dims: dict | None = None, **_) -> Case:
    """Qwen-Image at ``resolution`` x ``resolution`` pixels (a multiple of 16; default 1328, the model card's 1:1
    size; the pipeline's default is 1024) with ``text_tokens`` text tokens, inputs as ``QwenImagePipeline`` makes
    them for one prompt (packed 2 x 2 latent patches of 64 channels, ``img_shapes``, the text's mask of ones: the
    joint attention takes it as a ``(B, 1, 1, N)`` boolean key mask); ``dims`` as for Wan."""
    from diffusers import QwenImageTransformer2DModel

    resolution = image_side(resolution, 1328)
    cfg = dict(QWEN_IMAGE, num_layers=blocks or QWEN_IMAGE["num_layers"])
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = QwenImageTransformer2DModel(**cfg).to(torch.bfloat16).eval()
    side = resolution // 16
    tokens = side * side
    timestep = timestep_sigma(device)

    inputs = dict(
        hidden_states=torch.randn(1, tokens, cfg["in_channels"], device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text_tokens, cfg["joint_attention_dim"], device=device,
                                          dtype=torch.bfloat16),
        encoder_hidden_states_mask=torch.ones(1, text_tokens, device=device, dtype=torch.int64),
        timestep=timestep(0.5), img_shapes=[[(1, side, side)]], return_dict=False,
    )
    header = (f"Qwen-Image config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {resolution}x{resolution} = {tokens} image tokens + {text_tokens} "
              "text (key-masked)")
    return Case(model, inputs, timestep, header)


#: CogVideoX-5B's frame size, (height, width) pixels by ``--resolution``: 720 x 480.
COGVIDEOX_SIZES = {480: (480, 720)}


def build_cogvideox(*, blocks: int | None = None, frames: int = 49, resolution: int | None = None,
                    device: str = "cuda", dims: dict | None = None, **_) -> Case:
    """CogVideoX-5B at 720 x 480 (:data:`COGVIDEOX_SIZES`) with its 226 text tokens, inputs as
    ``CogVideoXPipeline`` makes them (latents frames-first, 8x spatial and 4x temporal compression, 3-D rotary
    embeddings on the latent grid); its head_dim is 64. ``dims`` as for Wan."""
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    height, width = frame_size("CogVideoX", COGVIDEOX_SIZES, resolution)
    if (frames - 1) % 4:
        raise ValueError(f"frames={frames} is invalid for CogVideoX; valid: 4·k + 1 (its VAE's temporal factor)")
    cfg = dict(num_attention_heads=48, attention_head_dim=64, num_layers=blocks or 42)
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = CogVideoXTransformer3DModel(
            in_channels=16, out_channels=16, time_embed_dim=512, text_embed_dim=4096, sample_width=width // 8,
            sample_height=height // 8, sample_frames=49, patch_size=2, max_text_seq_length=226,
            use_rotary_positional_embeddings=True, **cfg,
        ).to(torch.bfloat16).eval()
    latent_frames, grid = 1 + (frames - 1) // 4, (height // 16, width // 16)
    text, tokens = 226, latent_frames * grid[0] * grid[1]
    timestep = timestep_x1000(device)
    inputs = dict(
        hidden_states=torch.randn(1, latent_frames, 16, height // 8, width // 8, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, 4096, device=device, dtype=torch.bfloat16),
        timestep=timestep(0.5),
        image_rotary_emb=get_3d_rotary_pos_embed(cfg["attention_head_dim"], ((0, 0), grid), grid, latent_frames,
                                                 device=device),
        return_dict=False,
    )
    header = (f"CogVideoX-5B config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {frames} frames {width}x{height} = {tokens} video tokens + {text} "
              "text")
    return Case(model, inputs, timestep, header)


#: Stable Diffusion 3 Medium's published transformer config (``stabilityai/stable-diffusion-3-medium-diffusers``,
#: ``transformer/config.json``): an MMDiT of 24 joint blocks, 24 heads of head_dim 64.
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                  num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192)


def build_sd3(*, blocks: int | None = None, resolution: int | None = None, device: str = "cuda",
              dims: dict | None = None, **_) -> Case:
    """Stable Diffusion 3 Medium at ``resolution`` x ``resolution`` pixels (a multiple of 16; default 1024) with its
    333 text tokens (77 CLIP + 256 T5), inputs as ``StableDiffusion3Pipeline`` makes them (latents ``(1, 16, H/8,
    W/8)`` in 2 x 2 patches, the timestep ``1000 · sigma``); its head_dim is 64. ``dims`` as for Wan."""
    from diffusers import SD3Transformer2DModel

    resolution = image_side(resolution, 1024)
    cfg = dict(SD3_MEDIUM)
    if blocks:
        cfg["num_layers"] = blocks
    cfg.update(dims or {})
    torch.manual_seed(0)
    with torch.device(device):
        model = SD3Transformer2DModel(**cfg).to(torch.bfloat16).eval()
    side, text = resolution // 8, 333
    tokens = (side // 2) ** 2
    timestep = timestep_x1000(device)
    inputs = dict(
        hidden_states=torch.randn(1, cfg["in_channels"], side, side, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, cfg["joint_attention_dim"], device=device, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], device=device, dtype=torch.bfloat16),
        timestep=timestep(0.5),
        return_dict=False,
    )
    header = (f"SD3-medium config ({cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads, "
              f"d{cfg['attention_head_dim']}), {resolution}x{resolution} = {tokens} image tokens + {text} text")
    return Case(model, inputs, timestep, header)


MODELS = {"wan": build_wan, "hunyuan_video": build_hunyuan_video, "ltx_video": build_ltx_video, "flux": build_flux,
          "cogvideox": build_cogvideox, "qwen_image": build_qwen_image,
          "hunyuan_video15": build_hunyuan_video15, "sd3": build_sd3}


def no_attention_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """Inductor on the graph with every SDPA replaced by its query (the step without attention)."""
    from torch._inductor.compile_fx import compile_fx

    for call in match.find_sdpa(gm):
        call.node.replace_all_uses_with(call.q)
        call.graph.erase_node(call.node)
    gm.recompile()
    return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(mode, options))


def compile_model(model: torch.nn.Module, backend, how: str, mode: str):
    """``model`` compiled as ``how`` says: ``regional`` (``compile_repeated_blocks``, in place: returns the model) or
    ``whole`` (``torch.compile(model, backend=backend)``); ``mode`` is torch.compile's. Regional compilation is
    ``fullgraph`` unless a step cache is on: First Block Cache breaks the graph of the first block by design
    (:mod:`qattn_fx.stack`)."""
    kwargs = {} if mode == "default" else {"mode": mode}
    if how == "regional":
        fullgraph = not getattr(model, "is_cache_enabled", False)
        model.compile_repeated_blocks(backend=backend, fullgraph=fullgraph, **kwargs)
        return model
    if how == "whole":
        return torch.compile(model, backend=backend, **kwargs)
    raise ValueError(f"how={how!r} is invalid; valid: regional, whole")


def cuda_timer(times: list[float], host_times: list[float] | None = None):
    """A context manager factory: each ``with`` block's GPU time in ms (CUDA events, from the block's start to the
    end of the work it queued) is appended to ``times``, and the host's time to run the block (to issue the work,
    without waiting for it) to ``host_times``. A step whose host time reaches its GPU time is host-bound: the GPU
    waits for the launches."""

    @contextlib.contextmanager
    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        yield
        issued = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if host_times is not None:
            host_times.append(issued * 1e3)

    return timed


def denoise(step: Callable, case: Case, steps: int, timer=contextlib.nullcontext) -> torch.Tensor:
    """``steps`` Euler steps of a flow-matching sampler from noise level 1 to 0: each calls ``step`` (the model,
    compiled or not) on the current latents with that step's timestep (a new tensor every step, as a pipeline passes
    it) and moves the latents by ``(sigma_next - sigma) x output``. Each call runs inside ``timer()``; returns the
    final latents (``case.latent_channels`` of them where set: the conditioning channels are appended each call)."""
    latents, condition = case.inputs["hidden_states"], None
    if case.latent_channels is not None:
        latents, condition = latents[:, :case.latent_channels], latents[:, case.latent_channels:]
    sigmas = [1.0 - i / steps for i in range(steps + 1)]
    for sigma, sigma_next in zip(sigmas, sigmas[1:]):
        hidden = latents if condition is None else torch.cat([latents, condition], dim=1)
        call = dict(case.inputs, hidden_states=hidden, timestep=case.timestep(sigma))
        torch.compiler.cudagraph_mark_step_begin()  # each call a new step for CUDA graphs (reduce-overhead)
        with timer():
            velocity = step(**call)[0]
        latents = latents + (sigma_next - sigma) * velocity
    return latents


def loop_step_ms(step: Callable, case: Case, steps: int) -> float:
    """Mean GPU ms per step of a ``steps``-step :func:`denoise` loop timed as a whole, as a pipeline runs it: CUDA
    events around the loop and no synchronization between its steps, so the host issues a step while the GPU runs
    the one before (the per-step timer synchronizes after each step, which exposes the host's time to its first
    launch). The model's step cache is reset first."""
    stack.reset_cache(case.model)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    denoise(step, case, steps)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def in_cache_context(step: Callable, model: torch.nn.Module, recomputed: list | None = None) -> Callable:
    """``step`` with each call inside ``model``'s cache context (:func:`qattn_fx.stack.cache_context`), as a
    pipeline calls it; with a First Block Cache, whether each call recomputed the blocks is appended to
    ``recomputed``. Without a cache, ``step`` itself."""
    if not getattr(model, "is_cache_enabled", False):
        return step

    def call(**kwargs):
        with stack.cache_context(model):
            out = step(**kwargs)
            if recomputed is not None:
                recomputed.append(stack.fbc_recomputed(model))
        return out

    return call


def repeat(step: Callable, case: Case, calls: int, timer=contextlib.nullcontext) -> None:
    """``calls`` calls of ``step`` on the case's one input, each inside ``timer()``."""
    for _ in range(calls):
        torch.compiler.cudagraph_mark_step_begin()
        with timer():
            step(**case.inputs)


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (``torch._dynamo.utils.counters``; reset by ``counters.clear()``)."""
    return counters["stats"]["unique_graphs"]


def kernel_class(kernel: str) -> str:
    """The class of a CUDA kernel's name: the first of :data:`KERNEL_CLASSES` whose pattern it matches."""
    return next(name for name, pattern in KERNEL_CLASSES if re.search(pattern, kernel, re.IGNORECASE))


def compile_phases() -> dict[str, float]:
    """Seconds this process has spent in each of Dynamo's and Inductor's timed compile phases so far
    (``torch._dynamo.utils.compile_times``, aggregated)."""
    try:
        names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
        return {n: float(v) for n, v in zip(names, values, strict=True)}
    except (TypeError, ValueError) as error:  # a private API: a diagnostic, so the row goes on without it
        print(f"compile phases unavailable on torch {torch.__version__}: {error}", flush=True)
        return {}


def top_phases(before: dict[str, float], after: dict[str, float], top: int = 8) -> dict[str, float]:
    """The ``top`` phases by time spent between two :func:`compile_phases` snapshots (the outermost ones first by
    nature: they contain the rest)."""
    spent = {n: t - before.get(n, 0.0) for n, t in after.items()}
    return dict(sorted(((n, t) for n, t in spent.items() if t > 0), key=lambda kv: -kv[1])[:top])


def profile_call(step: Callable, case: Case, top: int = 12) -> dict:
    """One call of ``step`` under ``torch.profiler``: GPU ms per kernel class (:data:`KERNEL_CLASSES`) and the
    ``top`` kernels by GPU time (name cut to 100 characters, ms, launches)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.compiler.cudagraph_mark_step_begin()
        step(**case.inputs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    classes = {name: 0.0 for name, _ in KERNEL_CLASSES}
    for e in kernels:
        classes[kernel_class(e.key)] += e.device_time_total / 1e3
    return {"gpu_ms": sum(classes.values()), "classes_ms": classes,
            "top": [(e.key[:100], e.device_time_total / 1e3, e.count) for e in kernels[:top]]}


def parse_dense_steps(text: str, steps: int) -> int:
    """``--block-dense-steps``: ``N`` steps, or ``P%`` of ``steps`` (rounded), checked against ``steps``."""
    text = str(text).strip()
    try:
        n = round(float(text[:-1]) / 100.0 * steps) if text.endswith("%") else int(text)
    except ValueError:
        raise ValueError(f"--block-dense-steps={text!r} is invalid; valid: N (steps) or P% (of --steps)") from None
    if n < 0 or (n and not steps) or n > steps:
        raise ValueError(f"--block-dense-steps={text!r} is invalid with --steps {steps}; valid: 0 <= N <= --steps "
                         "(a dense prefix needs a denoising loop: --steps)")
    return n


def dense_until_timestep(dense_steps: int, steps: int) -> float | None:
    """The ``disabled_until_timestep`` D under which :func:`denoise`'s first ``dense_steps`` of ``steps`` run dense:
    step i has the normalized timestep ``t = 1 - i / steps`` (sigma; Wan's ``1000 · sigma`` / 1000) and a step is
    dense while ``t > D``, so D lies half a step below the last dense step's t. None: no dense step."""
    if not dense_steps:
        return None
    return 1.0 - (dense_steps - 0.5) / steps


def block_sparse_spec(spec: Spec, keep: float, disabled_until: float | None = None) -> Spec:
    """``spec`` with ``block_sparse: {"top_k": keep, "similarity": 0, "sink_tiles": 0, "diagonal": false}`` (and
    ``disabled_until_timestep``) in its default and in every rule's attention spec (``"dense"`` uses stay dense).
    ``ValueError`` where the spec or its backend does not take the key."""
    setting: dict = {"top_k": keep, "similarity": 0.0, "sink_tiles": 0, "diagonal": False}
    if disabled_until is not None:
        setting["disabled_until_timestep"] = disabled_until
    data = spec.to_dict()
    for use in [data["default"], *(rule["use"] for rule in data["rules"])]:
        if isinstance(use, dict):
            use["block_sparse"] = dict(setting)
    return Spec.from_dict(data)


def block_suffix(keep: float, dense_steps: int = 0, steps: int = 0) -> str:
    """A variant name's block-sparse suffix: `` +bs0.5``, `` +bs0.5 dense2/8``."""
    return f" +bs{keep:g}" + (f" dense{dense_steps}/{steps}" if dense_steps else "")


def run_variant(name: str, case: Case, backend, dense_out, args,
                dense_final: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """Compile ``case.model`` with ``backend`` as ``args.compile`` / ``args.mode`` say, run it once (the compile),
    ``args.warmup`` times, then time ``args.steps`` denoising steps (or ``args.iters`` calls on one input). With a
    cache on the model, every call runs in its context and the cache is reset before the timed loop. The row's
    ``final`` entry (popped by :func:`main`) holds the loop's final latents, compared with ``dense_final``."""
    torch._dynamo.reset()
    counters.clear()
    stack.reset_cache(case.model)
    recomputed: list = []
    step = in_cache_context(compile_model(case.model, backend, args.compile, args.mode), case.model, recomputed)
    print(f"{name}: compiling ({args.compile}, mode {args.mode}) ...", flush=True)
    phases_before = compile_phases()
    if args.stacks_every:  # where a long compile spends its time, even if the call's limit ends it
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), block_sparse.measure() as blocks:  # the predictor's choice on the first call (syncs)
            torch.compiler.cudagraph_mark_step_begin()
            out = step(**case.inputs)[0].clone()  # cloned: a CUDA-graph output is overwritten by the next replay
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
    finally:  # a failed compile must not leave the stacks printing through the next rows
        faulthandler.cancel_dump_traceback_later()
    phases = top_phases(phases_before, compile_phases())
    print(f"{name}: compile phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    with torch.no_grad():
        graphs = graphs_compiled()
        timed = f"{args.steps} denoising steps" if args.steps else f"{args.iters} calls"
        print(f"{name}: compiled {graphs} graph(s) in {compile_s:.0f} s; timing {args.warmup} + {timed}", flush=True)
        repeat(step, case, args.warmup)
        times: list[float] = []
        host: list[float] = []
        final = loop_ms = None
        if args.steps:
            loop_ms = loop_step_ms(step, case, args.steps)
            stack.reset_cache(case.model)
            recomputed.clear()
            final = denoise(step, case, args.steps, cuda_timer(times, host)).clone()
        else:
            repeat(step, case, args.iters, cuda_timer(times, host))
        recompiles = graphs_compiled() - graphs
        profiled = profile_call(step, case) if args.profile else None
    row = {"variant": name, "step_ms": statistics.median(times), "step_mean_ms": statistics.fmean(times),
           "step_times_ms": times, "host_ms": statistics.median(host),
           "compile_s": compile_s, "compile_phases_s": phases, "graphs": graphs, "recompiles": recompiles}
    if loop_ms is not None:
        row["loop_step_ms"] = loop_ms
    if profiled:
        row["profile"] = profiled
    if blocks.sites:  # block-sparse sites ran: the fraction of blocks their predictor skipped on the first call
        row["block_sparsity"] = blocks.overall()
        row["block_sparsity_sites"] = blocks.sparsity()
    if dense_out is not None:
        a, b = out.float().flatten(), dense_out.float().flatten()
        row["cos_vs_dense"] = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        row["rel_l2_vs_dense"] = ((a - b).norm() / b.norm()).item()
    if final is not None and dense_final is not None:
        a, b = final.float().flatten(), dense_final.float().flatten()
        row["cos_final_vs_dense"] = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    if getattr(case.model, "is_cache_enabled", False) and args.steps:
        row["cache_recomputed_steps"] = sum(bool(r) for r in recomputed)  # of args.steps timed steps
    row["final"] = final
    report = getattr(backend, "report", None)
    if report is not None:
        row["sites"] = report.summary()
    for module in case.model.modules():  # undo regional compilation (nn.Module.compile) for the next variant
        module._compiled_call_impl = None
    return row, out


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks.dit_step needs a CUDA GPU")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dit_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODELS), default="wan")
    parser.add_argument("--config", choices=tuple(CONFIGS), default="1.3b",
                        help="Wan config: Wan2.1 1.3b / 14b, Wan2.2-TI2V 2.2-5b")
    parser.add_argument("--blocks", type=int, help="transformer blocks (default: all of the config; HunyuanVideo: "
                                                   "dual-stream blocks; Flux: double-stream blocks)")
    parser.add_argument("--single-blocks", type=int, help="single-stream blocks of HunyuanVideo (default 40) and Flux "
                                                          "(default 38)")
    parser.add_argument("--text-tokens", type=int, default=120, help="HunyuanVideo: valid text tokens of 256; "
                                                                     "HunyuanVideo-1.5: of 1000; LTX-Video: of 128; "
                                                                     "Qwen-Image: text tokens")
    parser.add_argument("--frames", type=int, default=81, help="video frames (latent frames = 1 + (f-1)/4)")
    parser.add_argument("--resolution", type=int, help="Flux, Qwen-Image, SD3: image side in pixels, a multiple of "
                        "16 (default 1024, Qwen-Image 1328); Wan: 480 (832 x 480, the default) or 720 (1280 x 720); "
                        "HunyuanVideo (1.5): 480 (848 x 480, the default) or 720 (1280 x 720); LTX-Video: 512 (704 x "
                        "512, the default) or 704 (1216 x 704); CogVideoX: 480 (720 x 480)")
    parser.add_argument("--compile", choices=("regional", "whole"), default="regional")
    parser.add_argument("--mode", choices=MODES, default="default", help="torch.compile mode (reduce-overhead: "
                                                                         "CUDA graphs)")
    parser.add_argument("--steps", type=int, default=0, help="time N denoising steps with a changing timestep "
                                                             "(default 0: --iters calls on one input)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="substrings of variant names to run (the dense baseline always "
                                                  "runs)")
    parser.add_argument("--skip-no-attention", action="store_true", help="leave out the 'no attention' variant")
    parser.add_argument("--profile", action="store_true", help="profile one call per variant: GPU time by kernel "
                                                                "class and the heaviest kernels")
    parser.add_argument("--linears", nargs="+", choices=stack.LINEARS, default=["bf16"],
                        help="also run every row with TorchAO's quantized linears of each kind: fp8 (dynamic "
                             "activation and weight, per-row; sm_89+), fp8static (per-tensor scales, the "
                             "activations' calibrated over a denoising loop first), int8wo (int8 weight-only: a smoke "
                             "test on any device); default bf16 (only the model's own linears)")
    parser.add_argument("--fp8-gemms", choices=stack.FP8_GEMMS, default="cublas",
                        help="with FP8 linears: cublas (default: the ATen FP8 matmul, no autotuning) or autotune "
                             "(Inductor's default, which autotunes Triton templates per matmul shape: minutes of "
                             "compile; qattn_fx.stack)")
    parser.add_argument("--stack-only", action="store_true",
                        help="with --linears or --cache: of the rows with bf16 linears and no cache only the first "
                             "(compiled dense, the reference), so a call's time goes to the stacked rows")
    parser.add_argument("--cache", choices=stack.CACHES, default="none",
                        help="also run every row with a step cache: fbc (diffusers' First Block Cache; needs --steps)")
    parser.add_argument("--cache-threshold", type=float, default=0.05,
                        help="First Block Cache's threshold (default 0.05, diffusers' default)")
    parser.add_argument("--block-keep", default="",
                        help="comma-separated keep fractions in (0, 1): after each qattn variant, the same with "
                             "block_sparse top_k F (no guard, sinks or diagonal), named '... +bsF'")
    parser.add_argument("--block-dense-steps", default="0",
                        help="with --block-keep and --steps: the first N steps dense (N, or P%% of --steps, e.g. "
                             "25%%) through disabled_until_timestep; no recompile")
    parser.add_argument("--stacks-every", type=float, default=0,
                        help="while a row compiles, print every thread's Python stack every S seconds (faulthandler, "
                             "to stderr): where a compile that outlasts the call's limit spends its time")
    parser.add_argument("--out", default="bench_out/dit_step.json")
    args = parser.parse_args(argv)
    try:
        args.block_keep = [float(x) for x in args.block_keep.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--block-keep={args.block_keep!r} is invalid; valid: comma-separated fractions in (0, 1)")
    if any(not 0.0 < x < 1.0 for x in args.block_keep):
        parser.error(f"--block-keep={args.block_keep} is invalid; valid: fractions in (0, 1) (1 keeps every block)")
    try:
        args.block_dense_steps = parse_dense_steps(args.block_dense_steps, args.steps)
    except ValueError as e:
        parser.error(str(e))
    if args.block_dense_steps and not args.block_keep:
        parser.error("--block-dense-steps needs --block-keep (the block-sparse rows it schedules)")
    if args.stack_only and args.linears == ["bf16"] and args.cache == "none":
        parser.error("--stack-only needs --linears or --cache: without them there is no stacked row to run")
    if args.cache != "none" and args.steps < 2:
        parser.error(f"--cache {args.cache} needs --steps N with N >= 2: a cache reuses work between denoising steps")
    for name in ("steps", "iters", "warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name}={getattr(args, name)} is invalid; valid: an int >= 0")
    if not args.steps and not args.iters:
        parser.error("nothing to time: give --steps N or --iters N with N >= 1")
    return args


@dataclass(frozen=True)
class Row:
    """One row of the table: ``attention`` is ``dense``, ``no_attention`` or a :data:`VARIANTS` name, run on the
    model with ``linears`` (:data:`qattn_fx.stack.LINEARS`) and ``cache`` (:data:`qattn_fx.stack.CACHES`)."""

    name: str
    attention: str
    linears: str = "bf16"
    cache: str = "none"
    #: ``block_sparse`` top_k fraction added to the variant's spec (None: none) and the dense steps before it.
    block_keep: float | None = None
    block_dense_steps: int = 0


def plan(args: argparse.Namespace) -> list[Row]:
    """The rows ``args`` ask for, in the order they run: the model's own linears first (TorchAO quantizes the
    weights in place), each without then with the cache. The first row, compiled dense with bf16 linears and no
    cache, is the reference of every cosine (with ``--stack-only`` the only row without linears or cache)."""
    attention = [name for name in VARIANTS if not args.only or any(s in name for s in args.only)]
    rows = [Row("compiled dense (torch SDPA)", "dense")]
    if not args.skip_no_attention:
        rows.append(Row("compiled, no attention", "no_attention"))
    for linears in dict.fromkeys(("bf16", *args.linears)):
        for cache in dict.fromkeys(("none", args.cache)):
            suffix = (f" + {linears} linears" if linears != "bf16" else "") + (
                f" + {cache} {args.cache_threshold:g}" if cache != "none" else "")
            if args.stack_only and not suffix:
                continue
            if suffix:
                rows.append(Row("compiled dense" + suffix, "dense", linears, cache))
            for name in attention:
                rows.append(Row(name + suffix, name, linears, cache))
                rows += [Row(name + block_suffix(keep, args.block_dense_steps, args.steps) + suffix, name, linears,
                             cache, keep, args.block_dense_steps) for keep in args.block_keep]
    return rows


def prepare(case: Case, row: Row, args: argparse.Namespace, build: Callable[[], Case]) -> Case:
    """The case ``row`` runs on, in the state it runs in: ``case`` with its linears quantized as ``row.linears``
    says (in place, once, for the later rows of that kind; a model quantized otherwise is replaced by ``build()``,
    the same weights afresh) and its cache on or off."""
    current = getattr(case.model, "_dit_step_linears", "bf16")
    if row.linears != current:
        if current != "bf16":
            case = build()
        if row.linears in stack.CALIBRATED:
            with stack.calibrate_linears(case.model, kind=row.linears) as calibration:
                denoise(case.model, calibration_case(case), max(args.steps, 1))
            count = calibration.quantized
        else:
            count = stack.quantize_linears(case.model, row.linears)
        case.model._dit_step_linears = row.linears
        print(f"quantized {count} linears: {row.linears}", flush=True)
    cached = getattr(case.model, "is_cache_enabled", False)
    if row.cache != "none" and not cached:
        stack.enable_cache(case.model, row.cache, args.cache_threshold)
    elif row.cache == "none" and cached:
        case.model.disable_cache()
    return case


def calibration_case(case: Case) -> Case:
    """``case`` with latents of other noise (seed 1; the conditioning channels after ``case.latent_channels`` kept):
    what :func:`prepare` calibrates static activation scales on, so that the timed loop runs on inputs the
    calibration did not see."""
    hidden = case.inputs["hidden_states"].clone()
    latents = hidden[:, :case.latent_channels] if case.latent_channels is not None else hidden
    latents.copy_(torch.randn(latents.shape, generator=torch.Generator().manual_seed(1)))
    return replace(case, inputs=dict(case.inputs, hidden_states=hidden))


def spec_of(row: Row, steps: int = 0) -> Spec:
    """The spec of a qattn ``row``: its variant's, with ``block_sparse`` where the row sets a keep fraction."""
    spec = VARIANTS[row.attention]
    if row.block_keep is None:
        return spec
    return block_sparse_spec(spec, row.block_keep, dense_until_timestep(row.block_dense_steps, steps))


def timestep_scale(case: Case) -> float:
    """What divides ``case``'s timestep input to the normalized ``t`` (sigma): 1000 for Wan, HunyuanVideo, LTX-Video
    and CogVideoX (``1000 · sigma``), 1 for Flux and Qwen-Image (sigma itself)."""
    return float(case.timestep(1.0).float().amax())


def backend_of(row: Row, steps: int = 0, scale: float = 1000.0):
    """What ``row`` compiles with (``steps``: the denoising loop's, for a dense prefix of block-sparse rows;
    ``scale``: :func:`timestep_scale`, which that prefix's schedule reads the timestep with)."""
    if row.attention == "dense":
        return "inductor"
    if row.attention == "no_attention":
        return no_attention_backend
    if row.block_dense_steps:
        return qattn_fx.backend(spec_of(row, steps), timestep_scale=scale)
    return qattn_fx.backend(spec_of(row, steps))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda()

    def build() -> Case:
        return MODELS[args.model](config=args.config, blocks=args.blocks, single_blocks=args.single_blocks,
                                  frames=args.frames, text_tokens=args.text_tokens, resolution=args.resolution,
                                  device="cuda")

    try:
        case = build()
    except ValueError as e:  # a size the model cannot take, named by its builder
        sys.exit(f"python -m benchmarks.dit_step: error: {e}")
    hw = qattn_fx.detect("cuda")
    timed = f"{args.steps} denoising steps" if args.steps else f"{args.iters} calls on one input"
    linears = " + ".join(k for k in args.linears if k != "bf16")
    fp8 = next((k for k in args.linears if k in stack.FP8), "bf16")
    stacked = "".join(f", {k} {v}" for k, v in (("linears", linears), ("cache", args.cache)) if v not in (
        "", "none")) + (f" ({args.fp8_gemms} FP8 matmuls)" if fp8 != "bf16" else "")
    header = (f"{case.header}, bf16, {args.compile} compile, mode {args.mode}, {timed}{stacked}, "
              f"{torch.cuda.get_device_name()} ({hw.arch}), torch {torch.__version__}")
    print(header, flush=True)
    rows = []
    dense_out = dense_final = None
    with torch.no_grad(), torch._inductor.config.patch(stack.inductor_config(fp8, args.fp8_gemms)):
        for i, spec_row in enumerate(plan(args)):
            try:
                case = prepare(case, spec_row, args, build)
                reference = (None, None) if spec_row.attention == "no_attention" else (dense_out, dense_final)
                backend = backend_of(spec_row, args.steps, timestep_scale(case))
                row, out = run_variant(spec_row.name, case, backend, reference[0], args, reference[1])
                final = row.pop("final")
                if i == 0:
                    dense_out, dense_final = out, final
            except Exception as e:  # noqa: BLE001 - report and go on to the next row
                if i == 0:
                    raise
                row = {"variant": spec_row.name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            row.update(linears=spec_row.linears, cache=spec_row.cache)
            if spec_row.block_keep is not None:
                row.update(block_keep=spec_row.block_keep, block_dense_steps=spec_row.block_dense_steps)
            rows.append(row)
            print(json.dumps(row), flush=True)

    dense_ms = rows[0]["step_ms"]
    share = None
    print(f"\n{header}")
    if not args.skip_no_attention and "step_ms" in rows[1]:
        share = (dense_ms - rows[1]["step_ms"]) / dense_ms
        print(f"attention share of the compiled dense step: {share:.1%}")
    width = max(38, *(len(r["variant"]) for r in rows))
    dense_loop_ms = rows[0].get("loop_step_ms")
    print(f"{'variant':{width}} {'step ms':>9} {'host ms':>8} {'speedup':>8} {'loop ms':>8} {'loop x':>7} "
          f"{'cos':>9} {'rel L2':>8} {'final cos':>9} {'compile s':>9} {'graphs':>6} {'recompiles':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:{width}} error: {r['error']}")
            continue
        cos = f"{r['cos_vs_dense']:.5f}" if "cos_vs_dense" in r else "-"
        rel = f"{r['rel_l2_vs_dense']:.4f}" if "rel_l2_vs_dense" in r else "-"
        final = f"{r['cos_final_vs_dense']:.5f}" if "cos_final_vs_dense" in r else "-"
        loop, loop_x = "-", "-"
        if "loop_step_ms" in r:
            loop = f"{r['loop_step_ms']:.1f}"
            loop_x = f"{dense_loop_ms / r['loop_step_ms']:.2f}x" if dense_loop_ms else "-"
        print(f"{r['variant']:{width}} {r['step_ms']:9.1f} {r['host_ms']:8.1f} {dense_ms / r['step_ms']:7.2f}x "
              f"{loop:>8} {loop_x:>7} {cos:>9} {rel:>8} {final:>9} {r['compile_s']:9.1f} {r['graphs']:6d} "
              f"{r['recompiles']:10d}")
    for r in rows:
        if "cache_recomputed_steps" in r:
            print(f"{r['variant']}: the cache recomputed {r['cache_recomputed_steps']} of {args.steps} steps")
    for r in rows:
        if "block_sparsity" in r:
            print(f"{r['variant']}: the predictor skipped {r['block_sparsity']:.3f} of the blocks on the first call "
                  f"(timestep 0.5); {r['recompiles']} recompiles over the timed steps")
    for r in rows:
        if "sites" in r:
            print(f"{r['variant']}: {r['sites']}")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            classes = ", ".join(f"{k} {v:.2f}" for k, v in p["classes_ms"].items())
            print(f"\n{r['variant']}: one call's GPU time {p['gpu_ms']:.2f} ms ({classes})")
            for kname, ms, count in p["top"]:
                print(f"  {ms:8.3f} ms {count:5d}x  {kname}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"header": header, "attention_share": share, "rows": rows,
                               "settings": {k: v for k, v in vars(args).items() if k != "out"},
                               "date": time.strftime("%Y-%m-%d"),
                               "command": "python -m benchmarks.dit_step " + " ".join(sys.argv[1:])}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
