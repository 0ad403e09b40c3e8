"""Launching a ``@triton.jit`` / ``@gluon.jit`` kernel through the compiled kernel Triton returned for the same
arguments' specialization, skipping Triton's per-call binding.

``fn[grid](*args, **meta)`` makes Triton specialize every argument (dtype and 16-byte alignment of each tensor,
divisibility of each integer, the constexprs and options), hash that into a cache key, look the compiled kernel up
and check the kernel's globals on every call, before the launcher itself runs. For a kernel of ~60 parameters that
is tens of microseconds of host time per call, paid once per attention layer and step (``docs/kernel-profile.md``,
"Host path of one call"). :class:`CompiledLaunch` runs that path once per :func:`specialization` of the arguments
(the same facts Triton specializes on, read more cheaply, including every integer's value and every constexpr) and
then launches the compiled kernel directly (``CompiledKernel[grid](*bound_args)``, on the current stream, with
Triton's launch hooks).

Under the Triton interpreter (``TRITON_INTERPRET=1``, no compiled kernels), for a kernel that is not a plain
``JITFunction`` (an autotuner) and while the kernel has pre-run hooks, every launch takes the plain path.
"""

from __future__ import annotations

import torch

from ._cuda_utils import FifoCache, triton_interpreting


def specialization(args: tuple, meta: dict) -> tuple:
    """What a launch's compiled kernel depends on, as plain values: each positional argument's key (a tensor's dtype
    and whether its base is 16-byte aligned, an integer's or bool's value, a float's type only, ``None``, a TMA
    descriptor's base dtype, block shape and layout; anything else by type and value) and the keyword arguments
    (constexprs and launch options) in their order; plus the current CUDA device. Two launches with equal keys
    compile to the same kernel."""
    key = []
    for a in args:
        kind = type(a)
        if kind is torch.Tensor or isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif kind is float:
            key.append(float)
        elif a is None or kind is int:
            key.append(a)
        elif kind is bool:  # (True == 1 as a key; Triton types them apart)
            key.append((bool, a))
        elif hasattr(a, "block_shape") and hasattr(a, "base"):  # a host TMA descriptor
            key.append((a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None)))
        else:
            key.append((kind, a))
    return (torch.cuda.current_device(), *key, *meta.items())


class CompiledLaunch:
    """``launch = CompiledLaunch(fn)``; ``launch[grid](*args, **meta)`` runs what ``fn[grid](*args, **meta)``
    runs (module docstring): the first launch of each :func:`specialization` through Triton's binding (compiling
    or looking the kernel up, checking the arguments), later ones through the compiled kernel it returned.
    ``args`` are the kernel's leading parameters in order; ``meta`` names the rest (constexprs, defaults allowed)
    and the launch options (``num_warps``, ``maxnreg``, ...). Keeps the last ``maxsize`` compiled kernels."""

    def __init__(self, fn, maxsize: int = 256):
        self.fn = fn
        self.kernels = FifoCache(maxsize)
        params = getattr(fn, "params", None)
        self._names = tuple(p.name for p in params) if params is not None else None
        self._defaults = {p.name: p.default for p in params if p.has_default} if params is not None else {}

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def _direct(self) -> bool:
        """Whether launches may skip the binding: a compiled (not interpreted) ``JITFunction`` without pre-run
        hooks."""
        return (self._names is not None and not getattr(self.fn, "pre_run_hooks", None)
                and hasattr(self.fn, "device_caches") and not triton_interpreting())

    def launch(self, grid: tuple, args: tuple, meta: dict) -> None:
        if not self._direct():
            self.fn[grid](*args, **meta)
            return
        key = specialization(args, meta)
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **meta)  # binds, compiles or looks up, launches
            if kernel is None:  # (a JIT cache hook took the launch: nothing was compiled; ask Triton again next time)
                return
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            self.kernels.get_or_build(key, lambda: kernel)
            return
        kernel[(*grid, 1, 1)[:3]](*self.bound(args, meta))  # (the compiled kernel reads all three grid dims)

    def bound(self, args: tuple, meta: dict) -> list:
        """Every parameter's value in the kernel's order (as Triton's binding gives the compiled kernel): ``args``,
        then each later parameter from ``meta`` or its default; launch options left out."""
        names, defaults = self._names, self._defaults
        return [*args, *(meta[n] if n in meta else defaults[n] for n in names[len(args):])]


_LAUNCHES: dict[int, CompiledLaunch] = {}


def compiled(fn) -> CompiledLaunch:
    """The :class:`CompiledLaunch` of kernel ``fn`` (one per kernel object): ``compiled(fn)[grid](*args, **meta)``
    in place of ``fn[grid](*args, **meta)``."""
    launch = _LAUNCHES.get(id(fn))
    if launch is None or launch.fn is not fn:
        launch = _LAUNCHES[id(fn)] = CompiledLaunch(fn)
    return launch
