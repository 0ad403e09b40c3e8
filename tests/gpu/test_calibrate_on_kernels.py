"""qattn_fx.calibrate on the GPU with the real kernels: a tiny Wan (head_dim 64, bf16) on an H200.

Every candidate runs on gluon_sage; its per-site errors agree with the emulated calibration of the same calls
(the kernel's numerics are the reference's up to accumulation order: cosines within 2e-4), and the produced spec,
compiled by the backend, runs the plan's kernel at every site.
"""

import pytest
import torch

import qattn_fx
from qattn_fx import tiny_models

pytestmark = pytest.mark.gpu


def test_calibration_on_gluon_sage_matches_the_emulation():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    model, _ = tiny_models.wan(head_dim=64)
    model = model.to("cuda", torch.bfloat16)
    calls, labels = tiny_models.example_calls(model, 2, dtype=torch.bfloat16)
    calls = [((), {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in kw.items()}) for _, kw in calls]
    torch._dynamo.reset()
    real = qattn_fx.calibrate(model, calls, budget={"cos": 0.99}, candidates=["int8-1-16-1", "bf16-0-0-1"],
                              labels=labels)
    torch._dynamo.reset()
    emulated = qattn_fx.calibrate(model, calls, budget={"cos": 0.99}, candidates=["int8-1-16-1", "bf16-0-0-1"],
                                  emulate=True, labels=labels)
    assert {r.kernel for r in real.table} == {"gluon_sage"}
    for r, e in zip(real.table, emulated.table):
        assert (r.site, r.candidate) == (e.site, e.candidate)
        assert abs(r.errors.cos - e.errors.cos) < 2e-4, (r.site, r.candidate, r.errors, e.errors)
    backend = qattn_fx.backend(real.spec)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(*calls[0][0], **calls[0][1])
    assert [s.kernel for s in backend.report.sites] == ["gluon_sage" if s.choice != "dense" else None
                                                        for s in real.sites]
