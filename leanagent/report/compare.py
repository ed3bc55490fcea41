"""Comparing runs, `leanagent report SOURCE [SOURCE...]`: a SOURCE is a run_dir (its manifest) or a JSON file of a
recall matrix (`load_run`); `comparison_text` and `comparison_json` render them side by side, with the authors'
composite score."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leanagent.ground.json_files import read_json_file
from leanagent.report.cells import fit, mean, metric, mrr, pct
from leanagent.report.metrics import REGISTRY, check_matrix, composite_scores, lifelong_metrics
from leanagent.report.run import MATRIX_METRIC, RunReport, glossary_text, report_from_manifest, run_setup
from leanagent.run.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, ManifestUnreadableError, read_manifest

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
            data = read_manifest(manifest)
        except ManifestUnreadableError as exc:
            raise SourceError(str(exc)) from None
        try:
            report = report_from_manifest(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{manifest}: not a readable run manifest ({exc})") from None
        lm = report.lifelong_metrics()
        val = report.val_r10  # None where a train result has no Recall@10_val: IP is then None
        return LifelongRun(str(path), path.name, list(report.names[: len(report.matrix)]), check_matrix(report.matrix),
                           val if any(v is not None for v in val) else None, None, lm["final_R@1"], lm["final_MRR"],
                           report, run_setup(data.get("config")))
    if not path.is_file():
        raise SourceError(f"{path}: no such run_dir or JSON file")
    return _run_from_json(path, read_json_file(path, MAX_MANIFEST_BYTES, "report", SourceError))


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
                       mean(r1[-1]) if r1 else None, mean(mrr[-1]) if mrr else None)


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
                    **{k: m[k] for k in REGISTRY}, "composite": m["composite"], "avg": m["avg"],
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
        ("final R@1", [pct(m["final_R@1"]) for m in metrics]),
        ("final R@10", [pct(m["final_R@10"]) for m in metrics]),
        ("final MRR", [mrr(m["final_MRR"]) for m in metrics]),
        *((f"{c} ({'lower' if e.lower_is_better else 'higher'} is better)", [metric(c, m[c]) for m in metrics])
          for c, e in REGISTRY.items()),
        ("composite", ["-" if m["composite"] is None else f"{m['composite']:.4f}" for m in metrics]),
    ]
    # A row that no run has (JSON sources carry no setup, R@1 or MRR; WF5 needs 6 repositories) says nothing in
    # every column: named once below the table instead.
    empty = [name for name, cells in table if all(c == "-" for c in cells)]
    table = [(name, cells) for name, cells in table if name not in empty]
    legend = [f"{h} = {run.label} ({run.source})" for h, run in zip(heads, runs, strict=True)]
    if empty:
        legend.append(f"not shown, no run has it: {', '.join(empty)}")
    if markdown:
        text = "| metric | " + " | ".join(heads) + " |\n|---|" + "---|" * len(heads) + "\n"
        text += "".join(f"| {name} | " + " | ".join(cells) + " |\n" for name, cells in table)
        bullets = "\n".join(f"- {line}" for line in legend)
        parts.append(f"## Lifelong metrics\n\n{text}\n{bullets}\n\n{glossary_text()}")
    else:
        width = [max(10, len(h), *(len(cells[k]) for _, cells in table)) for k, h in enumerate(heads)]
        lines = [f"{'metric':<26} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, width, strict=True))]
        lines += [f"{name:<26} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, width, strict=True))
                  for name, cells in table]
        parts.append("Lifelong metrics\n" + "\n".join(lines) + "\n" + "\n".join(legend) + "\n" + glossary_text())
    return "\n\n".join(parts)


def _run_matrix(run: LifelongRun, markdown: bool) -> str:
    m = run.metrics()
    val = run.val_r10 or [None] * len(run.test_r10)
    title = f"{run.label} ({run.source}): {MATRIX_METRIC}, row: trained through; column: evaluated on"
    if markdown:
        text = f"## {title}\n\n| trained through \\ on | " + " | ".join(run.names) + " | avg | val |\n|---|"
        text += "---|" * (len(run.names) + 2) + "\n"
        for i, row in enumerate(run.test_r10):
            cells = [pct(v) for v in row] + [""] * (len(run.names) - len(row)) + [pct(m["avg"][i]), pct(val[i])]
            text += f"| {run.names[i]} | " + " | ".join(cells) + " |\n"
        return text
    lines = [title, f"{'':<24} " + " ".join(f"{fit(n, 8):>8}" for n in run.names) + f" {'avg':>8} {'val':>8}"]
    for i, row in enumerate(run.test_r10):
        cells = [pct(v) for v in row] + [""] * (len(run.names) - len(row)) + [pct(m["avg"][i]), pct(val[i])]
        lines.append(f"{fit(run.names[i], 24):<24} " + " ".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)


