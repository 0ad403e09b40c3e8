"""Skip-Softmax in gluon_sage on a real sm_90 GPU (:mod:`qattn_fx.skip_softmax`, the contract).

Run: ``pytest -m gpu tests/gpu/test_skip_softmax.py -v``. λ = 0 must give the bits of the launch without the test
(same config, no tail split); λ > 0 on structured inputs (local attention, :func:`benchmarks.common.local_qkv`) must
match the emulated tile loop with the same tile test (fp32 level, Hopper FP8-MMA precision), skip the same tiles
(counted by the kernel) up to decisions at the boundary, and stay close to the reference with the exact test.
"""

from __future__ import annotations

import math

import pytest
import torch

import support
from support import quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("triton")

import qattn_fx  # noqa: E402
import qattn_fx.ops  # noqa: E402,F401  (registers qattn::* ops)
from benchmarks.common import local_qkv  # noqa: E402
from qattn_fx import config as qattn_config  # noqa: E402
from qattn_fx import skip_softmax  # noqa: E402
from qattn_fx.kernels import emulation, reference  # noqa: E402
from qattn_fx.kernels import gluon_sage as gs  # noqa: E402

DEV = "cuda"
needs_sm90 = support.needs_capability(gs.CAPABILITY, reason="gluon_sage needs sm_90")

#: (config, Q/K recipe, blocks): the permk class (trio), the key-order class (two consumers, serial), bf16 Q/K, fp8.
CASES = [("128,3,trio,permk,tarrive,mmasum", "int8", (1, 16)), ("128,3,permk,mmasum", "int8", (1, 16)),
         ("128,3,tarrive,mmasum", "int8", (1, 4)), ("128,3,mmasum", "bf16", (0, 0)),
         ("128,3,trio,permk,mmasum", "fp8", (1, 16))]
IDS = [f"{c}-{q}" for c, q, _ in CASES]


def _inputs(qk, blocks, b=2, h=4, sq=1000, skv=1500, seed=0, sharpness=4.0):
    q, k, v = local_qkv(b, h, sq, skv, 128, sharpness=sharpness, width=300.0, seed=seed, device=DEV)
    return quantize(q, k, v, qk, *blocks)


def _run(args, config, threshold=None, count=None, key_bias=None, sm_scale=None):
    sm_scale = sm_scale or 1.0 / math.sqrt(args[0].shape[-1])
    thr = None if threshold is None else torch.tensor([threshold], device=DEV)
    with gs.use_config(config), qattn_config.patch(gluon_tail_split=False):
        return gs.attention(*args, sm_scale, torch.float32, key_bias=key_bias, skip_threshold=thr, skip_count=count)


@needs_sm90
@pytest.mark.parametrize("config,qk,blocks", CASES, ids=IDS)
def test_zero_threshold_gives_the_bits_of_the_launch_without_skipping(config, qk, blocks):
    args = _inputs(qk, blocks)
    count = torch.zeros(1, dtype=torch.int32, device=DEV)
    plain = _run(args, config)
    skipped = _run(args, config, 0.0, count)
    assert int(count) == 0
    assert torch.equal(plain, skipped), (plain - skipped).abs().max()


@needs_sm90
@pytest.mark.parametrize("threshold", [1e-3, 0.2])
@pytest.mark.parametrize("config,qk,blocks", CASES, ids=IDS)
def test_tile_skip_matches_the_emulation(config, qk, blocks, threshold):
    args = _inputs(qk, blocks)
    cfg = gs.GluonConfig.parse(config)
    sm_scale = 1.0 / math.sqrt(128)
    count = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = _run(args, config, threshold, count)
    counts = []
    want = emulation.emulate(*args, sm_scale, cfg.block_n, cfg.mmasum, skip_threshold=threshold, skip_counts=counts)
    rows, keys = skip_softmax.tiles(args[0].shape[2], args[2].shape[2])
    total = args[0].shape[0] * args[0].shape[1] * rows * keys
    assert counts[0] > 0.05 * total, f"structured inputs should skip tiles at λ={threshold}: {counts[0]}/{total}"
    assert abs(int(count) - counts[0]) <= max(2, 0.002 * total), (int(count), counts[0], total)
    support.assert_fp32_level(out.float(), want, f"{config} {qk} λ={threshold} vs emulation", fp8_qk=qk == "fp8",
                              name="gluon_sage", mmasum=bool(cfg.mmasum))
    with skip_softmax.measure() as measured:
        ref = reference.scaled_attention(*args, sm_scale, torch.float32, skip_threshold=torch.tensor(threshold),
                                         skip_label="site")
    assert abs(measured.sites["site"].skipped - counts[0]) <= max(2, 0.01 * total)
    support.assert_close_to_reference(out.float(), ref, f"{config} λ={threshold}", name="gluon_sage")


