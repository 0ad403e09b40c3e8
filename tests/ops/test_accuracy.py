"""Accuracy of the reference numerics on inputs with DiT-like outlier channels in K (and Q).

A small CPU version of the outlier accuracy check of ``tests/gpu/test_triton_sage.py``: K (and Q) get a
per-(head, channel) bias shared by every token, the outlier pattern SageAttention reports for real DiT activations.
Outputs are compared with fp32 SDPA. Measured on CPU (torch 2.13, B1 H2 S1024 D64, seed 0), cos / rel-L1:

=====================  ===================  ===================  ===================
recipe                 gaussian             K bias x5            K bias x10, Q x3
=====================  ===================  ===================  ===================
int8 1/16/1 smooth K   0.999321 / 0.0368    0.999321 / 0.0368    0.999381 / 0.0347
int8 1/16/1 raw K      0.999330 / 0.0366    0.998800 / 0.0487    0.993066 / 0.1193
fp8 per-tensor raw K   0.998586 / 0.0521    0.992198 / 0.1218    0.917834 / 0.3733
fp8 per-tensor smooth  0.998619 / 0.0517    0.998619 / 0.0517    0.997676 / 0.0681
bf16 Q/K, fp8 V/chan   0.999371 / 0.0355    0.999371 / 0.0355    0.999645 / 0.0250
=====================  ===================  ===================  ===================

(bf16 inputs, K x10 / Q x3: int8 smooth 0.999507, int8 raw 0.992497, fp8 per-tensor raw 0.909227.)
The ~0.035 rel-L1 floor of every row is FP8 P·V (P rounded to e4m3 with the fixed scale 448), as on the H200.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qattn_fx.ops import quantized_attention
from qattn_fx.recipes import Recipe

INT8_SMOOTH = Recipe("int8", "fp8", 1, 16, 1, smooth_k=True)
INT8_RAW = Recipe("int8", "fp8", 1, 16, 1, smooth_k=False)
FP8_TENSOR_RAW = Recipe("fp8", "fp8", 0, 0, 0, smooth_k=False)
FP8_TENSOR_SMOOTH = Recipe("fp8", "fp8", 0, 0, 0, smooth_k=True)
BF16_PV8 = Recipe("bf16", "fp8", 0, 0, 1)

CASES = {"gaussian": (0.0, 0.0), "k5": (5.0, 0.0), "k10q3": (10.0, 3.0)}


def make_inputs(k_bias: float, q_bias: float, dtype=torch.float32, b=1, h=2, s=1024, d=64, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, h, s, d) + q_bias * torch.randn(1, h, 1, d)
    k = torch.randn(b, h, s, d) + k_bias * torch.randn(1, h, 1, d)
    v = torch.randn(b, h, s, d)
    return tuple(x.to(dtype) for x in (q, k, v))


def metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    o, r = out.float().flatten(), ref.float().flatten()
    return F.cosine_similarity(o, r, dim=0).item(), ((o - r).abs().sum() / r.abs().sum()).item()


@pytest.fixture(scope="module")
def results():
    """{(case, dtype): {recipe name: (cos, rel_l1)}} computed once for the module."""
    table = {}
    for case, (kb, qb) in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.bfloat16 and case != "k10q3":
                continue
            q, k, v = make_inputs(kb, qb, dtype)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            row = {}
            for name, recipe in (("int8_smooth", INT8_SMOOTH), ("int8_raw", INT8_RAW),
                                 ("fp8_tensor_raw", FP8_TENSOR_RAW), ("fp8_tensor_smooth", FP8_TENSOR_SMOOTH),
                                 ("bf16_pv8", BF16_PV8)):
                row[name] = metrics(quantized_attention(q, k, v, recipe, out_dtype=torch.float32), ref)
            table[case, dtype] = row
    return table


def test_k_smoothing_is_exact_under_softmax():
    q, k, v = (x.double() for x in make_inputs(10.0, 3.0, s=256))
    smoothed = k - k.mean(dim=2, keepdim=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, smoothed, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_int8_sage_with_smoothed_k_stays_above_0_999(results, case):
    cos, rel = results[case, torch.float32]["int8_smooth"]
    assert cos > 0.999, cos  # measured 0.99932-0.99938
    assert rel < 0.045, rel  # measured 0.035-0.037: the FP8 P·V floor


def test_int8_sage_with_bf16_inputs(results):
    assert results["k10q3", torch.bfloat16]["int8_smooth"][0] > 0.999  # measured 0.999507
    assert results["k10q3", torch.bfloat16]["int8_raw"][0] < 0.996  # measured 0.992497


def test_unsmoothed_int8_drops_on_outliers(results):
    smooth_cos, smooth_rel = results["k10q3", torch.float32]["int8_smooth"]
    raw_cos, raw_rel = results["k10q3", torch.float32]["int8_raw"]
    assert raw_cos < 0.996  # measured 0.993066
    assert smooth_cos - raw_cos > 0.004  # measured gap 0.0063
    assert raw_rel > 2.5 * smooth_rel  # measured 0.1193 vs 0.0347
    # without outliers smoothing changes nothing measurable
    g_smooth, g_raw = (results["gaussian", torch.float32][n][0] for n in ("int8_smooth", "int8_raw"))
    assert abs(g_smooth - g_raw) < 1e-4
    # the drop grows with the outlier size
    assert results["k5", torch.float32]["int8_raw"][0] > raw_cos


def test_per_tensor_fp8_without_smoothing_degrades_on_outliers(results):
    gaussian = results["gaussian", torch.float32]["fp8_tensor_raw"][0]
    k5 = results["k5", torch.float32]["fp8_tensor_raw"][0]
    k10 = results["k10q3", torch.float32]["fp8_tensor_raw"][0]
    assert gaussian > 0.998  # measured 0.998586
    assert k5 < 0.995  # measured 0.992198
    assert k10 < 0.95  # measured 0.917834
    assert results["k10q3", torch.bfloat16]["fp8_tensor_raw"][0] < 0.95  # measured 0.909227
    # smoothing K rescues most of it, as on the H200 (cuDNN FP8 after K smoothing: 0.99618)
    assert results["k10q3", torch.float32]["fp8_tensor_smooth"][0] > 0.996  # measured 0.997676
    # and per-block INT8 beats per-tensor FP8 on every input set
    for case in CASES:
        assert results[case, torch.float32]["int8_smooth"][0] > results[case, torch.float32]["fp8_tensor_smooth"][0]


def test_bf16_qk_fp8_pv_bounds_the_pv_error(results):
    # QK16PV8 only quantizes V and P: it is the accuracy ceiling for every FP8 P·V recipe here
    for case in CASES:
        row = results[case, torch.float32]
        assert row["bf16_pv8"][0] > 0.999  # measured 0.99937-0.99965
        assert row["bf16_pv8"][0] >= row["int8_smooth"][0] - 1e-4


def test_int8_sage_on_activations_captured_from_a_tiny_wan_transformer():
    """The issue's bar on real activations (tiny Wan, random weights, 1024 tokens, head_dim 64), reference numerics:
    INT8 1/16/1 with smoothed K reaches cos >= 0.9995 and rel L1 <= 0.04 and beats per-tensor and per-head FP8
    (the cuDNN FP8 and FA3 FP8 recipes). Measured (CPU, torch 2.13): self-attention cos 0.99998 / rel L1 0.006 vs
    FP8 0.99985 / 0.017; cross-attention (12 text tokens) 0.99986 / 0.016 vs 0.99974 / 0.022. The synthetic
    outlier sets above stay at the FP8 P·V floor (0.9993-0.9994 / 0.035) because their V is zero-mean Gaussian
    and their attention is peakier than these activations'."""
    import support

    calls = support.captured_attention_inputs()
    assert sorted({role for role, *_ in calls}) == ["cross", "self"] and len(calls) == 4
    for role, q, k, v in calls:
        ref = F.scaled_dot_product_attention(q, k, v)
        sage = metrics(quantized_attention(q, k, v, INT8_SMOOTH, out_dtype=torch.float32), ref)
        fp8_tensor = metrics(quantized_attention(q, k, v, FP8_TENSOR_SMOOTH, out_dtype=torch.float32), ref)
        fp8_head = metrics(quantized_attention(q, k, v, Recipe("fp8", "fp8", 0, 0, 0, scale_scope="head"),
                                               out_dtype=torch.float32), ref)
        assert sage[0] >= 0.9995 and sage[1] <= 0.04, (role, sage)
        assert sage[0] > fp8_tensor[0] and sage[1] < fp8_tensor[1], (role, sage, fp8_tensor)
        assert sage[0] > fp8_head[0] and sage[1] < fp8_head[1], (role, sage, fp8_head)
