"""The whole stack around the backend: TorchAO's quantized linears and diffusers' step caches.

Both act on the model before ``torch.compile(model, backend=qattn_fx.backend(spec))``; the backend then sees the
graph as Dynamo traced it:

* **TorchAO linears** (:func:`quantize_linears`, ``torchao.quantization.quantize_``): the weights become TorchAO
  tensor subclasses. Dynamo traces the linear calls with the subclass weights as graph inputs (the subclass is
  desugared later, by AOT autograd, into its quantize and matmul ops, which Inductor fuses), so Q, K and V reach
  SDPA as plain tensors out of ``linear`` and every site is found, decided and rewritten as on the plain model, in
  one graph (``fullgraph=True`` holds). ``fp8``: FP8 dynamic activation and weight, per-row scales (Hopper and
  later, bf16); ``fp8static``: FP8 activation and weight with one scale each per linear, the activation's measured
  on calibration calls (:func:`calibrate_linears`), so quantizing an activation is a multiply and a cast that
  Inductor writes in the kernel of the op before the linear (no reduction over the activation; any device with
  FP8 ``_scaled_mm``: sm_89+ GPUs and the CPU); ``int8wo``: int8 weight-only; ``int8dq``: int8 dynamic activation
  (per token) and weight (any device: the CPU tests', where Inductor fuses the activation's quantization into the
  op before the linear).
* **Step caches** (:func:`enable_cache`, diffusers' ``CacheMixin.enable_cache``): ``fbc`` is First Block Cache.
  Its decision (does this step recompute the blocks after the first?) is a host read of a tensor under
  ``torch.compiler.disable``: a graph break by design, so ``fullgraph=True`` cannot hold and Dynamo compiles the
  blocks' hooked forwards as frames of their own, one per path the cache takes (compute or reuse, head, middle or
  tail block). The backend rewrites the sites of every such graph; the number of graphs is the cache's, the same as
  under any other backend (``tests/models/test_stack.py``). The hook's frames start at the block, so a site is named
  from there (``attn1``), without the block's index.

**Inductor settings.** TorchAO's configs change Inductor's settings for the whole process unless told not to
(``set_inductor_config=True``, their default, turns on coordinate-descent tuning of every generated kernel: most of
the minutes a DiT's compile then takes); :func:`linears_config` tells them not to, so the only settings the stack
changes are :func:`inductor_config`'s, and only where the caller applies them.

**FP8 matmuls under Inductor.** Inductor lowers each FP8 matmul (``aten._scaled_mm``) with Triton templates beside
cuBLAS and autotunes among them *also in the default mode* (``tuned_scaled_mm`` asks for templates without the
max-autotune check, torch 2.11 and 2.13), compiling and timing every template config for every matmul shape.
:func:`inductor_config` gives the Inductor settings of a choice in :data:`FP8_GEMMS`: ``cublas`` (the ATen kernel,
no autotuning) or ``autotune`` (Inductor's default); apply them around the compiled model's first calls
(``with torch._inductor.config.patch(stack.inductor_config("fp8", "cublas")):``), since Inductor compiles there.

A call of a model with a cache on must run inside its cache context (diffusers' pipelines open it;
:func:`cache_context` for a hand-written loop) and a new denoising run starts from a reset cache
(:func:`reset_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

#: ``--linears`` choices: what :func:`quantize_linears` applies.
LINEARS = ("bf16", "fp8", "fp8static", "int8wo", "int8dq")
#: The kinds of :data:`LINEARS` whose activation scales are measured on calibration calls (:func:`calibrate_linears`).
CALIBRATED = ("fp8static",)
#: The kinds of :data:`LINEARS` whose matmuls are FP8 (``aten._scaled_mm``; :func:`inductor_config`).
FP8 = ("fp8", "fp8static")
#: ``--cache`` choices: what :func:`enable_cache` applies.
CACHES = ("none", "fbc")
#: ``--fp8-gemms`` choices: how Inductor picks the kernel of each FP8 matmul (:func:`inductor_config`).
FP8_GEMMS = ("cublas", "autotune")


def linears_config(kind: str, step: str | None = None):
    """The TorchAO config of ``kind`` (:data:`LINEARS`, not ``bf16``); for a :data:`CALIBRATED` kind, of its
    ``step``: ``"prepare"`` (observers in the linears) or ``"convert"`` (the observed linears quantized)."""
    if kind not in LINEARS or kind == "bf16":
        raise ValueError(f"linears={kind!r} is invalid; valid: {', '.join(k for k in LINEARS if k != 'bf16')}")
    if (step is not None) != (kind in CALIBRATED) or step not in (None, "prepare", "convert"):
        valid = "'prepare' or 'convert'" if kind in CALIBRATED else "None (it is not calibrated)"
        raise ValueError(f"step={step!r} is invalid for linears={kind!r}; valid: {valid}")
    try:
        from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                          Float8StaticActivationFloat8WeightConfig,
                                          Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, PerRow,
                                          PerTensor)
    except ImportError as e:
        raise ImportError(f"linears={kind!r} needs torchao: pip install -e '.[stack]' ({e})") from e
    # set_inductor_config=False: TorchAO's default turns on Inductor's coordinate-descent tuning for the whole
    # process (minutes per compile of a DiT); the stack's Inductor settings are :func:`inductor_config`'s alone.
    if kind == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    if kind == "fp8static":
        return Float8StaticActivationFloat8WeightConfig(step=step, granularity=PerTensor(), set_inductor_config=False)
    if kind == "int8wo":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)


def _fp8_shape_ok(module: torch.nn.Module, _fqn: str) -> bool:
    """FP8 row-wise matmuls (``torch._scaled_mm``) need both sides of the weight to be multiples of 16."""
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def quantize_linears(model: torch.nn.Module, kind: str) -> int:
    """Quantize ``model``'s ``nn.Linear`` weights in place as ``kind`` (:data:`LINEARS`) says; returns how many
    linears were quantized (``bf16``: none, the model is left as it is). ``fp8`` leaves linears whose sides are not
    multiples of 16 as they are (the FP8 matmul cannot take them). A :data:`CALIBRATED` kind is quantized by
    :func:`calibrate_linears` instead (``ValueError`` here)."""
    if kind == "bf16":
        return 0
    if kind in CALIBRATED:
        raise ValueError(f"linears={kind!r} measures its activation scales on calibration calls: quantize with "
                         f"`with qattn_fx.stack.calibrate_linears(model, kind={kind!r}): <run the model>`")
    from torchao.quantization import quantize_

    config = linears_config(kind)
    take = _fp8_shape_ok if kind in FP8 else (lambda m, _: isinstance(m, torch.nn.Linear))
    chosen = sum(take(m, n) for n, m in model.named_modules())
    quantize_(model, config, filter_fn=take)
    return chosen


@dataclasses.dataclass
class LinearsCalibration:
    """What :func:`calibrate_linears` did, filled when its ``with`` block ends: ``quantized`` linears (every model's),
    and ``unseen``, the linears no calibration call reached (``model[i].path``), left in their own precision."""

    kind: str
    quantized: int = 0
    unseen: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def calibrate_linears(*models: torch.nn.Module, kind: str = "fp8static"):
    """Quantize ``models``' linears in place as ``kind`` (:data:`CALIBRATED`) says, with activation scales measured
    on the calls run inside the ``with`` block::

        with stack.calibrate_linears(pipe.transformer) as calibration:
            pipe(prompt, generator=torch.Generator().manual_seed(1))   # a few representative calls
        # the linears are FP8 now; calibration.quantized of them

    In the block, TorchAO's observers record each linear's input range (the linears still compute in their own
    precision, so the calls' outputs are the model's); when it ends, each observed linear becomes FP8 with its
    activation's scale fixed (one per linear: ``amax / 448``; larger values at inference clamp to ±448 · scale)
    and its weight's. Linears whose sides are not multiples of 16 stay as they are (the FP8 matmul cannot take
    them), and so do linears no call reached (named in a warning and in ``unseen``). If the block raises, the
    observers are taken out and the models are as they were."""
    if kind not in CALIBRATED:
        raise ValueError(f"kind={kind!r} is invalid for calibrate_linears; valid: {', '.join(CALIBRATED)}")
    from torchao.quantization import quantize_

    prepare, convert = linears_config(kind, "prepare"), linears_config(kind, "convert")
    for model in models:
        quantize_(model, prepare, filter_fn=_fp8_shape_ok)
    calibration = LinearsCalibration(kind)
    try:
        yield calibration
    except BaseException:
        for model in models:
            _unobserve(model, [name for name, _ in _observed(model)])
        raise
    for i, model in enumerate(models):
        unseen = [name for name, m in _observed(model) if not hasattr(m.input_act_obs, "max_val")]
        _unobserve(model, unseen)
        calibration.quantized += len(_observed(model))
        calibration.unseen += [f"model[{i}].{name}" if len(models) > 1 else name for name in unseen]
        quantize_(model, convert, filter_fn=lambda m, _: _is_observed(m))
    if calibration.unseen:
        warnings.warn(f"calibrate_linears: {len(calibration.unseen)} linear(s) saw no calibration call and stay in "
                      f"their own precision: {', '.join(calibration.unseen)}", stacklevel=3)


def _is_observed(module: torch.nn.Module) -> bool:
    return hasattr(module, "input_act_obs") and isinstance(module, torch.nn.Linear)


def _observed(model: torch.nn.Module):
    """``(path, module)`` of ``model``'s linears with a calibration observer."""
    return [(name, m) for name, m in model.named_modules() if _is_observed(m)]


