"""Host (CPU) time of one gluon_sage attention call: what runs in Python between
``torch.ops.qattn.scaled_attention(..., kernel="gluon_sage")`` and the Gluon kernel's launch; without a GPU by
default (launches mocked), on it with ``--cuda``.

When to use: after changing gluon_sage's host path (``qattn_fx/kernels/gluon_sage/launch.py``, the tail-split
planner, ``_sage_common.validate``, the op's checks in ``qattn_fx/ops/attention.py``), to see what one call costs
the CPU. A diffusion step issues one call per attention layer, and while the GPU waits for the next launch this
time is exposed::

    python -m tools.host_overhead --shape flux-1024 [--recipe int8-1-16] [--profile 25]
    python -m tools.host_overhead --shape wan1.3b-480p --key-bias --lse --iters 5000

What runs for real: the custom op's dispatch and checks, ``gluon_sage.attention`` (``validate``, the layout checks
of ``ineligible``, the output and workspace allocations, the tuner's lookup of a cached choice, the tail plan, the
TMA descriptors, ``plan_launch``, the ``LAST`` bookkeeping), on CPU tensors with the layouts the recipe's quantize
ops give (they run once, on zeros). With the default ``--q-in-kernel``, an int8 recipe with ``q_block`` 1 passes
the bf16 Q, as the compiled graph does for gluon_sage.

Mocked, since they need CUDA: the device check (``launch.device_reason``: no Gluon, not sm_90), ``torch.cuda.device``
(a null context), ``torch.cuda.current_device`` (0), the SM count (132, an H200), the GPU name in the tuner's cache
key, the tuner's timing (the first call, which picks a config; later calls look the choice up), and both launches:
``_sage_fwd_ws[grid](...)`` and the tail split's merge are no-ops. So the figures leave out Triton's launcher
(argument binding, specialization, the kernel cache lookup, the driver call) and the merge launch, and CPU
allocations stand in for CUDA's caching allocator (glibc's mmap is turned off so that a large output is not
mapped and unmapped on every call). Compare figures from one machine only.

With ``--cuda`` nothing is mocked: the calls launch on the GPU, in groups of 20 queued behind ~100 ms of GPU work
(then a synchronization), so no call waits for the GPU and the times are the host's, Triton's launcher included::

    python -m tools.host_overhead --cuda --shape ltx-512:1:32:3872:3872:64 --iters 400 --warmup 20 --profile 25

Prints the median, 10th and 90th percentile of ``--iters`` timed calls (after ``--warmup`` calls) in µs, and with
``--profile N`` the top ``N`` functions of a cProfile run of the same calls (``--sort``: tottime or cumulative).

``--in-step MODEL`` (on the GPU) measures the same host path where users pay it: inside a compiled model's step.
It compiles a ``benchmarks.dit_step`` model (whole model, ``--blocks``, ``--resolution``) dense and with gluon_sage
forced, times ``--steps`` calls of each (the host's time to issue the step, then its wall time to the end of its
GPU work), and inside the forced step each call's gluon_sage entry (``qattn_fx.kernels.gluon_sage.scaled_attention``:
the kernel's whole host path) and Triton's launch of the kernel within it (``compiled(_sage_fwd_ws)[grid](...)``,
:mod:`qattn_fx.kernels._compiled_launch`). Then it calls the op eagerly on the arguments of the step's first call (as
``--cuda`` does), with the same timers. It lists the calls that synchronize the host with the GPU in one step of each
variant (torch's CUDA sync debug mode), and with ``--profile N`` prints cProfile's top ``N`` functions of three steps
of each::

    python -m tools.host_overhead --in-step ltx_video --resolution 512 --blocks 8 --steps 8 --out host.json

A piece that costs more inside the step than eagerly costs it in the step's context (the CPU caches and branch
predictors then also serve Inductor's code and every other launch between two calls), not in its own work.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import cProfile
import functools
import json
import math
import pstats
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator
from unittest import mock

import torch

from benchmarks import common, dit_step
from benchmarks.shapes import SHAPES, Shape, parse_shape

#: The SM count of the mocked device (an H200): what the tail split's plan depends on.
SM_COUNT = 132


def inputs(shape: Shape, recipe: str, q_in_kernel: bool, device: str = "cpu") -> tuple:
    """``(q, q_scale, k, k_scale, v, v_scale, q_block, k_block)`` on ``device``: zeros quantized by ``recipe``'s ops
    (BSHD Q/K views, sequence-major V padded to 16 tokens); with ``q_in_kernel`` the bf16 Q in place of the int8
    one where the recipe is int8 with ``q_block`` 1 (gluon_sage quantizes that Q itself)."""
    b, h, sq, skv, d = shape
    q, k, v = (torch.zeros(b, s, h, d, dtype=torch.bfloat16, device=device).transpose(1, 2)
               for s in (sq, skv, skv))
    args = common.quantize_qkv(q, k, v, recipe)
    if q_in_kernel and args[0].dtype == torch.int8 and args[6] == 1:
        args = (q, None, *args[2:])
    return args


def _glibc_without_mmap() -> None:
    """Serve large allocations from the heap and keep it (no mmap/munmap per call), as a caching allocator does."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-4, 0)  # M_MMAP_MAX


