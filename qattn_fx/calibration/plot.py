"""The calibration plot: per site (in the order the model runs them), each candidate's error against dense.

Two panels, sites on the x axis (labelled by module path and layer): ``1 - cos`` (log scale) and relative L1 (log
scale), and with block-sparse candidates a third: the fraction of blocks each skipped (measured, the mean over
the calls). Each candidate is a line through its worst value over the calls, with every call's value as a faint dot; the
per-site budget is a dashed line; the plan's choice at each site is ringed, and sites the plan keeps dense are
shaded. The title has the budget and the plan's end-to-end error. Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

from pathlib import Path

_FLOOR = 1e-9  # log axes: an exact 0 error is drawn here


def plot(result, path: str | Path) -> Path:
    """Draw ``result`` (a :class:`~qattn_fx.calibration.result.Calibration`) as a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("Calibration.plot needs matplotlib: pip install matplotlib (or the [examples] extra); "
                          "the table is in Calibration.save()'s JSON") from e
    path = Path(path)
    sites = [s.site for s in result.sites]
    x = {s: i for i, s in enumerate(sites)}
    names = [c["name"] for c in result.candidates]
    sparse = any(r.sparsity is not None for r in result.table)
    fig, axes = plt.subplots(3 if sparse else 2, 1, figsize=(max(6.0, 0.55 * len(sites) + 3), 9.0 if sparse else 6.5),
                             sharex=True)
    metrics = (("1 - cos", lambda e: 1.0 - e.cos, "cos"), ("relative L1", lambda e: e.rel_l1, "rel_l1"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (label, value, key) in zip(axes, metrics):
        for s in result.sites:
            if s.choice == "dense":
                ax.axvspan(x[s.site] - 0.5, x[s.site] + 0.5, color="0.9", zorder=0)
        for j, name in enumerate(names):
            rows = [r for r in result.table if r.candidate == name and r.errors is not None]
            color = colors[j % len(colors)]
            xs = [x[r.site] for r in rows]
            ax.plot(xs, [max(value(r.errors), _FLOOR) for r in rows], "-o", color=color, ms=4, lw=1.2, label=name)
            for r in rows:
                calls = [max(value(e), _FLOOR) for e in r.per_call if e is not None]
                ax.scatter([x[r.site]] * len(calls), calls, color=color, s=6, alpha=0.35, lw=0)
                if r.chosen:
                    ax.scatter([x[r.site]], [max(value(r.errors), _FLOOR)], s=130, facecolors="none",
                               edgecolors=color, linewidths=1.8, zorder=5)
        bound = result.budget.site_bounds.get(key)
        if bound is not None:
            ax.axhline(1.0 - bound if key == "cos" else bound, color="k", ls="--", lw=1,
                       label=f"budget {key} {'>=' if key == 'cos' else '<='} {bound:g}")
        ax.set_yscale("log")
        ax.set_ylabel(label + " (worst call)")
        ax.grid(True, which="major", alpha=0.3)
    if sparse:
        ax = axes[2]
        for j, name in enumerate(names):
            rows = [r for r in result.table if r.candidate == name and r.sparsity is not None]
            if not rows:
                continue
            color = colors[j % len(colors)]
            ax.plot([x[r.site] for r in rows], [r.sparsity for r in rows], "-o", color=color, ms=4, lw=1.2,
                    label=name)
            for r in rows:
                if r.chosen:
                    ax.scatter([x[r.site]], [r.sparsity], s=130, facecolors="none", edgecolors=color,
                               linewidths=1.8, zorder=5)
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("blocks skipped (mean of calls)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    axes[-1].set_xticks(range(len(sites)))
    axes[-1].set_xticklabels(sites, rotation=60, ha="right", fontsize=8)
    e = min(result.plan_e2e, key=lambda e: e.cos)
    axes[0].set_title(f"per-site error vs dense ({len(result.calls)} calls; ringed: the plan's choice, shaded: "
                      f"dense)\nplan: {result.quantized}/{len(result.sites)} sites quantized, model output worst cos "
                      f"{e.cos:.6f}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
