"""Small helpers shared by the kernels (the library-backed :mod:`.cudnn` and :mod:`.flashinfer`, the Sage kernels).

Nothing here imports a GPU library, and nothing touches the CUDA runtime at import time, so the package imports on a
CPU-only machine. Everything that asks the device a question does it through ``torch.cuda`` at call time (tests patch
``torch.cuda.get_device_capability`` to fake a machine).

* :func:`require_cuda` / :func:`capability` / :func:`require_capability`: clear errors that name the device's
  compute capability and the ones a kernel accepts.
* :class:`FifoCache`: a bounded, thread-safe build-once cache (the cuDNN graph cache, FlashInfer plans, the Sage
  kernels' checked layouts and launch geometry), keyed on plain values (:func:`layout_key`), never on tensors.
* :class:`PerDevice`: one lazily created object per CUDA device (workspaces, constant scale tensors), refusing to
  create it while a CUDA graph is being captured (memory made during capture belongs to the graph's private pool and
  holds no value until replay, so a constant created there would be garbage for eager calls).
* :func:`log_once`: a message logged once per process per key.
* :func:`empty_bshd`: the ``(B, H, S, D)`` output stored BSHD that every kernel returns.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable

import torch

Capability = tuple[int, int]


def arch_name(cap: Capability) -> str:
    """``(9, 0)`` → ``"9.0 (sm_90)"``."""
    return f"{cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]})"


def describe_archs(caps: Iterable[Capability]) -> str:
    return ", ".join(arch_name(c) for c in caps)


def require_cuda(kernel: str, **tensors: torch.Tensor) -> torch.device:
    """The common CUDA device of ``tensors``; ``RuntimeError`` naming the offending argument otherwise."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise RuntimeError(f"{kernel} runs on CUDA tensors only; {name} is on {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise RuntimeError(f"{kernel}: all tensors must be on one device; {name} is on {t.device}, not {device}")
    if device is None:
        raise RuntimeError(f"{kernel}: no tensor given")
    return device


def refuse_empty_keys(kernel: str, k: torch.Tensor, why: str = "attention over an empty key set is refused") -> None:
    """``ValueError`` for a ``k`` of zero tokens (``(B, H, Skv, D)``), saying ``why`` the kernel refuses it."""
    if k.shape[2] == 0:
        raise ValueError(f"{kernel}: k has zero tokens (Skv=0); {why}")


def require_16bit_output(kernel: str, out_dtype: torch.dtype, writer: str) -> None:
    """``ValueError`` unless ``out_dtype`` is bf16 or fp16, the outputs ``writer`` (the library call) writes."""
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{kernel}: out_dtype={out_dtype} is invalid ({writer} writes 16-bit outputs); "
                         "valid: bfloat16, float16")


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> Capability:
    """Compute capability of a CUDA ``device`` (only ``torch.cuda.get_device_capability`` is asked)."""
    cap = torch.cuda.get_device_capability(device)
    return (int(cap[0]), int(cap[1]))


