"""Tiny diffusers transformers with random weights (no hub access) and their inputs, for the quickstart and tests.

Configs follow diffusers' own model tests; every model is built in eval mode from a fixed seed.
"""

from __future__ import annotations

import torch


def _wan(*, heads: int, head_dim: int, channels: int, text_dim: int, ffn_dim: int, num_layers: int, rope_len: int,
         latents: tuple[int, int, int], text_tokens: int):
    """A ``WanTransformer3DModel`` (2x2 patches, RMSNorm across heads on Q/K) and one call's inputs: latents
    ``(1, channels, *latents)`` (frames, height, width), ``text_tokens`` text embeddings, timestep 500."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=channels,
        out_channels=channels, text_dim=text_dim, freq_dim=256, ffn_dim=ffn_dim, num_layers=num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=rope_len,
    ).eval()
    inputs = dict(hidden_states=torch.randn(1, channels, *latents), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, text_tokens, text_dim), return_dict=False)
    return model, inputs


def wan(num_layers: int = 2, head_dim: int = 12):
    """2 heads of ``head_dim`` over 128 video tokens (2 latent frames of 16 x 16) and 12 text tokens."""
    return _wan(heads=2, head_dim=head_dim, channels=4, text_dim=16, ffn_dim=32, num_layers=num_layers, rope_len=32,
                latents=(2, 16, 16), text_tokens=12)


def wan_480p(num_layers: int = 2):
    """Wan2.1-1.3B's attention calls in a small model: 12 heads of 128 over 32,760 video tokens (81 frames at 480p)
    and 512 text tokens, in ``num_layers`` blocks with a small FFN and text width. The quickstart's model on a GPU:
    at these lengths ``auto`` quantizes the self-attention on an H200 and keeps the cross-attention to 512 tokens
    dense (its cost rule), where :func:`wan`'s 128 tokens would leave every site dense."""
    return _wan(heads=12, head_dim=128, channels=16, text_dim=64, ffn_dim=256, num_layers=num_layers,
                rope_len=1024, latents=(21, 60, 104), text_tokens=512)


def flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ).eval()
    inputs = dict(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 48, 32),
                  pooled_projections=torch.randn(1, 32), img_ids=torch.randn(16, 3), txt_ids=torch.randn(48, 3),
                  timestep=torch.tensor([1.0]), return_dict=False)
    return model, inputs


def dit():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        in_channels=4, out_channels=8, activation_fn="gelu-approximate", num_attention_heads=2, attention_head_dim=4,
        attention_bias=True, num_layers=1, norm_type="ada_norm_zero", num_embeds_ada_norm=8, patch_size=2,
        sample_size=8,
    ).eval()
    inputs = dict(hidden_states=torch.randn(4, 4, 8, 8), timestep=torch.tensor([1, 2, 3, 4]),
                  class_labels=torch.tensor([0, 1, 2, 3]), return_dict=False)
    return model, inputs


def hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None,
    ).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 1, 16, 16), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 12, 16), pooled_projections=torch.randn(1, 8),
                  encoder_attention_mask=torch.ones(1, 12), guidance=torch.tensor([500.0]), return_dict=False)
    return model, inputs


def hunyuan_video15():
    """HunyuanVideo-1.5 (text-to-video inputs: the image embedding all zeros), its text padded: 7 of 12 text tokens
    and 3 of 6 ByT5 tokens valid. Every block's joint self-attention masks with ``m_i & m_j`` of the padding mask.
    Its forward reorders the text tokens by a data-dependent mask, so Dynamo breaks the graph there (compile
    without ``fullgraph``)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, text_embed_dim=24, text_embed_2_dim=20, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
    ).eval()
    text, byt5 = torch.zeros(1, 12, dtype=torch.int64), torch.zeros(1, 6, dtype=torch.int64)
    text[:, :7], byt5[:, :3] = 1, 1
    inputs = dict(hidden_states=torch.randn(1, 9, 2, 8, 8), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 12, 24), encoder_attention_mask=text,
                  encoder_hidden_states_2=torch.randn(1, 6, 20), encoder_attention_mask_2=byt5,
                  image_embeds=torch.zeros(1, 5, 16), return_dict=False)
    return model, inputs


def sd3():
    """SD3.5's layout: joint attention, and a second (image-only) attention in block 0 (``dual_attention_layers``)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=32, pooled_projection_dim=8,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    ).eval()
    return model, example_inputs(model)