def _unobserve(model: torch.nn.Module, names: list[str]) -> None:
    """Put a plain ``nn.Linear`` (the same weight and bias) back where each observed linear of ``names`` is."""
    for name in names:
        observed = model.get_submodule(name)
        plain = torch.nn.Linear(observed.in_features, observed.out_features, bias=observed.bias is not None,
                                device="meta")
        plain.weight, plain.bias = observed.weight, observed.bias
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, plain)


def inductor_config(linears: str, fp8_gemms: str = "cublas") -> dict:
    """Inductor config patches for a model with ``linears`` (:data:`LINEARS`): with :data:`FP8` linears and
    ``fp8_gemms="cublas"`` (:data:`FP8_GEMMS`), ``max_autotune_gemm_backends="ATEN"``, so that every FP8 matmul is
    the ATen kernel (cuBLAS) without autotuning (the module docstring); otherwise none."""
    if linears not in LINEARS:
        raise ValueError(f"linears={linears!r} is invalid; valid: {', '.join(LINEARS)}")
    if fp8_gemms not in FP8_GEMMS:
        raise ValueError(f"fp8_gemms={fp8_gemms!r} is invalid; valid: {', '.join(FP8_GEMMS)}")
    if linears in FP8 and fp8_gemms == "cublas":
        return {"max_autotune_gemm_backends": "ATEN"}
    return {}


