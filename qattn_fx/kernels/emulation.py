"""The Sage kernels' tile loop in torch: their specification, executable on any device.

:func:`qattn_fx.kernels.reference` defines a recipe's numerics (P rounded against the global row max). The flash
kernels (triton_sage, gluon_sage) compute the same recipe tile by tile, rounding P against the running max of the
tiles seen so far; :func:`emulate` is that algorithm in its exact fp32 operation order (no fused multiply-add), so
a kernel is pinned to it at fp32 level (the interpreter tests, bitwise under ``TRITON_INTERPRET=1``; the GPU tests,
at the precision of Hopper's FP8 MMAs). :func:`emulate_launched` adds gluon_sage's tail split: the rows of a split
CTA are the LSE merge of the emulated pieces. Tools, benchmarks and users can call both to see what a kernel should
return.
"""

from __future__ import annotations

import math

import torch

from .. import block_sparse, formats, skip_softmax
from ._sage_common import INT8_ACC_BITS, INT8_ACC_OFFSET, LOG2_448, LOG2E, k_scale_kind

FP8 = torch.float8_e4m3fn


def emulate(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, block_n, mmasum=False, return_lse=False,
            key_bias=None, skip_threshold=None, skip_counts=None, block_index=None, block_count=None, pair=False):
    """The Triton kernel's tile loop in torch, in the kernel's fp32 operation order (no fused multiply-add).

    Per K tile of ``block_n`` keys: ``t`` = K-scaled accumulator, running max ``m``, ``P448 = exp2(t·rs - (m -
    log2 448))`` rounded to e4m3, ``acc = acc·alpha + P8·V8`` (exact in fp64 here), ``O = acc / l · v_scale``;
    ``l = l·alpha + ΣP448`` (``mmasum``: ``Σ e4m3(P448)``, gluon_sage's ones-MMA). Shared by the interpreter
    tests (exact fp32 agreement) and the GPU tests. ``return_lse``: also the kernels' natural-log LSE
    ``(m + log2 l - log2 448) · ln 2``. ``key_bias`` ``(B|1, Skv)``: logits are ``z = t·rs + bias·log2 e`` and the
    max is taken over ``z``; a running max of ``-inf`` (every key so far masked) is used as 0, and a row with
    ``l = 0`` gives 0. (Masked keys' K and V arrive zeroed by the lowering, with scales of the kept keys only; any
    finite data there gets P = 0.)

    ``skip_threshold`` (λ, a float or 0-d tensor): Skip-Softmax's tile test (:mod:`qattn_fx.skip_softmax`) on
    every tile of 64 rows and ``block_n`` (128) keys: ``max z - m < log2 λ`` for every row of the tile (``m``: the
    running max before it) leaves ``m``, ``l`` and ``acc`` unchanged for those rows. ``skip_counts``: a list that
    receives the number of tiles skipped (of the visited blocks' tiles).

    ``block_index`` / ``block_count`` (:mod:`qattn_fx.block_sparse`): the key tiles of a 128-row query tile that
    its lists leave out are not visited (``block_n`` divides 128: every ``block_n`` tile of a visited block is): they
    leave ``m``, ``l`` and ``acc`` of its rows as they were, and a row that visits nothing gives 0.

    ``pair`` (gluon_sage's ``pair``; ``mmasum``, no key bias, no Skip-Softmax): a row's visited tiles, in order, make
    online-softmax steps of two (the last alone when their number is odd): one running max over both tiles, one
    ``alpha``, ``l = l·alpha + (ΣP0 + ΣP1)``; each tile's K scales and masking stay its own.
    """
    b, hq, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = k.repeat_interleave(g, 1)
    v8 = v.double().repeat_interleave(g, 1)
    qk_scale = torch.tensor(sm_scale * LOG2E, dtype=torch.float32, device=q.device)
    s_all = q.double() @ kk.double().transpose(-1, -2)
    if q_scale is None:
        s_all = s_all.float()
        rs = torch.full((b, hq, sq), qk_scale.item(), device=q.device)
    else:
        s_all = s_all.to(torch.int32) if q.dtype == torch.int8 else s_all.float()
        rs = formats.expand_seq_scale(q_scale, q_block, sq)[..., 0].float().expand(b, hq, sq) * qk_scale
        if k_block == 0:
            rs = rs * k_scale.float().repeat_interleave(hq // k_scale.shape[1], 1)[..., :1]
    kind = k_scale_kind(k_block, block_n) if k_scale is not None else "none"  # how K's scales vary over a tile
    per_col = kind in ("group", "column")
    skipping = skip_threshold is not None
    sparse = block_index is not None
    if sparse:
        if block_sparse.BLOCK_KEYS % block_n:
            raise ValueError(f"block_n={block_n} is invalid for block-sparse calls; valid: divisors of "
                             f"{block_sparse.BLOCK_KEYS} (the block's keys)")
        visit_rows = block_sparse.row_mask(block_sparse.to_mask(block_sparse.Blocks(block_index, block_count)),
                                           sq).to(q.device)  # (B, Hq, Sq, NK)
    if skipping:
        if block_n != skip_softmax.TILE_KEYS:
            raise ValueError(f"block_n={block_n} is invalid for Skip-Softmax; valid: {skip_softmax.TILE_KEYS} (the "
                             "contract's key tile)")
        log2_thr = skip_softmax.log2_threshold(torch.as_tensor(skip_threshold)).to(q.device)
        n_rows = -(-sq // skip_softmax.TILE_ROWS)
        row_pad = n_rows * skip_softmax.TILE_ROWS - sq
        skipped = 0
    m = torch.full((b, hq, sq), -math.inf, device=q.device)
    l = torch.zeros(b, hq, sq, device=q.device)
    acc = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64, device=q.device)

    def scaled(s0):
        """Tile ``s0``'s keys ``n``, K-scaled logits ``t`` and row factors ``r`` (the kernels' ``rs``)."""
        n = torch.arange(s0, min(s0 + block_n, skv), device=q.device)
        s = s_all[..., n]
        if kind != "none":
            ks = k_scale.float().expand(b, hkv, -1).repeat_interleave(g, 1)[..., n // k_block]
            if per_col:  # the kernels cut scales that vary inside a tile to 22 significant bits, whatever Q's dtype
                ks = (ks.view(torch.int32) & -4).view(torch.float32)
        if q.dtype == torch.int8:
            t = (s + INT8_ACC_BITS).view(torch.float32)
            t = (t - INT8_ACC_OFFSET) * ks[:, :, None, :] if per_col else t - INT8_ACC_OFFSET
        else:
            t = s * ks[:, :, None, :] if per_col else s
        return n, t, rs * ks[..., :1] if kind == "tile" else rs

    if pair:
        if not mmasum or key_bias is not None or skipping or block_n != block_sparse.BLOCK_KEYS:
            raise ValueError(f"pair steps are emulated with mmasum and {block_sparse.BLOCK_KEYS}-key tiles, without "
                             f"a key bias or Skip-Softmax; got mmasum={mmasum}, block_n={block_n}, "
                             f"key_bias={'given' if key_bias is not None else None}, skip_threshold={skip_threshold}")
        visited = (visit_rows if sparse else torch.ones(b, hq, sq, -(-skv // block_n), dtype=torch.bool,
                                                        device=q.device))
        acc, m, l = _pair_steps(scaled, visited, skv, block_n, v8, m, l, acc)
        return _finish(acc, m, l, v_scale, hq, True, return_lse)
    for s0 in range(0, skv, block_n):
        n, t, r = scaled(s0)
        if key_bias is None:
            tile_max = t.amax(-1) * r
            m_new = torch.maximum(m, tile_max)
            p = torch.exp2(t * r[..., None] - (m_new - LOG2_448)[..., None])
            alpha = torch.exp2(m - m_new)
        else:
            kb = (key_bias.float()[:, None, None, :] * torch.tensor(LOG2E, dtype=torch.float32))[..., n]
            z = t * r[..., None] + kb
            tile_max = z.amax(-1)
            m_new = torch.maximum(m, tile_max)
            m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            p = torch.exp2(z - (m_use - LOG2_448)[..., None])
            alpha = torch.exp2(m - m_use)
        l_new = l * alpha + (p.to(FP8).float().sum(-1) if mmasum else p.sum(-1))
        acc_new = acc * alpha[..., None].double() + p.to(FP8).double() @ v8[..., n, :]
        keep = visit_rows[..., s0 // block_sparse.BLOCK_KEYS] if sparse else None
        if skipping:  # every row of a 64-row tile below the threshold: the tile leaves m, l, acc as they were
            vote = torch.nn.functional.pad((tile_max - m) < log2_thr, (0, row_pad), value=True)
            tile_skip = vote.reshape(b, hq, n_rows, skip_softmax.TILE_ROWS).all(-1)
            if sparse:  # only visited tiles are tested
                tile_skip &= torch.nn.functional.pad(keep, (0, row_pad)).reshape(
                    b, hq, n_rows, skip_softmax.TILE_ROWS).any(-1)
            skipped += int(tile_skip.sum())
            tested = ~tile_skip.repeat_interleave(skip_softmax.TILE_ROWS, -1)[..., :sq]
            keep = tested if keep is None else keep & tested
        if keep is not None:
            l_new, m_new = torch.where(keep, l_new, l), torch.where(keep, m_new, m)
            acc_new = torch.where(keep[..., None], acc_new, acc)
        l, acc, m = l_new, acc_new, m_new
    if skipping and skip_counts is not None:
        skip_counts.append(skipped)
    return _finish(acc, m, l, v_scale, hq, key_bias is not None or sparse, return_lse)


def _finish(acc, m, l, v_scale, hq, zero_empty, return_lse):
    """``O = acc / l · v_scale`` (rows with ``l = 0`` give 0 when ``zero_empty``) and, with ``return_lse``, the
    natural-log LSE."""
    vs = v_scale.double().repeat_interleave(hq // v_scale.shape[1], 1)[:, :, None, :]
    out = acc / l[..., None].double() * vs
    if zero_empty:
        out = torch.where(l[..., None] == 0, torch.zeros_like(out), out)
    if return_lse:
        return out, (m + torch.log2(l) - LOG2_448) * math.log(2.0)
    return out


def _pair_steps(scaled, visited, skv, block_n, v8, m, l, acc):
    """:func:`emulate`'s loop with ``pair`` steps: ``visited (B, H, Sq, NT)`` says which tiles each row visits, in
    order; visits ``2k`` and ``2k + 1`` of a row are its step ``k``. A first pass takes every tile's row max, a scatter
    the max of each step; the second visits the tiles in order, rescaling ``m``, ``l`` and ``acc`` at each step's
    first tile and adding ``l``'s step sum at its last. Returns ``(acc, m, l)``."""
    rank = visited.cumsum(-1) - 1
    count = visited.sum(-1)
    step = rank.clamp(min=0) // 2
    tile_max = torch.stack([t.amax(-1) * r for _, t, r in map(scaled, range(0, skv, block_n))], -1)
    tile_max = torch.where(visited, tile_max, torch.full_like(tile_max, -math.inf))
    step_max = torch.full_like(tile_max, -math.inf).scatter_reduce(-1, step, tile_max, "amax")
    pending = torch.zeros_like(l)
    for i, s0 in enumerate(range(0, skv, block_n)):
        n, t, r = scaled(s0)
        vis, rk = visited[..., i], rank[..., i]
        first = vis & (rk % 2 == 0)
        last = vis & ((rk % 2 == 1) | (rk == count - 1))
        m_new = torch.where(first, torch.maximum(m, step_max.gather(-1, step[..., i:i + 1])[..., 0]), m)
        alpha = torch.exp2(m - m_new)
        l = torch.where(first, l * alpha, l)
        acc = torch.where(first[..., None], acc * alpha[..., None].double(), acc)
        m = m_new
        p = torch.exp2(t * r[..., None] - (m - LOG2_448)[..., None]).to(FP8)
        tile_sum = p.float().sum(-1)
        pending = torch.where(first, tile_sum, torch.where(vis, pending + tile_sum, pending))
        l = torch.where(last, l + pending, l)
        acc = torch.where(vis[..., None], acc + p.double() @ v8[..., n, :], acc)
    return acc, m, l


def emulate_launched(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, config, tail,
                     return_lse=False, key_bias=None, block_index=None, block_count=None):
    """:func:`emulate` as gluon_sage launched it with ``config`` and tail split ``tail`` (``gluon_sage.last_config()``
    and ``last_tail_plan()``): the tail CTAs' rows are the LSE merge of the emulated pieces, each a tile loop over
    its own keys (so P is rounded against the piece's running max; with block lists, over the listed key tiles in
    its key range; with ``pair``, in steps of two of them)."""
    from .gluon_sage import q_blocks, tail_split

    args = (q, q_scale, k, k_scale, v, v_scale, q_block, k_block)
    pair = bool(config.pair)  # (steps of two tiles)
    want, want_lse = emulate(*args, sm_scale, config.block_n, config.mmasum, return_lse=True, key_bias=key_bias,
                             block_index=block_index, block_count=block_count, pair=pair)
    visit = None if block_index is None else block_sparse.to_mask(block_sparse.Blocks(block_index, block_count))
    if tail is not None:
        pieces = []
        for lo in range(0, k.shape[2], tail.kv_split):
            hi = min(lo + tail.kv_split, k.shape[2])
            kss = k_scale[..., lo // k_block:(hi + k_block - 1) // k_block] if (k_scale is not None and
                                                                                 k_block > 0) else k_scale
            blocks = (None, None) if visit is None else block_sparse.from_mask(
                visit[..., lo // block_sparse.BLOCK_KEYS:-(-hi // block_sparse.BLOCK_KEYS)])
            pieces.append(emulate(q, q_scale, k[:, :, lo:hi], kss, v[:, :, lo:hi], v_scale, q_block, k_block,
                                  sm_scale, config.block_n, config.mmasum, return_lse=True,
                                  key_bias=None if key_bias is None else key_bias[:, lo:hi],
                                  block_index=blocks[0], block_count=blocks[1], pair=pair))
        if len(pieces) != tail.splits:
            raise ValueError(f"tail split {tail} has {tail.splits} pieces; the keys make {len(pieces)}")
        split, split_lse = tail_split.merge_reference(torch.stack([p[0] for p in pieces]),
                                                      torch.stack([p[1] for p in pieces]))
        hq, sq = q.shape[1], q.shape[2]
        rows, n_m = config.rows, q_blocks(sq, config)
        for g in range(tail.main, tail.ctas):  # the tail CTAs' rows: merged pieces
            bh, m = divmod(g, n_m)
            at = (bh // hq, bh % hq, slice(m * rows, min((m + 1) * rows, sq)))
            want[at], want_lse[at] = split[at], split_lse[at]
    return (want, want_lse) if return_lse else want
