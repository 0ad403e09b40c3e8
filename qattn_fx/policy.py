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

import fnmatch

from . import recipes
from .cost_rule import PREDICTED_SLOWER, cost_rule, is_auto
from .deployment import Target, deployment
from .hardware import Hardware, detect
from .recipes import AUTO, REFERENCE
from .serving import NO_DENSE_SKIP_KERNEL, candidates, first_serving, site_blocker, unmet, why_not
from .site import Decision, Site
from .spec import DENSE, AttentionSpec, Match, Spec, layer_selected


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


def _skip_calibrated(use: AttentionSpec, source: str) -> None:
    """``target_sparsity`` is served through a calibration only (the contract: :mod:`qattn_fx.skip_softmax`)."""
    skip = use.skip_softmax
    if skip is not None and skip.target_sparsity is not None:
        raise ValueError(
            f"{source} asks for skip_softmax.target_sparsity={skip.target_sparsity:g}, which needs a calibration: "
            "run qattn_fx.calibrate_skip_softmax(model, calls, target_sparsity=...) and compile with the spec it "
            "returns (a threshold per site), or give skip_softmax.threshold (λ) or threshold_scale_factor")


def _block_calibrated(use: AttentionSpec, source: str) -> None:
    """``block_sparse.target_sparsity`` is served through a calibration only (that turns it into a ``cdf`` or
    ``top_k`` per site)."""
    blocks = use.block_sparse
    if blocks is not None and blocks.target_sparsity is not None:
        raise ValueError(
            f"{source} asks for block_sparse.target_sparsity={blocks.target_sparsity:g}, which needs a calibration "
            "that turns it into a cdf or top_k per site: run qattn_fx.calibrate_block_sparse(model, calls, "
            "target_sparsity=...) and compile with the spec it returns, or give block_sparse.cdf (the predicted "
            "attention mass to keep, e.g. 0.9) or block_sparse.top_k (the fraction of key tiles to keep)")


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
    _block_calibrated(use, source)
    if site.lse and use.block_sparse is not None and not is_auto(use):  # auto keeps it dense, saying why (unmet)
        raise ValueError(
            f"{source} asks for {use.describe()} but site {site.name!r} ({site.module or 'no module'}) also returns "
            "its log-sum-exp (ring attention merges partial results by it), which block sparsity does not serve; "
            "give the site a rule without block_sparse (match its module), or use backend='auto' to keep it dense")
    skip, blocks = use.skip_softmax, use.block_sparse
    if emulate or use.backend == REFERENCE:
        how = "emulated" if emulate else "backend REFERENCE"
        why = unmet(recipes.REFERENCE_REQUIREMENTS, site, hardware, use)
        if why is not None:
            return Decision(False, f"dense: reference: {why}", recipe, None, None, source, notes)
        deploy = deployment(site, use, target) if emulate and use.backend != REFERENCE else None
        return Decision(True, f"quantized ({how}): {use.describe_recipe()} on reference ({hardware.arch})", recipe,
                        "reference", REFERENCE, source, notes, deploy, skip, block_sparse=blocks)
    found, reasons = first_serving(candidates(use), site, hardware, use)
    if found is not None:
        row, req = found
        dense, said = (cost_rule(req.kernel, site, hardware, blocks) if is_auto(use) and apply_cost_rule
                       else (False, None))
        if dense:
            return Decision(False, f"dense: {said}", recipe, None, None, source, notes, predicted_slower=said)
        slower = None
        if not is_auto(use):  # run as asked, but say where the cost data expect it to be slower than dense
            predicted, why = cost_rule(req.kernel, site, hardware, blocks)
            slower = why if predicted else None
            said = f"{PREDICTED_SLOWER}{why}; auto would keep it dense" if predicted else None
        return Decision(True, f"quantized: {use.describe_recipe()} on {req.kernel} ({hardware.arch})"
                        + (f"; {said}" if said else ""), recipe, req.kernel, row.backend, source, notes,
                        skip_softmax=skip, predicted_slower=slower, block_sparse=blocks)
    summary = why_not(reasons, grouped=False) if recipe is not None else NO_DENSE_SKIP_KERNEL
    what = use.describe()
    if is_auto(use):
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
