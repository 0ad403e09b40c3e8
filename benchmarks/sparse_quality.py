"""Block-sparse attention quality: how much of the true attention the predictor's blocks keep, against an oracle
that keeps the best blocks at the same count, and what the output loses (``python -m benchmarks.sparse_quality``).

Inputs (``--inputs``): ``grid``, attention local in a video's ``(frames, height, width)`` token grid with a window per
head and attention-sink keys (:func:`benchmarks.common.grid_qkv`), ``random``, Gaussian Q/K/V with no structure (the
honest row: the pooled scores have nothing to find there), and ``digits``, the real activations of a trained model:
every attention call of ``examples/dit_digits.py``'s checkpoint on ``--digits-images`` digits at ``--digits-side`` x
``--digits-side`` tokens (positions interpolated onto its 8 x 8 training grid) noised to each of ``--digits-timesteps``
(:func:`examples.dit_digits.attention_inputs`), one row per call and keep. For each selection mode and keep value
(``top_k``: the fraction of key tiles; ``cdf``: the pooled mass) the predictor (:func:`qattn_fx.kernels.
predict_blocks.predict`: the Triton pooling on CUDA, torch on CPU) picks the blocks of 128 query rows x 128 keys; then,
from exact fp32 attention (TF32 off):

* ``sparsity``: the fraction of blocks not visited;
* ``mass``: the share of each query tile's attention (its rows' softmax summed over the block's keys, averaged over
  its rows) in the visited blocks, averaged over query tiles; ``oracle``: the same for the blocks with the largest
  true mass at the same count per query tile; ``ratio = mass / oracle`` and ``ratio_p05`` its 5th percentile over
  query tiles;
* ``cos`` / ``rel_l1``: the output with the unvisited blocks masked (fp32 softmax over the visited keys) against
  dense fp32 attention (``cos_oracle`` / ``rel_l1_oracle``: with the oracle's blocks).

Everything is computed in query chunks of whole tiles, so memory stays bounded at video lengths. CPU-sized by
default (8 x 16 x 16 tokens, 4 heads); ``--grid 21x30x52 --heads 12 --head-dim 128`` is Wan 2.1 480p's call.
Writes ``--out`` (JSON: environment, arguments, rows) and prints the table.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from . import common

COLUMNS = [("inputs", "inputs", "s"), ("mode", "mode", "s"), ("keep", "keep", ".2f"),
           ("sparsity", "skipped", ".3f"), ("mass", "mass", ".4f"), ("oracle", "oracle", ".4f"),
           ("ratio", "ratio", ".4f"), ("ratio_p05", "ratio p05", ".4f"), ("cos", "cos", ".6f"),
           ("rel_l1", "rel-L1", ".4f"), ("cos_oracle", "cos oracle", ".6f"), ("rel_l1_oracle", "rel-L1 oracle", ".4f")]
#: Default windows per head (grid cells along frames, height, width): spatial, cubic, row-wise, wide.
WINDOWS = "1,2,2;4,4,4;0.5,1,8;2,8,8"


def _rows_per_chunk(b: int, h: int, skv: int, max_bytes: int) -> int:
    rows = max(1, max_bytes // max(1, b * h * skv * 4))
    return max(128, rows // 128 * 128)


def attention_and_masses(q, k, v, sm_scale: float, visit: torch.Tensor | None = None, *, masses: bool = False,
                         max_bytes: int = 1 << 30):
    """fp32 attention of ``q (B, H, Sq, D)``, ``k``, ``v`` (GQA repeats K/V heads) with the blocks where ``visit``
    (bool ``(B, H, NQ, NK)``) is False masked; with ``masses`` also the per-block mass ``(B, H, NQ, NK)`` (each
    query tile's rows' softmax summed over the block's keys, averaged over its rows). Returns ``(out, masses)``."""
    from qattn_fx import block_sparse  # noqa: PLC0415

    b, h, sq, _ = q.shape
    skv = k.shape[2]
    nq, nk = block_sparse.tiles(sq, skv)
    g = h // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    out = torch.empty(b, h, sq, vf.shape[-1], device=q.device)
    mass = torch.zeros(b, h, nq, nk, device=q.device) if masses else None
    step = _rows_per_chunk(b, h, skv, max_bytes)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for s0 in range(0, sq, step):
            s = torch.matmul(q[:, :, s0:s0 + step].float(), kf.transpose(-1, -2)) * sm_scale
            if visit is not None:
                tile0 = s0 // block_sparse.BLOCK_ROWS
                part = visit[:, :, tile0:tile0 + -(-s.shape[2] // block_sparse.BLOCK_ROWS)]
                s = s.masked_fill(~block_sparse.expand(part, s.shape[2], skv), -math.inf)
            p = torch.softmax(s, -1).nan_to_num(0.0)
            out[:, :, s0:s0 + step] = torch.matmul(p, vf)
            if masses:
                rows = p.shape[2]
                per_key = torch.nn.functional.pad(p, (0, nk * block_sparse.BLOCK_KEYS - skv))
                per_key = per_key.reshape(b, h, rows, nk, block_sparse.BLOCK_KEYS).sum(-1)  # (B, H, rows, NK)
                tiles = -(-rows // block_sparse.BLOCK_ROWS)
                per_key = torch.nn.functional.pad(per_key, (0, 0, 0, tiles * block_sparse.BLOCK_ROWS - rows))
                summed = per_key.reshape(b, h, tiles, block_sparse.BLOCK_ROWS, nk).sum(3)
                counts = torch.full((tiles,), float(block_sparse.BLOCK_ROWS), device=q.device)
                counts[-1] = rows - (tiles - 1) * block_sparse.BLOCK_ROWS
                tile0 = s0 // block_sparse.BLOCK_ROWS
                mass[:, :, tile0:tile0 + tiles] = summed / counts[:, None]
            del s, p
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out, mass


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """``cos`` and ``rel_l1`` (Σ|o−r| / Σ|r|) of the flattened outputs, in fp64 (so identical outputs give 1 and 0)."""
    o, r = out.double().reshape(-1), ref.double().reshape(-1)
    return {"cos": torch.nn.functional.cosine_similarity(o, r, dim=0).item(),
            "rel_l1": ((o - r).abs().sum() / r.abs().sum().clamp_min(1e-300)).item()}


def oracle_visit(mass: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The ``count (B, H, NQ)`` blocks of largest ``mass`` per query tile (ties to the lower index), bool."""
    order = torch.sort(-mass, dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(mass.shape[-1], device=mass.device)
                                            .expand_as(order).contiguous())
    return rank < count[..., None].long()


def evaluate(q, k, v, *, modes: dict[str, list[float]], sink_tiles: int, diagonal: bool, similarity: float,
             label: str, max_bytes: int = 1 << 30) -> list[dict]:
    """One row per (mode, keep) on these inputs (the module docstring)."""
    from qattn_fx import block_sparse  # noqa: PLC0415
    from qattn_fx.kernels import predict_blocks  # noqa: PLC0415

    sm = 1.0 / math.sqrt(q.shape[-1])
    dense, mass = attention_and_masses(q, k, v, sm, masses=True, max_bytes=max_bytes)
    rows = []
    for mode, keeps in modes.items():
        for keep in keeps:
            blocks = predict_blocks.predict(q, k, None, sm, keep, mode, sink_tiles, diagonal, similarity)
            visit = block_sparse.to_mask(blocks)
            oracle = oracle_visit(mass, blocks.count)
            kept, best = (mass * visit).sum(-1), (mass * oracle).sum(-1)
            tile_ratio = kept / best.clamp_min(1e-30)
            out, _ = attention_and_masses(q, k, v, sm, visit, max_bytes=max_bytes)
            out_oracle, _ = attention_and_masses(q, k, v, sm, oracle, max_bytes=max_bytes)
            acc, acc_oracle = accuracy(out, dense), accuracy(out_oracle, dense)
            row = dict(inputs=label, mode=mode, keep=keep, sparsity=blocks.sparsity(), mass=kept.mean().item(),
                       oracle=best.mean().item(), ratio=(kept.mean() / best.mean()).item(),
                       ratio_p05=torch.quantile(tile_ratio.flatten().double(), 0.05).item(),
                       cos=acc["cos"], rel_l1=acc["rel_l1"], cos_oracle=acc_oracle["cos"],
                       rel_l1_oracle=acc_oracle["rel_l1"])
            rows.append(row)
            common.log(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                                for key, value in row.items()))
    return rows


def _digits_calls(a) -> list:
    """The trained digits DiT's attention calls (:func:`examples.dit_digits.attention_inputs`) on ``a.device``."""
    from examples import dit_digits  # noqa: PLC0415

    calls = dit_digits.attention_inputs(dit_digits.load(), side=a.digits_side, timesteps=_floats(a.digits_timesteps),
                                        n=a.digits_images, seed=a.seed)
    return [(label, tuple(x.to(a.device) for x in qkv)) for label, qkv in calls]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="8x16x16", help="frames x height x width of the token grid (default 8x16x16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--windows", default=WINDOWS, help=f"per-head windows f,h,w ';'-separated, cycled (default "
                                                      f"{WINDOWS})")
    p.add_argument("--sharpness", type=float, default=4.0, help="grid_qkv sharpness (default 4)")
    p.add_argument("--sink", type=int, default=4, help="attention-sink keys (default 4)")
    p.add_argument("--inputs", default="grid,random", help="grid, random and/or digits (default grid,random)")
    p.add_argument("--digits-side", type=int, default=32, help="digits: tokens per side (default 32: 1,024 tokens)")
    p.add_argument("--digits-images", type=int, default=4, help="digits: images per call (default 4)")
    p.add_argument("--digits-timesteps", default="0.9,0.5,0.1", help="digits: noise levels t (default 0.9,0.5,0.1)")
    p.add_argument("--top-k", default="0.15,0.25,0.35,0.5,0.75", help="top_k keep fractions ('' for none)")
    p.add_argument("--cdf", default="0.5,0.75,0.9,0.95", help="cdf keep masses ('' for none)")
    p.add_argument("--sink-tiles", type=int, default=1, help="key tiles always visited (default 1)")
    p.add_argument("--no-diagonal", action="store_true", help="do not always visit the diagonal tile")
    p.add_argument("--similarity", type=float, default=0.0, help="the self-similarity guard (default 0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="bound on one chunk's fp32 scores (bytes)")
    p.add_argument("--out", default="bench_out/sparse_quality.json", help="JSON output path")
    a = p.parse_args(argv)
    grid = tuple(int(x) for x in a.grid.lower().split("x"))
    if len(grid) != 3:
        p.error(f"--grid {a.grid!r} is invalid; valid: FxHxW, e.g. 8x16x16")
    windows = tuple(tuple(float(x) for x in w.split(",")) for w in a.windows.split(";"))
    if any(len(w) != 3 for w in windows):
        p.error(f"--windows {a.windows!r} is invalid; valid: f,h,w[;f,h,w...]")
    modes = {m: _floats(text) for m, text in (("top_k", a.top_k), ("cdf", a.cdf)) if _floats(text)}
    kinds = [x for x in a.inputs.split(",") if x]
    if not set(kinds) <= {"grid", "random", "digits"}:
        p.error(f"--inputs {a.inputs!r} is invalid; valid: grid, random, digits")
    s = grid[0] * grid[1] * grid[2]
    start = time.time()
    rows: list[dict] = []
    for kind in kinds:
        if kind == "digits":
            for label, (q, k, v) in _digits_calls(a):
                rows += evaluate(q, k, v, modes=modes, sink_tiles=a.sink_tiles, diagonal=not a.no_diagonal,
                                 similarity=a.similarity, label=f"digits {label}", max_bytes=a.max_bytes)
            continue
        if kind == "grid":
            q, k, v = common.grid_qkv(a.batch, a.heads, grid, a.head_dim, windows=windows, sharpness=a.sharpness,
                                      sink=a.sink, seed=a.seed, device=a.device)
        else:
            g = torch.Generator(device=a.device).manual_seed(a.seed)
            q, k, v = (torch.randn(a.batch, s, a.heads, a.head_dim, generator=g, device=a.device)
                       .to(torch.bfloat16).transpose(1, 2) for _ in range(3))
        rows += evaluate(q, k, v, modes=modes, sink_tiles=a.sink_tiles, diagonal=not a.no_diagonal,
                         similarity=a.similarity, label=kind, max_bytes=a.max_bytes)
    print(common.format_table(rows, COLUMNS))
    env = common.environment()
    env["device_used"] = a.device
    payload = {"environment": env, "args": vars(a), "tokens": s, "seconds": time.time() - start, "rows": rows}
    if "digits" in kinds:
        payload["digits_tokens"] = a.digits_side ** 2
    import os  # noqa: PLC0415

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    common.write_json(a.out, payload)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
