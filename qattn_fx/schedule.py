"""Step schedules for quantization in general: keep the early, noisy denoising steps unquantized.

Skip-Softmax's own schedule (``disabled_until_timestep``) is data inside the compiled graph (λ computed from the
model's ``timestep`` input, :mod:`qattn_fx.skip_softmax`). Switching a whole site between dense and quantized
attention cannot be: the quantize passes and the kernel either run or not, and data-dependent control flow in a
graph (``torch.cond``) reads its predicate on the host, which CUDA graphs cannot capture. :class:`DenseUntil`
therefore switches between *two compiled graphs* at the call boundary: the model compiled dense and compiled with a
qattn_fx backend, each compiled once for the whole loop (tested on the CPU; each could use
``mode="reduce-overhead"``, not yet run on a GPU); per call it reads the timestep (one small device-to-host copy per
transformer call) and runs the dense graph while ``t = max(timestep) / timestep_scale`` is above
``until_timestep``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch


class DenseUntil(torch.nn.Module):
    """``dense(...)`` while the normalized timestep is above ``until_timestep``, then ``quantized(...)``.

    ``model``: the transformer both are compiled from (its attributes, e.g. diffusers' ``config``, ``dtype`` and
    ``cache_context``, are read through this wrapper, so it can replace ``pipe.transformer``); ``dense`` and
    ``quantized``: callables taking the model's arguments, e.g. ``torch.compile(model)`` and ``torch.compile(model,
    backend=qattn_fx.backend(spec))``. ``timestep``: the name of the model's forward argument holding the denoising
    timestep (positional or keyword); ``timestep_scale``: what divides it to ``t`` in [0, 1] (1000: diffusers'
    ``num_train_timesteps``; 1 when the pipeline passes ``t``). ``calls`` counts the calls each way ran.
    """

    def __init__(self, model: torch.nn.Module, dense: Callable, quantized: Callable, until_timestep: float, *,
                 timestep: str = "timestep", timestep_scale: float = 1000.0):
        super().__init__()
        if isinstance(until_timestep, bool) or not isinstance(until_timestep, (int, float)) or not (
                0.0 <= until_timestep <= 1.0):
            raise ValueError(f"until_timestep={until_timestep!r} is invalid; valid: a number in [0, 1] (the normalized "
                             "timestep below which quantized attention runs)")
        if isinstance(timestep_scale, bool) or not isinstance(timestep_scale, (int, float)) or timestep_scale <= 0:
            raise ValueError(f"timestep_scale={timestep_scale!r} is invalid; valid: a number > 0")
        params = list(inspect.signature(model.forward).parameters)
        if timestep not in params:
            raise ValueError(f"timestep={timestep!r} is not an argument of {type(model).__name__}.forward; valid: "
                             f"{', '.join(params)}")
        self.model = model
        self._dense, self._quantized = dense, quantized
        self.until_timestep, self.timestep_scale = float(until_timestep), float(timestep_scale)
        self._name, self._position = timestep, params.index(timestep)
        self.calls = {"dense": 0, "quantized": 0}

    def normalized_timestep(self, args: tuple, kwargs: dict) -> float:
        """``t`` of this call: the timestep argument's largest value over ``timestep_scale``."""
        value = kwargs[self._name] if self._name in kwargs else args[self._position]
        return float(torch.as_tensor(value).detach().float().max()) / self.timestep_scale

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dense = self.normalized_timestep(args, kwargs) > self.until_timestep
        self.calls["dense" if dense else "quantized"] += 1
        return (self._dense if dense else self._quantized)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)


__all__ = ["DenseUntil"]
