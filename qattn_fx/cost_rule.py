"""``auto``'s cost rule: keep a site dense where the kernel it would run is predicted slower than dense attention
(:func:`cost_rule`, from the measurements in :mod:`qattn_fx.cost`).
"""

from __future__ import annotations

import math

from . import cost, sparse_cost
from .block_sparse_spec import BlockSparse
from .hardware import Hardware
from .recipes import AUTO
from .site import Site
from .spec import AttentionSpec


#: ``auto`` keeps a site dense when the kernel it would pick is predicted to be less than this many times as fast as
#: dense attention (torch SDPA on cuDNN, bf16) at the site's shape: :func:`cost_rule`, :mod:`qattn_fx.cost`.
MIN_PREDICTED_SPEEDUP = 1.0
#: How the reason of a site that an explicit backend or a pinned kernel quantizes, but :func:`cost_rule` would keep
#: dense, gives the prediction (after the kernel; the prediction itself is :attr:`Decision.predicted_slower`).
PREDICTED_SLOWER = "slower than dense: "


def is_auto(use: AttentionSpec) -> bool:
    """``use`` lets the policy choose (backend ``auto``, no pinned kernel): nothing raises, the cost rule applies."""
    return use.backend == AUTO and use.kernel is None


def _static(size) -> int | None:
    """``size`` as an int when it is one at compile time, else None; a symbolic size is read, never guarded on."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    return node.maybe_as_int() if node is not None else None


def cost_rule(kernel: str, site: Site, hardware: Hardware,
              block_sparse: BlockSparse | None = None) -> tuple[bool, str | None]:
    """Whether ``auto`` keeps ``site`` dense instead of running ``kernel`` on ``hardware``, and what to say.

    With ``block_sparse`` the kernel visits part of the blocks: ``top_k`` predicts the dense kernel's speedup
    over the measured time of block-sparse calls visiting the fraction ``top_k`` (:mod:`qattn_fx.sparse_cost`);
    ``cdf`` visits a data-dependent share, so nothing is predicted (``(False, "no prediction: ...")``, the
    calibration measures it).

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
    if block_sparse is not None and block_sparse.top_k is None:
        return False, (f"no prediction: {block_sparse.short_name} visits a data-dependent share of blocks "
                       "(qattn_fx.calibrate measures it)")
    symbolic = (False, "no prediction: symbolic lengths")
    if kv_len is None or head_dim is None:
        return symbolic
    prediction = cost.predict(kernel, hardware.arch, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                              batch_heads=batch_heads, gpu=hardware.gpu)
    speedup, what, data, upper_bound = prediction.speedup, kernel, prediction.data, prediction.upper_bound
    if block_sparse is not None:
        time = sparse_cost.sparse_time(kernel, hardware.arch, kv_len=kv_len, head_dim=head_dim, gpu=hardware.gpu)
        speedup = sparse_cost.sparse_speedup(speedup, 1.0 - block_sparse.top_k, time)
        what, data = f"{kernel} with {block_sparse.short_name}", f"{data}; block-sparse: {time.data}"
        upper_bound = upper_bound or time.lower_bound
    if cost.no_gain(speedup, upper_bound, MIN_PREDICTED_SPEEDUP):
        bound = "at most " if upper_bound else ""
        q = "symbolic" if q_len is None else q_len
        return True, (f"{what} predicted {bound}{speedup:.2f}x of cuDNN bf16 at Sq {q}, Skv {kv_len} "
                      f"(cost data: {data})")
    return symbolic if q_len is None or batch_heads is None else (False, None)