class _NoLaunch:
    """Stands in for a Triton/Gluon kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def mocked_device() -> Iterator[None]:
    """Patch what needs CUDA (the module docstring's list) for the duration of the block."""
    from qattn_fx.kernels import _config_tuner
    from qattn_fx.kernels.gluon_sage import launch, tail_split

    patches = [(launch, "device_reason", lambda device: None), (launch, "_sage_fwd_ws", _NoLaunch()),
               (launch, "sm_count", lambda index: SM_COUNT), (tail_split, "merge", lambda *a, **kw: None),
               (torch.cuda, "device", lambda device: contextlib.nullcontext()),
               (torch.cuda, "current_device", lambda: 0),
               (_config_tuner, "_cuda_device_tag", functools.lru_cache(None)(lambda index: "H200 (mocked)"))]
    for tuner in launch.TUNERS:
        patches += [(tuner, "timer", lambda run: (run(), 1.0)[1]), (tuner, "capturing", lambda: False),
                    (tuner, "cache_path", None)]
    with contextlib.ExitStack() as stack:
        for obj, name, value in patches:
            stack.enter_context(mock.patch.object(obj, name, value))
        yield


def call(args: tuple, shape: Shape, *, key_bias: bool, lse: bool, skip: bool,
         device: str = "cpu") -> Callable[[], object]:
    """One ``qattn::scaled_attention`` (or ``_lse``) call on gluon_sage with these inputs."""
    import qattn_fx.ops  # noqa: F401  (registers qattn::*)

    extra = {}
    if key_bias:
        extra["key_bias"] = torch.zeros(shape.b, shape.skv, device=device)
    if skip:
        extra["skip_threshold"] = torch.full((1,), 1e-3, device=device)
    op = torch.ops.qattn.scaled_attention_lse if lse else torch.ops.qattn.scaled_attention
    return functools.partial(op, *args, shape.d ** -0.5, torch.bfloat16, "gluon_sage", **extra)


def _groups(iters: int, busy: Callable[[], None] | None, chunk: int) -> Iterator[int]:
    """The sizes of the groups of calls to make, ``iters`` in all. With ``busy`` (a GPU workload longer than
    ``chunk`` calls' kernels) each group is queued behind one ``busy()`` after a synchronization, and the stream is
    synchronized after the last, so that no call waits for the GPU."""
    done = 0
    while done < iters:
        if busy is not None:
            torch.cuda.synchronize()
            busy()
        size = min(chunk, iters - done)
        yield size
        done += size
    if busy is not None:
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], object], iters: int, warmup: int, busy: Callable[[], None] | None = None,
               chunk: int = 1) -> list[float]:
    """Microseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones, in groups of ``chunk``
    behind ``busy()`` where given (:func:`_groups`: the times are then the host's alone)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for size in _groups(iters, busy, chunk):
        for _ in range(size):
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def gpu_busy(ms: float) -> Callable[[], None]:
    """A function that queues about ``ms`` milliseconds of GPU work (bf16 matmuls) without waiting for it."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    torch.cuda.synchronize()
    reps = max(1, math.ceil(ms / start.elapsed_time(end)))

    def busy() -> None:
        for _ in range(reps):
            a @ a

    return busy


def profile(fn: Callable[[], object], iters: int, top: int, sort: str, busy: Callable[[], None] | None = None,
            chunk: int = 1) -> None:
    """cProfile's top ``top`` functions over ``iters`` calls of ``fn`` (grouped as :func:`time_calls` does)."""
    prof = cProfile.Profile()
    for size in _groups(iters, busy, chunk):
        prof.enable()
        for _ in range(size):
            fn()
        prof.disable()
    pstats.Stats(prof).strip_dirs().sort_stats(sort).print_stats(top)


