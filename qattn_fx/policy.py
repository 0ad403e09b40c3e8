"""Resolve a spec for one attention call site on one machine: dense or quantized, which recipe, which kernel, why.

``resolve(site, hardware, spec)`` walks:

1. the spec's rules in order (numbered from 1 in reasons) then its default → an attention spec or dense;
2. facts of the site that *no* quantized kernel serves (autograd on, dropout, causal, masks, non-float inputs)
   → dense, with the fact as the reason;
3. ``emulate=True`` (or backend ``REFERENCE``) → the reference kernel, on any device; an emulated site also says
   what its deployment target would do (:func:`deployment`: the same site resolved without emulation on the
   archs of the recipe's backend, or on an explicit ``target``), in ``Decision.deployment``;
4. otherwise the rows of :data:`qattn_fx.recipes.TABLE` that accept the recipe for the spec's backend, in table
   order, and each row's implementations: the first whose requirements the hardware and site meet wins.
   ``backend="auto"`` with no such row → dense with the reason; an explicit backend with no such row raises
   ``ValueError`` (never a silent switch to another backend);
5. the cost rule, for ``auto`` only (no pinned kernel): when the kernel found is predicted slower than dense
   attention at the site's shape (:func:`cost_rule`, :mod:`qattn_fx.cost`) → dense, with the prediction as the
   reason. Explicit backends and pinned kernels run what they name; where the cost rule would have kept the site
   dense, their reason says so (``...; slower than dense: gluon_sage predicted 0.94x ...; auto would keep it dense``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import cost, recipes
from .hardware import Hardware, detect
from .ops.canonical import KEY_MASKS, MASK_KINDS, unservable
from .recipes import AUTO, REFERENCE, Recipe, Requirements, SkipSoftmax
from .spec import DENSE, AttentionSpec, Match, Spec, layer_selected
from .validate import check_choice



@dataclass(frozen=True)
class Site:
    """One ``scaled_dot_product_attention`` call, as the policy sees it.

    Shapes are SDPA's operand shapes, usually ``(B, H, S, D)`` (also ``(N, S, E)`` or ``(..., H, S, D)``). Under
    dynamic shapes a size may be a ``SymInt``: comparing it (a rule's ``min_q_len``, a kernel's head dims) adds a
    guard to the compiled graph, so the decision is re-made when a later shape would change it.
    ``role``: ``self`` (q/k/v from the same tokens), ``cross`` (k/v from another source, e.g. text),
    ``joint`` (text and image tokens concatenated, MM-DiT). ``mask`` (:mod:`qattn_fx.ops.canonical`): ``none``,
    ``key_padding`` (boolean, per key, e.g. ``(B, 1, 1, Skv)``), ``key_bias`` (additive float, per key),
    ``bool`` / ``float`` (varying per query or head); ``mask_shape`` its shape.
    ``layer`` is the block index in ``num_layers`` sibling blocks; ``layer_shared`` marks a graph shared by many
    layers (regional compilation), where per-layer rules cannot be honoured. ``runtime_args`` names SDPA
    arguments that are values computed in the graph rather than constants (``scale``, ``dropout_p``); ``dropout``
    is then its value when known, else NaN. ``kv_dtypes``: K's and V's dtypes (``dtype`` is Q's).
    ``lse``: the call also returns the log-sum-exp of each query row (``aten._scaled_dot_product_flash_attention``
    / ``_cudnn_attention``, what ring attention merges partial results by); ``other_outputs``: the indices of its
    further outputs (backward bookkeeping) that the graph reads, which no quantized op produces. ``context``: how
    the operands reached this rank under context parallelism (:func:`qattn_fx.fx.match.context_parallel`), a note.
    ``mask_note``: how the pass read a mask it did not take as SDPA got it (a mask repeated over the heads, read
    per key: :mod:`qattn_fx.fx.masks`), a note; ``mask`` and ``mask_shape`` are then those of the mask as read.
    """

    name: str = "sdpa"
    module: str = ""
    layer: int | None = None
    num_layers: int | None = None
    role: str = "self"
    q_shape: tuple = ()
    k_shape: tuple = ()
    v_shape: tuple = ()
    dtype: torch.dtype = torch.bfloat16
    mask: str = "none"
    causal: bool = False
    dropout: float = 0.0
    scale: float | None = None
    enable_gqa: bool = False
    grad_enabled: bool = False
    layer_shared: bool = False
    mask_shape: tuple | None = None
    runtime_args: tuple[str, ...] = ()
    kv_dtypes: tuple | None = None
    lse: bool = False
    other_outputs: tuple[int, ...] = ()
    context: str | None = None
    mask_note: str | None = None

    def __post_init__(self) -> None:
        check_choice("site.mask", self.mask, MASK_KINDS)
        check_choice("site.role", self.role, ("self", "cross", "joint"))

    @property
    def head_dim(self) -> int | None:
        return self.q_shape[-1] if self.q_shape else None

    @property
    def v_head_dim(self) -> int | None:
        return self.v_shape[-1] if self.v_shape else self.head_dim

    @property
    def q_len(self) -> int | None:
        return self.q_shape[-2] if len(self.q_shape) >= 2 else None

    @property
    def kv_len(self) -> int | None:
        return self.k_shape[-2] if len(self.k_shape) >= 2 else None

    @property
    def gqa(self) -> bool:
        return len(self.q_shape) >= 4 and len(self.k_shape) >= 4 and self.q_shape[-3] != self.k_shape[-3]

    @classmethod
    def from_tensors(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> "Site":
        shape = lambda t: tuple(int(d) for d in t.shape)  # noqa: E731
        kwargs.setdefault("role", "self" if q.shape[2] == k.shape[2] else "cross")
        return cls(q_shape=shape(q), k_shape=shape(k), v_shape=shape(v), dtype=q.dtype, **kwargs)


@dataclass(frozen=True)
class Decision:
    """The outcome for one site. ``reason`` is one human line; ``source`` names the rule or the default.

    ``deployment`` (emulated sites only): what the site would run on the hardware it is meant for, e.g.
    ``on sm_90: gluon_sage; on sm_100: dense (TRTLLM: head_dim 12 not in 128)`` (:func:`deployment`).
    """

    quantized: bool
    reason: str
    recipe: Recipe | None = None
    kernel: str | None = None
    backend: str | None = None
    source: str = "default"
    notes: tuple[str, ...] = field(default=())
    deployment: str | None = None
    #: Skip-Softmax on top of the recipe (quantized sites only; :mod:`qattn_fx.skip_softmax`).
    skip_softmax: SkipSoftmax | None = None
    #: The cost rule's prediction where it expects the site's kernel to be slower than dense (:func:`cost_rule`),
    #: e.g. ``gluon_sage predicted 0.94x of cuDNN bf16 at Sq 3872, Skv 3872 (cost data: H200 2026-12-02)``: set on
    #: a site ``auto`` keeps dense for it and on a site an explicit backend or a pinned kernel runs anyway.
    predicted_slower: str | None = None


def module_matches(glob: str, site: Site) -> str | None:
    """How a module glob matches the site's module path: ``"path"``, ``"tail"`` or ``None`` (no match).

    A site whose graph is one block compiled alone (regional compilation, ``compile_repeated_blocks``) knows its
    path only inside the block (``attn2`` for ``blocks.3.attn2``). There the glob's last components are matched
    against that path (``blocks.*.attn2`` → ``attn2``), so a module rule means the same under whole-model and
    regional compilation; the decision's notes say so.
    """
    if fnmatch.fnmatchcase(site.module, glob):
        return "path"
    if site.layer is None and site.layer_shared and site.module:
        parts = site.module.split(".")
        tail = glob.split(".")[-len(parts):]
        if len(glob.split(".")) > len(parts) and fnmatch.fnmatchcase(site.module, ".".join(tail)):
            return "tail"
    return None


def match_site(match: Match, site: Site) -> bool:
    if match.role is not None and site.role not in match.role:
        return False
    if match.module is not None and module_matches(match.module, site) is None:
        return False
    if match.layers is not None:
        if site.layer is None or not layer_selected(match.layers, site.layer, site.num_layers):
            return False
    if match.head_dim is not None and site.head_dim not in match.head_dim:
        return False
    if match.min_q_len is not None and (site.q_len is None or site.q_len < match.min_q_len):
        return False
    if match.min_kv_len is not None and (site.kv_len is None or site.kv_len < match.min_kv_len):
        return False
    return True


def select(spec: Spec, site: Site) -> tuple[object, str, tuple[str, ...]]:
    """(attention spec or ``"dense"``, which rule/default chose it, notes on rules that could not apply)."""
    notes = []
    for i, rule in enumerate(spec.rules, start=1):
        if rule.match.layers is not None and site.layer is None and site.layer_shared:
            notes.append(
                f"rule {i} ({rule.match.describe()}) cannot be honoured: the site has no layer index (its graph is "
                "one block compiled alone and reused by every layer, or a nested subgraph shared by several "
                "layers), so per-layer rules are not applied to it"
            )
            continue
        if match_site(rule.match, site):
            if rule.match.module is not None and module_matches(rule.match.module, site) == "tail":
                notes.append(f"rule {i}: module glob {rule.match.module!r} matched against the path's tail "
                             f"{site.module!r} (the site's graph is one block compiled alone, so its path starts "
                             "inside the block)")
            return rule.use, f"rule {i} ({rule.match.describe()})", tuple(notes)
    return spec.default, "default", tuple(notes)


def rule_usage(spec: Spec, sites: list[Site]) -> list[tuple[int, int, int]]:
    """Per rule (numbered from 1): ``(index, sites it decided, sites it matched)`` over ``sites``.

    A rule that matched sites but decided none was shadowed by an earlier rule.
    """
    decided = [0] * len(spec.rules)
    matched = [0] * len(spec.rules)
    for site in sites:
        _, source, _ = select(spec, site)
        for i, rule in enumerate(spec.rules):
            if match_site(rule.match, site):
                matched[i] += 1
            if source.startswith(f"rule {i + 1} ("):
                decided[i] += 1
    return [(i + 1, decided[i], matched[i]) for i in range(len(spec.rules))]


#: Why a site of a training graph (autograd enabled) stays dense.
TRAINING = "autograd is enabled (training graph); the quantized attention ops have no backward"


def _runtime_dropout(site: Site) -> str:
    known = "not known at compile time" if site.dropout != site.dropout else f"{site.dropout} when compiled"
    return f"dropout_p is a value computed in the graph ({known}); quantized kernels do not implement dropout"


def site_blocker(site: Site) -> str | None:
    """A fact of the site that no quantized kernel in qattn_fx serves, or None (what each kernel takes is
    :func:`unmet`'s question)."""
    if site.grad_enabled:
        return TRAINING
    if "dropout_p" in site.runtime_args:
        return _runtime_dropout(site)
    if site.dropout:
        return f"dropout_p={site.dropout} > 0; quantized kernels do not implement dropout"
    if site.causal:
        return "is_causal=True; qattn_fx's quantized attention ops are non-causal"
    if site.mask == "float":
        shape = f" of shape {tuple(site.mask_shape)}" if site.mask_shape is not None else ""
        return f"attn_mask is a float bias{shape} that varies per query or head; per-key biases are served"
    if site.mask == "bool":
        shape = f" of shape {tuple(site.mask_shape)}" if site.mask_shape is not None else ""
        return f"attn_mask is a boolean mask{shape} that varies per query or head; per-key masks are served"
    if not site.dtype.is_floating_point:
        return f"inputs are {site.dtype}, not floating point"
    if site.kv_dtypes is not None and any(d != site.dtype for d in site.kv_dtypes):
        return f"q, k, v dtypes differ ({site.dtype}, {', '.join(map(str, site.kv_dtypes))})"
    if site.q_shape and site.k_shape and site.v_shape:
        why = unservable(site.q_shape, site.k_shape, site.v_shape, site.mask_shape, site.enable_gqa)
        if why is not None:
            return why
    if site.kv_len == 0:
        return "zero-length keys"
    if site.lse and site.other_outputs:
        return (f"the graph reads outputs {', '.join(map(str, site.other_outputs))} of the LSE attention op "
                "(backward bookkeeping); the quantized ops return the output and the LSE only")
    if site.lse and len(site.q_shape) != 4:
        return f"{len(site.q_shape)}-D operands of an LSE attention op; 4-D (B, H, S, D) are served"
    return None


def unmet(req: Requirements, site: Site, hardware: Hardware, use: AttentionSpec) -> str | None:
    """Why implementation ``req`` cannot serve ``site`` on ``hardware`` (None: it can)."""
    if req.kernel is None:
        return "no kernel in qattn_fx (emulate=True to measure it)"
    if req.archs is not None and (hardware.device != "cuda" or hardware.arch not in req.archs):
        return f"needs {'/'.join(req.archs)}, have {hardware.arch}"
    if req.library is not None and not hardware.has_library(*req.library):
        have = hardware.libraries.get(req.library[0], "none")
        return f"needs {req.library[0]} >= {req.library[1]}, have {have}"
    if not req.head_dims.accepts(site.head_dim):
        return f"head_dim {site.head_dim} not in {req.head_dims.describe()}"
    if site.v_head_dim != site.head_dim and not req.head_dims.accepts(site.v_head_dim):
        return f"V head_dim {site.v_head_dim} not in {req.head_dims.describe()}"
    if site.dtype not in req.dtypes:
        return f"inputs are {site.dtype}, not {'/'.join(str(d).removeprefix('torch.') for d in req.dtypes)}"
    if site.mask in KEY_MASKS and not req.key_bias:
        return f"no masks ({site.mask} attn_mask)"
    if site.lse and not req.lse:
        return "returns no LSE (the call's log-sum-exp, which ring attention merges by)"
    if site.lse and use.skip_softmax is not None:
        return "no skip-softmax with LSE (the call's log-sum-exp, which ring attention merges by)"
    if site.lse and use.recipe is not None and use.recipe.family != "scaled":
        return (f"no LSE op for {use.recipe.qk_dtype} Q/K, {use.recipe.v_dtype} V (LSE calls are served for "
                "int8/fp8/bf16 Q/K with fp8 V)")
    if site.role == "cross" and not req.cross_attention:
        return "no cross-attention"
    if site.gqa and not req.gqa:
        return "no GQA"
    if req.self_attention_only_equal_shapes and site.q_shape != site.k_shape:
        return "needs equal Q/K/V shapes (self-attention)"
    m = req.seq_multiple_of
    if m > 1 and any(n is None or n % m for n in (site.q_len, site.kv_len)):
        return f"sequence lengths must be multiples of {m}"
    if use.skip_softmax is not None and not req.skip_softmax:
        return "no skip-softmax"
    return None


def _candidates(use: AttentionSpec) -> tuple[tuple[recipes.Row, Requirements], ...]:
    """The (row, implementation) pairs that may serve ``use``, in ``auto`` preference order (none for bf16 +
    skip-softmax, ``recipe=None``: no kernel in qattn_fx runs it; :data:`NO_DENSE_SKIP_KERNEL`)."""
    if use.recipe is None:
        return ()
    rows = recipes.matching_rows(use.backend, use.recipe)
    return tuple((row, req) for row in rows for req in row.implementations
                 if use.kernel is None or req.kernel == use.kernel)  # the spec may pin one implementation


def _first_serving(candidates, site: Site, hardware: Hardware, use: AttentionSpec):
    """(the first (row, implementation) that serves ``site`` on ``hardware`` or None, why each one before it
    cannot: ``(backend, why)`` pairs in order, without repeats; where a backend's kernels fail for different
    reasons, each reason names its kernel: ``needs sm_90, have sm_103 (gluon_sage)``)."""
    failures: list[tuple[str, str, str]] = []
    for row, req in candidates:
        why = unmet(req, site, hardware, use)
        if why is None:
            return (row, req), ()
        failures.append((row.backend, req.kernel, why))
    kernels: dict[str, set[str]] = {}
    whys: dict[str, set[str]] = {}
    for backend, kernel, why in failures:
        kernels.setdefault(backend, set()).add(kernel)
        whys.setdefault(backend, set()).add(why)
    named = {backend for backend in whys if len(whys[backend]) > 1 and len(kernels[backend]) > 1}
    return None, tuple(dict.fromkeys((backend, f"{why} ({kernel})" if backend in named else why)
                                     for backend, kernel, why in failures))


def _why_not(reasons: tuple[tuple[str, str], ...], *, grouped: bool) -> str:
    """``"TRITON: needs sm_90, have cpu (gluon_sage); needs sm_89/sm_90, have cpu (triton_sage); TRTLLM: ..."``
    (a label once for its clauses in a row), or with ``grouped`` one clause per distinct reason (``"TRTLLM,
    TRTLLM_ATTN: head_dim 12 not in 128"``)."""
    if grouped:
        by_why: dict[str, list[str]] = {}
        for backend, why in reasons:
            by_why.setdefault(why, []).append(backend)
        reasons = tuple((", ".join(backends), why) for why, backends in by_why.items())
    clauses, label = [], None
    for backends, why in reasons:
        clauses.append(why if backends == label else f"{backends}: {why}")
        label = backends
    return "; ".join(clauses)


#: Why no kernel serves ``recipe=None`` (bf16 attention + Skip-Softmax).
NO_DENSE_SKIP_KERNEL = ("no kernel in qattn_fx runs bf16 attention with skip-softmax (trtllm-gen's dense FMHA is not "
                        "wired); give a recipe (e.g. vLLM-Omni 'quant') to run it quantized, or emulate=True to "
                        "measure it on the reference kernel")


def _skip_calibrated(use: AttentionSpec, source: str) -> None:
    """``target_sparsity`` is served through a calibration only (the contract: :mod:`qattn_fx.skip_softmax`)."""
    skip = use.skip_softmax
    if skip is not None and skip.target_sparsity is not None:
        raise ValueError(
            f"{source} asks for skip_softmax.target_sparsity={skip.target_sparsity:g}, which needs a calibration: "
            "run qattn_fx.calibrate_skip_softmax(model, calls, target_sparsity=...) and compile with the spec it "
            "returns (a threshold per site), or give skip_softmax.threshold (λ) or threshold_scale_factor")


#: ``auto`` keeps a site dense when the kernel it would pick is predicted to be less than this many times as fast as
#: dense attention (torch SDPA on cuDNN, bf16) at the site's shape: :func:`cost_rule`, :mod:`qattn_fx.cost`.
MIN_PREDICTED_SPEEDUP = 1.0
#: How the reason of a site that an explicit backend or a pinned kernel quantizes, but :func:`cost_rule` would keep
#: dense, gives the prediction (after the kernel; the prediction itself is :attr:`Decision.predicted_slower`).
PREDICTED_SLOWER = "slower than dense: "


def _auto(use: AttentionSpec) -> bool:
    """``use`` lets the policy choose (backend ``auto``, no pinned kernel): nothing raises, the cost rule applies."""
    return use.backend == AUTO and use.kernel is None


def _static(size) -> int | None:
    """``size`` as an int when it is one at compile time, else None; a symbolic size is read, never guarded on."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    return node.maybe_as_int() if node is not None else None


def cost_rule(kernel: str, site: Site, hardware: Hardware) -> tuple[bool, str | None]:
    """Whether ``auto`` keeps ``site`` dense instead of running ``kernel`` on ``hardware``, and what to say.

    * ``(True, "gluon_sage predicted 0.90x of cuDNN bf16 at Sq 4608, Skv 4608 (cost data: H200 2026-12-02)")``:
      the predicted speedup (:func:`qattn_fx.cost.predict`) is below :data:`MIN_PREDICTED_SPEEDUP`, or an upper
      bound that does not exceed it (:func:`qattn_fx.cost.no_gain`); ``at most`` marks an upper bound (a length below
      the measured ones, or the query length not known);
    * ``(False, "no prediction: symbolic lengths")``: the lengths are symbolic (dynamic shapes) and what is static
      (a key length alone bounds the speedup) does not predict a loss. Nothing here guards on a symbolic size, so
      the decision neither adds a recompile nor depends on the sizes of the call that compiled the graph;
    * ``(False, None)``: predicted at least :data:`MIN_PREDICTED_SPEEDUP`, or no cost data for (kernel, arch).
    """
    q_len, kv_len, head_dim = _static(site.q_len), _static(site.kv_len), _static(site.head_dim)
    leading = [_static(n) for n in site.q_shape[:-2]]
    batch_heads = math.prod(leading) if None not in leading else None
    if (kernel, hardware.arch) not in cost.covered() or 0 in (q_len, batch_heads):  # an empty call costs nothing
        return False, None
    symbolic = (False, "no prediction: symbolic lengths")
    if kv_len is None or head_dim is None:
        return symbolic
    prediction = cost.predict(kernel, hardware.arch, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                              batch_heads=batch_heads)
    if cost.no_gain(prediction.speedup, prediction.upper_bound, MIN_PREDICTED_SPEEDUP):
        bound = "at most " if prediction.upper_bound else ""
        q = "symbolic" if q_len is None else q_len
        return True, (f"{kernel} predicted {bound}{prediction.speedup:.2f}x of cuDNN bf16 at Sq {q}, Skv {kv_len} "
                      f"(cost data: {prediction.data})")
    return symbolic if q_len is None or batch_heads is None else (False, None)


Target = Hardware | str | Sequence[Hardware | str] | None


def deployment_targets(use: AttentionSpec) -> tuple[str, ...]:
    """The architectures a recipe of ``use`` is meant for: one per implementation of the rows of ``use.backend``
    that accept the recipe, skipping an implementation whose archs an earlier one already covers (TRTLLM →
    ``sm_100``; TRITON → ``sm_90``; CUDNN fp8 → ``sm_100``, ``sm_90``; ``auto`` int8 → ``sm_90``, ``sm_100``)."""
    archs: list[str] = []
    for _, req in _candidates(use):
        if req.archs is None or any(a in archs for a in req.archs):
            continue
        archs.append(req.archs[0])
    return tuple(archs)


def _target_hardware(target: Target, use: AttentionSpec) -> tuple[Hardware, ...]:
    if target is None:
        target = deployment_targets(use)
    if isinstance(target, (Hardware, str)):
        target = (target,)
    return tuple(t if isinstance(t, Hardware) else Hardware.supported_install(t) for t in target)


def deployment(site: Site, use: AttentionSpec, target: Target = None) -> str:
    """What ``site`` would run, without emulation, on each deployment target: ``target`` (a :class:`Hardware`, an
    arch such as ``"sm_90"`` for a supported install of it, or a sequence of them) or, by default, the archs the
    recipe's backend is meant for (:func:`deployment_targets`, each with a supported install).

    One clause per target: ``on sm_90: gluon_sage``, ``on sm_100: dense (TRTLLM: head_dim 12 not in 128)`` for
    ``auto``, ``on sm_100: error (...)`` for an explicit backend (which raises where it cannot run). A float32
    site (a CPU model) is judged as bf16, as GPUs run it, and the text starts with ``(as bf16)``.
    """
    if use.recipe is None:
        return "no kernel in qattn_fx runs bf16 + skip-softmax (trtllm-gen's dense FMHA, sm_100, is not wired)"
    as_bf16 = site.dtype == torch.float32
    if as_bf16:
        site = dataclasses.replace(site, dtype=torch.bfloat16,
                                   kv_dtypes=None if site.kv_dtypes is None else (torch.bfloat16,) * 2)
    candidates = _candidates(use)
    clauses = []
    for hardware in _target_hardware(target, use):
        here = tuple((row, req) for row, req in candidates if req.archs is not None and hardware.arch in req.archs)
        found, reasons = _first_serving(here, site, hardware, use)
        if found is not None:
            kernel = found[1].kernel
            dense, said = cost_rule(kernel, site, hardware) if _auto(use) else (False, None)
            clauses.append(f"on {hardware.arch}: " + ("dense" if dense else kernel) + (f" ({said})" if said else ""))
            continue
        outcome = "dense" if _auto(use) else "error"
        why = _why_not(reasons, grouped=True) or f"no {use.backend} kernel for {hardware.arch}"
        clauses.append(f"on {hardware.arch}: {outcome} ({why})")
    return ("(as bf16) " if as_bf16 else "") + "; ".join(clauses)


def resolve(site: Site, hardware: Hardware | None = None, spec: Spec | None = None, *,
            emulate: bool = False, target: Target = None, apply_cost_rule: bool = True) -> Decision:
    """Decide how ``site`` runs on ``hardware`` (default: this machine) under ``spec`` (default: :class:`Spec`).

    ``emulate=True``: every quantized site runs on the reference kernel, and ``Decision.deployment`` says what it
    would run on ``target`` (default: the archs of the recipe's backend; see :func:`deployment`).
    ``apply_cost_rule=False``: ``auto`` runs the kernel it finds even where :func:`cost_rule` predicts it slower than
    dense (``qattn_fx.calibrate`` measures that kernel's error and weighs the same prediction itself).
    """
    spec = Spec() if spec is None else spec
    hardware = detect() if hardware is None else hardware
    use, source, notes = select(spec, site)
    if use == DENSE:
        return Decision(False, f"dense: {source}", source=source, notes=notes)
    blocker = site_blocker(site)
    if blocker is not None:
        return Decision(False, f"dense: {blocker}", source=source, notes=notes)
    recipe = use.recipe
    if recipe is not None and recipe.qk_dtype == "nvfp4" and site.head_dim % 16:
        why = f"nvfp4 Q/K needs head_dim % 16 == 0, got {site.head_dim}"
        if use.backend != AUTO:  # an explicit backend never falls back silently
            raise ValueError(f"{source} asks for {use.describe()} but site {site.name!r} "
                             f"({site.module or 'no module'}) cannot run it: {why}")
        return Decision(False, f"dense: {why}", source=source, notes=notes)
    _skip_calibrated(use, source)
    skip = use.skip_softmax
    if emulate or use.backend == REFERENCE:
        how = "emulated" if emulate else "backend REFERENCE"
        why = unmet(recipes.REFERENCE_REQUIREMENTS, site, hardware, use)
        if why is not None:
            return Decision(False, f"dense: reference: {why}", recipe, None, None, source, notes)
        deploy = deployment(site, use, target) if emulate and use.backend != REFERENCE else None
        return Decision(True, f"quantized ({how}): {use.describe_recipe()} on reference ({hardware.arch})", recipe,
                        "reference", REFERENCE, source, notes, deploy, skip)
    found, reasons = _first_serving(_candidates(use), site, hardware, use)
    if found is not None:
        row, req = found
        dense, said = cost_rule(req.kernel, site, hardware) if _auto(use) and apply_cost_rule else (False, None)
        if dense:
            return Decision(False, f"dense: {said}", recipe, None, None, source, notes, predicted_slower=said)
        slower = None
        if not _auto(use):  # run as asked, but say where the cost data expect it to be slower than dense
            predicted, why = cost_rule(req.kernel, site, hardware)
            slower = why if predicted else None
            said = f"{PREDICTED_SLOWER}{why}; auto would keep it dense" if predicted else None
        return Decision(True, f"quantized: {use.describe_recipe()} on {req.kernel} ({hardware.arch})"
                        + (f"; {said}" if said else ""), recipe, req.kernel, row.backend, source, notes,
                        skip_softmax=skip, predicted_slower=slower)
    summary = _why_not(reasons, grouped=False) if recipe is not None else NO_DENSE_SKIP_KERNEL
    what = use.describe()
    if _auto(use):
        return Decision(False, f"dense: no kernel serves {what} here ({summary})", recipe, None, None, source, notes)
    if use.kernel is not None:  # a pinned kernel never falls back, whatever the backend
        raise ValueError(
            f"{source} asks for {what} but kernel {use.kernel!r} cannot serve site {site.name!r} "
            f"({site.module or 'no module'}) on {hardware.arch}: {summary}. Remove 'kernel' to let the backend "
            "pick what runs here")
    raise ValueError(
        f"{source} asks for {what} but backend {use.backend!r} cannot serve site {site.name!r} "
        f"({site.module or 'no module'}) on {hardware.arch}: {summary}. Use backend='auto' to pick what runs "
        "here, or emulate=True to measure the recipe with the reference kernel"
    )
