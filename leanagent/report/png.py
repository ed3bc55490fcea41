"""`leanagent report --png`: each run's recall matrix as a heat map beside its average recall curves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from leanagent.ground.atomic import write_atomic
from leanagent.report.cells import fit, metric
from leanagent.report.compare import LifelongRun
from leanagent.report.metrics import REGISTRY
from leanagent.report.run import MATRIX_METRIC


def write_png(runs: Sequence[LifelongRun], out: str | Path) -> None:
    """Each run's recall matrix as a heat map, beside its average test and validation R@10 curves (Agg, no display)."""
    fig = render(runs)
    write_atomic(Path(out), lambda f: fig.savefig(f, format="png", dpi=130), mode="wb", suffix=".png")


# The longest repository name a tick label shows whole; a longer one is cut with an ellipsis.
LABEL_CHARS = 22


def render(runs: Sequence[LifelongRun]):
    """The figure `write_png` saves: per run, the heat map and the curves on recall's 0-100 axis, with the
    lifelong metrics after the last repository.

    Every heat map takes one colour scale, from the lowest recall of all the runs to the highest, so that one
    colour is one recall in every panel and runs compare at a glance."""
    import numpy as np
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure  # a Figure without pyplot renders with Agg and touches no global state

    n = max(1, len(runs))
    fig = Figure(figsize=(13, 4.8 * n), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False)
    grids = [_grid(run) for run in runs]
    shown = [g for g, _ in grids if g.size and not np.isnan(g).all()]
    lo = min(float(np.nanmin(g)) for g in shown) if shown else 0.0
    hi = max(float(np.nanmax(g)) for g in shown) if shown else 100.0
    norm = Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1.0)
    for k, (run, (grid, labels)) in enumerate(zip(runs, grids, strict=True)):
        heat, curve = axes[k]
        T = len(run.test_r10)
        title = run.label + (f" ({run.setup})" if run.setup else "")
        heat.set_title(f"{title}: test {MATRIX_METRIC} (%)", fontsize=10)
        curve.set_title(f"average test {MATRIX_METRIC}" + (" and best validation" if run.val_r10 else ""), fontsize=10)
        if T == 0:
            heat.text(0.5, 0.5, "no repository finished", ha="center", va="center")
            continue
        image = heat.imshow(np.ma.masked_invalid(grid), cmap="viridis", norm=norm, aspect="auto")
        scale = "one scale for every panel" if len(runs) > 1 else ""
        fig.colorbar(image, ax=heat, label=f"{MATRIX_METRIC} (%)" + (f", {scale}" if scale else ""))
        short = [fit(name, LABEL_CHARS) for name in run.names]
        heat.set_xticks(list(range(T)), short[:T], rotation=60, ha="right", fontsize=9)
        heat.set_yticks(list(range(len(labels))), labels, fontsize=9)
        heat.set_xlabel("evaluated on")
        heat.set_ylabel("trained through")
        if T <= 16:  # the numbers, large enough to read at a glance: bigger for fewer cells
            size = max(7.0, min(14.0, 96.0 / T))
            for i in range(len(labels)):
                for j in range(T):
                    if np.isnan(grid[i, j]):
                        continue
                    dark = norm(grid[i, j]) < 0.5  # the lower half of viridis is dark: white digits on it
                    heat.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=size,
                              fontweight="bold", color="white" if dark else "black")
        m = run.metrics()
        x = list(range(1, T + 1))
        curve.plot(x, m["avg"], marker="o", label="average test R@10, repositories so far")
        if run.val_r10 is not None:
            vx = [i + 1 for i, v in enumerate(run.val_r10) if v is not None]
            curve.plot(vx, [v for v in run.val_r10 if v is not None], marker="s", label="best validation R@10")
        curve.set_xticks(x, short[:T], rotation=60, ha="right", fontsize=9)
        curve.set_xlabel("after training through")
        curve.set_ylabel(f"{MATRIX_METRIC} (%)")
        curve.set_ylim(0, 100)  # recall's whole range: a few points of noise must not look like a cliff
        curve.grid(True, alpha=0.3)
        curve.legend(fontsize=8, loc="lower left")
        # The lifelong metrics after the last repository, with which way is better ("-": the run is too short).
        summary = "\n".join(f"{name} {metric(name, m.get(name))} ({'lower' if e.lower_is_better else 'higher'} "
                            f"is better)" for name, e in REGISTRY.items())
        curve.text(0.99, 0.02, summary, transform=curve.transAxes, ha="right", va="bottom", fontsize=8,
                   family="monospace", bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8})
    return fig


def _grid(run: LifelongRun):
    """A run's heat map: its rows (the untrained model's first, where the run has one: what training gained is read
    against it) as a T x T array, NaN where nothing was evaluated; and the rows' labels."""
    import numpy as np

    T = len(run.test_r10)
    baseline = run.report.baseline if run.report is not None and run.report.baseline else None
    rows = ([baseline] if baseline else []) + [list(row) for row in run.test_r10]
    labels = (["(untrained)"] if baseline else []) + [fit(name, LABEL_CHARS) for name in run.names[:T]]
    grid = np.full((len(rows), T), np.nan)
    for i, row in enumerate(rows):
        values = [np.nan if v is None else v for v in row[:T]]
        grid[i, : len(values)] = values
    return grid, labels
