"""The whole stack on the GPU: TorchAO FP8 linears (``fp8``: dynamic activation and weight, per-row; ``fp8static``:
per-tensor scales, the activations' calibrated on other noise first) and quantized attention in one compile of a
tiny bf16 Wan (head_dim 128, every linear's sides multiples of 16, so all are FP8).

The backend finds and decides the same sites as on the plain model, in one graph (``fullgraph=True``), Inductor's
code calls the FP8 matmul (``_scaled_mm``) beside the attention kernel, and the output stays close to the dense
bf16 model. Tolerance: FP8 linears alone are cos ≈ 0.999 on random weights, the Sage recipe ≈ 0.9993 per layer
(tests/gpu/test_compiled_models.py); together two residual layers keep cosine above 0.99.
"""

import re

import pytest
import torch

import qattn_fx
from qattn_fx import AttentionSpec, Recipe, Spec, stack, tiny_models

pytestmark = pytest.mark.gpu

SAGE = Spec(default=AttentionSpec("TRITON", Recipe("int8", "fp8", 1, 16, 1)))


def on_gpu(model, inputs):
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: (v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.to("cuda")) if torch.is_tensor(v)
              else v for k, v in inputs.items()}
    return model, inputs


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


@pytest.mark.parametrize("linears", ["fp8", "fp8static"])
def test_fp8_linears_and_quantized_attention_in_one_graph(linears):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90+ GPU")
    pytest.importorskip("diffusers")
    pytest.importorskip("torchao")
    from torch._inductor.utils import run_and_get_code

    model, inputs = on_gpu(*tiny_models.wan(head_dim=128))
    with torch.no_grad():
        dense = model(**inputs)[0]
        torch._dynamo.reset()
        plain = qattn_fx.backend(SAGE)
        plain_out = torch.compile(model, backend=plain, fullgraph=True)(**inputs)[0]

        count = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        if linears == "fp8":
            assert stack.quantize_linears(model, "fp8") == count
        else:
            other = dict(inputs, hidden_states=torch.randn_like(inputs["hidden_states"]))
            with stack.calibrate_linears(model) as calibration:
                model(**other)
            assert calibration.quantized == count and calibration.unseen == []
        fp8_eager = model(**inputs)[0]
        torch._dynamo.reset()
        backend = qattn_fx.backend(SAGE)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with torch._inductor.config.patch(stack.inductor_config(linears, "cublas")):  # no autotuning: seconds
            out, code = run_and_get_code(compiled, **inputs)
        out = out[0]
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled(**inputs)

    assert len(backend.graph_modules) == 1
    rows = [(s.module, s.role, s.rewritten, s.kernel, s.reason) for s in backend.report.sites]
    assert rows == [(s.module, s.role, s.rewritten, s.kernel, s.reason) for s in plain.report.sites]
    assert all(s.rewritten for s in backend.report.sites), str(backend.report)
    assert any("scaled_mm" in c or "f8f8bf16" in c for c in code), "Inductor's code calls an FP8 matmul"
    if linears == "fp8static":  # the activation's cast in the GELU's kernel: no pass over the activation of its own
        kernels = set(re.findall(r"triton_\w+", "\n".join(code)))
        assert any("gelu" in k and "clamp" in k for k in kernels), sorted(kernels)
    assert cosine(plain_out, dense) >= 0.99
    assert cosine(fp8_eager, dense) >= 0.99
    cos = cosine(out, dense)
    assert cos >= 0.99, f"FP8 linears + qattn: cosine {cos:.5f} vs dense bf16"
