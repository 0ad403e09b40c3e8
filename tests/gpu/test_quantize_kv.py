"""The fused K/V quantize compiled on a CUDA GPU (``qattn::quantize_kv``'s CUDA implementation, one Triton launch of
:mod:`qattn_fx.kernels.quantize_kv`), bit for bit against the separate ops on the same device over the shared cases
(``tests/kernels/quantize_kv_cases.py``) and at the benchmark shapes (flux-1024, d64, Wan2.1-1.3B's 480p call).

Run: ``pytest -m gpu tests/gpu/test_quantize_kv.py -v`` (or ``GPU_TESTS=tests/gpu/test_quantize_kv.py
tools/device_session.sh gpu-tests``). Both sides take the statistics ``qattn::kv_stats`` computed on the device
(K's mean is a sum whose rounding depends on the reduction's order; the op is defined for a given mean), and the
separate ops as the lowering emits them (``smooth_k`` computing its own mean eagerly, the same reduction) are
compared too. Also: the roundings at ties and saturation, NaN reaching the scales it reaches in torch, a CUDA-graph
capture, and the compiled graph choosing the fused op with ``qattn_fx.config.fused_kv_quantize`` on (and not off).
"""

from __future__ import annotations

import pytest
import torch

import support

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx  # noqa: E402
from qattn_fx.kernels import quantize_kv as fused  # noqa: E402
from qattn_fx.ops.lowering import quantized_attention  # noqa: E402
from qattn_fx.recipes import Recipe  # noqa: E402
from tests.kernels import quantize_kv_cases as cases  # noqa: E402

DEV = "cuda"
ops = torch.ops.qattn
I8, F8 = torch.int8, torch.float8_e4m3fn
LARGE = {
    "flux-1024": cases.Case(1, 24, 4608, 128, 128),
    "d64-fp8-k64-dmajor": cases.Case(2, 16, 16384, 64, 64, F8, 64, False),
    "wan1.3b-480p-masked": cases.Case(1, 12, 32760, 128, 128, I8, 16, True, bias="batch1"),
    "wan1.3b-480p-k128": cases.Case(1, 12, 32760, 128, 128, I8, 128, True, "contiguous", "contiguous"),
}
ALL = {**cases.CASES, **LARGE}

pytestmark.append(pytest.mark.skipif(torch.cuda.is_available() and not fused.device_supported(torch.device(DEV)),
                                     reason="needs compute capability 8.9 or newer"))


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("name", list(ALL))
def test_cuda_op_is_bitwise_the_unfused_ops(name):
    case = ALL[name]
    k, v, key_bias = cases.make(case, DEV)
    k_mean, v_scale = ops.kv_stats(k, v, key_bias)
    args = (key_bias, case.k_block, case.k_dtype, case.seq_major)
    got = ops.quantize_kv(k, v, k_mean, v_scale, *args)
    assert all(x.device == k.device for x in got)
    cases.assert_bitwise(got, cases.defined(k, v, k_mean, v_scale, *args))  # the same statistics
    cases.assert_bitwise((*got, v_scale), cases.unfused(k, v, *args), ("k_data", "k_scale", "v_data", "v_scale"))
    promised = fused.outputs(k, v, case.k_block, case.k_dtype, case.seq_major)  # what the fake says
    assert [x.stride() for x in got] == [x.stride() for x in promised]


def test_rounding_ties_subnormals_and_saturation():
    k, v, k_mean, v_scale = cases.ties(DEV)
    for k_dtype, k_block in ((I8, 16), (F8, 128)):
        for seq_major in (False, True):
            got = ops.quantize_kv(k, v, k_mean, v_scale, None, k_block, k_dtype, seq_major)
            cases.assert_bitwise(got, cases.defined(k, v, k_mean, v_scale, None, k_block, k_dtype, seq_major))


def test_nan_reaches_the_scales_it_reaches_in_torch():
    """An inf in a kept key's K makes the head's mean inf; the blocks then hold NaN or inf as the separate ops'."""
    case = cases.CASES["bshd-int8-k16-seq"]
    k, v, _ = cases.make(case, DEV)
    k[0, 1, 40, 3] = float("inf")
    k[1, 0, 7, 0] = float("nan")
    k_mean, v_scale = ops.kv_stats(k, v)
    got = ops.quantize_kv(k, v, k_mean, v_scale, None, 16, I8, True)[1]
    want = cases.defined(k, v, k_mean, v_scale, None, 16, I8, True)[1]
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    blocks = -(-case.s // 16)  # (the row's padding stays 0)
    assert bool(got[0, 1].isnan().any()) and bool(got[1, 0, :blocks].isnan().all())


def test_replays_in_a_cuda_graph():
    case = LARGE["flux-1024"]
    k, v, key_bias = cases.make(case, DEV, seed=1)
    stats = ops.kv_stats(k, v, key_bias)
    graph, captured = support.capture_graph(lambda: ops.quantize_kv(k, v, *stats, key_bias, 16, I8, True))
    k2, v2, _ = cases.make(case, DEV, seed=2)
    k.copy_(k2)
    v.copy_(v2)
    new_stats = ops.kv_stats(k, v, key_bias)
    for old, new in zip(stats, new_stats):
        old.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    cases.assert_bitwise(captured, cases.defined(k, v, *stats, key_bias, 16, I8, True))


@pytest.mark.parametrize("masked", [False, True])
def test_compiled_graph_takes_the_fused_op_with_the_setting_on(masked):
    """torch.compile of a Sage site on the reference kernel (any GPU): the fused op is in the code with the setting
    on, not with it off, and the outputs agree to the rounding of K's mean (each graph's reduction has its own
    order)."""
    from torch._inductor.utils import run_and_get_code

    q, k, v = support.make_qkv(2, 4, 4, 300, 333, 128, dtype=torch.bfloat16, device=DEV)
    mask = torch.ones(2, 1, 1, 333, dtype=torch.bool, device=DEV)
    mask[1, ..., 200:] = False

    def attend(q, k, v):
        return quantized_attention(q, k, v, Recipe("int8", "fp8", 1, 16, 1), kernel="reference",
                                   attn_mask=mask if masked else None)

    outs = {}
    for on in (True, False):
        torch._dynamo.reset()
        with qattn_fx.config.patch(fused_kv_quantize=on):
            outs[on], code = run_and_get_code(torch.compile(attend, fullgraph=True), q, k, v)
        assert ("torch.ops.qattn.quantize_kv.default(" in "".join(code)) is on
    torch.testing.assert_close(outs[True], outs[False], rtol=2e-2, atol=2e-2)
    eager = attend(q, k, v)  # eagerly on CUDA: the fused op too
    torch.testing.assert_close(eager, outs[True], rtol=2e-2, atol=2e-2)
