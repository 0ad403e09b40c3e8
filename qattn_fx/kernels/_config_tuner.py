"""Pick a kernel's launch config per problem key by timing the candidates, and remember the choice.

:class:`ConfigTuner` is the autotuner of kernels whose configs change more than Triton's ``triton.autotune`` can
express (the grid, the TMA descriptors and ``maxnreg`` depend on the config, as in :mod:`.gluon_sage`). For a key
seen for the first time it times every candidate with ``triton.testing.do_bench`` (:func:`do_bench_ms`: warm-up
calls, which also compile, then timed calls with the L2 flushed before each) in :attr:`ConfigTuner.rounds`
interleaved rounds (a, b, c, a, b, c, ...) and keeps the lowest median over the rounds: a kernel call of 100 ms or
more gets a single timed call per ``do_bench``, and one round let clock drift between candidates pick a slower
config than the best (docs/kernel-design.md, "Tried and rejected"). Choices
live in memory and, unless disabled, in a JSON file shared across processes (``qattn_fx.config.tuning_cache``,
``$QATTN_TUNING_CACHE``, default ``~/.cache/qattn_fx/tuning.json``), keyed by kernel, GPU name, Triton version and
problem key, so later processes start tuned.

A call made while the current CUDA stream is capturing a graph cannot be timed: it uses the cached choice, or the
kernel's default when the key was never tuned (and says so through :meth:`ConfigTuner.last_source`).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .. import config


def default_cache_path() -> Optional[Path]:
    """``qattn_fx.config.tuning_cache`` (``$QATTN_TUNING_CACHE``; empty: no file, memory only), else
    ``~/.cache/qattn_fx/tuning.json``."""
    text = config.tuning_cache
    if text is not None:
        return Path(text) if text else None
    return Path.home() / ".cache" / "qattn_fx" / "tuning.json"


def tuning_enabled() -> bool:
    """``qattn_fx.config.autotune`` (``$QATTN_AUTOTUNE``; off: every call uses the cached choice or the kernel's
    default, timing nothing)."""
    return config.flag("autotune")


def do_bench_ms(run: Callable[[], None]) -> float:
    """Median milliseconds of ``run()`` by ``triton.testing.do_bench`` (25 ms of warm-up calls, then about 100 ms
    of timed calls, L2 flushed before each; at least one of each): the protocol of
    ``python -m benchmarks.tune``, whose rankings of gluon_sage's configs held across runs (docs/kernel-profile.md,
    "Tuning: gluon_sage's default config"). It
    allocates triton's 256 MB L2-flush buffer while it runs."""
    from triton.testing import do_bench  # the kernels tuned here are Triton kernels: triton is importable

    return float(do_bench(run, warmup=25, rep=100, return_mode="median"))


@functools.lru_cache(maxsize=None)
def _cuda_device_tag(index: int) -> str:
    import triton  # the kernels tuned here are Triton kernels: triton is importable

    return f"{torch.cuda.get_device_name(index)}|triton {triton.__version__}"


@dataclass
class ConfigTuner:
    """Autotuner of one kernel: ``candidates`` are config names (the kernel parses them), ``default(key)`` the
    config used when timing is impossible (graph capture) or disabled (``$QATTN_AUTOTUNE=0``).

    ``numerics(config) -> key``, when given, is what decides a config's output bits: every candidate must have the
    same (``ValueError`` otherwise), so that the choice, and the cache, change only the time, never the result.
    ``timer(run) -> ms`` and ``capturing() -> bool`` are injectable for tests; ``cache_path=None`` keeps choices
    in memory only; ``rounds``: interleaved timing rounds per candidate (the median is kept)."""

    kernel: str
    candidates: Sequence[str]
    default: Callable[[tuple], str]
    cache_path: Optional[Path] = field(default_factory=default_cache_path)
    timer: Callable[[Callable[[], None]], float] = do_bench_ms
    capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing
    device_tag: Callable[[], str] = lambda: ConfigTuner.cuda_device_tag()  # noqa: E731 - resolved at call time
    rounds: int = 3
    numerics: Optional[Callable[[str], object]] = None

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError(f"{self.kernel}: ConfigTuner needs at least one candidate config")
        if self.numerics is not None:
            classes = {config: self.numerics(config) for config in self.candidates}
            if len(set(classes.values())) > 1:
                raise ValueError(f"{self.kernel}: the tuner's candidates must give identical outputs, but their "
                                 f"numerics differ: {classes}")
        if not (isinstance(self.rounds, int) and self.rounds >= 1):
            raise ValueError(f"{self.kernel}: rounds={self.rounds!r} is invalid; valid: an int >= 1")
        self._choices: dict[str, str] = {}
        self._timings: dict[str, dict[str, float]] = {}
        self._loaded = False
        self._lock = threading.Lock()
        self._last_source = "none"

    @staticmethod
    def cuda_device_tag() -> str:
        """``"<GPU name>|triton <version>"`` of the current CUDA device (looked up once per device)."""
        return _cuda_device_tag(torch.cuda.current_device())

    def _entry(self, key: tuple) -> str:
        return f"{self.kernel}|{self.device_tag()}|{key!r}"

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        path = self.cache_path
        if path is None or not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ValueError("not a JSON object of strings")
        except ValueError as exc:
            raise ValueError(f"tuning cache {path} is unreadable ({exc}); delete it or point $QATTN_TUNING_CACHE "
                             "(qattn_fx.config.tuning_cache) elsewhere") from exc
        self._choices.update({k: v for k, v in data.items() if v in self.candidates})

    def _store(self) -> None:
        path = self.cache_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update({k: v for k, v in self._choices.items() if k.startswith(f"{self.kernel}|")})
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)

    def choose(self, key: tuple, run: Callable[[str], None]) -> str:
        """The config for ``key``: remembered, else the candidate with the lowest median time of ``run(config)``
        over :attr:`rounds` interleaved rounds
        (``run`` launches the kernel with that config on the real inputs), else (graph capture, tuning disabled)
        ``default(key)``. :meth:`last_source` tells which."""
        entry = self._entry(key)
        with self._lock:
            self._load()
            if entry in self._choices:
                self._last_source = "cache"
                return self._choices[entry]
            if self.capturing() or not tuning_enabled():
                self._last_source = "default"
                return self.default(key)
            samples: dict[str, list[float]] = {candidate: [] for candidate in self.candidates}
            for _ in range(self.rounds):
                for candidate in self.candidates:
                    samples[candidate].append(self.timer(lambda c=candidate: run(c)))
            timings = {candidate: statistics.median(times) for candidate, times in samples.items()}
            best = min(self.candidates, key=timings.__getitem__)
            self._choices[entry], self._timings[entry] = best, timings
            self._store()
            self._last_source = "tuned"
            return best

    def last_source(self) -> str:
        """Where the latest :meth:`choose` got its answer: ``cache``, ``tuned``, ``default`` (or ``none``)."""
        return self._last_source

    def timings(self) -> dict[str, dict[str, float]]:
        """Milliseconds per candidate for the keys this process timed, by cache entry."""
        return {k: dict(v) for k, v in self._timings.items()}

    def clear(self) -> None:
        """Forget the in-memory choices (the file stays; it is read again on the next call)."""
        with self._lock:
            self._choices.clear()
            self._timings.clear()
            self._loaded = False
