"""Tiny diffusers transformers with random weights (no hub access) and their inputs, for the quickstart and tests.

Configs follow diffusers' own model tests; every model is built in eval mode from a fixed seed.
"""

from __future__ import annotations

import torch


def wan(num_layers: int = 2, head_dim: int = 12):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 16), return_dict=False)
    return model, inputs


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


MODELS = {"wan": wan, "flux": flux, "dit": dit, "hunyuan_video": hunyuan_video}
