"""qattn_fx.kernels._compiled_launch without a GPU: the arguments a compiled kernel gets equal those of Triton's own
binding, the specialization key tells apart every pair of launches Triton compiles apart, and launches take the
compiled kernel only after Triton's path returned it (never under the interpreter)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import compute_cache_key, create_function_from_signature  # noqa: E402

from qattn_fx.kernels import _compiled_launch as cl  # noqa: E402


@triton.jit
def _probe(X, Y, n, scale, stride, BLOCK: tl.constexpr, FLAG: tl.constexpr = 0):
    pass


def triton_binding(fn, args: tuple, meta: dict) -> tuple[list, str]:
    """Triton's binding of a launch for an sm_90 target: every parameter's value in order, and its cache key."""
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    bound, specialization, options = binder(*args, **meta, debug=False, instrumentation_mode="")
    return list(bound.values()), compute_cache_key({}, specialization, options)


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _same(a, b) -> bool:
    return a is b if isinstance(a, torch.Tensor) else type(a) is type(b) and a == b


def test_bound_arguments_equal_tritons_binding_defaults_included():
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    for meta in ({"BLOCK": 16, "num_warps": 4}, {"BLOCK": 32, "FLAG": 1, "num_warps": 8}):
        args = (x, y, 64, 0.5, 16)
        expected, _ = triton_binding(_probe, args, meta)
        got = cl.CompiledLaunch(_probe).bound(args, meta)
        assert len(got) == len(expected) and all(_same(a, b) for a, b in zip(got, expected))


def _launches():
    """Launches of ``_probe`` differing in one fact each (alignment, dtype, integer divisibility and value, a
    float's value, a constexpr, an option)."""
    buf = torch.zeros(80, dtype=torch.int8)
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64)
    base = dict(BLOCK=16, num_warps=4)
    return {
        "base": ((x, y, 64, 0.5, 16), base),
        "float value": ((x, y, 64, 0.25, 16), base),
        "misaligned x": ((buf[1:], y, 64, 0.5, 16), base),
        "x dtype": ((torch.zeros(64, dtype=torch.float16), y, 64, 0.5, 16), base),
        "n not a multiple of 16": ((x, y, 65, 0.5, 16), base),
        "n == 1": ((x, y, 1, 0.5, 16), base),
        "n == True": ((x, y, True, 0.5, 16), base),
        "stride 32": ((x, y, 64, 0.5, 32), base),
        "BLOCK": ((x, y, 64, 0.5, 16), dict(base, BLOCK=32)),
        "FLAG": ((x, y, 64, 0.5, 16), dict(base, FLAG=1)),
        "num_warps": ((x, y, 64, 0.5, 16), dict(base, num_warps=8)),
    }


def test_specialization_separates_every_pair_triton_compiles_apart():
    launches = _launches()
    triton_keys = {name: triton_binding(_probe, *launch)[1] for name, launch in launches.items()}
    ours = {name: cl.specialization(*launch) for name, launch in launches.items()}
    for a in launches:
        for b in launches:
            if triton_keys[a] != triton_keys[b]:
                assert ours[a] != ours[b], (a, b)
    assert ours["float value"] == ours["base"]  # as Triton: floats are not specialized
    assert triton_keys["float value"] == triton_keys["base"]


_DTYPES = (torch.int8, torch.bfloat16, torch.float16, torch.float32)
_BUFFERS = {dtype: torch.zeros(64, dtype=dtype) for dtype in _DTYPES}


@st.composite
def probe_launches(draw):
    """A launch of ``_probe``: tensors of any dtype at element offsets (16-byte aligned or not), integers around the
    values Triton specializes on (1, multiples of 16, the 32-bit limit), a float, constexprs and an option."""
    def tensor():
        dtype = draw(st.sampled_from(_DTYPES))
        offset = draw(st.sampled_from((0, 1, 2, 4, 8, 16)))  # elements into a 16-byte aligned buffer
        return _BUFFERS[dtype][offset:offset + 32]
    ints = st.sampled_from((0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 1, 2**31, -16))
    args = (tensor(), tensor(), draw(ints), draw(st.sampled_from((0.5, 0.25, 1.0))), draw(ints))
    meta = {"BLOCK": draw(st.sampled_from((16, 32))), "num_warps": draw(st.sampled_from((4, 8)))}
    if draw(st.booleans()):
        meta["FLAG"] = draw(st.sampled_from((0, 1)))
    return args, meta


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(a=probe_launches(), b=probe_launches())
def test_specialization_is_at_least_as_fine_as_tritons_key(a, b):
    """Over random pairs of launches: where Triton's cache key differs, so does :func:`specialization` (so a
    compiled kernel is never reused for arguments Triton would compile apart)."""
    if triton_binding(_probe, *a)[1] != triton_binding(_probe, *b)[1]:
        assert cl.specialization(*a) != cl.specialization(*b)


