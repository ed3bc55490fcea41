"""LeanAgent's lifelong-learning metrics, computed from the recall matrix.

Why these and not accuracy alone: LeanAgent (Kumarappan et al., ICLR 2025, Sec. 4.3, Table 3 and
Appendix A.4) judges a lifelong premise retriever by how it trades stability (what it keeps) against
plasticity (what it learns), with six metrics over the test Recall@10 matrix and the validation
Recall@10 curve. The definitions below are those of the authors' analysis script
(`statistical_analysis.py`, github.com/vishnya/LeanAgent, commit 86661491fe), which reproduces the
paper's Table 4; the test `tests/unit/test_lifelong_metrics.py` checks that it still does.

Notation (0-based, T repositories, all recalls in percent):

- ``R[i][j]``: test Recall@10 on repository j after training through repository i (j <= i);
- ``avg[i]``: mean of ``R[i][0..i]``, the average test Recall@10 over the repositories seen so far;
- ``val[i]``: the best validation Recall@10 while training on repository i.

Metrics:

- ``WF5`` (Windowed-Forgetting 5, lower is better): the largest drop of ``avg[i]`` below the best of the
  5 averages before it, ``max(0, max over i >= 5 of (max(avg[i-5..i-1]) - avg[i]))``; None when T <= 5.
- ``WP5`` (Windowed-Plasticity 5, higher is better): mean over i of ``max(0, avg[i] - avg[max(0, i-5)])``.
- ``FM`` (Forgetting Measure, lower is better): mean over t in 0..T-2 of
  ``max(R[t][0..t]) - R[T-1][t]``. This is the script's formula read literally: the best recall in
  *row* t (any repository, after training through t) against the final recall on repository t, not
  the textbook column maximum. Kept so that the numbers compare with the paper's.
- ``EBWT`` (Expanded Backward Transfer, higher is better): mean over the pairs 0 <= j <= t <= T-2 of
  ``R[t][j] - R[j][j]``. Again the script's indices: the final row and the j == t pairs (worth 0) are in.
- ``IP`` (Incremental Plasticity, higher is better): mean of ``val[i+1] - val[i]``.
- ``CFR`` (Catastrophic Forgetting Resilience, higher is better): ``min(avg) / max(avg)``.

A metric that needs more repositories than there are is None, not 0: FM, EBWT and IP need T >= 2,
WF5 needs T >= 6 (the script reports 0 there, which reads as "no forgetting" when nothing was measured).
IP is also None without validation recalls.

The composite score (the authors' script, not the paper's tables) ranks two or more runs:
``0.2(1-WF5') + 0.2(1-FM') + 0.1 WP5' + 0.1 IP' + 0.2 EBWT' + 0.2 CFR'``, where x' is x min-max
normalised across the compared runs (1 when all runs are equal). See `composite_scores` for what
happens when a metric is None for some run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

WINDOW = 5


@dataclass(frozen=True)
class Curves:
    """What every metric is computed from: the lower-triangular matrix R, the averages avg[i] and the validation
    recalls val[i] (None when not all are known)."""

    R: list[list[float]]
    avg: list[float]
    val: list[float] | None


@dataclass(frozen=True)
class LifelongMetric:
    """One metric of the report: its name, how to compute it (None when the run is too short to say), which way is
    better, its one-line meaning (printed beside it), its weight in the composite score, and its printed
    decimals."""

    name: str
    compute: Callable[[Curves], float | None]
    lower_is_better: bool
    meaning: str
    weight: float = 0.0
    decimals: int = 2


def _wf5(c: Curves) -> float | None:
    T = len(c.avg)
    if T <= WINDOW:
        return None
    return max(0.0, max(max(c.avg[i - WINDOW:i]) - c.avg[i] for i in range(WINDOW, T)))


def _fm(c: Curves) -> float | None:
    T = len(c.R)
    return _mean([max(c.R[t]) - c.R[T - 1][t] for t in range(T - 1)]) if T >= 2 else None


def _ebwt(c: Curves) -> float | None:
    T = len(c.R)
    return _mean([c.R[t][j] - c.R[j][j] for t in range(T - 1) for j in range(t + 1)]) if T >= 2 else None


def _wp5(c: Curves) -> float | None:
    return _mean([max(0.0, c.avg[i] - c.avg[max(0, i - WINDOW)]) for i in range(len(c.avg))])


def _ip(c: Curves) -> float | None:
    if c.val is None or len(c.val) < 2:
        return None
    return _mean([c.val[i + 1] - c.val[i] for i in range(len(c.val) - 1)])


def _cfr(c: Curves) -> float | None:
    top = max(c.avg) if c.avg else 0.0
    return min(c.avg) / top if top > 0 else None


# LeanAgent's metrics (Table 3; the weights are its script's `calculate_composite_score`, summing to 1). A new
# metric is one entry here: the report, the comparison, the artifacts and the PNG read this table.
REGISTRY: dict[str, LifelongMetric] = {m.name: m for m in (
    LifelongMetric("WF5", _wf5, True, "windowed forgetting: the largest drop of average R@10 below its best of the "
                   "5 repositories before (needs 6 or more)", 0.2),
    LifelongMetric("FM", _fm, True, "forgetting measure: how far the final R@10 on each earlier repository fell "
                   "below that row's best", 0.2),
    LifelongMetric("EBWT", _ebwt, False, "expanded backward transfer: how later training changed R@10 on "
                   "repositories seen before (negative: forgetting)", 0.2),
    LifelongMetric("WP5", _wp5, False, "windowed plasticity: the rise of average R@10 over the last 5 "
                   "repositories, clipped at 0 (0.00: average recall did not rise over the window)", 0.1),
    LifelongMetric("IP", _ip, False, "incremental plasticity: the mean change of the best validation R@10 from one "
                   "repository to the next", 0.1),
    LifelongMetric("CFR", _cfr, False, "catastrophic forgetting resilience: the lowest average R@10 over the highest "
                   "(1: never below its best)", 0.2, decimals=3),
)}


def metric_names() -> tuple[str, ...]:
    """The metrics in the table's order (the report's columns)."""
    return tuple(REGISTRY)


def glossary() -> str:
    """Each metric's meaning and which way is better, one line each."""
    return "\n".join(f"{m.name} ({'lower' if m.lower_is_better else 'higher'} is better): {m.meaning}"
                     for m in REGISTRY.values())


