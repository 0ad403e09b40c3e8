"""Test configuration: GPU tests skip cleanly without CUDA; compiles use a per-session Inductor cache and scalar
(unvectorized) C++ on the CPU; kernel autotuning keeps its choices in memory; each test file starts from a fresh
Dynamo state."""

import contextlib
import os
import tempfile

import pytest
import torch
import torch._inductor.config

# Keep Inductor's on-disk caches inside this test session (so cache tests start cold and CI starts clean).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qattn_fx_inductor_"))
# Inductor's CPU kernels as scalar C++: the tests check what the pass puts in the graph and the numerics against the
# reference (with tolerances), not Inductor's vectorizer, and the compiler takes about a third less time without it
# (subprocesses the tests start, such as the examples, inherit it).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
torch._inductor.config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
# Under pytest-xdist every worker is a process of its own on a small machine: one compile thread and one intra-op
# thread each, so that the workers do not oversubscribe the cores (the full suite is about 5 % faster on 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch._inductor.config.compile_threads = 1
    torch.set_num_threads(1)
# Autotuning choices (gluon_sage) in memory only: tests neither read nor write the user's tuning cache.
os.environ.setdefault("QATTN_TUNING_CACHE", "")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def qattn_config():
    """``qattn_config(autotune=False, ...)``: set ``qattn_fx.config`` settings for this test (restored after)."""
    import qattn_fx

    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(qattn_fx.config.patch(**settings))


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test file starts with Dynamo reset: the entries earlier files compiled stay out of its recompile limits
    (diffusers' models share one decorated ``forward`` wrapper, so every compile of any of them adds an entry to the
    same code object, counted by ``torch._dynamo.config.accumulated_recompile_limit``)."""
    torch._dynamo.reset()
    yield
