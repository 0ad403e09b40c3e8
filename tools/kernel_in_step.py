"""GPU time of each gluon_sage call inside a compiled model's step against the same calls alone, with the GPU's SM
clock and board power over both: whether the kernel runs slower in a model than ``benchmarks.attention_ops`` times
it, and whether the inputs or the clock make the difference.

When to use: when a model step gains less than the op benchmark predicts. It builds a ``benchmarks.dit_step`` model,
compiles it whole under the default spec (``auto``), captures the arguments of every gluon_sage call of one step
(copies), profiles ``--steps`` steps (each call's kernel time, ``torch.profiler``), then runs each captured call alone
``--repeats`` times back to back after one untimed call (``benchmarks.common.time_ms``: CUDA events, median) in
``--rounds`` rounds, and with ``--gemm-ms MS`` again with about ``MS`` of bf16 GEMMs queued before each timed call
(the context a block's projections and feed-forward leave), while ``nvidia-smi`` samples the SM clock and the power
draw every 100 ms::

    python -m tools.kernel_in_step --model wan --config 14b --resolution 720 --blocks 4 --out in_step.json

Prints per call its shape, kernel ms in each profiled step, ms alone, and the ratio; then the median clock and power
of the samples taken during the steps and during the calls alone. The calls alone run on the step's own inputs, so
a ratio above 1 is the step's context (what ran before each call: the clock the GEMMs leave, the caches), not data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import tempfile
import time
from typing import Callable
from unittest import mock

import torch

from benchmarks import common

#: ``nvidia-smi`` fields sampled, in order (``timestamp`` first).
SMI_FIELDS = ("timestamp", "clocks.sm", "power.draw")


@contextlib.contextmanager
def captured_calls(module, name: str):
    """Patch ``module.name`` (a kernel entry) with a spy that forwards every call and keeps a copy of its arguments;
    yields the list of ``(args, kwargs)`` (tensors cloned)."""
    calls, original = [], getattr(module, name)
    copy = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731

    def spy(*args, **kwargs):
        calls.append((tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()}))
        return original(*args, **kwargs)

    with mock.patch.object(module, name, spy):
        yield calls


def gemm_burst(ms: float) -> Callable[[], None] | None:
    """A function that queues about ``ms`` of bf16 8192³ matmuls (the GEMM work a transformer block runs between
    two attention calls; timed once here); ``None`` for ``ms`` 0."""
    if ms <= 0:
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    count = max(1, round(ms / common.time_ms(lambda: a @ a, iters=5)))

    def burst():
        for _ in range(count):
            a @ a

    return burst


def phase_medians(samples: list[tuple[float, float, float]], phases: dict[str, list[tuple[float, float]]]) -> dict:
    """Median SM clock (MHz) and power (W) of the ``(time, clock, power)`` samples inside each phase's
    ``(start, end)`` spans; ``None`` where no sample fell inside."""
    out = {}
    for name, spans in phases.items():
        inside = [s for s in samples if any(a <= s[0] <= b for a, b in spans)]
        out[name] = {"samples": len(inside),
                     "clock_mhz": statistics.median(s[1] for s in inside) if inside else None,
                     "power_w": statistics.median(s[2] for s in inside) if inside else None}
    return out


def parse_smi(text: str) -> list[tuple[float, float, float]]:
    """``(unix time, clock MHz, power W)`` from ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw
    --format=csv,noheader,nounits`` lines (timestamps ``YYYY/MM/DD HH:MM:SS.mmm``, local time)."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(SMI_FIELDS):
            continue
        stamp, frac = parts[0].split(".")
        when = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
        rows.append((when, float(parts[1]), float(parts[2])))
    return rows


@contextlib.contextmanager
def smi_sampler():
    """Samples ``nvidia-smi`` every 100 ms while inside; yields a list that receives the parsed samples on exit."""
    samples: list = []
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=log)
        try:
            yield samples
        finally:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)  # nvidia-smi flushes what it buffered (SIGTERM would lose it)
            proc.wait()
            log.seek(0)
            samples.extend(parse_smi(log.read()))


