"""Which kernel serves a site: the facts of a site that no quantized kernel serves (:func:`site_blocker`), why one
implementation cannot serve it (:func:`unmet`), and the first of a spec's candidate implementations that can
(:func:`candidates`, :func:`first_serving`), with the reasons of those that cannot (:func:`why_not`).
"""

from __future__ import annotations

from . import recipes
from .hardware import Hardware
from .kernels import names_with
from .ops.canonical import KEY_MASKS, unservable
from .recipes import Requirements
from .site import Site
from .spec import AttentionSpec


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
    if site.lse and use.block_sparse is not None:
        return "no block sparsity with LSE (the call's log-sum-exp, which ring attention merges by)"
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
    if use.block_sparse is not None and not req.block_sparse:
        return f"no block sparsity (kernels with it: {names_with('block_sparse')})"
    return None


def candidates(use: AttentionSpec) -> tuple[tuple[recipes.Row, Requirements], ...]:
    """The (row, implementation) pairs that may serve ``use``, in ``auto`` preference order (none for bf16 +
    skip-softmax, ``recipe=None``: no kernel in qattn_fx runs it; :data:`NO_DENSE_SKIP_KERNEL`)."""
    if use.recipe is None:
        return ()
    rows = recipes.matching_rows(use.backend, use.recipe)
    return tuple((row, req) for row in rows for req in row.implementations
                 if use.kernel is None or req.kernel == use.kernel)  # the spec may pin one implementation


def first_serving(candidates, site: Site, hardware: Hardware, use: AttentionSpec):
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


def why_not(reasons: tuple[tuple[str, str], ...], *, grouped: bool) -> str:
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
