"""The torch.compile backend and the Inductor pre-grad pass (``explain`` is :mod:`qattn_fx.explain`).

``torch.compile(model, backend=qattn_fx.backend(spec))`` hands every Dynamo graph to :class:`Backend`, which
rewrites its SDPA sites (:mod:`qattn_fx.fx.rewrite`) before AOT autograd and then delegates to Inductor (or
``aot_eager`` / ``eager`` for debugging). ``mode=`` and ``options=`` given to torch.compile are forwarded to
Inductor as config patches, as torch does for its own Inductor backend.

Progress goes to the ``qattn_fx`` logger: per graph, ``rewriting graph N: K SDPA sites`` before the rewrite and the
summary after it (INFO), one line per site (DEBUG), and how long Inductor took. ``TORCH_LOGS=qattn_fx`` shows the
INFO lines, ``TORCH_LOGS=+qattn_fx`` the DEBUG ones too (the logger is registered with ``torch._logging``); plain
``logging`` configuration works as well.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from .version import __version__
from .deployment import Target
from .fx import match, tracing
from .fx.rewrite import TimestepSource, rewrite
from .hardware import Hardware, detect
from .policy import rule_usage
from .report import Report, SiteRecord, debug_dir, emit_trace_artifacts, readable, write_dump, write_sparsity
from .serving import TRAINING
from .site import Site
from .spec import Spec
from .validate import finite_float, wrong_type

log = logging.getLogger("qattn_fx")


def _register_torch_log() -> None:
    """Let ``TORCH_LOGS=qattn_fx`` / ``+qattn_fx`` (and ``torch._logging.set_logs``'s registry) control the
    ``qattn_fx`` logger. torch reads ``TORCH_LOGS`` when it is imported, before this name exists, so the settings
    are read again when they name it."""
    try:
        from torch._logging import _internal
    except ImportError:  # pragma: no cover - torch without the logging registry: plain logging still works
        return
    _internal.register_log("qattn_fx", "qattn_fx")
    if "qattn_fx" in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()


_register_torch_log()

COMPILERS = ("inductor", "aot_eager", "eager")


_ARCH = "a Hardware or an arch such as 'sm_90' (a supported install of it)"


def _as_hardware(hardware: Hardware | str | None) -> Hardware | None:
    """``hardware=``: a :class:`Hardware`, an arch string (``"sm_90"``: :meth:`Hardware.supported_install`, as
    ``target=`` and ``calibrate(hardware=)`` read one) or ``None``."""
    if hardware is None or isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        return Hardware.supported_install(hardware)
    raise wrong_type("hardware", hardware, f"{_ARCH}, or None (this machine)")


def _check_target(target: Target) -> None:
    """``target=``: a :class:`Hardware`, an arch string, a non-empty list of them, or ``None``."""
    if target is None:
        return
    items = (target,) if isinstance(target, (Hardware, str)) else target
    if not isinstance(items, (list, tuple)):
        raise wrong_type("target", target, f"{_ARCH}, a list of them, or None")
    if not items:
        raise ValueError("target=[] is invalid; valid: a Hardware or an arch such as 'sm_90', a non-empty list of "
                         "them, or None (the archs of each recipe's backend)")
    for item in items:
        if isinstance(item, str):
            Hardware.for_arch(item)  # ValueError naming the valid form
        elif not isinstance(item, Hardware):
            raise wrong_type("target", item, f"{_ARCH}, a list of them, or None")


def _check_arguments(emulate: Any, compiler: Any, debug_dir: Any, timestep: Any, timestep_scale: Any) -> None:
    """``TypeError`` for an argument of the wrong Python type, ``ValueError`` for a bad value; each names what is
    accepted."""
    if not isinstance(emulate, bool):
        raise wrong_type("emulate", emulate, "True or False")
    if not isinstance(compiler, str):
        raise wrong_type("compiler", compiler, f"one of {', '.join(COMPILERS)}")
    if compiler not in COMPILERS:
        raise ValueError(f"compiler={compiler!r} is invalid; valid: {', '.join(COMPILERS)}")
    if debug_dir is not None and not isinstance(debug_dir, (str, os.PathLike)):
        raise wrong_type("debug_dir", debug_dir, "a str or Path naming a directory, or None")
    if not isinstance(timestep, str):
        raise wrong_type("timestep", timestep, "the name of the model's forward argument holding the timestep")
    if isinstance(timestep_scale, bool) or not isinstance(timestep_scale, (int, float)):
        raise wrong_type("timestep_scale", timestep_scale, "a number > 0")
    if not (finite_float(timestep_scale) and timestep_scale > 0):
        raise ValueError(f"timestep_scale={timestep_scale!r:.80} is invalid; valid: a finite number > 0 (1000 for "
                         "diffusers' num_train_timesteps, 1 when the pipeline passes t in [0, 1])")


class Backend:
    """A torch.compile backend that quantizes attention. ``.report`` lists every site it has compiled."""

    def __init__(self, spec: Spec | dict | str | Path | None = None, *, emulate: bool = False,
                 compiler: str = "inductor", debug_dir: str | Path | None = None,
                 hardware: Hardware | str | None = None, target: Target = None, timestep: str = "timestep",
                 timestep_scale: float = 1000.0):
        _check_arguments(emulate, compiler, debug_dir, timestep, timestep_scale)
        hardware = _as_hardware(hardware)
        _check_target(target)
        if target is not None and not emulate:
            raise ValueError("target= names where an emulated compile (emulate=True) would deploy; without "
                             "emulation use hardware= to resolve the sites for another machine")
        self.spec = Spec.coerce(spec)
        self.timestep = TimestepSource(timestep, timestep_scale)
        self.emulate = emulate
        self.target = target
        self.compiler = compiler
        self.debug_dir = debug_dir
        self.hardware = hardware
        self.report = Report()
        #: Every graph module this backend rewrote, in compile order (inspect them with ``qattn_fx.fx.printer``).
        self.graph_modules: list[fx.GraphModule] = []
        self._sites: list[Site] = []  # the policy's view of every site so far (for rule usage)
        self._graph_notes: list[str] = []  # per-graph notes (attention ops that are not sites)
        self._warned_rules: set[int] = set()

    # -- the pass ----------------------------------------------------------------------------------------------
    def rewrite(self, gm: fx.GraphModule, example_inputs=None) -> Report:
        """Rewrite ``gm`` in place; return (and append to ``self.report``) the sites of this graph. Whether autograd
        records a site is read from the graph per site (:func:`qattn_fx.fx.rewrite.records_autograd`), not from
        ``example_inputs`` or the grad mode now."""
        graph = len(self.graph_modules)
        self.graph_modules.append(gm)
        dump = debug_dir(self.debug_dir)
        before = readable(gm)
        if log.isEnabledFor(logging.INFO):
            log.info("qattn_fx: rewriting graph %d: %d SDPA sites", graph, len(match.find_sdpa(gm)))
        self._note_other_attention(gm, graph)
        outcomes = rewrite(gm, self.spec, hardware=self.hardware, emulate=self.emulate,
                           first_index=len(self.report.sites), target=self.target, timestep=self.timestep)
        sites = Report([SiteRecord.from_outcome(graph, o) for o in outcomes])
        for record, outcome in zip(sites.sites, outcomes):
            log.debug("qattn_fx: graph %d site %s (%s, layer %s, %s, q %s, kv %s): %s%s%s", graph, record.site,
                      record.module or "no module", record.layer, record.role, record.q_shape, record.kv_shape,
                      record.reason, f"; {record.deployment}" if record.deployment else "",
                      f"; inserted {', '.join(outcome.inserted)}" if outcome.inserted else "")
        self.report.sites.extend(sites.sites)
        self._sites.extend(o.site for o in outcomes)
        self._note_unused_rules()
        after = readable(gm)
        if sites.sites and not sites.quantized:
            log.warning("%s (graph %d): no attention site was quantized%s", sites.summary(), graph,
                        self._what_would_quantize(gm, sites))
        elif sites.sites and sites.deployed() and not any(done for done, _ in sites.deployed().values()):
            log.warning("%s (graph %d): without emulation the deployment would quantize none of them",
                        sites.summary(), graph)
        elif sites.sites:
            log.info("%s (graph %d)", sites.summary(), graph)
        emit_trace_artifacts(before, after, sites)
        if dump is not None:
            write_dump(dump, graph, before, after, sites, self.context(gm))
            log.info("qattn_fx: debug dump of graph %d written to %s", graph, dump)
        return sites

    def _what_would_quantize(self, gm: fx.GraphModule, sites: Report) -> str:
        """For the warning of a graph with no quantized site: what would quantize its sites, where that is the
        machine (no quantized kernel runs on it, ``emulate=True`` measures the recipes anyway) or grad mode (the
        quantized ops have no backward); ``""`` when neither applies."""
        hints = []
        arch = (self.hardware or _hardware_of(gm)).arch
        if not self.emulate and arch not in _kernel_archs():
            hints.append(f"no quantized kernel runs on {arch}: emulate=True runs the recipes on the reference kernel "
                         "to measure them")
        if any(s.reason == f"dense: {TRAINING}" for s in sites.sites):
            hints.append("the quantized attention ops have no backward: run the model under torch.no_grad() (or "
                         "torch.inference_mode()), as pipelines do")
        return f" ({'; '.join(hints)})" if hints else ""

    def _note_other_attention(self, gm: fx.GraphModule, graph: int) -> None:
        """A report-wide note (and a WARNING) for the calls of attention ops other than SDPA in ``gm``
        (:func:`qattn_fx.fx.match.other_attention`: flex attention, another library's op), which run as written."""
        others = Counter(match.find_other_attention(gm))
        if not others:
            return
        ops = ", ".join(f"{name} x{n}" for name, n in others.items())
        note = (f"graph {graph}: {sum(others.values())} call(s) of attention ops other than "
                f"scaled_dot_product_attention run as the model wrote them ({ops}): qattn_fx rewrites "
                "scaled_dot_product_attention only" + (f"; {tracing.MHA_HINT}" if tracing.MHA in others else ""))
        self._graph_notes.append(note)
        log.warning("qattn_fx: %s", note)

    def _note_unused_rules(self) -> None:
        """Report-wide notes (and one WARNING per rule) for rules that decided no site of any graph so far, after
        the graphs' own notes (:meth:`_note_other_attention`)."""
        notes = []
        graphs = len(self.graph_modules)
        if not self._sites:  # graphs without attention (a model's other compiled regions) say nothing of rules
            self.report.notes[:] = self._graph_notes
            return
        for index, decided, matched in rule_usage(self.spec, self._sites):
            if decided:
                continue
            rule = self.spec.rules[index - 1]
            what = ("matched no site" if not matched else
                    f"matched {matched} site(s), all decided by earlier rules")
            note = (f"rule {index} ({rule.match.describe()}) {what} of the {len(self._sites)} site(s) in "
                    f"{graphs} graph(s) compiled so far")
            notes.append(note)
            if index not in self._warned_rules:
                self._warned_rules.add(index)
                log.warning("qattn_fx: %s", note)
        self.report.notes[:] = self._graph_notes + notes

    def record_sparsity(self, measurement) -> Report:
        """Put measured Skip-Softmax sparsity (a :func:`qattn_fx.skip_softmax.measure` block around calls of the
        compiled model) into ``self.report`` and, with a debug directory, ``sparsity.json``; returns the report."""
        self.report.record_sparsity(measurement)
        dump = debug_dir(self.debug_dir)
        if dump is not None:
            write_sparsity(dump, self.report, measurement)
        return self.report

    def record_block_sparsity(self, measurement) -> Report:
        """Put measured block sparsity (a :func:`qattn_fx.block_sparse.measure` block around calls of the compiled
        model) into ``self.report`` and, with a debug directory, ``block_sparsity.json``; returns the report."""
        self.report.record_block_sparsity(measurement)
        dump = debug_dir(self.debug_dir)
        if dump is not None:
            write_sparsity(dump, self.report, measurement, blocks=True)
        return self.report

    def context(self, gm: fx.GraphModule | None = None) -> dict:
        hw = self.hardware or _hardware_of(gm)
        return {
            "spec": self.spec.to_dict(),
            "emulate": self.emulate,
            "target": None if self.target is None else repr(self.target),
            "compiler": self.compiler,
            "hardware": {"arch": hw.arch, "libraries": hw.libraries},
            "versions": {"qattn_fx": __version__, "torch": torch.__version__},
        }

    # -- the backend ---------------------------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs, **kwargs) -> Callable:
        """Rewrite ``gm`` and compile it. When compiling raises, this graph's sites leave the report again: Dynamo
        may restart its analysis (Inductor's ``RestartAnalysis`` for a float that became symbolic, e.g. diffusers'
        ``attn.scale`` under ``dynamic=True``) and call the backend once more for the same frame."""
        counts = len(self.graph_modules), len(self.report.sites), len(self._sites), len(self._graph_notes)
        self.rewrite(gm, example_inputs)
        try:
            return self.delegate(gm, example_inputs, **kwargs)
        except BaseException:
            del self.graph_modules[counts[0]:], self.report.sites[counts[1]:], self._sites[counts[2]:]
            del self._graph_notes[counts[3]:]
            self._note_unused_rules()
            raise

    def delegate(self, gm: fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict | None = None, **unknown) -> Callable:
        if unknown:
            raise TypeError(f"unexpected torch.compile arguments for qattn_fx: {sorted(unknown)}")
        if self.compiler == "eager":
            return gm.forward
        if self.compiler == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs, config_patches=inductor_config_patches(mode, options))
        log.info("qattn_fx: graph %d compiled by Inductor in %.1f s", len(self.graph_modules) - 1,
                 time.perf_counter() - start)
        return compiled


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """torch.compile's ``mode``/``options`` as Inductor config patches (what torch's own wrapper applies)."""
    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(mode))
    if options:
        patches.update(options)
    return patches


