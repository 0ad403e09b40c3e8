"""Split-KV for the last, partial wave of a flash-attention grid (gluon_sage's ``SPLIT_TAIL``).

A grid of ``C`` equal CTAs on ``W`` resident slots (SMs × CTAs per SM) runs in ``ceil(C / W)`` waves; when ``C``
is not a multiple of ``W`` the last wave keeps only ``C mod W`` slots busy for a whole CTA's time. At wan1.3b-480p
(2052 CTAs of 192 rows, 132 SMs) that is 15.55 waves of work in 16 waves of time; at flux-1024 (576) 4.36 in 5.
:func:`plan` splits each of the tail's ``T = C mod W`` CTAs into ``n`` pieces over disjoint key ranges, so the
tail takes ``ceil(T·n / W)`` waves of ``1/n`` of a CTA's time. Each piece writes its normalized fp32 output and
natural-log LSE to a workspace; :func:`merge` (one Triton kernel) combines them:

    lse = log Σ_s exp(lse_s),   O = Σ_s exp(lse_s − lse) · O_s

which is the unsplit result up to fp32 rounding and the e4m3 rounding of P: a piece rounds P against its own
running max (:func:`merge_reference` is the same arithmetic in torch, used by the tests).

Workspace layout: ``o_ws (T·n, R, Dv)`` fp32 and ``lse_ws (T·n, R)`` fp32, piece ``t·n + s`` of tail CTA ``t``
(grid CTA ``main + t``) in row block ``t·n + s``; ``R`` = the CTA's query rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .._compiled_launch import compiled

try:  # optional at import time (CPU machines): merge() needs it, plan() does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

#: Below this many key tiles a row is too short for pieces to pay their prologue and epilogue.
MIN_KV_TILES = 16
#: A piece's fixed cost (pipeline fill, epilogue, workspace), in key tiles: the planner's cost model.
PIECE_OVERHEAD_TILES = 2.0
#: The tail must shrink by at least this fraction of a CTA's time to be split.
MIN_GAIN = 0.1
#: Among split counts within this (fraction of a CTA's time) of the best, the fewest pieces win (less workspace).
SPLIT_SLACK = 0.03
MAX_SPLITS = 16


@dataclass(frozen=True)
class TailPlan:
    """``main`` whole CTAs, then ``splits`` pieces of ``kv_split`` keys for each of the ``tail`` CTAs after them."""

    ctas: int
    main: int
    splits: int
    kv_split: int

    @property
    def tail(self) -> int:
        return self.ctas - self.main

    @property
    def pieces(self) -> int:
        return self.tail * self.splits

    @property
    def grid(self) -> int:
        return self.main + self.pieces


@functools.lru_cache(maxsize=None)  # asked once per launch with the same few shapes: a pure function of ints
def plan(ctas: int, slots: int, kv_len: int, block_n: int, k_block: int = 0) -> Optional[TailPlan]:
    """The split of a ``ctas``-CTA grid's partial last wave on ``slots`` resident CTAs, or ``None`` (no partial
    wave, rows shorter than :data:`MIN_KV_TILES` tiles, or less than :data:`MIN_GAIN` to win).

    Pieces hold a whole number of ``block_n`` tiles and start on a multiple of ``k_block`` (K scales per
    ``k_block`` keys; 0: per head or tensor), every piece at least two tiles. Cost model, in units of one CTA's
    time: ``ceil(tail·n / slots) · (tiles per piece + PIECE_OVERHEAD_TILES) / tiles``, against 1 unsplit.
    """
    if ctas <= 0 or slots <= 0 or block_n <= 0:
        raise ValueError(f"plan: ctas={ctas}, slots={slots}, block_n={block_n}; valid: positive ints")
    full, tail = divmod(ctas, slots)
    tiles = -(-kv_len // block_n)
    if tail == 0 or tiles < MIN_KV_TILES:
        return None
    step = (math.lcm(block_n, k_block) if k_block > 0 else block_n) // block_n  # tiles a piece is a multiple of
    options = []
    for n in range(2, MAX_SPLITS + 1):
        per = -(-(-(-tiles // n)) // step) * step
        n_eff = -(-tiles // per)
        last = tiles - (n_eff - 1) * per
        if n_eff < 2 or per < 2 or last < 2 or any(o[1] == n_eff for o in options):
            continue
        waves = -(-(tail * n_eff) // slots)
        options.append((waves * (per + PIECE_OVERHEAD_TILES) / tiles, n_eff, per))
    if not options:
        return None
    best = min(o[0] for o in options)
    if best > 1.0 - MIN_GAIN:
        return None
    _, n, per = min((o for o in options if o[0] <= best + SPLIT_SLACK), key=lambda o: o[1])
    return TailPlan(ctas=ctas, main=full * slots, splits=n, kv_split=per * block_n)


def workspace(tail_plan: TailPlan, rows: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(o_ws (pieces, rows, dv), lse_ws (pieces, rows))`` fp32 (the module docstring's layout)."""
    o_ws = torch.empty(tail_plan.pieces, rows, dv, dtype=torch.float32, device=device)
    return o_ws, torch.empty(tail_plan.pieces, rows, dtype=torch.float32, device=device)