@dataclass
class PathTimer:
    """While :meth:`active`: the host time of each gluon_sage call's entry (``entry``: the package's
    ``scaled_attention``, which ``qattn::scaled_attention`` calls) and of each Triton launch of the kernel inside it
    (``launch``: ``compiled(_sage_fwd_ws)[grid](...)``), in µs; ``first`` holds the first entry call's
    ``(args, kwargs)``."""

    entry: list[float] = field(default_factory=list)
    launch: list[float] = field(default_factory=list)
    first: tuple | None = None

    def clear(self) -> None:
        self.entry.clear()
        self.launch.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator["PathTimer"]:
        from qattn_fx.kernels import gluon_sage
        from qattn_fx.kernels._compiled_launch import compiled
        from qattn_fx.kernels.gluon_sage import launch

        entry_fn, kernel = gluon_sage.scaled_attention, launch._sage_fwd_ws

        def entry(*args, **kwargs):
            if self.first is None:
                self.first = (args, kwargs)
            return self._timed(self.entry, entry_fn, args, kwargs)

        class Launch:
            def __getitem__(_, grid):
                return lambda *args, **kwargs: self._timed(self.launch, compiled(kernel)[grid], args, kwargs)

        with mock.patch.object(gluon_sage, "scaled_attention", entry), mock.patch.object(launch, "_sage_fwd_ws",
                                                                                          Launch()):
            yield self

    @staticmethod
    def _timed(into: list[float], fn: Callable, args: tuple, kwargs: dict):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.perf_counter_ns() - t0) / 1e3)


def eager_call(first: tuple) -> Callable[[], object]:
    """``qattn::scaled_attention`` (``_lse``) on gluon_sage with the arguments gluon_sage's entry got (``first``:
    ``(args, kwargs)`` of :class:`PathTimer`)."""
    args, kwargs = first
    op = torch.ops.qattn.scaled_attention_lse if kwargs.get("return_lse") else torch.ops.qattn.scaled_attention
    extra = {"key_bias": kwargs["key_bias"]} if kwargs.get("key_bias") is not None else {}
    return functools.partial(op, *args[:10], "gluon_sage", **extra)


def step_times(step: Callable[[], object], steps: int, timer: PathTimer) -> list[dict]:
    """Per call of ``step`` (synchronized before and after): the host's ms to issue it (``host_ms``), its wall ms
    to the end of its GPU work (``wall_ms``), and the gluon_sage calls inside it (``calls``, with the sums of their
    ``entry_us`` and ``launch_us``)."""
    rows = []
    for _ in range(steps):
        timer.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        rows.append({"host_ms": (t1 - t0) * 1e3, "wall_ms": (time.perf_counter() - t0) * 1e3,
                     "calls": len(timer.entry), "entry_us": sum(timer.entry), "launch_us": sum(timer.launch)})
    return rows