def check_matrix(test_r10: Sequence[Sequence[float | None]]) -> list[list[float]]:
    """The lower triangle of a recall matrix as floats; raises ValueError naming the first bad row.

    Row i must hold at least i+1 numbers; anything after them (the None padding of a report's matrix,
    which has a column per repository) is ignored.
    """
    rows: list[list[float]] = []
    for i, row in enumerate(test_r10):
        if len(row) < i + 1:
            raise ValueError(f"row {i} has {len(row)} value(s); row i needs i+1 (repositories 0..{i})")
        values = list(row[: i + 1])
        for j, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"row {i}, column {j}: {v!r} is not a number")
        rows.append([float(v) for v in values])
    return rows


def lifelong_metrics(test_r10: Sequence[Sequence[float | None]], val_r10: Sequence[float | None] | None = None,
                     *, avg: Sequence[float] | None = None) -> dict[str, float | list[float] | None]:
    """WF5, WP5, FM, EBWT, IP, CFR and avg (see the module docstring) of one run.

    `test_r10[i][j]` is the test Recall@10 (percent) on repository j after training through i, j <= i;
    `val_r10[i]` the best validation Recall@10 (percent) while training on i, or None when unknown
    (IP is then None). `avg`, when given, replaces the row means in WF5, WP5 and CFR: LeanAgent computed
    those from the average recalls it logged, rounded to 2 decimals, so reproducing its published numbers
    to their last digit needs them. Raises ValueError for a matrix that is not lower-triangular, or a
    val_r10 or avg whose length is not the number of rows.
    """
    R = check_matrix(test_r10)
    T = len(R)
    if val_r10 is not None and len(val_r10) != T:
        raise ValueError(f"{len(val_r10)} validation recall(s) for {T} repositories")
    if avg is not None and len(avg) != T:
        raise ValueError(f"{len(avg)} average recall(s) for {T} repositories")
    avg = [float(a) for a in avg] if avg is not None else [sum(row) / len(row) for row in R]
    out: dict[str, float | list[float] | None] = {m: None for m in REGISTRY}
    out["avg"] = avg
    if T == 0:
        return out
    val = [float(v) for v in val_r10] if val_r10 is not None and all(v is not None for v in val_r10) else None
    curves = Curves(R, avg, val)  # type: ignore[arg-type]
    for name, m in REGISTRY.items():
        out[name] = m.compute(curves)
    return out


def composite_scores(runs: Sequence[Mapping[str, object]]) -> list[float | None]:
    """The authors' composite score of each run, in the order given; None for every run when fewer than two.

    Each metric is min-max normalised across the runs (1 for every run when all are equal, as the
    script does), inverted for WF5 and FM (lower is better), weighted by each metric's `weight` and summed.

    A metric that is None for any run (WF5 of a run with T <= 5, IP of a run without validation
    recalls, ...) is left out of every run's score, and the remaining weights are rescaled to sum to 1:
    the runs are then still scored on the same terms and on the same 0..1 scale, instead of a run being
    rewarded or punished for a number nobody measured. When no metric is known for all runs, every
    score is None.
    """
    n = len(runs)
    if n < 2:
        return [None] * n
    weights = {name: m.weight for name, m in REGISTRY.items() if m.weight}
    terms = [m for m in weights if all(isinstance(r.get(m), (int, float)) for r in runs)]
    total = sum(weights[m] for m in terms)
    if not terms or total == 0:
        return [None] * n
    scores = [0.0] * n
    for m in terms:
        values = [float(r[m]) for r in runs]  # type: ignore[arg-type]
        lo, hi = min(values), max(values)
        for k, v in enumerate(values):
            x = 1.0 if hi == lo else (v - lo) / (hi - lo)
            scores[k] += weights[m] / total * ((1.0 - x) if REGISTRY[m].lower_is_better else x)
    return list(scores)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
