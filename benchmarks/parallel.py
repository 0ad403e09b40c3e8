"""diffusers context parallelism (Ulysses, ring) set up for a whole-model ``torch.compile``, on GPUs or CPU (gloo).

diffusers 0.42.1 splits the sequence over ranks with ``model.enable_parallelism(config=ContextParallelConfig(...))``:
hooks shard the inputs of the planned modules (``model._cp_plan``) and gather the output, and every attention
processor that is given the config runs its attention through the dispatcher's templated context-parallel path
(``diffusers/models/attention_dispatch.py``):

* Ulysses (``ulysses_degree``): an all-to-all turns this rank's tokens of every head into every token of its share
  of the heads, a local attention runs (backend ``native``: ``F.scaled_dot_product_attention``; ``_native_cudnn`` /
  ``_native_flash``: ``aten._scaled_dot_product_cudnn_attention`` / ``_flash_attention``), an all-to-all turns it
  back;
* ring (``ring_degree``): K/V of every rank are all-gathered, the local queries attend to each chunk in turn and the
  partial outputs are merged by their log-sum-exp, so the local attention must return the LSE: backend ``native``
  refuses (``Native attention does not support return_lse=True``); ``_native_cudnn`` and ``_native_flash`` call the
  aten ops above, which return it.

Four things stand between that API and a compiled run, each handled here and named where it is:

1. on a machine without an accelerator diffusers computes the rank's device as ``rank %
   torch.accelerator.device_count()``, a division by zero (:func:`enable`);
2. the split hook finds a positional argument (``blocks.0``'s ``hidden_states``) through ``inspect.signature`` on
   its first call, which Dynamo cannot trace (torch 2.13: ``hasattr(..., '__wrapped__')`` is unsupported): the
   cache that first call fills is filled before compiling (:func:`prime_split_hooks`);
3. the split hook logs ``logger.warning_once`` for Wan2.1's one-dimensional timestep (its plan expects Wan2.2's
   two), a logging call Dynamo refuses to trace: the function is added to Dynamo's ignored logging functions
   (:func:`ignore_warning_once`);
4. the output's gather (``all_gather_tensor`` along the sequence) calls ``torch._utils._maybe_view_chunk_cat``,
   which torch 2.13's Dynamo traces (``trace_rules``) and torch 2.11's skips, breaking the graph after the last
   attention: on such versions the same trace rule is added (:func:`trace_gather_chunk_cat`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from unittest import mock

import torch

KINDS = ("ulysses", "ring")


def ignore_warning_once() -> None:
    """Let Dynamo skip ``Logger.warning_once`` (diffusers' split hook calls it) instead of breaking the graph.

    torch 2.13 names the setting ``ignore_logging_functions``; earlier versions ``ignore_logger_methods``.
    """
    function = getattr(logging.Logger, "warning_once", None)
    if function is None:
        return
    config = torch._dynamo.config
    for name in ("ignore_logging_functions", "ignore_logger_methods"):
        ignored = getattr(config, name, None)
        if ignored is not None:
            ignored.add(function)
            return
    raise RuntimeError(f"torch {torch.__version__} has neither torch._dynamo.config.ignore_logging_functions nor "
                       "ignore_logger_methods: Logger.warning_once cannot be ignored by Dynamo")


#: What the output's all-gather calls to put the gathered chunks along the sequence (see item 4 above).
CHUNK_CAT = "torch._utils._maybe_view_chunk_cat"


def trace_gather_chunk_cat() -> bool:
    """Have Dynamo trace :data:`CHUNK_CAT` (torch 2.13's own trace rule for it) where this torch skips it;
    returns whether a rule was added."""
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import UserFunctionVariable

    if CHUNK_CAT in trace_rules.manual_torch_name_rule_map:
        return False
    trace_rules.manual_torch_name_rule_map[CHUNK_CAT] = UserFunctionVariable
    trace_rules.get_torch_obj_rule_map.cache_clear()
    return True


def prime_split_hooks(model: torch.nn.Module) -> int:
    """Fill each context-parallel split hook's argument-index cache as its first call would; returns how many.

    ``ContextParallelSplitHook`` looks a positional argument up by name in ``inspect.signature(cls.forward)`` once
    and caches the indices (``module_forward_metadata.cached_parameter_indices``); Dynamo cannot trace the lookup.
    """
    primed = 0
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", {}).values():
            metadata = getattr(hook, "module_forward_metadata", None)
            if metadata is None or metadata.cached_parameter_indices is not None:
                continue
            names = list(inspect.signature(metadata._cls.forward).parameters)[1:]  # without self
            metadata.cached_parameter_indices = {name: i for i, name in enumerate(names)}
            primed += 1
    return primed


@contextlib.contextmanager
def _device_count_for_cpu():
    """On a machine without an accelerator, ``torch.accelerator.device_count()`` reads 1 (diffusers then places
    every rank on ``cpu``); elsewhere nothing changes."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def enable(model: torch.nn.Module, kind: str, degree: int, attention_backend: str) -> None:
    """Split ``model``'s sequence over ``degree`` ranks of the initialized process group, ``kind`` ``ulysses`` or
    ``ring``, its attention on diffusers backend ``attention_backend`` (``native``, ``_native_cudnn``,
    ``_native_flash``: the ones whose local attention is a torch op qattn_fx finds), ready for ``torch.compile``.
    """
    from diffusers import ContextParallelConfig

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid; valid: {', '.join(KINDS)}")
    if not torch.distributed.is_initialized():
        raise RuntimeError("context parallelism needs an initialized process group (torchrun, or "
                           "torch.distributed.init_process_group)")
    model.set_attention_backend(attention_backend)
    config = ContextParallelConfig(**{f"{kind}_degree": degree})
    with _device_count_for_cpu():
        model.enable_parallelism(config=config)
    prime_split_hooks(model)
    ignore_warning_once()
    trace_gather_chunk_cat()
