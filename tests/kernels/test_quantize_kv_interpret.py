"""The fused K/V quantize kernel (:mod:`qattn_fx.kernels.quantize_kv`) under the Triton interpreter (CPU), bit for
bit against the separate ops the lowering emits without it (``smooth_k`` → ``quantize_per_block``, ``mask_keys`` →
``quantize_per_channel``), over the shared cases (``tests/kernels/quantize_kv_cases.py``), and compiled offline for
sm_90 (registers, spills, the correctly rounded operations in the PTX). The GPU file
(``tests/gpu/test_quantize_kv.py``) repeats the comparison on the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.kernels import quantize_kv_cases as cases  # noqa: E402
from qattn_fx.kernels import quantize_kv as fused  # noqa: E402

ops = torch.ops.qattn


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """The kernel module is loaded per Triton mode at its first call in that mode: this suffices."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def run(case: cases.Case, k, v, key_bias, out=None):
    k_mean, v_scale = ops.kv_stats(k, v, key_bias)
    got = fused.quantize_kv(k, v, k_mean, v_scale, key_bias, case.k_block, case.k_dtype, case.seq_major, out=out)
    return got, v_scale


@pytest.mark.parametrize("name", list(cases.CASES))
def test_bitwise_equal_to_the_unfused_ops(name):
    case = cases.CASES[name]
    k, v, key_bias = cases.make(case)
    got, v_scale = run(case, k, v, key_bias)
    want = cases.unfused(k, v, key_bias, case.k_block, case.k_dtype, case.seq_major)
    cases.assert_bitwise((*got, v_scale), want, ("k_data", "k_scale", "v_data", "v_scale"))
    assert [x.stride() for x in got] == [x.stride() for x in fused.outputs(k, v, case.k_block, case.k_dtype,
                                                                           case.seq_major)]


def test_rounding_ties_subnormals_and_saturation():
    """Given statistics that make the scaled values exact (:func:`quantize_kv_cases.ties`): ties go to even in int8
    and e4m3 (subnormals too) and values past 448 saturate, as the separate ops round them."""
    k, v, k_mean, v_scale = cases.ties()
    for k_dtype, k_block in ((torch.int8, 16), (torch.float8_e4m3fn, 128)):
        for seq_major in (False, True):
            got = fused.quantize_kv(k, v, k_mean, v_scale, None, k_block, k_dtype, seq_major)
            cases.assert_bitwise(got, cases.defined(k, v, k_mean, v_scale, None, k_block, k_dtype, seq_major))


def test_masked_keys_leave_no_trace_whatever_they_hold():
    case = cases.CASES["gaps-int8-k128-masked"]
    k, v, key_bias = cases.make(case)
    masked = (key_bias == float("-inf"))[:, None, :, None]
    junk_k, junk_v = k.masked_fill(masked, 1e4), v.masked_fill(masked, -3e4)
    got, _ = run(case, k.masked_fill(masked, 0), v.masked_fill(masked, 0), key_bias)
    junk, _ = run(case, junk_k, junk_v, key_bias)
    cases.assert_bitwise(junk, got)
    k_data, k_scale, v_data = got
    assert not bool(k_data[-1].any()) and not bool(k_scale[-1].any())  # the batch element with every key masked
    assert not bool(v_data[-1].view(torch.uint8).any())


def test_writes_into_outputs_of_any_layout():
    """The launcher takes the outputs' strides (the op allocates them in the unfused ops' layouts)."""
    case = cases.CASES["bshd-int8-k16-seq"]
    k, v, key_bias = cases.make(case)
    default, _ = run(case, k, v, key_bias)
    b, h, s, _ = k.shape
    out = (torch.empty(b, h, s, case.dk, dtype=torch.int8), torch.empty_like(default[1]),
           torch.empty(b, s + 4, h, case.dv, dtype=torch.float8_e4m3fn)[:, :default[2].shape[2]].transpose(1, 2))
    got, _ = run(case, k, v, key_bias, out=out)
    assert got is out
    cases.assert_bitwise(got, default)


def test_zero_tokens_launch_nothing():
    k, v = torch.zeros(1, 2, 0, 32), torch.zeros(1, 2, 0, 16)
    k_data, k_scale, v_data = fused.quantize_kv(k, v, torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 16), None, 16,
                                                torch.int8, True)
    assert k_data.shape == (1, 2, 0, 32) and k_scale.shape == (1, 2, 0) and v_data.shape == (1, 2, 0, 16)


def test_without_triton_the_kernel_names_the_requirement(monkeypatch):
    monkeypatch.setattr(fused._source(), "missing", ImportError("No module named 'triton'"))
    k = torch.zeros(1, 1, 16, 32)
    with pytest.raises(RuntimeError, match=r"qattn::quantize_kv on CUDA needs triton \(the fused K/V quantize kernel, "
                                           r"qattn_fx.kernels.quantize_kv\); install triton"):
        fused.quantize_kv(k, k, torch.zeros(1, 1, 1, 32), torch.ones(1, 1, 32), None, 16, torch.int8, True)


@pytest.mark.parametrize("dtype, key_bias, seq_major, k_block, k_dtype, d", [
    (torch.bfloat16, False, True, 16, torch.int8, 128),
    (torch.bfloat16, True, True, 64, torch.float8_e4m3fn, 128),
    (torch.float16, False, False, 128, torch.int8, 64),
])
def test_compiles_offline_for_sm90_without_spills(dtype, key_bias, seq_major, k_block, k_dtype, d):
    """The compiled (not interpreted) kernel at Wan2.1-1.3B's 480p call (BSHD views): ptxas accepts it, nothing
    spills, and its roundings are the correctly rounded ones (``div.rn``, the saturating round-to-nearest e4m3
    convert, no fma: Triton's fp fusion is off)."""
    from qattn_fx.kernels._offline import ptxas_report

    k = torch.empty(1, 32760, 12, d, dtype=dtype, device="meta").transpose(1, 2)
    bias = torch.zeros(1, 32760, device="meta") if key_bias else None
    compiled = fused.compile_for((9, 0), k, k, bias, k_block, k_dtype, seq_major)
    report = ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    assert compiled.metadata.num_warps == fused.NUM_WARPS
    ptx = compiled.asm["ptx"]
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx and "fma." not in ptx
