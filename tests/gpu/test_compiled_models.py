"""A tiny diffusers Wan transformer (head_dim 128, bf16) compiled on the GPU with each Hopper kernel selected.

Each compile must be one graph (``fullgraph=True``: zero graph breaks), quantize every attention site with the
chosen kernel, not recompile on a second call, and stay close to the dense bf16 model. Tolerance: per-tensor or
per-head FP8 attention is cos ≈ 0.998 per layer on random activations (BENCHMARKS.md), the Sage recipe ≈ 0.9993;
two layers with residual connections keep the model output above cosine 0.99.
"""

import pytest
import torch

import qattn_fx
from qattn_fx import AttentionSpec, Recipe, Spec, tiny_models

pytestmark = pytest.mark.gpu

KERNELS = {
    # backend TRITON on sm_90 with triton >= 3.6 runs the warp-specialized Gluon kernel
    "gluon_sage": (Spec(default=AttentionSpec("TRITON", Recipe("int8", "fp8", 1, 16, 1))), None),
    "triton_sage": (Spec(default=AttentionSpec("TRITON", Recipe("int8", "fp8", 1, 16, 1), kernel="triton_sage")),
                    None),
    "cudnn_fp8": (Spec(default=AttentionSpec("CUDNN", Recipe("fp8", "fp8"))), "cudnn"),
    "flashinfer_fa3_fp8": (Spec(default=AttentionSpec("FLASHINFER", Recipe("fp8", "fp8", scale_scope="head"))),
                           "flashinfer"),
}


def compile_on_gpu(model, inputs: dict, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """``model`` and its floating inputs in bf16 on the GPU, compiled whole with ``backend`` (one graph) and called
    twice, the second time failing on a recompile: ``(dense output, compiled output)`` in fp32."""
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.to("cuda")) if torch.is_tensor(v)
              else v for k, v in inputs.items()}
    torch._dynamo.reset()
    with torch.no_grad():
        dense = model(**inputs)[0].float()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(**inputs)[0].float()
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled(**inputs)
    return dense, out


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_compiled_wan_on_gpu(kernel):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    spec, library = KERNELS[kernel]
    if library:
        pytest.importorskip(library)
    pytest.importorskip("diffusers")
    backend = qattn_fx.backend(spec)
    dense, out = compile_on_gpu(*tiny_models.wan(head_dim=128), backend)
    assert len(backend.graph_modules) == 1
    assert [s.kernel for s in backend.report.sites] == [kernel] * 4, str(backend.report)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), dense.flatten(), dim=0).item()
    assert cos >= 0.99, f"{kernel}: cosine {cos:.5f} vs dense"


def test_compiled_ltx_video_text_mask_on_gluon_sage():
    """LTX-Video's cross-attention mask, repeated over the heads by diffusers, is read per key: with gluon_sage
    forced both sites run it (the text padding as its key bias), in one graph, close to the dense model."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("diffusers")
    model, inputs = tiny_models.ltx_video(head_dim=64)
    inputs["encoder_attention_mask"][:, 8:] = 0  # 8 valid text tokens of 12
    backend = qattn_fx.backend(KERNELS["gluon_sage"][0])
    dense, out = compile_on_gpu(model, inputs, backend)
    sites = backend.report.sites
    assert [s.kernel for s in sites] == ["gluon_sage"] * 2, str(backend.report)
    assert "read per key as (1, 1, 1, 12)" in sites[1].notes[0]
    cos = torch.nn.functional.cosine_similarity(out.flatten(), dense.flatten(), dim=0).item()
    assert cos >= 0.99, f"cosine {cos:.5f} vs dense"


def test_quickstart_model_on_gpu_quantizes_self_and_keeps_cross_dense_under_auto():
    """The quickstart's GPU model (Wan2.1-1.3B's attention shapes at 480p) under the default spec: on an H200 the
    self-attention runs on gluon_sage and the cross-attention to 512 text tokens stays dense by the cost rule."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("diffusers")
    backend = qattn_fx.backend()
    dense, out = compile_on_gpu(*tiny_models.wan_480p(), backend)
    sites = backend.report.sites
    assert [(s.role, s.kernel) for s in sites] == [("self", "gluon_sage"), ("cross", None)] * 2, str(backend.report)
    assert all("predicted 0.66x of cuDNN bf16 at Sq 32760, Skv 512" in s.reason for s in sites[1::2])
    cos = torch.nn.functional.cosine_similarity(out.flatten(), dense.flatten(), dim=0).item()
    assert cos >= 0.999, f"cosine {cos:.5f} vs dense"
