"""One attention call site as the policy sees it (:class:`Site`) and the policy's outcome for it (:class:`Decision`).

Both are public as ``qattn_fx.Site`` / ``qattn_fx.Decision``; :func:`qattn_fx.policy.resolve` maps one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ops.canonical import MASK_KINDS
from .recipes import BlockSparse, Recipe, SkipSoftmax
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
class DeploymentClause:
    """What a site would run on one deployment target: ``kernel`` (None where it stays dense or the explicit
    backend fails there), ``outcome`` (``"kernel"``, ``"dense"`` or ``"error"``) and ``detail`` (the cost rule's
    prediction or why not). ``str()``: ``on sm_90: gluon_sage``, ``on sm_100: dense (TRTLLM: head_dim 12 not in
    128)``."""

    arch: str
    outcome: str
    kernel: str | None = None
    detail: str = ""

    @property
    def quantized(self) -> bool:
        return self.outcome == "kernel"

    def __str__(self) -> str:
        return f"on {self.arch}: {self.kernel if self.quantized else self.outcome}" + (
            f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class Deployment:
    """What an emulated site would run where its recipe is meant to deploy (:func:`qattn_fx.deployment.deployment`):
    one :class:`DeploymentClause` per target; ``as_bf16``: a float32 site (a CPU model) judged as bf16, as GPUs
    run it; ``note``: why no target applies (then ``clauses`` is empty). ``str()``: ``(as bf16) on sm_90:
    gluon_sage; on sm_100: dense (...)``."""

    clauses: tuple[DeploymentClause, ...] = ()
    as_bf16: bool = False
    note: str = ""

    def __str__(self) -> str:
        return ("(as bf16) " if self.as_bf16 else "") + ("; ".join(map(str, self.clauses)) or self.note)


@dataclass(frozen=True)
class Decision:
    """The outcome for one site. ``reason`` is one human line; ``source`` names the rule or the default.

    ``deployment`` (emulated sites only): what the site would run on the hardware it is meant for, e.g.
    ``on sm_90: gluon_sage; on sm_100: dense (TRTLLM: head_dim 12 not in 128)`` as text (:class:`Deployment`).
    """

    quantized: bool
    reason: str
    recipe: Recipe | None = None
    kernel: str | None = None
    backend: str | None = None
    source: str = "default"
    notes: tuple[str, ...] = field(default=())
    deployment: Deployment | None = None
    #: Skip-Softmax on top of the recipe (quantized sites only; :mod:`qattn_fx.skip_softmax`).
    skip_softmax: SkipSoftmax | None = None
    #: The cost rule's prediction where it expects the site's kernel to be slower than dense (:func:`cost_rule`),
    #: e.g. ``gluon_sage predicted 0.94x of cuDNN bf16 at Sq 3872, Skv 3872 (cost data: H200 2026-12-02)``: set on
    #: a site ``auto`` keeps dense for it and on a site an explicit backend or a pinned kernel runs anyway.
    predicted_slower: str | None = None
    #: Block sparsity on top of the recipe (quantized sites only; :mod:`qattn_fx.block_sparse`): the blocks the
    #: site visits are predicted in the graph before the attention op. Set only where the spec asked for it.
    block_sparse: BlockSparse | None = None
