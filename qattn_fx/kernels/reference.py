"""Reference kernel: the exact numerics of every recipe, in torch, on CPU or CUDA.

This is the *definition* every fast kernel is tested against:

1. dequantize Q, K and V exactly (:mod:`qattn_fx.formats`) to fp32;
2. ``S = Q·Kᵀ · sm_scale + key_bias`` in fp32 (``key_bias``: a per-key logit bias, ``-inf`` for masked keys,
   whose quantized K and V the lowering has zeroed, so their scales never saw them; any finite data there gets
   weight 0 here);
   ``P = exp(S - rowmax(S))``; ``l = rowsum(P)`` (fp32, before any rounding);
3. P is rounded the way the recipe's P·V sees it: e4m3 with the fixed scale 448 when V is fp8/mxfp8, NVFP4 with
   a fixed tensor scale when V is nvfp4;
4. ``O = (P_rounded · V) / l`` in fp32, cast to ``out_dtype`` and stored BSHD. A row whose logits are all
   ``-inf`` (every key masked) gives 0, as ``F.scaled_dot_product_attention`` does;
5. with ``return_lse`` (scaled family) also the natural-log ``LSE = rowmax(S) + log(l)``, fp32 ``(B, Hq, Sq)``
   (``-inf`` for a row whose keys are all masked), what the Sage kernels return for a merge of partial results.

With ``skip_threshold`` (λ), Skip-Softmax (:mod:`qattn_fx.skip_softmax`): the tiles of 64 rows x 128 keys its
test skips are left out (their logits set to ``-inf`` before step 2), the exact tile test on the fp32 logits in
log2 units; the skipped and tested tile counts are recorded under ``skip_label`` inside
:func:`qattn_fx.skip_softmax.measure`.

With ``block_index`` / ``block_count`` (:mod:`qattn_fx.block_sparse`), the blocks of 128 rows x 128 keys a query
tile does not visit have their logits set to ``-inf`` before step 2 (and before Skip-Softmax's test, which then
counts only the visited blocks' tiles); a query tile that visits nothing gives 0 and LSE ``-inf``.

Work is chunked over query rows so that memory stays bounded for video-length sequences. GQA (``Hq = g · Hkv``)
repeats K/V heads. Inputs are never modified.
"""

from __future__ import annotations

import torch

from .. import block_sparse, formats, skip_softmax

#: Upper bound on fp32 elements of one chunk of the score matrix.
_CHUNK_ELEMENTS = 1 << 26


