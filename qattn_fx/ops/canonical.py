"""Which SDPA call forms the attention ops serve, and how each maps onto their canonical form.

``F.scaled_dot_product_attention`` takes ``(N, S, E)``, ``(B, H, S, D)`` or ``(..., H, S, D)`` operands whose batch
dims broadcast, key heads that divide the query heads (``enable_gqa``) or broadcast (one side has 1 head), and masks
of any shape that broadcasts to ``(..., Hq, Sq, Skv)``. The ``qattn`` attention ops take one canonical form:
``(B, H, S, D)`` operands with one batch size, ``Hq % Hkv == 0``, and at most a per-key logit bias ``(B|1, Skv)``.

This module is the single definition of the mapping. :func:`unservable` says why a call cannot be mapped (the
policy keeps such a site dense with that reason); :func:`plan` gives the steps that map one that can
(:mod:`qattn_fx.ops.lowering` emits them, eagerly or as graph nodes); :func:`mask_kind` classifies masks. Shapes
may hold symbolic sizes: comparisons of two different symbols become guards of the compiled graph (the decision
is then re-checked for the next shape), and no rule here depends on a length's value.

Mask kinds: ``none``; ``key_padding`` (boolean, masks keys only: every query and head sees the same keys) and
``key_bias`` (additive float, per key only) — both served as a key bias; ``bool`` and ``float`` (vary per
query or head) — not served.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK_KINDS = ("none", "key_padding", "key_bias", "bool", "float")
#: Mask kinds the ops serve (as a per-key logit bias).
KEY_MASKS = ("key_padding", "key_bias")
SERVED_RANKS = "3-D (N, S, E), 4-D (B, H, S, D) and higher (..., H, S, D)"


def _fmt(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def mask_kind(mask_shape: tuple | None, is_bool: bool, ndim: int) -> str:
    """The kind of an ``attn_mask`` of ``mask_shape`` for ``ndim``-D operands (``None``: no mask).

    A mask is per-key when it is 1 (or absent) along the query axis (-2) and, for operands of 4 or more dims, the
    head axis (-3): then every query of every head sees the same bias of its keys.
    """
    if mask_shape is None:
        return "none"
    per_key = (len(mask_shape) < 2 or mask_shape[-2] == 1) and (
        ndim < 4 or len(mask_shape) < 3 or mask_shape[-3] == 1)
    if per_key and len(mask_shape) <= ndim:
        return "key_padding" if is_bool else "key_bias"
    return "bool" if is_bool else "float"


def _batch(shape: tuple, ndim: int) -> object:
    """The batch size of an operand or mask of the call (1 where it has no batch dim)."""
    if ndim == 3:
        return shape[0] if len(shape) == 3 else 1
    return shape[-4] if len(shape) >= 4 else 1


def unservable(q_shape: tuple, k_shape: tuple, v_shape: tuple, mask_shape: tuple | None,
               enable_gqa: bool) -> str | None:
    """Why the call cannot be mapped onto the canonical form (``None``: it can).

    The mask is only looked at for its batch dim and rank here; whether its kind is served is the policy's
    question (:data:`KEY_MASKS`).
    """
    nd = len(q_shape)
    if len(k_shape) != nd or len(v_shape) != nd:
        return f"q, k, v have {nd}, {len(k_shape)}, {len(v_shape)} dims; the ops need equal ranks"
    if nd < 3:
        return f"{nd}-D operands; qattn_fx serves {SERVED_RANKS}"
    if q_shape[-1] != k_shape[-1]:
        return f"q and k head dims differ ({q_shape[-1]} vs {k_shape[-1]})"
    if k_shape[-2] != v_shape[-2]:
        return f"k and v lengths differ ({k_shape[-2]} vs {v_shape[-2]})"
    if mask_shape is not None and len(mask_shape) > nd:
        return f"attn_mask has {len(mask_shape)} dims for {nd}-D operands"
    if nd > 4:
        if mask_shape is not None:
            return f"attn_mask with {nd}-D operands; masks are served with 3-D and 4-D operands"
        if not (tuple(q_shape[:-3]) == tuple(k_shape[:-3]) == tuple(v_shape[:-3])):
            return (f"leading dims of {nd}-D operands differ (q {_fmt(q_shape)}, k {_fmt(k_shape)}, "
                    f"v {_fmt(v_shape)}); they are served when equal")
    batches = [_batch(s, nd) for s in (q_shape, k_shape, v_shape)]
    if mask_shape is not None:
        batches.append(_batch(mask_shape, nd))
    full = max(batches)
    if any(b != 1 and b != full for b in batches):
        return f"batch sizes {', '.join(map(str, batches))} (q, k, v, mask) do not broadcast"
    if nd >= 4:
        hq, hk, hv = q_shape[-3], k_shape[-3], v_shape[-3]
        if hk != hv:
            return f"k and v head counts differ ({hk} vs {hv})"
        if hq != hk and not enable_gqa and hk != 1:  # heads broadcast where one side has 1
            if hq == 1:
                return (f"1 query head and {hk} key heads: SDPA broadcasts the query head (the output has {hk} "
                        "heads); the ops need query heads that are a multiple of the key heads")
            return (f"{hq} query heads and {hk} key heads without enable_gqa: neither is 1, so they do not "
                    "broadcast (SDPA itself rejects it)")
        if hq % hk:
            return f"{hq} query heads are not a multiple of {hk} key heads (SDPA with enable_gqa rejects it too)"
    return None


@dataclass(frozen=True)
class Plan:
    """The steps that map a servable call onto the canonical form (see :func:`plan`).

    ``add_head_dim``: 3-D operands get a head dim of 1 (``unsqueeze(-3)``), removed from the output after;
    ``flatten_batch``: operands of ``ndim > 4`` have their leading dims flattened into one batch dim
    (restored on the output); ``expand_batch``: which of q, k, v (and the mask) have batch 1 where the call's
    batch is larger (expanded, a view); ``batch``: that batch size.
    """

    ndim: int
    add_head_dim: bool
    flatten_batch: bool
    expand_batch: tuple[bool, bool, bool]
    batch: object

    @property
    def identity(self) -> bool:
        return not (self.add_head_dim or self.flatten_batch or any(self.expand_batch))


def plan(q_shape: tuple, k_shape: tuple, v_shape: tuple, mask_shape: tuple | None, enable_gqa: bool) -> Plan:
    """The canonical-form steps for a call; raises ``ValueError`` with :func:`unservable`'s reason if none."""
    why = unservable(q_shape, k_shape, v_shape, mask_shape, enable_gqa)
    if why is not None:
        raise ValueError(f"this SDPA call cannot run on the qattn ops: {why}")
    nd = len(q_shape)
    batches = [_batch(s, nd) for s in (q_shape, k_shape, v_shape)]
    if mask_shape is not None:
        batches.append(_batch(mask_shape, nd))
    full = max(batches)
    expand = tuple(b == 1 and full != 1 for b in batches[:3])
    return Plan(nd, nd == 3, nd > 4, expand, full)