def cogvideox():
    """CogVideoX-5B's layout: joint text + video attention with rotary embeddings on the video tokens."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=2, sample_width=16, sample_height=16, sample_frames=5, patch_size=2,
        max_text_seq_length=12, use_rotary_positional_embeddings=True,
    ).eval()
    return model, example_inputs(model)


def ltx_video(head_dim: int = 16):
    """LTX-Video's layout: self-attention, and cross-attention to the text under its padding mask."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=head_dim,
        cross_attention_dim=2 * head_dim, num_layers=1, caption_channels=16,
    ).eval()
    return model, example_inputs(model, height=8, width=8)


MODELS = {"wan": wan, "flux": flux, "dit": dit, "hunyuan_video": hunyuan_video, "sd3": sd3, "cogvideox": cogvideox,
          "ltx_video": ltx_video}


# ------------------------------------------------------------------------------------------------------------------
# Example inputs for a model of a known class (``qattn-fx inspect --config ... --class ...``)
# ------------------------------------------------------------------------------------------------------------------

#: The model classes :func:`example_inputs` makes inputs for.
KNOWN_CLASSES = ("WanTransformer3DModel", "FluxTransformer2DModel", "DiTTransformer2DModel",
                 "HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel", "SD3Transformer2DModel",
                 "CogVideoXTransformer3DModel", "LTXVideoTransformer3DModel", "QwenImageTransformer2DModel")