def test_gluon_sage_launch_binds_as_triton_does():
    """The kernel of ~60 parameters, with the arguments the host path builds (TMA descriptors, dummies, None
    constexprs): the compiled kernel gets what Triton's binding gives it."""
    pytest.importorskip("triton.experimental.gluon")
    from benchmarks.shapes import parse_shape
    from qattn_fx.kernels.gluon_sage import kernel, launch
    from tools import host_overhead

    _, shape = parse_shape("sd3:1:24:4429:4429:64")
    args = host_overhead.inputs(shape, "int8-1-16", True)
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **meta: seen.append((a, meta))

    with host_overhead.mocked_device(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "_sage_fwd_ws", Recorder())
        torch.ops.qattn.scaled_attention(*args, 0.125, torch.bfloat16, "gluon_sage")
    a, meta = seen[-1]
    expected, _ = triton_binding(kernel._sage_fwd_ws, a, meta)
    got = cl.CompiledLaunch(kernel._sage_fwd_ws).bound(a, meta)
    assert len(got) == len(expected) and all(x is y or x == y for x, y in zip(got, expected))


class FakeKernel:
    """Triton's compiled kernel: ``kernel[grid](*bound)`` records the launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *bound: self.log.append(("compiled", grid, bound))


class FakeJit:
    """A ``JITFunction`` with ``_probe``'s parameters whose ``fn[grid](...)`` records the launch and returns a
    :class:`FakeKernel`."""

    params = _probe.params
    device_caches: dict = {}
    pre_run_hooks: list = []

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("triton", grid, args))
            return FakeKernel(self.log)
        return run


def test_the_compiled_kernel_runs_after_tritons_path_returned_it():
    fn = FakeJit()
    launch = cl.CompiledLaunch(fn)
    (args, meta), (misaligned, _) = _launches()["base"], _launches()["misaligned x"]
    launch[(2,)](*args, **meta)
    launch[(3,)](*args, **meta)
    launch[(4,)](*misaligned, **meta)
    # (the compiled kernel gets all three grid dims, as Triton's path pads them)
    assert [(how, grid) for how, grid, _ in fn.log] == [("triton", (2,)), ("compiled", (3, 1, 1)), ("triton", (4,))]
    assert list(fn.log[1][2]) == launch.bound(args, meta)


def test_a_launch_triton_did_not_compile_is_not_cached():
    """Where Triton's path returns no kernel (a JIT cache hook took the launch), the next launch asks it again."""
    fn = FakeJit()
    returned = iter((None, FakeKernel(fn.log)))
    run = fn.__getitem__

    class Hooked(FakeJit):
        def __getitem__(self, grid):
            return lambda *a, **meta: (run(grid)(*a, **meta), next(returned))[1]

    hooked = Hooked()
    launch = cl.CompiledLaunch(hooked)
    args, meta = _launches()["base"]
    for grid in ((1,), (2,), (3,)):
        launch[grid](*args, **meta)
    assert [(how, grid) for how, grid, _ in fn.log] == [("triton", (1,)), ("triton", (2,)), ("compiled", (3, 1, 1))]


def test_interpreted_and_hooked_kernels_take_tritons_path(monkeypatch):
    fn = FakeJit()
    launch = cl.CompiledLaunch(fn)
    args, meta = _launches()["base"]
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    launch[(1,)](*args, **meta)
    launch[(1,)](*args, **meta)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(fn, "pre_run_hooks", [lambda *a, **k: None])
    launch[(1,)](*args, **meta)
    launch[(1,)](*args, **meta)
    assert [how for how, _, _ in fn.log] == ["triton"] * 4


def test_compiled_keeps_one_launcher_per_kernel():
    assert cl.compiled(_probe) is cl.compiled(_probe)
    assert cl.compiled(_probe).fn is _probe