def synchronizing_calls(step: Callable[[], object]) -> list[str]:
    """The warnings of torch's CUDA sync debug mode during one call of ``step``: each operation of the step that
    makes the host wait for the GPU (a device-to-host copy, ``.item()``, a synchronizing allocation)."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")  # (outside the record: turning it on warns that it is a prototype)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]


def in_step(model: str, resolution: int | None, blocks: int | None, steps: int, warmup: int, iters: int,
            top: int = 0) -> dict:
    """The ``--in-step`` measurement (module docstring): per-step rows of the dense and the forced compiled model,
    the synchronizing calls of one step of each, and the median µs per call of the op, its gluon_sage entry and
    Triton's launch, called eagerly. ``top`` > 0: also prints cProfile's top ``top`` functions of three steps of
    each variant (by own time, then by cumulative time)."""
    case = dit_step.MODELS[model](blocks=blocks, resolution=resolution, device="cuda")
    forced = dit_step.VARIANTS["qattn gluon_sage int8 1/16/1"]
    timer = PathTimer()
    result = {"model": case.header, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import qattn_fx

    with torch.no_grad(), timer.active():
        for name, backend in (("dense", "inductor"), ("gluon_sage", lambda: qattn_fx.backend(forced))):
            torch._dynamo.reset()
            compiled = torch.compile(case.model, backend=backend if isinstance(backend, str) else backend())
            step = functools.partial(compiled, **case.inputs)
            for _ in range(warmup):
                step()
            result[name] = step_times(step, steps, timer)
            result[f"{name}_syncs"] = synchronizing_calls(step)
            if top:
                print(f"--- cProfile of 3 {name} steps")
                for sort in ("tottime", "cumulative"):
                    profile(step, 3, top, sort)
        if timer.first is None:
            raise RuntimeError(f"no gluon_sage call in the forced {model} step: nothing to compare")
        op = eager_call(timer.first)
        timer.clear()
        ops = time_calls(op, iters, 20, gpu_busy(100.0), 20)
        result["eager_us"] = {"op": statistics.median(ops), "entry": statistics.median(timer.entry),
                              "launch": statistics.median(timer.launch)}
    return result


def print_in_step(result: dict) -> None:
    """The ``--in-step`` table: per step medians, then µs per gluon_sage call in the step and eagerly."""
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    dense, forced = result["dense"], result["gluon_sage"]
    calls = med(forced, "calls")
    print(f"{result['model']}, {result['device']}, torch {result['torch']}; medians of {len(forced)} steps")
    print(f"{'compiled step':24} {'host ms':>8} {'wall ms':>8} {'gluon_sage calls':>17}")
    for name, rows in (("dense", dense), ("gluon_sage forced", forced)):
        print(f"{name:24} {med(rows, 'host_ms'):8.2f} {med(rows, 'wall_ms'):8.2f} {med(rows, 'calls'):17.0f}")
    eager = result["eager_us"]
    print(f"{'per gluon_sage call, us':40} {'in the step':>12} {'eager':>8}")
    print(f"{'qattn::scaled_attention':40} {'-':>12} {eager['op']:8.1f}")
    print(f"{'gluon_sage entry (its whole host path)':40} {med(forced, 'entry_us') / calls:12.1f} "
          f"{eager['entry']:8.1f}")
    print(f"{'Triton launch of the kernel':40} {med(forced, 'launch_us') / calls:12.1f} {eager['launch']:8.1f}")
    for name in ("dense", "gluon_sage"):
        syncs = result[f"{name}_syncs"]
        print(f"synchronizing calls in one {name} step: {len(syncs)}")
        for line in sorted(set(syncs))[:20]:
            print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.host_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="flux-1024",
                   help=f"a preset ({', '.join(SHAPES)}) or name:B:H:Sq:Skv:D")
    p.add_argument("--recipe", default="int8-1-16", choices=list(common.KERNEL_RECIPES))
    p.add_argument("--q-in-kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="pass the bf16 Q of an int8 q_block-1 recipe (the kernel quantizes it; default: on)")
    p.add_argument("--key-bias", action="store_true",
                   help="with a key bias (a key-padding mask; its span computed per call)")
    p.add_argument("--lse", action="store_true", help="qattn::scaled_attention_lse")
    p.add_argument("--skip", action="store_true", help="with a Skip-Softmax threshold")
    p.add_argument("--config", default=None, help="force a gluon_sage config (default: the tuner's choice)")
    p.add_argument("--tail-split", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cuda", action="store_true",
                   help="launch for real on the GPU (nothing mocked; calls queued behind a GPU workload, so the "
                        "times stay host time); default: mocked launches on the CPU")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    p.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    p.add_argument("--in-step", default=None, metavar="MODEL", choices=sorted(dit_step.MODELS),
                   help="time the host path inside a compiled benchmarks.dit_step model's step (GPU; module doc)")
    p.add_argument("--resolution", type=int, default=None, help="--in-step: the model's resolution")
    p.add_argument("--blocks", type=int, default=None, help="--in-step: transformer blocks")
    p.add_argument("--steps", type=int, default=8, help="--in-step: timed steps per variant")
    p.add_argument("--out", default=None, help="--in-step: also write the rows as JSON")
    a = p.parse_args(argv)
    if a.in_step:
        if not torch.cuda.is_available():
            p.error("--in-step needs a CUDA GPU")
        result = in_step(a.in_step, a.resolution, a.blocks, a.steps, warmup=4, iters=min(a.iters, 400), top=a.profile)
        print_in_step(result)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if a.lse and a.skip:
        p.error("--lse and --skip cannot be combined: qattn::scaled_attention_lse takes no Skip-Softmax threshold")
    import qattn_fx
    from qattn_fx.kernels import gluon_sage

    name, shape = (a.shape, SHAPES[a.shape]) if a.shape in SHAPES else parse_shape(a.shape)
    _glibc_without_mmap()
    device = "cuda" if a.cuda else "cpu"
    args = inputs(shape, a.recipe, a.q_in_kernel, device)
    fn = call(args, shape, key_bias=a.key_bias, lse=a.lse, skip=a.skip, device=device)
    busy, chunk = (None, 1)
    if a.cuda:  # a chunk of calls behind one workload: enough GPU time that the calls never wait for it
        busy, chunk = gpu_busy(100.0), 20
    where = contextlib.nullcontext() if a.cuda else mocked_device()
    with where, qattn_fx.config.patch(gluon_tail_split=a.tail_split), gluon_sage.use_config(a.config):
        times = time_calls(fn, a.iters, a.warmup, busy, chunk)
        deciles = statistics.quantiles(times, n=10)
        print(f"{name} ({shape}) {a.recipe}{' q-in-kernel' if a.q_in_kernel else ''}"
              f"{' key-bias' if a.key_bias else ''}{' lse' if a.lse else ''}{' skip' if a.skip else ''}: "
              f"config {gluon_sage.last_config()}, tail {gluon_sage.last_tail_plan()}")
        how = "launched on the GPU behind a GPU workload" if a.cuda else "launches mocked"
        print(f"host time per call: median {statistics.median(times):.1f} us (p10 {deciles[0]:.1f}, "
              f"p90 {deciles[-1]:.1f}; {a.iters} calls, {how})")
        if a.profile:
            profile(fn, a.iters, a.profile, a.sort, busy, chunk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
