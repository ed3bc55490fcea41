"""What a lifelong run reports: a row per repository, the recall matrix and LeanAgent's lifelong metrics.

Kept in the library (no Prefect) so that the CLI's plain-text table, the Prefect artifacts and
the tests all read one representation. The matrix is the point of lifelong learning: row i is
the model after training on repository i, column j the repository it is evaluated on, so the
column under an early repository shows what later training forgot. The untrained model's row
(the baseline) shows what training gained at all. The metrics (WF5, FM, EBWT, WP5, IP, CFR; see
`leanagent.lifelong_metrics`) are LeanAgent's summary of that matrix and of the validation recall
curve, and are recomputed after every repository, so a run can be judged while it is still going.

Units, as in LeanAgent: Recall@1 and Recall@10 in percent (2 decimals), MRR a fraction (3 decimals).

`leanagent report SOURCE...` compares runs: a SOURCE is a run_dir (its manifest) or a JSON file of
a recall matrix (`load_run`); `comparison_text`, `comparison_json` and `write_png` render them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leanagent.atomic import write_atomic
from leanagent.lifelong_metrics import check_matrix, composite_scores, lifelong_metrics
from leanagent.run_state import EVAL_UNTRAINED, MANIFEST_NAME, TRAIN, eval_stage, stage_result

MATRIX_METRIC = "Recall@10"
VAL_METRIC = "Recall@10_val"  # the train stage's best validation Recall@10, percent
UNTRAINED = "(untrained)"
METRIC_COLUMNS = ("WF5", "FM", "EBWT", "WP5", "IP", "CFR")
GLOSSARY = ("WF5: windowed forgetting over 5 repositories; FM: forgetting measure (both lower is better); "
            "EBWT: expanded backward transfer; WP5: windowed plasticity; IP: incremental plasticity (validation "
            "R@10); CFR: min/max average R@10 (higher is better). LeanAgent, ICLR 2025, Table 3.")


@dataclass
class RunReport:
    names: list[str]
    # One dict per finished repository: own-split recalls, validation R@10, averages over the repositories
    # seen so far, and the lifelong metrics after it (what the flow's table artifact shows).
    rows: list[dict] = field(default_factory=list)
    # matrix[i][j]: MATRIX_METRIC of the model trained through repository i, on repository j's test split.
    matrix: list[list[float | None]] = field(default_factory=list)
    # baseline[j]: MATRIX_METRIC of the untrained model (model.name_or_path) on repository j.
    baseline: list[float | None] = field(default_factory=list)

    def set_baseline(self, evaluations: list[dict]) -> None:
        self.baseline = [e["metrics"][MATRIX_METRIC] for e in evaluations]

    def add_repository(self, index: int, train: dict, evaluations: list[dict]) -> None:
        """Record repository `index` after its training and its evaluations on repositories 0..index."""
        own = evaluations[index]["metrics"]
        seen = [e["metrics"] for e in evaluations]
        self.matrix.append([m[MATRIX_METRIC] for m in seen] + [None] * (len(self.names) - len(seen)))
        val = (train.get("metrics") or {}).get(VAL_METRIC)
        row = {
            "repository": self.names[index],
            "R@1": own.get("Recall@1"),
            "R@10": own.get("Recall@10"),
            "MRR": own.get("MRR"),
            "val R@10": val,
            "avg R@1 (seen)": _mean_of(m.get("Recall@1") for m in seen),
            "avg R@10 (seen)": _mean_of(m.get(MATRIX_METRIC) for m in seen),
            "avg MRR (seen)": _mean_of(m.get("MRR") for m in seen),
        }
        metrics = lifelong_metrics(self._triangle(), [*self.val_r10, val])
        row.update({m: metrics[m] for m in METRIC_COLUMNS})
        # Epochs trained so far, counted from 1 (the checkpoint's own name holds the 0-based index of its epoch).
        row.update({"epochs": train.get("epoch"), "checkpoint": train.get("checkpoint")})
        self.rows.append(row)

    @property
    def val_r10(self) -> list[float | None]:
        """val[i]: the best validation Recall@10 while training on repository i (None when not recorded)."""
        return [r.get("val R@10") for r in self.rows]

    def metrics_after_each(self) -> list[dict[str, Any]]:
        """The lifelong metrics over repositories 0..i, for each finished repository i."""
        triangle, val = self._triangle(), self.val_r10
        return [lifelong_metrics(triangle[: i + 1], val[: i + 1] if len(val) > i else None)
                for i in range(len(triangle))]

    def lifelong_metrics(self) -> dict[str, Any]:
        """LeanAgent's metrics after the last finished repository (None where they need more repositories),
        the final model's mean R@1 / R@10 / MRR over the repositories seen, and its mean R@10 gain over the
        untrained model on them."""
        triangle = self._triangle()
        val = self.val_r10
        out: dict[str, Any] = dict(lifelong_metrics(triangle, val if len(val) == len(triangle) else None))
        last = self.rows[-1] if self.rows and len(self.rows) == len(triangle) else {}
        out["final_R@1"] = last.get("avg R@1 (seen)")
        out["final_R@10"] = out["avg"][-1] if out["avg"] else None
        out["final_MRR"] = last.get("avg MRR (seen)")
        k = len(triangle)
        base = self.baseline if len(self.baseline) == len(self.names) else [None] * len(self.names)
        gain = [triangle[-1][j] - base[j] for j in range(k) if base[j] is not None] if k else []
        out["gain_over_untrained"] = _mean(gain)
        return out

    def markdown(self, manifest: str) -> str:
        header = "| repository | R@1 | R@10 | MRR | val R@10 | epochs | checkpoint |\n|---|---|---|---|---|---|---|\n"
        body = "".join(f"| {r['repository']} | {_pct(r.get('R@1'))} | {_pct(r.get('R@10'))} | {_mrr(r.get('MRR'))} | "
                       f"{_pct(r.get('val R@10'))} | {r.get('epochs')} | `{r.get('checkpoint')}` |\n"
                       for r in self.rows)
        cols = " | ".join(self.names)
        matrix = f"| trained through \\ evaluated on | {cols} |\n|---|" + "---|" * len(self.names) + "\n"
        matrix += "".join(f"| {label} | " + " | ".join(_pct(v) for v in row) + " |\n"
                          for label, row in self._matrix_rows())
        return (f"# Lifelong retrieval: {len(self.rows)} of {len(self.names)} repositories\n\n"
                f"## Per repository (on its own test split)\n\n{header}{body}\n"
                f"## Lifelong metrics after each repository\n\nOver the repositories seen so far; recall in percent. "
                f"{GLOSSARY}\n\n{self._metrics_markdown()}\n"
                f"## {MATRIX_METRIC} matrix\n\nRow i: the model after training on repository i; column j: the "
                f"repository evaluated. Read a column downwards to see forgetting.\n\n{matrix}\n"
                f"{self._summary_lines()}\n\nManifest: `{manifest}`\n")

    def text(self) -> str:
        """Plain text for a terminal: the per-repository table, the metrics after each repository, the matrix."""
        lines = [f"{'repository':<24} {'R@1':>7} {'R@10':>7} {'MRR':>7} {'val R@10':>8} {'epochs':>6}  checkpoint"]
        lines += [f"{r['repository'][:24]:<24} {_pct(r.get('R@1')):>7} {_pct(r.get('R@10')):>7} "
                  f"{_mrr(r.get('MRR')):>7} {_pct(r.get('val R@10')):>8} {r.get('epochs')!s:>6}  {r.get('checkpoint')}"
                  for r in self.rows]
        lines += ["", "Lifelong metrics after each repository (over the repositories seen so far)",
                  self._metrics_text(), "", f"{MATRIX_METRIC} (row: trained through; column: evaluated on)",
                  f"{'':<24} " + " ".join(f"{n[:10]:>10}" for n in self.names)]
        lines += [f"{label[:24]:<24} " + " ".join(f"{_pct(v):>10}" for v in row) for label, row in self._matrix_rows()]
        lines += ["", self._summary_lines(), GLOSSARY]
        return "\n".join(lines)

    def _triangle(self) -> list[list[float]]:
        """The finished rows of the matrix, each cut to the repositories seen (the metrics' input)."""
        return check_matrix(self.matrix)

    def _metric_rows(self) -> list[tuple[str, list[str]]]:
        out = []
        for i, m in enumerate(self.metrics_after_each()):
            row = self.rows[i] if i < len(self.rows) else {}
            cells = [_pct(row.get("avg R@1 (seen)")), _pct(m["avg"][-1]), _mrr(row.get("avg MRR (seen)"))]
            out.append((self.names[i], cells + [_metric(c, m[c]) for c in METRIC_COLUMNS]))
        return out

    def _metrics_markdown(self) -> str:
        head = ["after repository", "avg R@1", "avg R@10", "avg MRR", *METRIC_COLUMNS]
        text = "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
        return text + "".join(f"| {name} | " + " | ".join(cells) + " |\n" for name, cells in self._metric_rows())

    def _metrics_text(self) -> str:
        head = ["avg R@1", "avg R@10", "avg MRR", *METRIC_COLUMNS]
        lines = [f"{'after':<24} " + " ".join(f"{h:>8}" for h in head)]
        lines += [f"{name[:24]:<24} " + " ".join(f"{c:>8}" for c in cells) for name, cells in self._metric_rows()]
        return "\n".join(lines)

    def _matrix_rows(self) -> list[tuple[str, list[float | None]]]:
        rows = [(UNTRAINED, list(self.baseline))] if self.baseline else []
        return rows + [(self.names[i], row) for i, row in enumerate(self.matrix)]

    def _summary_lines(self) -> str:
        lm = self.lifelong_metrics()
        k = len(self.matrix)
        return (f"Final model over the {k} repositories seen: R@1 {_pct(lm['final_R@1'])}, R@10 "
                f"{_pct(lm['final_R@10'])}, MRR {_mrr(lm['final_MRR'])}; R@10 gain over untrained: "
                f"{_pct(lm['gain_over_untrained'])}\n"
                f"WF5 {_metric('WF5', lm['WF5'])}, FM {_metric('FM', lm['FM'])}, EBWT (expanded backward transfer) "
                f"{_metric('EBWT', lm['EBWT'])}, WP5 {_metric('WP5', lm['WP5'])}, IP {_metric('IP', lm['IP'])}, "
                f"CFR {_metric('CFR', lm['CFR'])}")


def report_from_manifest(manifest: dict) -> RunReport:
    """Rebuild the report of a run (finished or not) from its manifest, as `leanagent report` prints it."""
    names = list(manifest.get("order") or [])
    report = RunReport(names)
    baseline = [stage_result(manifest, j, name, EVAL_UNTRAINED) for j, name in enumerate(names)]
    if names and all(b is not None for b in baseline):
        report.set_baseline(baseline)
    for i, name in enumerate(names):
        train = stage_result(manifest, i, name, TRAIN)
        evaluations = [stage_result(manifest, i, name, eval_stage(j, names[j])) for j in range(i + 1)]
        if train is None or any(e is None for e in evaluations):
            break  # the run stopped here; later repositories have nothing to report yet
        report.add_repository(i, train, evaluations)
    return report


# ---------------------------------------------------------------------------------------------------------------
# Comparing runs: `leanagent report SOURCE [SOURCE...]`

JSON_KEYS = {"names", "test_recall_at_10", "val_recall_at_10", "avg_test_recall_at_10", "test_recall_at_1",
             "test_mrr", "label", "source", "published", "comment"}


class SourceError(ValueError):
    """A SOURCE of `leanagent report` that cannot be read; the message names the file and the problem."""


@dataclass
class LifelongRun:
    """One run to compare: its recall matrix (percent, lower-triangular) and what else its source holds."""

    source: str
    label: str
    names: list[str]
    test_r10: list[list[float]]
    val_r10: list[float | None] | None = None
    # LeanAgent computed WF5, WP5 and CFR from the averages it logged (rounded); a JSON source may give them.
    avg_r10: list[float] | None = None
    final_r1: float | None = None
    final_mrr: float | None = None
    report: RunReport | None = None  # a run_dir's full report
    # A run_dir's LeanAgent setup (dataset strategy, curriculum, EWC), so that compared runs say what they are.
    setup: str | None = None

    @property
    def short_name(self) -> str:
        path = Path(self.source)
        return path.name if path.is_dir() else path.stem

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(lifelong_metrics(self.test_r10, self.val_r10, avg=self.avg_r10))
        out["final_R@1"] = self.final_r1
        out["final_R@10"] = out["avg"][-1] if out["avg"] else None
        out["final_MRR"] = self.final_mrr
        return out


def load_run(path: str | Path) -> LifelongRun:
    """A run_dir (holding manifest.json) or a JSON file `{"names", "test_recall_at_10", "val_recall_at_10"}`.

    The JSON rows are lower-triangular, in percent: row i holds the Recall@10 on repositories 0..i after
    training through i. Optional keys: `avg_test_recall_at_10` (logged averages, used instead of the row
    means), `test_recall_at_1` and `test_mrr` (matrices of the same shape, for the final means), and
    `label`, `source`, `published`, `comment` (annotations). Raises SourceError naming the file.
    """
    path = Path(path)
    if path.is_dir():
        manifest = path / MANIFEST_NAME
        if not manifest.is_file():
            raise SourceError(f"{path}: a folder without {MANIFEST_NAME} (not a run_dir of `leanagent run`)")
        try:
            data = json.loads(manifest.read_text())
            report = report_from_manifest(data)
        except (json.JSONDecodeError, OSError, KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{manifest}: not a readable run manifest ({exc})") from None
        lm = report.lifelong_metrics()
        val = report.val_r10  # None where a train result has no Recall@10_val: IP is then None
        return LifelongRun(str(path), path.name, list(report.names[: len(report.matrix)]), check_matrix(report.matrix),
                           val if any(v is not None for v in val) else None, None, lm["final_R@1"], lm["final_MRR"],
                           report, run_setup(data.get("config")))
    if not path.is_file():
        raise SourceError(f"{path}: no such run_dir or JSON file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    return _run_from_json(path, doc)


def run_setup(config: Any) -> str | None:
    """`merge_all, curriculum, EWC 0.1`: LeanAgent's three switches, from a manifest's config (a run recorded before
    `dataset_strategy` existed ran `single`, the default)."""
    lifelong = config.get("lifelong") if isinstance(config, dict) else None
    if not isinstance(lifelong, dict):
        return None
    ewc = lifelong.get("ewc_lambda") or 0
    return ", ".join([str(lifelong.get("dataset_strategy", "single")),
                      "curriculum" if lifelong.get("curriculum", True) else "given order",
                      f"EWC {ewc:g}" if ewc else "no EWC"])


def _run_from_json(path: Path, doc: Any) -> LifelongRun:
    def fail(problem: str) -> SourceError:
        return SourceError(f"{path}: {problem}")

    if not isinstance(doc, dict):
        raise fail(f"expected a JSON object with names and test_recall_at_10, found {type(doc).__name__}")
    unknown = sorted(set(doc) - JSON_KEYS)
    if unknown:
        raise fail(f"unknown key(s) {unknown}; known: {sorted(JSON_KEYS)}")
    for key in ("names", "test_recall_at_10"):
        if key not in doc:
            raise fail(f"missing key {key!r}")
    names = doc["names"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise fail("names: expected a non-empty list of repository names")
    T = len(names)

    def triangle(key: str, low: float, high: float) -> list[list[float]] | None:
        rows = doc.get(key)
        if rows is None:
            return None
        if not isinstance(rows, list) or len(rows) != T or not all(isinstance(r, list) for r in rows):
            raise fail(f"{key}: expected {T} rows (one per name), row i holding i+1 values")
        for i, row in enumerate(rows):
            if len(row) != i + 1:
                raise fail(f"{key} row {i} has {len(row)} value(s); row i holds i+1 (repositories 0..{i}), "
                           f"lower-triangular")
            for j, v in enumerate(row):
                _check_number(fail, f"{key}[{i}][{j}]", v, low, high)
        return [[float(v) for v in row] for row in rows]

    def vector(key: str, allow_null: bool) -> list[Any] | None:
        values = doc.get(key)
        if values is None:
            return None
        if not isinstance(values, list) or len(values) != T:
            raise fail(f"{key}: expected a list of {T} values (one per name)")
        for i, v in enumerate(values):
            if not (allow_null and v is None):
                _check_number(fail, f"{key}[{i}]", v, 0.0, 100.0)
        return [None if v is None else float(v) for v in values]

    test_r10 = triangle("test_recall_at_10", 0.0, 100.0)
    assert test_r10 is not None
    r1 = triangle("test_recall_at_1", 0.0, 100.0)
    mrr = triangle("test_mrr", 0.0, 1.0)
    label = doc.get("label")
    return LifelongRun(str(path), label if isinstance(label, str) and label else path.stem, list(names), test_r10,
                       vector("val_recall_at_10", allow_null=True), vector("avg_test_recall_at_10", allow_null=False),
                       _mean(r1[-1]) if r1 else None, _mean(mrr[-1]) if mrr else None)


def _check_number(fail: Any, where: str, v: Any, low: float, high: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise fail(f"{where}: {v!r} is not a number")
    if not low <= v <= high:
        unit = "percent" if high == 100.0 else "a fraction"
        raise fail(f"{where}: {v} is outside [{low:g}, {high:g}] ({unit})")


def compare(runs: Sequence[LifelongRun]) -> list[dict[str, Any]]:
    """Each run's metrics and, with two or more runs, its composite score across them, in the order given."""
    metrics = [run.metrics() for run in runs]
    for m, score in zip(metrics, composite_scores(metrics), strict=True):
        m["composite"] = score
    return metrics


def comparison_json(runs: Sequence[LifelongRun]) -> dict[str, Any]:
    """What `leanagent report --json` writes: {"runs": [...]}, in the order given."""
    out = []
    for run, m in zip(runs, compare(runs), strict=True):
        out.append({"source": run.source, "label": run.label, "setup": run.setup, "names": run.names,
                    "repositories": len(run.test_r10),
                    **{k: m[k] for k in METRIC_COLUMNS}, "composite": m["composite"], "avg": m["avg"],
                    "val": run.val_r10, "final_R@1": m["final_R@1"], "final_R@10": m["final_R@10"],
                    "final_MRR": m["final_MRR"]})
    return {"runs": out}


def comparison_text(runs: Sequence[LifelongRun], markdown: bool = False) -> str:
    """Each run's recall matrix (with the average and validation R@10 of each row), then the metrics side by
    side, one column per run."""
    parts = [_run_matrix(run, markdown) for run in runs]
    metrics = compare(runs)
    heads = [f"{k + 1}:{run.short_name}" for k, run in enumerate(runs)]
    table: list[tuple[str, list[str]]] = [
        ("setup", [run.setup or "-" for run in runs]),
        ("repositories", [str(len(run.test_r10)) for run in runs]),
        ("final R@1", [_pct(m["final_R@1"]) for m in metrics]),
        ("final R@10", [_pct(m["final_R@10"]) for m in metrics]),
        ("final MRR", [_mrr(m["final_MRR"]) for m in metrics]),
        *((f"{c} ({'lower' if c in ('WF5', 'FM') else 'higher'} is better)", [_metric(c, m[c]) for m in metrics])
          for c in METRIC_COLUMNS),
        ("composite", ["-" if m["composite"] is None else f"{m['composite']:.4f}" for m in metrics]),
    ]
    legend = [f"{h} = {run.label} ({run.source})" for h, run in zip(heads, runs, strict=True)]
    if markdown:
        text = "| metric | " + " | ".join(heads) + " |\n|---|" + "---|" * len(heads) + "\n"
        text += "".join(f"| {name} | " + " | ".join(cells) + " |\n" for name, cells in table)
        bullets = "\n".join(f"- {line}" for line in legend)
        parts.append(f"## Lifelong metrics\n\n{text}\n{bullets}\n\n{GLOSSARY}")
    else:
        width = [max(10, len(h), *(len(cells[k]) for _, cells in table)) for k, h in enumerate(heads)]
        lines = [f"{'metric':<26} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, width, strict=True))]
        lines += [f"{name:<26} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, width, strict=True))
                  for name, cells in table]
        parts.append("Lifelong metrics\n" + "\n".join(lines) + "\n" + "\n".join(legend) + "\n" + GLOSSARY)
    return "\n\n".join(parts)


def _run_matrix(run: LifelongRun, markdown: bool) -> str:
    m = run.metrics()
    val = run.val_r10 or [None] * len(run.test_r10)
    title = f"{run.label} ({run.source}): {MATRIX_METRIC}, row: trained through; column: evaluated on"
    if markdown:
        text = f"## {title}\n\n| trained through \\ on | " + " | ".join(run.names) + " | avg | val |\n|---|"
        text += "---|" * (len(run.names) + 2) + "\n"
        for i, row in enumerate(run.test_r10):
            cells = [_pct(v) for v in row] + [""] * (len(run.names) - len(row)) + [_pct(m["avg"][i]), _pct(val[i])]
            text += f"| {run.names[i]} | " + " | ".join(cells) + " |\n"
        return text
    lines = [title, f"{'':<24} " + " ".join(f"{n[:8]:>8}" for n in run.names) + f" {'avg':>8} {'val':>8}"]
    for i, row in enumerate(run.test_r10):
        cells = [_pct(v) for v in row] + [""] * (len(run.names) - len(row)) + [_pct(m["avg"][i]), _pct(val[i])]
        lines.append(f"{run.names[i][:24]:<24} " + " ".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)


def write_png(runs: Sequence[LifelongRun], out: str | Path) -> None:
    """Each run's recall matrix as a heat map, beside its average test and validation R@10 curves (Agg, no display)."""
    import numpy as np
    from matplotlib.figure import Figure  # a Figure without pyplot renders with Agg and touches no global state

    n = max(1, len(runs))
    fig = Figure(figsize=(13, 4.8 * n), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False)
    for k, run in enumerate(runs):
        heat, curve = axes[k]
        T = len(run.test_r10)
        heat.set_title(f"{run.label}: test {MATRIX_METRIC} (%)", fontsize=10)
        curve.set_title(f"average test {MATRIX_METRIC}" + (" and best validation" if run.val_r10 else ""), fontsize=10)
        if T == 0:
            heat.text(0.5, 0.5, "no repository finished", ha="center", va="center")
            continue
        # The untrained model's row first, where the run has one: what training gained is read against it.
        baseline = run.report.baseline if run.report is not None and run.report.baseline else None
        rows = ([baseline] if baseline else []) + [list(row) for row in run.test_r10]
        labels = (["(untrained)"] if baseline else []) + [name[:14] for name in run.names[:T]]
        grid = np.full((len(rows), T), np.nan)
        for i, row in enumerate(rows):
            values = [np.nan if v is None else v for v in row[:T]]
            grid[i, : len(values)] = values
        image = heat.imshow(np.ma.masked_invalid(grid), cmap="viridis", aspect="auto")
        fig.colorbar(image, ax=heat, label=f"{MATRIX_METRIC} (%)")
        short = [name[:14] for name in run.names]
        heat.set_xticks(list(range(T)), short, rotation=60, ha="right", fontsize=9)
        heat.set_yticks(list(range(len(rows))), labels, fontsize=9)
        heat.set_xlabel("evaluated on")
        heat.set_ylabel("trained through")
        if T <= 16:  # the numbers, large enough to read at a glance: bigger for fewer cells
            size = max(7.0, min(14.0, 96.0 / T))
            lo, hi = np.nanmin(grid), np.nanmax(grid)
            for i in range(len(rows)):
                for j in range(T):
                    if np.isnan(grid[i, j]):
                        continue
                    dark = hi > lo and (grid[i, j] - lo) / (hi - lo) < 0.5
                    heat.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=size,
                              fontweight="bold", color="white" if dark else "black")
        m = run.metrics()
        x = list(range(1, T + 1))
        curve.plot(x, m["avg"], marker="o", label="average test R@10 over the repositories seen")
        if run.val_r10 is not None:
            vx = [i + 1 for i, v in enumerate(run.val_r10) if v is not None]
            curve.plot(vx, [v for v in run.val_r10 if v is not None], marker="s", label="best validation R@10")
        curve.set_xticks(x, short, rotation=60, ha="right", fontsize=9)
        curve.set_xlabel("after training through")
        curve.set_ylabel(f"{MATRIX_METRIC} (%)")
        curve.grid(True, alpha=0.3)
        curve.legend(fontsize=8)
    write_atomic(Path(out), lambda f: fig.savefig(f, format="png", dpi=130), mode="wb", suffix=".png")


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean_of(values: Any) -> float | None:
    """The mean of the values, or None when one is missing (an average over part of the seen repositories misleads)."""
    vals = list(values)
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def _pct(value: float | None) -> str:
    """A recall in percent (or a difference of recalls), 2 decimals."""
    return "-" if value is None else f"{value:.2f}"


def _mrr(value: float | None) -> str:
    """An MRR, a fraction as in LeanAgent, 3 decimals."""
    return "-" if value is None else f"{value:.3f}"


def _metric(name: str, value: float | None) -> str:
    """A lifelong metric as the paper prints it (2 decimals); CFR, a ratio, with 3."""
    if value is None:
        return "-"
    return f"{value:.3f}" if name == "CFR" else f"{value:.2f}"
