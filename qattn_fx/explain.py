"""``qattn_fx.explain(model, *args, spec=...)``: the site report of one call, without compiling anything.

Dynamo traces the call with one shared backend (:func:`_explain_backend`); each traced graph is rewritten by the
call's :class:`~qattn_fx.backend.Backend` to decide its sites, while the call runs the original graph eagerly.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from .backend import Backend
from .fx import match
from .hardware import Hardware
from .deployment import Target
from .report import Report
from .spec import Spec

log = logging.getLogger("qattn_fx")


class _Explaining:
    """The state of one :func:`explain` call: its :class:`Backend`, the ids of the graphs it has decided on, and how
    many attention calls ran inside traced graphs."""

    def __init__(self, owner: Backend):
        self.owner, self.decided, self.traced_calls = owner, set(), 0


#: The :func:`explain` call in progress (``None`` outside one).
_EXPLAINING: contextvars.ContextVar[_Explaining | None] = contextvars.ContextVar("qattn_fx_explain", default=None)


def _explain_backend(gm: fx.GraphModule, example_inputs, **_) -> Callable:
    """:func:`explain`'s one backend (the same function at every call, so Dynamo reuses the entry it compiled for a
    model, its inputs' shapes and grad mode instead of adding one per call): runs ``gm`` as traced and, inside an
    ``explain`` call, has a copy of it rewritten by that call's :class:`Backend` the first time it runs."""
    sites = len(match.find_sdpa(gm))

    def run(*args):
        current = _EXPLAINING.get()
        if current is not None:
            current.traced_calls += sites
            if id(gm) not in current.decided:
                current.decided.add(id(gm))
                current.owner.rewrite(copy.deepcopy(gm), args)
        return gm.forward(*args)

    return run


class _CountAttention(torch.overrides.TorchFunctionMode):
    """Counts ``F.scaled_dot_product_attention`` calls (eager code only: a mode on the stack changes what Dynamo
    traces, so :func:`explain` uses it in a second, eager run)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in match.SDPA_TARGETS or func is torch.nn.functional.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _frames_run_eagerly() -> tuple[int, dict[str, int]]:
    """Dynamo's count of frames it did not convert (``counters["frames"]``: total minus ok) and of each reason it
    recorded (``counters["unimplemented"]``), for :func:`explain`'s completeness check."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return frames["total"] - frames["ok"], dict(counters["unimplemented"])


#: Dynamo's reasons for running code of a model eagerly, from the :func:`explain` call that saw them: later calls
#: find the code already marked to skip, and Dynamo records nothing again.
_EAGER_REASONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remember_reasons(model, reasons: list[str]) -> None:
    try:
        _EAGER_REASONS[model] = reasons
    except TypeError:  # not weakly referenceable: later calls say that no reason was recorded
        pass


def _note_attention_outside_graphs(owner: Backend, state: _Explaining, model, args, kwargs,
                                   reasons: list[str]) -> None:
    """Count the call's attention calls in an eager run; those beyond the traced graphs' ran in code that Dynamo
    runs eagerly, and ``torch.compile`` skips them too, so they stay dense and no report lists them: say so in the
    report's notes and the log. ``reasons``: Dynamo's, for the note."""
    counter = _CountAttention()
    with torch.compiler.set_stance("force_eager"), counter:
        model(*args, **kwargs)
    outside = counter.calls - state.traced_calls
    if outside <= 0:
        return
    why = "; ".join(list(dict.fromkeys(reasons))[:3]) or "Dynamo logged why when it first traced it"
    note = (f"{outside} of the call's {counter.calls} attention calls ran outside every traced graph, in code Dynamo "
            f"runs eagerly ({why}); torch.compile skips it too, so those calls stay dense and no report lists them. "
            "torch.compile(..., fullgraph=True) names the code (for a data-dependent op, "
            "torch._dynamo.config.capture_dynamic_output_shape_ops = True may let Dynamo trace it)")
    owner.report.notes.append(note)
    log.warning("qattn_fx.explain: %s", note)


def explain(model: Callable, *args, spec: Spec | dict | str | Path | None = None, emulate: bool = False,
            hardware: Hardware | str | None = None, target: Target = None, **kwargs) -> Report:
    """The site report for ``model(*args, **kwargs)`` under ``spec``, without compiling anything.

    Dynamo traces the call; each traced graph is rewritten (to decide every site) but the call itself runs the
    original, unrewritten graph eagerly, so nothing is quantized, Inductor never runs, and the outputs are the dense
    ones. Grad mode matters as in the real call (diffusers pipelines run under ``torch.no_grad()``). Shapes affect
    decisions through rules on lengths and, on hardware with cost data (sm_90), through ``auto``'s cost rule, which
    keeps short calls dense: small inputs make the report cheap for a big model but show what those lengths would
    run; use the real lengths to see the real call. Shapes are traced static (``dynamic=False``), so the report
    shows this call's lengths.

    Every ``explain`` call uses one backend, so Dynamo traces a model once per input shapes and grad mode and later
    calls reuse that trace (deciding again under their own spec): repeated calls do not add to the model's
    recompilations, whose limit (``torch._dynamo.config.recompile_limit``) would otherwise leave later compiles of
    it, ``qattn_fx.backend()``'s too, running eagerly. ``RuntimeError`` when Dynamo ran no traced graph for the
    call (a limit already reached, a model under ``torch.compiler.disable``): the report would be empty.

    Attention in code that Dynamo runs eagerly (a frame it skips after a graph break inside a loop, or once a
    recompile limit is reached) is compiled by no backend and so is in no report. Where Dynamo has run any frame
    eagerly in this process, ``explain`` runs the model once more, eagerly, counting its attention calls; calls
    beyond those of the traced graphs become a note of the report (and a WARNING) naming Dynamo's reasons.
    """
    # (the model's own ``timestep`` keyword goes to the model: step schedules read the default TimestepSource)
    owner = Backend(spec, emulate=emulate, compiler="eager", hardware=hardware, target=target)
    state = _Explaining(owner)
    token = _EXPLAINING.set(state)
    _, reasons_before = _frames_run_eagerly()
    try:
        # static shapes: the report shows this call's lengths even when the same code was traced before at others
        torch.compile(model, backend=_explain_backend, dynamic=False)(*args, **kwargs)
    finally:
        _EXPLAINING.reset(token)
    skipped, reasons = _frames_run_eagerly()
    if not owner.graph_modules:
        raise RuntimeError(
            "qattn_fx.explain: Dynamo ran no traced graph for this call, so there is nothing to report. Usually a "
            "recompile limit of this process was reached for the model's code (torch._dynamo.config.recompile_limit"
            f" = {torch._dynamo.config.recompile_limit}, accumulated_recompile_limit = "
            f"{torch._dynamo.config.accumulated_recompile_limit}; Dynamo logs it): torch._dynamo.reset() clears "
            "them, or raise the limits. A model run under torch.compiler.disable is not traced either.")
    if skipped:  # Dynamo ran a frame eagerly in this process: this model's attention may be in one (a cached skip)
        new = [text.strip().splitlines()[0] for text, n in reasons.items() if n > reasons_before.get(text, 0)]
        if new:
            _remember_reasons(model, new)
        _note_attention_outside_graphs(owner, state, model, args, kwargs, new or _EAGER_REASONS.get(model, []))
    return owner.report