def _kernel_archs() -> set[str]:
    """The archs some quantized kernel of :data:`qattn_fx.recipes.TABLE` runs on (the reference kernel aside)."""
    from .recipes import TABLE

    return {arch for row in TABLE for req in row.implementations if req.kernel and req.archs for arch in req.archs}


def _placeholder_values(gm: fx.GraphModule) -> list:
    return [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]


def _hardware_of(gm: fx.GraphModule | None) -> Hardware:
    for value in _placeholder_values(gm) if gm is not None else ():
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return detect(value.device)
    return detect("cpu")


def backend(spec: Spec | dict | str | Path | None = None, *, emulate: bool = False, compiler: str = "inductor",
            debug_dir: str | Path | None = None, hardware: Hardware | str | None = None,
            target: Target = None, timestep: str = "timestep", timestep_scale: float = 1000.0) -> Backend:
    """A torch.compile backend that rewrites every SDPA per ``spec`` (default: the auto Sage INT8 spec).

    ``spec``: a :class:`Spec`, a mapping in any accepted format, JSON or YAML text (a ``str`` starting with ``{``
    or holding a newline), the path of a ``.json`` / ``.yaml`` / ``.yml`` file (any other ``str``, or a ``Path``),
    or ``None`` (:meth:`Spec.coerce`). Every bad argument raises when the backend is made: ``TypeError`` for a
    wrong Python type, ``ValueError`` for a bad value (a malformed spec, ``no such spec file: ...``, an unknown
    arch), each naming what is accepted.

    Without a supported GPU no kernel quantizes: on a CPU, ``emulate=True`` (and inference under
    ``torch.no_grad()``, as pipelines run: the quantized ops have no backward) measures the recipe.

    ``emulate=True`` runs every quantized site on the reference kernel (any device): measure a recipe's quality
    before deploying it. Each emulated site's report also says what it would run where it is meant to deploy
    (``SiteRecord.deployment``, e.g. ``on sm_100: dense (TRTLLM: head_dim 12 not in 128)``): ``target`` names
    that machine (a :class:`Hardware`, an arch such as ``"sm_90"`` for a supported install of it, or a list of
    them); by default the archs of the recipe's backend in the recipe table. ``compiler``: ``inductor``
    (default), ``aot_eager`` or ``eager``. ``debug_dir`` (or ``$QATTN_FX_DEBUG``) receives per-graph dumps.
    ``hardware`` is the machine the compiled sites run on (default: detected from the inputs): a
    :class:`Hardware`, or an arch such as ``"sm_90"`` for a supported install of it; set it to resolve for another
    GPU without emulation. ``timestep`` / ``timestep_scale``: where step schedules
    (``skip_softmax.disabled_until_timestep``) read the denoising timestep: the model's forward argument of that
    name, divided by ``timestep_scale`` to ``t`` in [0, 1] (:class:`~qattn_fx.fx.rewrite.TimestepSource`); it
    reaches the compiled graph as data, so a denoising loop compiles once.
    """
    return Backend(spec, emulate=emulate, compiler=compiler, debug_dir=debug_dir, hardware=hardware,
                   target=target, timestep=timestep, timestep_scale=timestep_scale)