def measure(model: str, config: str, resolution: int | None, blocks: int | None, steps: int, repeats: int,
            rounds: int, gemm_ms: float = 0.0) -> dict:
    """The measurement of the module docstring, as a JSON-able dict."""
    import qattn_fx
    from benchmarks import dit_step
    from qattn_fx.kernels.gluon_sage import launch

    case = dit_step.MODELS[model](config=config, blocks=blocks, resolution=resolution, device="cuda")
    compiled = torch.compile(case.model, backend=qattn_fx.backend())
    result = {"model": case.header, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "in_step_ms": [], "alone_ms": [], "after_gemm_ms": [], "gemm_ms": gemm_ms}
    spans: dict[str, list] = {"steps": [], "alone": [], "after_gemm": []}
    with torch.no_grad(), smi_sampler() as samples:
        compiled(**case.inputs)  # compiles, tunes
        torch.cuda.synchronize()
        with captured_calls(launch, "attention") as calls:
            compiled(**case.inputs)
            torch.cuda.synchronize()
        if not calls:
            raise RuntimeError(f"no gluon_sage call in the {model} step under the default spec: nothing to time")
        result["calls"] = [[list(a.shape) for a in (args[0], args[2])] for args, _ in calls]
        for _ in range(steps):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.time()
                compiled(**case.inputs)
                torch.cuda.synchronize()
                spans["steps"].append((t0, time.time()))
            result["in_step_ms"].append([e.device_time_total / 1e3 for e in prof.events()
                                         if e.device_type == torch.autograd.DeviceType.CUDA
                                         and e.name.startswith("_sage_fwd_ws")])
        burst = gemm_burst(gemm_ms)
        phases = [("alone", None)] + ([("after_gemm", burst)] if burst else [])
        for _ in range(rounds):
            for phase, before in phases:
                t0 = time.time()
                result[f"{phase}_ms"].append([
                    common.time_ms(lambda: launch.attention(*args, **kwargs), warmup=1, iters=repeats,
                                   min_iters=repeats, before=before)
                    for args, kwargs in calls])
                spans[phase].append((t0, time.time()))
    result["power"] = phase_medians(samples, spans)
    return result


def print_result(result: dict) -> None:
    """Per call: shapes, kernel ms in each profiled step, the median alone, the ratio; then clock and power."""
    print(f"{result['model']}, {result['device']}, torch {result['torch']}")
    gemm = result.get("after_gemm_ms") or []
    extra = f" {'after ' + format(result['gemm_ms'], 'g') + ' ms GEMM':>18}" if gemm else ""
    print(f"{'call':>4} {'Q (B,H,Sq,D)':>22} {'Skv':>7} {'in step ms':>22} {'alone ms':>9} {'step/alone':>10}{extra}")
    for i, (q_shape, k_shape) in enumerate(result["calls"]):
        step = [row[i] for row in result["in_step_ms"] if i < len(row)]
        alone = statistics.median(row[i] for row in result["alone_ms"])
        ratio = statistics.median(step) / alone if step else float("nan")
        after = f" {statistics.median(row[i] for row in gemm):18.2f}" if gemm else ""
        print(f"{i:4} {str(tuple(q_shape)):>22} {k_shape[2]:7} {' '.join(f'{t:.2f}' for t in step):>22} "
              f"{alone:9.2f} {ratio:10.3f}{after}")
    for phase, stats in result["power"].items():
        if stats["samples"]:
            print(f"{phase}: SM clock {stats['clock_mhz']:.0f} MHz, power {stats['power_w']:.0f} W (median of "
                  f"{stats['samples']} samples)")


def main(argv: list[str] | None = None) -> int:
    from benchmarks import dit_step

    p = argparse.ArgumentParser(prog="python -m tools.kernel_in_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan", choices=list(dit_step.MODELS))
    p.add_argument("--config", default="1.3b", choices=list(dit_step.CONFIGS), help="Wan's config")
    p.add_argument("--resolution", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None, help="transformer blocks")
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--repeats", type=int, default=5, help="back-to-back calls per captured call and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gemm-ms", type=float, default=0.0,
                   help="also time each captured call with about this many ms of bf16 GEMMs queued before it "
                        "(the clock a block's GEMMs leave behind; 0: not timed)")
    p.add_argument("--out", default=None, help="also write the result as JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (gluon_sage runs on sm_90)")
    result = measure(a.model, a.config, a.resolution, a.blocks, a.steps, a.repeats, a.rounds, a.gemm_ms)
    print_result(result)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
