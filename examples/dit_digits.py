"""A small DiT trained on real images, to measure quantized attention on a trained model, on the CPU.

    python examples/dit_digits.py train                 # train from the seed, write examples/dit_digits.pt
    python examples/dit_digits.py quality               # samples dense vs the default recipe: PSNR / SSIM
    python examples/dit_digits.py calibrate --plot docs/calibration_dit_digits.png --check   # cos >= 0.9999
    python examples/dit_digits.py calibrate --side 32 --block-sparse --budget cos=0.999     # 1,024 tokens, sparse
    qattn-fx calibrate --model examples.dit_digits:factory --calls 4 --budget cos=0.9999 --emulate --out spec.json

**Data.** scikit-learn's handwritten digits (1797 images of 8x8 pixels, 10 classes), shipped inside its wheel:
nothing is downloaded. Each image is upsampled to 16x16 (bilinear) and scaled to [-1, 1].

**Model** (:class:`TinyDiT`): a class-conditional DiT on 2x2 patches (64 tokens), 4 blocks of width 128 with
2 heads of head_dim 64 (what the Hopper kernels take; emulation takes any), MLP ratio 2, fixed 2D sin-cos positions,
and adaLN-single conditioning (one shared MLP of timestep and class embeddings gives the six modulations, each
block adds its own learned table, as in PixArt-alpha). Attention calls ``F.scaled_dot_product_attention`` from
modules ``blocks.{i}.attn``. About 0.66 M parameters; the checkpoint is stored in fp16 (1.3 MB).

**Training**: rectified flow (``x_t = (1 - t) x_0 + t e``, the model predicts ``e - x_0``; ``t`` logit-normal),
AdamW at 1e-3 (one-cycle schedule), batch 64, ``--steps`` 2500 from ``--seed`` 0, on one CPU thread: about 12
CPU-minutes (``train`` prints the checkpoint's sha256; the same torch build on the same CPU type reproduces it bit for
bit). **Sampling**: Euler from ``t = 1`` to 0 in ``--sample-steps`` 20 steps.

**Quality** (``quality``): 100 samples (10 per class) from the same noise, dense and with the default recipe
(emulated on the reference kernel); PSNR and SSIM per image on [0, 1] pixels, SSIM with a 7x7 Gaussian window
(sigma 1.5), constants of Wang et al. (2004), over the valid region. **Calibration** (``calibrate``): the calls are
the model's real inputs at ``--calls`` steps of dense sampling trajectories, from high noise to low; candidates rank
by accuracy alone (:func:`accuracy_only`), since at 64 tokens the cost data predicts no speed gain on an H200
(``--cost-data``, and ``qattn-fx calibrate``'s default: every site dense).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
CHECKPOINT = HERE / "dit_digits.pt"
IMAGE, PATCH, CLASSES = 16, 2, 10
WIDTH, HEADS, DEPTH, MLP = 128, 2, 4, 2


# ------------------------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------------------------


def sincos_positions(side: int, dim: int, step: float = 1.0) -> torch.Tensor:
    """Fixed 2D sin-cos position embeddings, ``(side * side, dim)``, of the grid coordinates ``step · [0, side)``
    (``step < 1``: a finer grid over the same extent, as position interpolation serves a larger image)."""
    quarter = dim // 4
    freqs = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    coords = torch.arange(side, dtype=torch.float64) * step
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    parts = []
    for coord in (ys.flatten(), xs.flatten()):
        angles = coord[:, None] * freqs[None]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float()


def timestep_embedding(t: torch.Tensor, dim: int = 64) -> torch.Tensor:
    """Sinusoidal embedding of ``t`` in [0, 1] (scaled by 1000), ``(B, dim)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` of ``x (B, S, W)``: each ``(B, heads, S, W / heads)``."""
        b, s, w = x.shape
        return self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        out = F.scaled_dot_product_attention(*self.split_heads(x))
        return self.proj(out.transpose(1, 2).reshape(b, s, w))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, mlp * width), nn.GELU(approximate="tanh"), nn.Linear(mlp * width,
                                                                                                       width))
        self.table = nn.Parameter(torch.randn(6, width) / width ** 0.5)

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod + self.table[None]).unbind(1)
        x = x + gate1[:, None] * self.attn(self.norm1(x) * (1 + scale1[:, None]) + shift1[:, None])
        return x + gate2[:, None] * self.mlp(self.norm2(x) * (1 + scale2[:, None]) + shift2[:, None])


class TinyDiT(nn.Module):
    """``forward(x (B, 1, 16, 16), t (B,) in [0, 1], y (B,) class ids) -> velocity (B, 1, 16, 16)``; a larger
    square image (a multiple of the patch) runs with its positions interpolated onto the trained 8 x 8 grid
    (:func:`sincos_positions`' ``step``), as DiTs serve resolutions they were not trained at."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS, depth: int = DEPTH, mlp: int = MLP):
        super().__init__()
        self.side = IMAGE // PATCH
        self.patch = nn.Linear(PATCH * PATCH, width)
        self.register_buffer("pos", sincos_positions(self.side, width), persistent=False)
        self.t_mlp = nn.Sequential(nn.Linear(64, width), nn.SiLU(), nn.Linear(width, width))
        self.y_embed = nn.Embedding(CLASSES, width)
        self.adaln = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        self.blocks = nn.ModuleList(Block(width, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_table = nn.Parameter(torch.randn(2, width) / width ** 0.5)
        self.out = nn.Linear(width, PATCH * PATCH)
        nn.init.zeros_(self.adaln[1].weight)
        nn.init.zeros_(self.adaln[1].bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        p, s = PATCH, x.shape[-1] // PATCH
        tokens = x.view(b, 1, s, p, s, p).permute(0, 2, 4, 1, 3, 5).reshape(b, s * s, p * p)
        pos = self.pos if s == self.side else sincos_positions(s, self.pos.shape[1], self.side / s).to(x.device)
        h = self.patch(tokens) + pos
        c = self.t_mlp(timestep_embedding(t)) + self.y_embed(y)
        mod = self.adaln(c).view(b, 6, -1)
        for block in self.blocks:
            h = block(h, mod)
        shift, scale = (c[:, None] + self.final_table[None]).unbind(1)
        h = self.out(self.norm(h) * (1 + scale[:, None]) + shift[:, None])
        return h.view(b, s, s, 1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, 1, s * p, s * p)


def load(path: str | Path = CHECKPOINT) -> TinyDiT:
    """The trained model (eval mode, float32) from ``path``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; train it with: python examples/dit_digits.py train")
    model = TinyDiT()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


# ------------------------------------------------------------------------------------------------------------------
# Data, training, sampling
# ------------------------------------------------------------------------------------------------------------------


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as ``(1797, 1, 16, 16)`` images in [-1, 1] and their labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("training needs scikit-learn (its wheel ships the digits): pip install -e '.[examples]'") \
            from e
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    images = F.interpolate(images, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)
    return images.clamp(0, 1) * 2 - 1, torch.tensor(data.target, dtype=torch.long)


def train(steps: int, seed: int, out: Path, batch: int = 64, log_every: int = 250) -> TinyDiT:
    """Train from ``seed`` for ``steps`` steps on one CPU thread; write the fp16 checkpoint to ``out``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    try:
        return _train(steps, seed, Path(out), batch, log_every)
    finally:
        torch.set_num_threads(threads)


def _train(steps: int, seed: int, out: Path, batch: int, log_every: int) -> TinyDiT:
    torch.manual_seed(seed)
    images, labels = digits()
    model = TinyDiT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        idx = torch.randint(0, images.shape[0], (batch,), generator=g)
        x0, y = images[idx], labels[idx]
        noise = torch.randn(x0.shape, generator=g)
        t = torch.sigmoid(torch.randn(batch, generator=g))
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        loss = F.mse_loss(model(xt, t, y), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            print(f"step {step}/{steps}: loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    torch.save({k: v.half() for k, v in model.state_dict().items()}, out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB), sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}")
    return model


def noise_and_labels(n: int, seed: int, size: int = IMAGE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, size, size, generator=g), torch.arange(n) % CLASSES


@torch.no_grad()
def sample(model, noise: torch.Tensor, labels: torch.Tensor, steps: int = 20, record: list | None = None):
    """Euler sampling of the flow from ``t = 1`` (noise) to 0; ``record`` receives each step's ``(x, t, y)``."""
    x = noise.clone()
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        t = torch.full((x.shape[0],), float(ts[i]))
        if record is not None:
            record.append((x.clone(), t, labels))
        x = x + (ts[i + 1] - ts[i]) * model(x, t, labels)
    return x


# ------------------------------------------------------------------------------------------------------------------
# Quality metrics
# ------------------------------------------------------------------------------------------------------------------


def to_unit(x: torch.Tensor) -> torch.Tensor:
    return ((x.clamp(-1, 1) + 1) / 2).float()


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image PSNR in dB of ``(N, C, H, W)`` images in [0, 1] (inf where identical)."""
    mse = (a - b).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7, sigma: float = 1.5) -> torch.Tensor:
    """Per image SSIM of ``(N, C, H, W)`` images in [0, 1]: Gaussian window, C1 = (0.01)^2, C2 = (0.03)^2, mean over
    the valid region and channels."""
    coords = torch.arange(window, dtype=torch.float64) - (window - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = (g / g.sum()).float()
    kernel = (g[:, None] * g[None, :]).expand(a.shape[1], 1, window, window)
    blur = lambda x: F.conv2d(x, kernel, groups=a.shape[1])  # noqa: E731
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1)


# ------------------------------------------------------------------------------------------------------------------
# Calibration calls, and the factory for ``qattn-fx calibrate --model examples.dit_digits:factory``
# ------------------------------------------------------------------------------------------------------------------


def accuracy_only(kernel, arch, *, q_len, kv_len, head_dim, batch_heads):
    """A calibration speed source without data: candidates inside the budget rank by the recipe table's order, so the
    plan shows the accuracy side. This model's 64-token sites lie far below every call the H200 cost data measured;
    there the default source predicts no gain (``qattn_fx.cost.no_gain``) and keeps every site dense, as ``auto``
    would on an H200 (``calibrate --cost-data``)."""
    return None


def calibration_calls(model, n: int, *, batch: int = 20, seed: int = 1, sample_steps: int = 20, side: int = 0):
    """``n`` calls of ``model``: its real inputs at ``n`` steps, evenly spaced from the first (pure noise) to the
    last, of dense sampling trajectories from ``seed``; with labels ``t=...``. ``side``: tokens per side of the
    sampled images (0: the trained 8; larger: positions interpolated, :class:`TinyDiT`)."""
    record: list = []
    noise, labels = noise_and_labels(batch, seed, (side or IMAGE // PATCH) * PATCH)
    sample(model, noise, labels, sample_steps, record)
    picks = [round(i * (sample_steps - 1) / max(1, n - 1)) for i in range(n)]
    calls = [((record[i][0], record[i][1], record[i][2]), {}) for i in picks]
    return calls, [f"t={float(record[i][1][0]):.2f}" for i in picks]


def attention_inputs(model, *, side: int, timesteps, n: int = 4, seed: int = 1) -> list[tuple[str, tuple]]:
    """The ``(q, k, v)`` of every attention call of ``model`` on the first ``n`` digits upsampled to ``side`` x
    ``side`` patches (``side · PATCH`` pixels, positions interpolated: :class:`TinyDiT`), noised to each of
    ``timesteps`` as in training (``(1 - t) x0 + t e``, ``e`` from ``seed``): ``[(label, (q, k, v)), ...]`` with
    labels ``t=0.9 blocks.0`` and ``q, k, v (n, HEADS, side², WIDTH / HEADS)``; what ``python -m
    benchmarks.sparse_quality --inputs digits`` measures block sparsity on."""
    images, labels = digits()
    x0 = F.interpolate(images[:n], size=(side * PATCH, side * PATCH), mode="bilinear", align_corners=False)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    found: list[tuple[str, tuple]] = []
    for t in timesteps:
        hooks = [block.attn.register_forward_hook(
            lambda mod, args, out, name=f"t={t:g} blocks.{i}": found.append((name, mod.split_heads(args[0]))))
            for i, block in enumerate(model.blocks)]
        try:
            with torch.no_grad():
                model((1 - t) * x0 + t * noise, torch.full((n,), float(t)), labels[:n])
        finally:
            for hook in hooks:
                hook.remove()
    return found


def factory():
    """``(model, calls)`` for ``qattn-fx calibrate``: the trained model and ``calls(n)``."""
    model = load()
    return model, lambda n: calibration_calls(model, n)[0]


# ------------------------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------------------------


def quality(model, *, n: int, seed: int, sample_steps: int, spec=None, compiler: str = "inductor") -> dict:
    """Samples dense and under ``spec`` (default: the default recipe) from the same noise; PSNR/SSIM per image."""
    import qattn_fx

    torch._dynamo.reset()
    noise, labels = noise_and_labels(n, seed)
    dense = sample(model, noise, labels, sample_steps)
    backend = qattn_fx.backend(spec, emulate=True, compiler=compiler)
    quantized = sample(torch.compile(model, backend=backend, dynamic=False), noise, labels, sample_steps)
    p, s = psnr(to_unit(quantized), to_unit(dense)), ssim(to_unit(quantized), to_unit(dense))
    return {"psnr_mean": float(p.mean()), "psnr_min": float(p.min()), "ssim_mean": float(s.mean()),
            "ssim_min": float(s.min()), "report": backend.report, "dense": dense, "quantized": quantized}


def save_grid(path: Path, rows: list[torch.Tensor], titles: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = rows[0].shape[0]
    fig, axes = plt.subplots(len(rows), cols, figsize=(cols * 0.8, len(rows) * 0.9))
    for r, (images, title) in enumerate(zip(rows, titles)):
        for c in range(cols):
            ax = axes[r, c]
            ax.imshow(images[c, 0].numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r, 0].set_ylabel(title, rotation=0, ha="right", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from the seed and write the checkpoint")
    t.add_argument("--steps", type=int, default=2500)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", type=Path, default=CHECKPOINT)
    q = sub.add_parser("quality", help="samples dense vs quantized from the same noise: PSNR / SSIM")
    q.add_argument("--samples", type=int, default=100)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--sample-steps", type=int, default=20)
    q.add_argument("--spec", help="spec file (default: the default recipe everywhere)")
    q.add_argument("--grid", type=Path, help="write a PNG of dense and quantized samples")
    q.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    c = sub.add_parser("calibrate", help="calibrate on sampling steps; print the table, write spec/table/plot")
    c.add_argument("--budget", default="cos=0.9999", help="default cos=0.9999 (a per-site bound that some sites "
                   "of the trained model keep and others do not)")
    c.add_argument("--calls", type=int, default=4)
    c.add_argument("--out", type=Path, help="write the spec (JSON)")
    c.add_argument("--table", type=Path, help="write the calibration (JSON)")
    c.add_argument("--plot", type=Path, help="write the plot (PNG)")
    c.add_argument("--check", action="store_true", help="compile the plan's spec with the backend (emulated) and "
                   "re-measure the model output on the calls")
    c.add_argument("--cost-data", action="store_true", help="rank candidates by the H200 cost data (default: by "
                   "the recipe table's order, accuracy_only): at 64 tokens it predicts no gain and keeps every site "
                   "dense")
    c.add_argument("--side", type=int, default=0, help="tokens per side of the sampled images (default: the "
                   "trained 8; 32: 1,024 tokens, 8 x 8 blocks, positions interpolated)")
    c.add_argument("--block-sparse", action="store_true", help="add the default recipe with block sparsity as "
                   "candidates (cdf 0.9 and 0.95, top_k 0.5; the self-similarity guard off, which at this model's "
                   "tiles visits every block)")
    for p in (q, c):
        p.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.command == "train":
        train(args.steps, args.seed, args.out)
        return {}
    model = load(args.checkpoint)
    if args.command == "quality":
        import qattn_fx

        spec = qattn_fx.Spec.from_file(args.spec) if args.spec else None
        r = quality(model, n=args.samples, seed=args.seed, sample_steps=args.sample_steps, spec=spec,
                    compiler=args.compiler)
        print(r["report"])
        print(f"{args.samples} samples, {args.sample_steps} Euler steps, seed {args.seed}: quantized vs dense PSNR "
              f"mean {r['psnr_mean']:.2f} dB (min {r['psnr_min']:.2f}), SSIM mean {r['ssim_mean']:.5f} "
              f"(min {r['ssim_min']:.5f})")
        if args.grid:
            k = min(10, args.samples)
            save_grid(args.grid, [to_unit(r["dense"][:k]), to_unit(r["quantized"][:k])], ["dense", "int8 Sage"])
            print(f"wrote {args.grid}")
        return r
    import qattn_fx

    calls, labels = calibration_calls(model, args.calls, side=args.side)
    candidates = None
    if args.block_sparse:
        from qattn_fx.calibration.candidates import DEFAULT_CANDIDATES
        from qattn_fx.spec import DEFAULT_RECIPE

        candidates = list(DEFAULT_CANDIDATES) + [
            qattn_fx.AttentionSpec(recipe=DEFAULT_RECIPE, block_sparse=qattn_fx.BlockSparse(similarity=0.0, **keep))
            for keep in (dict(cdf=0.9), dict(cdf=0.95), dict(top_k=0.5))]
    result = qattn_fx.calibrate(model, calls, budget=args.budget, emulate=True, labels=labels, progress=print,
                                speed=None if args.cost_data else accuracy_only, candidates=candidates)
    print(result)
    if args.out:
        args.out.write_text(result.spec.to_json(indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.table:
        print(f"wrote {result.save(args.table)}")
    if args.plot:
        print(f"wrote {result.plot(args.plot)}")
    if args.check:
        decided, e2e = check(model, calls, result.spec)
        print(decided)
        print(f"the spec compiled by the backend: model output vs dense, worst over the calls: cos {e2e.cos:.6f}, "
              f"rel_l1 {e2e.rel_l1:.3g} (the calibration measured cos {min(e.cos for e in result.plan_e2e):.6f})")
    return {"result": result}


def check(model, calls, spec, compiler: str = "aot_eager"):
    """``spec`` compiled by the backend (emulated): its site report and the worst model-output errors on ``calls``."""
    import qattn_fx
    from qattn_fx.calibration import errors
    from qattn_fx.calibration.budget import worst

    torch._dynamo.reset()
    backend = qattn_fx.backend(spec, emulate=True, compiler=compiler)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        found = [errors(compiled(*a, **kw), model(*a, **kw)) for a, kw in calls]
    return backend.report, worst(found)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main()