def require_capability(kernel: str, device: torch.device, allowed: Iterable[Capability], why: str = "") -> Capability:
    """The device's capability if it is in ``allowed``; else ``RuntimeError`` naming both."""
    allowed = tuple(allowed)
    cap = capability(device)
    if cap not in allowed:
        reason = f" ({why})" if why else ""
        raise RuntimeError(
            f"{kernel} needs compute capability {describe_archs(allowed)}{reason}; "
            f"device {device} has compute capability {arch_name(cap)}"
        )
    return cap


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (False without CUDA)."""
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 — a CPU build or an uninitialised runtime: not capturing
        return False


def refuse_during_capture(what: str) -> None:
    if is_capturing():
        raise RuntimeError(
            f"{what} would happen inside CUDA-graph capture; run the same call once eagerly (a warm-up) before "
            "capturing so that it is built outside the graph"
        )


class FifoCache:
    """A bounded map of built objects with thread-safe, build-once insertion.

    Lookups of existing entries take no lock (a dict read is atomic under the GIL), so executing cached entries is
    lock-free; a miss takes the lock, re-checks, builds, inserts, and evicts the oldest entries beyond ``maxsize``
    (FIFO, like cudnn-frontend's own torch op cache). ``hits`` / ``misses`` count lookups for tests and reports.
    """

    def __init__(self, maxsize: int = 128):
        if maxsize < 1:
            raise ValueError(f"maxsize={maxsize} is invalid; valid: an int >= 1")
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The entry of ``key``, or ``None`` (no lock; not counted)."""
        return self._entries.get(key)

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            return entry
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                return entry
            entry = build()
            if entry is None:
                raise RuntimeError(f"cache build for {key!r} returned None")
            self.misses += 1
            self._entries[key] = entry
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
            return entry

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list:
        return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = 0
            self.misses = 0


class PerDevice:
    """One object per CUDA device index, created on first use by ``factory(device)`` (never during capture)."""

    def __init__(self, what: str, factory: Callable[[torch.device], Any]):
        self._what = what
        self._factory = factory
        self._objects: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> Any:
        index = device_index(device)
        obj = self._objects.get(index)
        if obj is not None:
            return obj
        with self._lock:
            obj = self._objects.get(index)
            if obj is None:
                refuse_during_capture(f"creating the {self._what} for cuda:{index}")
                obj = self._factory(torch.device("cuda", index))
                self._objects[index] = obj
            return obj


_logged: set = set()
_logged_lock = threading.Lock()


def log_once(logger: logging.Logger, key: Hashable, level: int, message: str, *args: Any) -> bool:
    """Log ``message`` once per process for ``key``; returns whether it logged now."""
    with _logged_lock:
        if key in _logged:
            return False
        _logged.add(key)
    logger.log(level, message, *args)
    return True


def layout_key(t: torch.Tensor | None) -> tuple | None:
    """``(shape, strides, dtype)`` of ``t`` (``None`` for ``None``): a cache key for what follows from a tensor's
    layout alone; it holds no reference to the tensor."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


def empty_bshd(b: int, h: int, s: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Logical ``(B, H, S, D)`` stored BSHD: strides ``(S·H·D, D, H·D, 1)``, the layout every kernel returns."""
    return torch.empty(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def cudnn_version_tuple(version: int) -> tuple[int, int, int]:
    """cuDNN's integer version (``91900`` for 9.19.0, ``8907`` for 8.9.7) as ``(major, minor, patch)``."""
    if version >= 10000:
        return (version // 10000, (version % 10000) // 100, version % 100)
    return (version // 1000, (version % 1000) // 100, version % 100)


def format_version(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def bias_stride(key_bias: torch.Tensor | None) -> int:
    """A ``(B|1, S)`` key bias's batch stride (0: one row for every batch element, or no bias)."""
    return 0 if key_bias is None or key_bias.shape[0] == 1 else key_bias.stride(0)


def bias_args(key_bias: torch.Tensor | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A Triton launch's ``(pointer, batch stride, key stride)`` of a ``(B|1, S)`` key bias; without one,
    ``placeholder`` and zeros (never read: the kernel's ``HAS_BIAS`` is false)."""
    if key_bias is None:
        return placeholder, 0, 0
    return key_bias, bias_stride(key_bias), key_bias.stride(1)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``): Triton block sizes, tuning-key buckets."""
    return 1 << max(n - 1, 0).bit_length()


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), read now; False without triton."""
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def load_triton_source(package: str, source, stem: str, interpret: bool, loaded: dict):
    """The Triton kernels of file ``source`` loaded as module ``<package>.<stem>_<interpreted|compiled>`` with
    ``@triton.jit`` in interpreter (``interpret``) or compiled mode, once per mode (kept in ``loaded``, keyed by
    ``interpret``): a test can run the interpreter beside compiled kernels in one process. Needs triton."""
    import importlib.util

    import triton

    module = loaded.get(interpret)
    if module is None:
        name = f"{package}.{stem}_{'interpreted' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
        loaded[interpret] = module
    return module


class TritonSource:
    """The Triton kernels of one source file (``path``, a sibling of the module in ``package``), loaded on first use
    once per Triton mode (:func:`load_triton_source`, module ``<package>.<stem>_<mode>``). ``needed_by`` (the
    caller) and ``what`` (these kernels) are named in the ``RuntimeError`` raised when triton does not import
    (:attr:`missing`, the import's error)."""

    def __init__(self, package: str, path, stem: str, needed_by: str, what: str):
        try:
            import triton  # noqa: F401
        except ImportError as error:  # pragma: no cover - depends on the install
            self.missing: Exception | None = error
        else:
            self.missing = None
        self.package, self.path, self.stem, self.needed_by, self.what = package, path, stem, needed_by, what
        self._loaded: dict = {}

    def require(self) -> None:
        """``RuntimeError`` naming the requirement unless triton imports."""
        if self.missing is not None:
            raise RuntimeError(f"{self.needed_by} needs triton ({self.what}); install triton: {self.missing}")

    def module(self, interpret: bool | None = None):
        """The loaded module, in the mode ``interpret`` names (default: :func:`triton_interpreting`, read now)."""
        self.require()
        interpret = triton_interpreting() if interpret is None else interpret
        return load_triton_source(self.package, self.path, self.stem, interpret, self._loaded)