def _empty_out(b: int, h: int, sq: int, dv: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(b, sq, h, dv, dtype=dtype, device=device).transpose(1, 2)


def _repeat_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    hk = x.shape[1]
    return x if hk == hq else x.repeat_interleave(hq // hk, dim=1)


def _attend(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, sm_scale: float, round_p, out: torch.Tensor,
            key_bias: torch.Tensor | None = None, skip_threshold: torch.Tensor | None = None, skip_label: str = "",
            lse: torch.Tensor | None = None, visit: torch.Tensor | None = None):
    """``visit``: the per-block mask of block-sparse calls (bool ``(B, H, NQ, NK)``, :mod:`qattn_fx.block_sparse`)."""
    b, h, sq, _ = qf.shape
    kf = _repeat_heads(kf, h)
    vf = _repeat_heads(vf[:, :, : kf.shape[-2]], h)  # V may carry padding rows past Skv
    bias = None if key_bias is None else key_bias.float()[:, None, None, :]
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * h * kf.shape[-2]))
    if skip_threshold is not None or visit is not None:  # whole blocks (and 64-row skip tiles) per chunk
        rows = -(-rows // block_sparse.BLOCK_ROWS) * block_sparse.BLOCK_ROWS
    if skip_threshold is not None:
        log2_thr, skipped, tested = skip_softmax.log2_threshold(skip_threshold).to(qf.device), 0, 0
    if visit is not None:
        visit_rows = block_sparse.row_mask(visit.to(qf.device), sq)  # (B, H, Sq, NK)
    for start in range(0, sq, rows):
        s = torch.matmul(qf[:, :, start : start + rows], kf.transpose(-1, -2)) * sm_scale
        if bias is not None:
            s = s + bias
        if visit is not None:
            keep = visit_rows[:, :, start : start + rows].repeat_interleave(block_sparse.BLOCK_KEYS, -1)
            s = s.masked_fill(~keep[..., : s.shape[-1]], float("-inf"))
        if skip_threshold is not None:
            collector = skip_softmax.margins_collector()
            if collector is not None:  # calibration: every λ's sparsity from this one pass
                collector.add(skip_label, skip_softmax.tile_margins(s * skip_softmax.LOG2E))
            tiles = skip_softmax.skip_mask(s * skip_softmax.LOG2E, log2_thr)
            if visit is None:
                tested += tiles.numel()
            else:  # only the visited blocks' tiles are tested
                per_block = block_sparse.BLOCK_ROWS // skip_softmax.TILE_ROWS
                visited = visit[:, :, start // block_sparse.BLOCK_ROWS:].repeat_interleave(per_block, 2)
                visited = visited[:, :, : tiles.shape[2]]
                tiles, tested = tiles & visited, tested + int(visited.sum())
            skipped += int(tiles.sum())
            s = s.masked_fill(skip_softmax.expand_mask(tiles, s.shape[-2], s.shape[-1]), float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(m == float("-inf"), torch.zeros_like(m), m))  # all -inf rows: P = 0
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(round_p(p), vf) / torch.where(denom == 0, torch.ones_like(denom), denom)
        out[:, :, start : start + rows] = o.to(out.dtype)
        if lse is not None:
            lse[:, :, start : start + rows] = (m + torch.log(denom)).squeeze(-1)
    if skip_threshold is not None:
        skip_softmax.record(skip_label, skipped, tested)
    return out


def _visit(block_index, block_count):
    return None if block_index is None else block_sparse.to_mask(block_sparse.Blocks(block_index, block_count))


def scaled_attention(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out_dtype, *, key_bias=None,
                     return_lse=False, skip_threshold=None, skip_label="", block_index=None, block_count=None):
    """Reference for ``qattn::scaled_attention`` (see :mod:`qattn_fx.ops.attention` for the layouts); with
    ``return_lse`` it returns ``(out, lse)`` (``qattn::scaled_attention_lse``), ``lse`` fp32 ``(B, Hq, Sq)``;
    ``block_index`` / ``block_count``: the blocks to visit (:mod:`qattn_fx.block_sparse`)."""
    qf = formats.dequantize_scaled(q, q_scale, q_block)
    kf = formats.dequantize_scaled(k, k_scale, k_block)
    vf = formats.dequantize_v(v, v_scale)
    out = _empty_out(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], out_dtype, q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if return_lse else None
    out = _attend(qf, kf, vf, sm_scale, formats.round_p_fp8, out, key_bias, skip_threshold, skip_label, lse=lse,
                  visit=_visit(block_index, block_count))
    return (out, lse) if return_lse else out


def dense_attention(q, k, v, sm_scale, out_dtype, *, key_bias=None, skip_threshold=None, skip_label="",
                    block_index=None, block_count=None):
    """Reference for ``qattn::skip_softmax_attention``: fp32 attention of float ``q``, ``k``, ``v`` (P not rounded),
    with Skip-Softmax's tile test when ``skip_threshold`` is given."""
    out = _empty_out(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], out_dtype, q.device)
    return _attend(q.float(), k.float(), v.float(), sm_scale, lambda p: p, out, key_bias, skip_threshold, skip_label,
                   visit=_visit(block_index, block_count))


def dequantize_block_scaled(data, sf, gs, fmt: str, role: str, n: int) -> torch.Tensor:
    """fp32 ``(B, H, S, D)`` values of a block-scaled operand (``role``: ``qk`` or ``v``; ``n``: S for V, D for Q/K)."""
    if fmt == "mxfp8":
        return formats.dequantize_mxfp8(data, sf, -1 if role == "qk" else -2)
    if fmt == "nvfp4":
        values = formats.dequantize_nvfp4(data, sf, gs, n)
        return values if role == "qk" else values.transpose(-1, -2)
    if fmt == "fp8" and role == "v":
        return formats.dequantize_v(data, sf)
    raise ValueError(f"format={fmt!r} is invalid for {role}; valid: mxfp8, nvfp4" + (", fp8" if role == "v" else ""))


def block_scaled_attention(q, q_sf, q_gs, k, k_sf, k_gs, v, v_sf, v_gs, qk_format, v_format, sm_scale, out_dtype, *,
                           key_bias=None, skip_threshold=None, skip_label="", block_index=None, block_count=None):
    """Reference for ``qattn::block_scaled_attention``."""
    head_dim = q.shape[-1] * (2 if qk_format == "nvfp4" else 1)
    qf = dequantize_block_scaled(q, q_sf, q_gs, qk_format, "qk", head_dim)
    kf = dequantize_block_scaled(k, k_sf, k_gs, qk_format, "qk", head_dim)
    vf = dequantize_block_scaled(v, v_sf, v_gs, v_format, "v", k.shape[2])
    round_p = formats.round_p_nvfp4 if v_format == "nvfp4" else formats.round_p_fp8
    out = _empty_out(q.shape[0], q.shape[1], q.shape[2], vf.shape[-1], out_dtype, q.device)
    return _attend(qf, kf, vf, sm_scale, round_p, out, key_bias, skip_threshold, skip_label,
                   visit=_visit(block_index, block_count))
