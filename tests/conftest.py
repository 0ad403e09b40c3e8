"""Test configuration: GPU tests skip cleanly without CUDA; compiles use a per-session Inductor cache; kernel
autotuning keeps its choices in memory."""

import contextlib
import os
import tempfile

import pytest
import torch

# Keep Inductor's on-disk caches inside this test session (so cache tests start cold and CI starts clean).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qattn_fx_inductor_"))
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