@needs_sm90
def test_key_bias_rows_with_every_key_masked_never_skip():
    args = _inputs("int8", (1, 16), b=1, sq=700, skv=900)
    bias = torch.zeros(1, 900, device=DEV)
    bias[:, :300] = float("-inf")  # the first key tiles masked: m = -inf votes no
    out = _run(args, "128,3,mmasum", 0.01, key_bias=bias)
    want = emulation.emulate(*args, 1.0 / math.sqrt(128), 128, True, key_bias=bias, skip_threshold=0.01)
    support.assert_fp32_level(out.float(), want, "bias λ=0.01", name="gluon_sage", mmasum=True)


@needs_sm90
def test_op_records_measured_sparsity_and_ahead_configs_are_refused():
    args = _inputs("int8", (1, 16), b=1)
    thr = torch.tensor(0.01, device=DEV)
    with skip_softmax.measure() as measured:
        torch.ops.qattn.scaled_attention(*args, 0.088, torch.bfloat16, "gluon_sage", skip_threshold=thr,
                                         skip_label="blocks_0_attn1")
    assert measured.sites["blocks_0_attn1"].sparsity > 0.05
    with gs.use_config("128,3,ahead,mmasum"), pytest.raises(ValueError, match="cannot run Skip-Softmax"):
        gs.attention(*args, 0.088, torch.bfloat16, skip_threshold=thr)


def _wan_on_gpu(frames=4, size=64):
    pytest.importorskip("diffusers")
    from qattn_fx import tiny_models

    model, inputs = tiny_models.wan(head_dim=128)
    model = model.to(DEV, torch.bfloat16)
    inputs = dict(inputs, hidden_states=torch.randn(1, 4, frames, size, size))  # 4 x 32 x 32 = 4096 tokens
    inputs = {k: (v.to(DEV, torch.bfloat16) if v.is_floating_point() else v.to(DEV)) if torch.is_tensor(v) else v
              for k, v in inputs.items()}
    return model, inputs


#: Skip-Softmax on gluon_sage with a step schedule: nothing skipped while t > 0.5. λ = 1 skips the tiles whose max is
#: below every row's running max (a random-weight model's attention maps are flat: the other λ skip little).
SCHEDULED = {"default": {"backend": "TRITON", "recipe": {"qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": 1,
                                                         "k_block_size": 16, "v_block_size": 1},
                         "skip_softmax": {"threshold": 1.0, "disabled_until_timestep": 0.5}},
             "rules": [{"match": {"role": "cross"}, "use": "dense"}]}


@needs_sm90
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_wan_step_schedule_compiles_once(mode):
    """A 6-step loop over the model's timestep: one graph, no recompile (the timestep is a graph input, λ a tensor
    computed from it), under CUDA graphs too; the skipped tiles follow the schedule (measured without CUDA graphs:
    counting reads the kernel's counter on the host)."""
    model, inputs = _wan_on_gpu()
    backend = qattn_fx.backend(SCHEDULED)
    torch._dynamo.reset()
    steps = [999, 800, 600, 400, 200, 10]
    outs = []
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend, fullgraph=True, mode=mode)
        for i, t in enumerate(steps):
            step_inputs = dict(inputs, timestep=torch.tensor([t], device=DEV))
            if i:
                with torch.compiler.set_stance("fail_on_recompile"):
                    outs.append(compiled(**step_inputs)[0].float().clone())
            else:
                outs.append(compiled(**step_inputs)[0].float().clone())
    assert len(backend.graph_modules) == 1
    assert [s.kernel for s in backend.report.sites if s.rewritten] == ["gluon_sage"] * 2, str(backend.report)
    assert all(torch.isfinite(o).all() for o in outs)
    if mode is None:
        with torch.no_grad(), skip_softmax.measure() as measured:
            for t in steps:
                compiled(**dict(inputs, timestep=torch.tensor([t], device=DEV)))
        per_call = measured.sites["blocks_0_attn1"]
        assert per_call.calls == len(steps) and per_call.skipped > 0
        with torch.no_grad(), skip_softmax.measure() as early:
            compiled(**dict(inputs, timestep=torch.tensor([999], device=DEV)))
        assert early.overall() == 0.0
        print(backend.record_sparsity(measured))