def example_inputs(model, *, batch: int = 1, frames: int = 2, height: int = 16, width: int = 16,
                   text_len: int = 12, dtype: torch.dtype | None = None, seed: int = 0,
                   noise_level: float | None = None) -> dict:
    """Keyword inputs for ``model`` (a diffusers transformer of one of :data:`KNOWN_CLASSES`) from its config.

    Sizes are in latent units, before patching: ``frames`` x ``height`` x ``width`` latent pixels (video models;
    image models ignore ``frames``; DiT uses its ``sample_size``) and ``text_len`` text tokens. Attention lengths
    follow from them and the model's patch size (Wan ``(1, 2, 2)``: ``frames * height/2 * width/2`` tokens).
    Decisions only depend on lengths through rules on them, so small sizes are enough to see every site.
    ``seed`` seeds the random tensors; ``noise_level`` in (0, 1] sets the timestep as that fraction of the model's
    range (Flux: of 1; the others: of 1000 steps), else a mid-range default. CogVideoX takes its latents
    frames-first, ``(B, frames, C, height, width)``, and its rotary embeddings when its config uses them; LTX-Video
    takes them packed, ``(B, frames·height·width, C)``, with its text's padding mask (every token valid);
    Qwen-Image packed 2 x 2, ``(B, height/2 · width/2, C)``, with ``img_shapes`` and its text mask (all valid);
    HunyuanVideo-1.5 text-to-video inputs: ``text_len`` tokens of each text encoder (all valid) and ``text_len``
    image tokens of zeros (none valid).
    """
    name = type(model).__name__
    if name not in KNOWN_CLASSES:
        raise ValueError(f"no example inputs for {name}; known classes: {', '.join(KNOWN_CLASSES)} (or pass "
                         "module:factory returning (model, inputs))")
    c = model.config
    if dtype is None:
        dtype = next(model.parameters()).dtype
    if noise_level is not None and not 0.0 < noise_level <= 1.0:
        raise ValueError(f"noise_level={noise_level!r} is invalid; valid: a fraction in (0, 1]")
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    level = 0.5 if noise_level is None else noise_level
    t = torch.full((batch,), 1000.0 * level)
    if name == "WanTransformer3DModel":
        inputs = dict(hidden_states=rand(batch, c.in_channels, frames, height, width), timestep=t,
                      encoder_hidden_states=rand(batch, text_len, c.text_dim), return_dict=False)
        if c.image_dim is not None:  # image-to-video: CLIP image tokens
            inputs["encoder_hidden_states_image"] = rand(batch, 257, c.image_dim)
        return inputs
    if name == "HunyuanVideoTransformer3DModel":
        inputs = dict(hidden_states=rand(batch, c.in_channels, frames, height, width), timestep=t,
                      encoder_hidden_states=rand(batch, text_len, c.text_embed_dim),
                      pooled_projections=rand(batch, c.pooled_projection_dim),
                      encoder_attention_mask=torch.ones(batch, text_len), return_dict=False)
        if c.guidance_embeds:
            inputs["guidance"] = torch.full((batch,), 5000.0)
        return inputs
    if name == "HunyuanVideo15Transformer3DModel":  # text-to-video: the image embedding all zeros
        ones = torch.ones(batch, text_len, dtype=torch.int64)
        return dict(hidden_states=rand(batch, c.in_channels, frames, height, width), timestep=t.to(dtype),
                    encoder_hidden_states=rand(batch, text_len, c.text_embed_dim), encoder_attention_mask=ones,
                    encoder_hidden_states_2=rand(batch, text_len, c.text_embed_2_dim), encoder_attention_mask_2=ones,
                    image_embeds=torch.zeros(batch, text_len, c.image_embed_dim, dtype=dtype), return_dict=False)
    if name == "QwenImageTransformer2DModel":
        side_h, side_w = height // c.patch_size, width // c.patch_size
        return dict(hidden_states=rand(batch, side_h * side_w, c.in_channels),
                    encoder_hidden_states=rand(batch, text_len, c.joint_attention_dim),
                    encoder_hidden_states_mask=torch.ones(batch, text_len, dtype=torch.int64),
                    timestep=torch.full((batch,), level).to(dtype), img_shapes=[[(1, side_h, side_w)]] * batch,
                    return_dict=False)
    if name == "FluxTransformer2DModel":
        tokens = height * width
        inputs = dict(hidden_states=rand(batch, tokens, c.in_channels),
                      encoder_hidden_states=rand(batch, text_len, c.joint_attention_dim),
                      pooled_projections=rand(batch, c.pooled_projection_dim), img_ids=rand(tokens, 3),
                      txt_ids=rand(text_len, 3), timestep=torch.full((batch,), 1.0 if noise_level is None else level),
                      return_dict=False)
        if c.guidance_embeds:
            inputs["guidance"] = torch.full((batch,), 3.5)
        return inputs
    if name == "SD3Transformer2DModel":
        return dict(hidden_states=rand(batch, c.in_channels, height, width),
                    encoder_hidden_states=rand(batch, text_len, c.joint_attention_dim),
                    pooled_projections=rand(batch, c.pooled_projection_dim), timestep=t, return_dict=False)
    if name == "CogVideoXTransformer3DModel":
        inputs = dict(hidden_states=rand(batch, frames, c.in_channels, height, width),  # frames before channels
                      encoder_hidden_states=rand(batch, text_len, c.text_embed_dim), timestep=t, return_dict=False)
        if c.use_rotary_positional_embeddings:  # as the pipeline makes them, on the latent grid
            from diffusers.models.embeddings import get_3d_rotary_pos_embed

            grid = (height // c.patch_size, width // c.patch_size)
            inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(
                c.attention_head_dim, ((0, 0), grid), grid, -(-frames // (c.patch_size_t or 1)))
        return inputs
    if name == "LTXVideoTransformer3DModel":  # latents packed to (B, frames·height·width, C), as LTXPipeline does
        return dict(hidden_states=rand(batch, frames * height * width, c.in_channels),
                    encoder_hidden_states=rand(batch, text_len, c.caption_channels), timestep=t,
                    encoder_attention_mask=torch.ones(batch, text_len), num_frames=frames, height=height,
                    width=width, return_dict=False)
    size = c.sample_size  # DiT: class-conditional images of the configured size
    step = 1 if noise_level is None else min(999, int(1000 * level))
    return dict(hidden_states=rand(batch, c.in_channels, size, size), timestep=torch.full((batch,), step),
                class_labels=torch.zeros(batch, dtype=torch.long), return_dict=False)


def example_calls(model, n: int, **sizes) -> tuple[list[tuple[tuple, dict]], list[str]]:
    """``n`` calls of ``model`` (a diffusers transformer of :data:`KNOWN_CLASSES`) as ``(args, kwargs)`` pairs, as
    denoising steps see them: noise levels ``1, (n-1)/n, ..., 1/n`` (high noise first), each with random inputs of
    its own seed; and a label per call (``t=0.67``). ``sizes``: :func:`example_inputs`'s sizes and dtype."""
    if n < 1:
        raise ValueError(f"n={n!r} is invalid; valid: an int >= 1")
    levels = [1.0 - i / n for i in range(n)]
    calls = [((), example_inputs(model, seed=i, noise_level=level, **sizes)) for i, level in enumerate(levels)]
    return calls, [f"t={level:.2f}" for level in levels]