# ------------------------------------------------------------------------------------------------------------------
# Inductor pre-grad pass (for stacks that own the torch.compile call)
# ------------------------------------------------------------------------------------------------------------------


def pre_grad_pass(spec: Spec | dict | str | Path | None = None, *, emulate: bool = False,
                  debug_dir: str | Path | None = None, hardware: Hardware | str | None = None, target: Target = None,
                  timestep: str = "timestep", timestep_scale: float = 1000.0):
    """The same rewrite as an Inductor ``pre_grad_custom_pass`` (a ``CustomGraphPass``).

    Use it where another stack calls ``torch.compile`` itself: ``torch._inductor.config.pre_grad_custom_pass =
    qattn_fx.pre_grad_pass(spec)`` (or :func:`install_pre_grad_pass`). The pass's ``.report`` lists its sites.

    The pass runs on every compile, before Inductor's compile caches are looked up, so ``.report`` lists every
    site whether or not a warm FX-graph / AOT-autograd cache serves the compiled graph, and the caches key on the
    rewritten graph (which holds every decision) and stay useful, as they do for :func:`backend`, which rewrites
    before handing the graph to Inductor. torch 2.11 runs pre-grad passes that way whatever they are. torch 2.13
    runs a pass with a ``uuid()`` after the cache lookup, only on a miss (its ``pre_grad_pass_timing`` "late"),
    so a warm cache would serve the graph without the pass and the report would miss its sites; there ``uuid()``
    returns None, which its default timing runs "early", before the lookup (setting ``pre_grad_pass_timing =
    "late"`` then makes torch refuse the pass). ``.key()`` names the pass's spec and settings (the uuid where
    torch takes one).
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    owner = Backend(spec, emulate=emulate, debug_dir=debug_dir, hardware=hardware, target=target, timestep=timestep,
                    timestep_scale=timestep_scale)
    package = Path(__file__).parent
    files = tuple(sorted(str(p) for p in package.rglob("*.py")))
    late_when_keyed = hasattr(torch._inductor.config, "pre_grad_pass_timing")

    class QattnPreGradPass(CustomGraphPass):
        report = owner.report
        backend = owner

        def __call__(self, graph: fx.Graph) -> None:
            gm = graph.owning_module
            if gm is None:
                raise RuntimeError("qattn_fx pre-grad pass needs a graph owned by a GraphModule")
            owner.rewrite(gm)

        def key(self) -> bytes:
            extra = repr((owner.spec.to_json(sort_keys=True), emulate, hardware, target, owner.timestep)).encode()
            return hashlib.sha256(get_hash_for_files(files) + extra).digest()

        def uuid(self) -> bytes | None:
            return None if late_when_keyed else self.key()

        def __copy__(self):  # one pass, one report: config copies (patching) share it
            return self

        def __deepcopy__(self, memo):
            return self

        def __reduce__(self):
            # torch 2.11 pickles Inductor's config, this pass included, into its FX-graph cache key: the pass
            # pickles as its key (a local class cannot pickle, and the cache was then bypassed)
            return _pre_grad_pass_from_pickle, (self.key(),)

    if late_when_keyed:
        _quiet_missing_uuid_warning(QattnPreGradPass)
    return QattnPreGradPass()


def _pre_grad_pass_from_pickle(key: bytes):
    """What a pickled :func:`pre_grad_pass` stands for in a cache key (its spec's key); never a pass again."""
    raise RuntimeError("a qattn_fx pre-grad pass is pickled only into cache keys; call qattn_fx.pre_grad_pass() "
                       "to make one")


def _quiet_missing_uuid_warning(cls: type) -> None:
    """torch 2.13 warns once per pass without a uuid that caching is bypassed and asks for one; for this pass the
    caches still serve (:func:`pre_grad_pass`), so the warning is marked as given."""
    try:
        from torch._inductor import codecache

        codecache._warned_pre_grad_pass_missing_uuid.add(cls.__qualname__)
    except (ImportError, AttributeError):  # pragma: no cover - a torch without that warning
        pass


def install_pre_grad_pass(spec=None, **kwargs):
    """Set ``torch._inductor.config.pre_grad_custom_pass`` to :func:`pre_grad_pass`; returns the pass."""
    p = pre_grad_pass(spec, **kwargs)
    torch._inductor.config.pre_grad_custom_pass = p
    return p