def merge_reference(o_pieces: torch.Tensor, lse_pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, lse)`` of pieces stacked on dim 0: ``o_pieces (n, ..., Dv)``, ``lse_pieces (n, ...)`` (natural log).
    A piece whose keys are all masked (LSE ``-inf``) weighs 0; a row whose pieces all are gives 0 and ``-inf``."""
    lse = torch.logsumexp(lse_pieces, dim=0)
    finite = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    w = torch.exp(lse_pieces - finite)
    return (w.unsqueeze(-1) * o_pieces).sum(0), lse


if tl is not None:

    @triton.jit
    def _merge_kernel(OWs, LseWs, Out, Lse, stride_ob, stride_oh, stride_os, H, SEQ_Q, N_M, MAIN, SPLITS,
                      CTA_ROWS: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, RETURN_LSE: tl.constexpr):
        t = tl.program_id(0)  # tail CTA
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DV)
        first = (t * SPLITS).to(tl.int64) * CTA_ROWS
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for s in range(SPLITS):
            m = tl.maximum(m, tl.load(LseWs + first + s * CTA_ROWS + r))
        # every piece of the row masked (key bias): weights 0, output 0, LSE -inf
        m_use = tl.where(m == float("-inf"), 0.0, m)
        den = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DV], tl.float32)
        for s in range(SPLITS):
            row = first + s * CTA_ROWS + r
            w = tl.exp(tl.load(LseWs + row) - m_use)
            den += w
            acc += w[:, None] * tl.load(OWs + row[:, None] * DV + d[None, :])
        g = MAIN + t
        pid_m = g % N_M
        pid_bh = g // N_M
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        rows = pid_m * CTA_ROWS + r
        valid = rows < SEQ_Q
        o_ptrs = Out + b * stride_ob + h * stride_oh + rows.to(tl.int64)[:, None] * stride_os + d[None, :]
        o = acc / tl.where(den == 0.0, 1.0, den)[:, None]  # (acc is 0 where den is)
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=valid[:, None])
        if RETURN_LSE:
            tl.store(Lse + (b * H + h) * SEQ_Q + rows, m + tl.log(den), mask=valid)


def merge(tail_plan: TailPlan, o_ws: torch.Tensor, lse_ws: torch.Tensor, out: torch.Tensor,
          lse: Optional[torch.Tensor], n_m: int) -> None:
    """Write the merged pieces into ``out (B, H, Sq, Dv)`` (unit stride on Dv) and, if given, ``lse (B, H, Sq)``
    (contiguous): tail CTA ``t`` is grid CTA ``main + t``, i.e. rows ``(g % n_m)·R + [0, R)`` of (batch, head)
    ``g // n_m``. Runs on the current stream."""
    _, h, sq, dv = out.shape
    rows = o_ws.shape[1]
    block = 64 if rows % 64 == 0 else rows
    compiled(_merge_kernel)[(tail_plan.tail, rows // block)](
        o_ws, lse_ws, out, lse if lse is not None else lse_ws, out.stride(0), out.stride(1), out.stride(2),
        h, sq, n_m, tail_plan.main, tail_plan.splits,
        CTA_ROWS=rows, DV=dv, ROWS=block, RETURN_LSE=lse is not None, num_warps=4)
