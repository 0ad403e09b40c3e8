"""What the machine has: device kind, compute capability and library versions.

Detection is lazy and never imports a GPU library at package import time; it only reads installed distribution
metadata (``importlib.metadata``) and, for cuDNN, asks torch. A :class:`Hardware` can also be written by hand
(tests, ``qattn-fx resolve --arch sm_100``) to resolve a spec for a machine you are not on:
:meth:`Hardware.for_arch` is a bare machine (no libraries unless given), :meth:`Hardware.supported_install` one
with the libraries a supported install of that architecture has (:func:`supported_libraries`: the version floors
that the kernels of that architecture declare in :data:`qattn_fx.kernels.KERNELS`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass, field

import torch

from .kernels import KERNELS
from .requirements import parse_version


@dataclass(frozen=True)
class Hardware:
    """A device and the software around it.

    ``capability`` is the CUDA compute capability ``(major, minor)`` or ``None`` for a CPU;
    ``libraries`` maps distribution names (``flashinfer-python``, ``nvidia-cudnn-frontend``, ``triton``) and
    ``cudnn`` (the cuDNN backend library torch loaded) to version strings; ``gpu`` is the GPU's product name as
    CUDA reports it (``NVIDIA H100 80GB HBM3``), ``None`` for a CPU or a machine written by hand. The cost data
    (:mod:`qattn_fx.cost`) prefer the measurements of that GPU over others of the same architecture.
    """

    device: str = "cpu"
    capability: tuple[int, int] | None = None
    libraries: dict[str, str] = field(default_factory=dict)
    gpu: str | None = None

    @property
    def arch(self) -> str:
        """``sm_90`` style name, or ``cpu``."""
        if self.capability is None:
            return self.device
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def has_library(self, name: str, minimum: str) -> bool:
        found = self.libraries.get(name)
        return found is not None and parse_version(found) >= parse_version(minimum)

    def describe(self) -> str:
        libs = ", ".join(f"{k} {v}" for k, v in sorted(self.libraries.items()))
        return self.arch + (f", {self.gpu}" if self.gpu else "") + (f" ({libs})" if libs else "")

    @classmethod
    def for_arch(cls, arch: str, libraries: dict[str, str] | None = None) -> "Hardware":
        """A hypothetical machine, e.g. ``Hardware.for_arch("sm_100", {"flashinfer-python": "0.7.4"})``."""
        if arch == "cpu":
            return cls("cpu", None, dict(libraries or {}))
        match = re.fullmatch(r"sm_(\d+)(\d)", arch)
        if not match:
            raise ValueError(f"arch={arch!r} is invalid; valid: 'cpu' or 'sm_XY' such as sm_90, sm_100, sm_120")
        return cls("cuda", (int(match.group(1)), int(match.group(2))), dict(libraries or {}))

    @classmethod
    def supported_install(cls, arch: str, libraries: dict[str, str] | None = None) -> "Hardware":
        """A hypothetical machine with a supported install of ``arch``: every library that a kernel of qattn_fx for
        ``arch`` needs, at the minimum version it needs (:func:`supported_libraries`), updated by ``libraries``
        (``{"cudnn": "9.19.0"}`` to ask about another version)."""
        return cls.for_arch(arch, {**supported_libraries(arch), **(libraries or {})})


def supported_libraries(arch: str) -> dict[str, str]:
    """The libraries a supported install of ``arch`` has: for every library that an implementation in
    :data:`qattn_fx.kernels.KERNELS` running on ``arch`` requires (the requirements the recipe table names), the highest of their minimum versions (so every
    kernel of qattn_fx for that architecture runs). ``{}`` for ``cpu`` and for architectures no kernel targets.

    ``supported_libraries("sm_90")`` → ``{"triton": "3.6.0", "cudnn": "9.1.0", "flashinfer-python": "0.6.0"}``.
    """
    floors: dict[str, str] = {}
    for entry in KERNELS.values():
        for req in entry.requirements:
            if req.library is None or req.archs is None or arch not in req.archs:
                continue
            name, minimum = req.library
            if name not in floors or parse_version(minimum) > parse_version(floors[name]):
                floors[name] = minimum
    return floors


_DISTRIBUTIONS = ("flashinfer-python", "nvidia-cudnn-frontend", "triton", "sageattention")


def detect(device: torch.device | str | None = None) -> Hardware:
    """The hardware that tensors on ``device`` run on (default: CUDA device 0 when available, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return Hardware(device.type, None, _libraries(False))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _detect_cuda(index)


@functools.lru_cache(maxsize=None)
def _detect_cuda(index: int) -> Hardware:
    return Hardware("cuda", tuple(torch.cuda.get_device_capability(index)), _libraries(True),
                    torch.cuda.get_device_name(index))


@functools.lru_cache(maxsize=2)
def _libraries(cuda: bool) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if cuda and torch.backends.cudnn.is_available():
        v = torch.backends.cudnn.version()  # e.g. 91900
        if v:
            found["cudnn"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return found
