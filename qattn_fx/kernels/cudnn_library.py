"""The cuDNN frontend as qattn_fx's cudnn kernels (:mod:`qattn_fx.kernels.cudnn`) reach it: the lazy ``import
cudnn``, the backend version and its gates, one cuDNN handle per (device, thread) on torch's current stream.
"""

from __future__ import annotations

import logging
import threading

import torch

from ._cuda_utils import cudnn_version_tuple, device_index, format_version, log_once, refuse_during_capture

logger = logging.getLogger("qattn_fx.kernels.cudnn")  # the kernels' logger: one name for everything cuDNN logs


def import_cudnn(kernel: str):
    """The ``cudnn`` frontend module (imported here, lazily: the package imports without it), or ``RuntimeError``
    naming the kernel that needs it."""
    try:
        import cudnn  # noqa: PLC0415 (lazy on purpose)
    except ImportError as exc:
        raise RuntimeError(
            f"{kernel} needs the cuDNN frontend Python package (pip install nvidia-cudnn-frontend); "
            f"'import cudnn' failed: {exc}"
        ) from exc
    _log_backend_mismatch(cudnn)
    return cudnn


def backend_version(cudnn) -> tuple[int, int, int]:
    """The cuDNN backend library the frontend loaded, as ``(major, minor, patch)``."""
    return cudnn_version_tuple(int(cudnn.backend_version()))


def _log_backend_mismatch(cudnn) -> None:
    """Log once when torch and the cuDNN frontend loaded different cuDNN backends (TensorRT-LLM does the same)."""
    try:
        fe = int(cudnn.backend_version())
        pt = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception as exc:  # noqa: BLE001 — informational only
        log_once(logger, "cudnn-version-query", logging.DEBUG, "could not compare cuDNN versions: %s", exc)
        return
    if pt is not None and int(pt) != fe:
        log_once(
            logger, ("cudnn-mismatch", pt, fe), logging.WARNING,
            "PyTorch and the cuDNN frontend loaded different cuDNN backends: torch %s, cudnn-frontend %s. "
            "qattn_fx's cudnn kernels use the frontend's (%s); feature gates follow that version.",
            format_version(cudnn_version_tuple(int(pt))), format_version(cudnn_version_tuple(fe)),
            format_version(cudnn_version_tuple(fe)),
        )


def check_cudnn_version(kernel: str, version: tuple[int, int, int], minimum: tuple[int, int, int],
                        bad: tuple[tuple[int, int, int], ...] = ()) -> None:
    """``RuntimeError`` unless ``minimum <= version`` and ``version`` is not a known-bad release."""
    if tuple(version) < tuple(minimum):
        raise RuntimeError(
            f"{kernel} needs a cuDNN backend >= {format_version(minimum)}; the cuDNN frontend loaded "
            f"{format_version(version)} (upgrade nvidia-cudnn-cu12/cu13)"
        )
    if tuple(version) in tuple(map(tuple, bad)):
        raise RuntimeError(
            f"{kernel}: cuDNN {format_version(version)} has known bugs for this operation; "
            f"use a version >= {format_version(minimum)} other than {', '.join(format_version(b) for b in bad)}"
        )


_thread_handles = threading.local()


def thread_handle(cudnn, device: torch.device):
    """The calling thread's cuDNN handle for ``device``, set to torch's current stream (cheap when unchanged)."""
    handles = getattr(_thread_handles, "by_device", None)
    if handles is None:
        handles = _thread_handles.by_device = {}
    index = device_index(device)
    handle = handles.get(index)
    if handle is None:
        refuse_during_capture(f"creating a cuDNN handle for cuda:{index}")
        with torch.cuda.device(index):
            handle = cudnn.create_handle()
        handles[index] = handle
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
    return handle