def enable_cache(model: torch.nn.Module, kind: str, threshold: float = 0.05) -> None:
    """Turn ``model``'s step cache on as ``kind`` (:data:`CACHES`) says: ``fbc``, diffusers' First Block Cache with
    ``threshold`` (the relative change of the first block's residual below which the other blocks are reused);
    ``none`` leaves the model as it is."""
    if kind == "none":
        return
    if kind != "fbc":
        raise ValueError(f"cache={kind!r} is invalid; valid: {', '.join(CACHES)}")
    from diffusers.hooks import FirstBlockCacheConfig

    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))


def cache_context(model: torch.nn.Module, name: str = "cond"):
    """The cache context a call of ``model`` runs in (diffusers' ``cache_context``; nothing without a cache)."""
    if getattr(model, "is_cache_enabled", False):
        return model.cache_context(name)
    return contextlib.nullcontext()


def reset_cache(model: torch.nn.Module) -> None:
    """Forget the cached residuals: the next call starts a new denoising run (no-op without a cache)."""
    if getattr(model, "is_cache_enabled", False):
        model._reset_stateful_cache()


def fbc_recomputed(model: torch.nn.Module, name: str = "cond") -> bool | None:
    """First Block Cache's latest decision for context ``name``: True when the call recomputed every block, False
    when it reused the cached residual (None without the cache or before a call)."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            hook = registry.get_hook(_FBC_LEADER_BLOCK_HOOK)
            if hook is not None:
                state = hook.state_manager._state_cache.get(name)
                return None if state is None else state.should_compute
    return None
