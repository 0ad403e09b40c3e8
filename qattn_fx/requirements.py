"""What a kernel needs from the hardware and from an attention call site: the one declaration of each fact.

:class:`Requirements` objects are declared once per kernel, in :data:`qattn_fx.kernels.KERNELS`; the accepted
(backend, recipe) table (:data:`qattn_fx.recipes.TABLE`) names them, the policy checks them for each site
(:func:`qattn_fx.serving.unmet`), and the kernel modules read their own limits (head dims, architectures, library
floors) from them instead of restating them. This module imports nothing of qattn_fx.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Architecture groups.
SM89 = ("sm_89",)
SM90 = ("sm_90",)
SM100 = ("sm_100",)
SM100_103 = ("sm_100", "sm_103")
SM120_121 = ("sm_120", "sm_121")
ADA_HOPPER = ("sm_89", "sm_90")


def capabilities(archs: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """``("sm_90", "sm_100")`` → ``((9, 0), (10, 0))``: what ``torch.cuda.get_device_capability`` returns."""
    return tuple((int(a[3:-1]), int(a[-1])) for a in archs)


@dataclass(frozen=True)
class HeadDims:
    """Head dims a kernel accepts: an explicit set, or multiples of ``multiple_of`` up to ``max``."""

    allowed: tuple[int, ...] | None = None
    multiple_of: int = 1
    max: int = 1 << 30

    def accepts(self, head_dim: int) -> bool:
        if self.allowed is not None:
            return head_dim in self.allowed
        return head_dim % self.multiple_of == 0 and head_dim <= self.max

    def describe(self) -> str:
        if self.allowed is not None:
            return "/".join(str(d) for d in self.allowed)
        return f"multiple of {self.multiple_of}, <= {self.max}"


ANY_HEAD_DIM = HeadDims()


@dataclass(frozen=True)
class Requirements:
    """What one implementation of a recipe row needs from the hardware and from the attention call site.

    ``archs`` are compute capabilities as ``sm_XY`` strings (``None``: any device, CPU included);
    ``library`` is ``(distribution, minimum version)``; ``kernel`` names the entry in
    :data:`qattn_fx.kernels.KERNELS` that implements it (``None``: no kernel in qattn_fx yet, so the row can
    only be emulated). ``dtypes``: the Q/K/V dtypes it takes; ``key_bias``: it serves per-key masks
    (key-padding or additive, as a logit bias); ``lse``: it also returns the log-sum-exp of each query row (what
    ring attention merges partial results by; ``qattn::scaled_attention_lse``); ``qk_dtypes``: the recipe Q/K
    formats this target runs (``None``: every format the kernel implements), for kernels whose architectures differ
    by format; ``skip_softmax``: it runs Skip-Softmax's tile test (:mod:`qattn_fx.skip_softmax`);
    ``block_sparse``: it visits only listed blocks (:mod:`qattn_fx.block_sparse`).
    """

    kernel: str | None
    archs: tuple[str, ...] | None
    head_dims: HeadDims = ANY_HEAD_DIM
    library: tuple[str, str] | None = None
    cross_attention: bool = True
    gqa: bool = True
    causal: bool = False
    key_bias: bool = False
    lse: bool = False
    dtypes: tuple = (torch.bfloat16, torch.float16)
    self_attention_only_equal_shapes: bool = False
    seq_multiple_of: int = 1
    skip_softmax: bool = False
    block_sparse: bool = False
    qk_dtypes: tuple[str, ...] | None = None
    note: str = ""

    @property
    def capabilities(self) -> tuple[tuple[int, int], ...]:
        return capabilities(self.archs or ())


def parse_version(text: str) -> tuple:
    """A comparable key for versions like ``0.6.16rc1``, ``0.7.2.post1``, ``9.19.0``.

    Release numbers compare numerically; a pre-release (``rc``/``a``/``b``) sorts before its release, a
    ``post`` release after it.
    """
    match = re.match(r"^(\d+(?:\.\d+)*)(?:\.?(a|b|rc|post|dev)(\d*))?", text.strip())
    if not match:
        raise ValueError(f"version={text!r} is not a version number")
    release = tuple(int(x) for x in match.group(1).split("."))
    release = release + (0,) * (4 - len(release))
    tag, num = match.group(2), int(match.group(3) or 0)
    rank = {"dev": -4, "a": -3, "b": -2, "rc": -1, None: 0, "post": 1}[tag]
    return release + (rank, num)
