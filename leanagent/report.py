"""What a lifelong run reports: a row per repository and the recall matrix, as plain data and text.

Kept in the library (no Prefect) so that the CLI's plain-text table, the Prefect artifacts and
the tests all read one representation. The matrix is the point of lifelong learning: row i is
the model after training on repository i, column j the repository it is evaluated on, so the
column under an early repository shows what later training forgot. The untrained model's row
(the baseline) shows what training gained at all, and what it transferred forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leanagent.run_state import EVAL_UNTRAINED, TRAIN, eval_stage, stage_result

MATRIX_METRIC = "Recall@10"
UNTRAINED = "(untrained)"


@dataclass
class RunReport:
    names: list[str]
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
        seen = [e["metrics"][MATRIX_METRIC] for e in evaluations]
        self.rows.append({
            "repository": self.names[index],
            "R@1": own.get("Recall@1"),
            "R@10": own.get("Recall@10"),
            "MRR": own.get("MRR"),
            "avg R@10 (seen)": sum(seen) / len(seen),
            "epoch": train.get("epoch"),
            "checkpoint": train.get("checkpoint"),
        })
        self.matrix.append(seen + [None] * (len(self.names) - len(seen)))

    def lifelong_metrics(self) -> dict[str, float | None]:
        """Average final recall; backward transfer (negative = forgetting) over earlier repositories; and the
        gain of the final model over the untrained one. (Forward transfer would need every repository scored
        before it is trained on; the flow scores only those seen so far.)"""
        none = {"average": None, "backward_transfer": None, "gain_over_untrained": None}
        if not self.matrix:
            return none
        last = self.matrix[-1]
        k = len(self.matrix)
        final = [v for v in last[:k] if v is not None]
        bwt = [last[j] - self.matrix[j][j] for j in range(k - 1)
               if last[j] is not None and self.matrix[j][j] is not None]
        base = self.baseline if len(self.baseline) == len(self.names) else [None] * len(self.names)
        gain = [last[j] - base[j] for j in range(k) if last[j] is not None and base[j] is not None]
        return {"average": _mean(final), "backward_transfer": _mean(bwt), "gain_over_untrained": _mean(gain)}

    def markdown(self, manifest: str) -> str:
        header = "| repository | R@1 | R@10 | MRR | epoch | checkpoint |\n|---|---|---|---|---|---|\n"
        body = "".join(f"| {r['repository']} | {_f(r['R@1'])} | {_f(r['R@10'])} | {_f(r['MRR'])} | {r['epoch']} | "
                       f"`{r['checkpoint']}` |\n" for r in self.rows)
        cols = " | ".join(self.names)
        matrix = f"| trained through \\ evaluated on | {cols} |\n|---|" + "---|" * len(self.names) + "\n"
        matrix += "".join(f"| {label} | " + " | ".join(_f(v) for v in row) + " |\n"
                          for label, row in self._matrix_rows())
        return (f"# Lifelong retrieval: {len(self.rows)} of {len(self.names)} repositories\n\n"
                f"## Per repository (on its own test split)\n\n{header}{body}\n"
                f"## {MATRIX_METRIC} matrix\n\nRow i: the model after training on repository i; column j: the "
                f"repository evaluated. Read a column downwards to see forgetting.\n\n{matrix}\n"
                f"{self._summary_line()}\n\nManifest: `{manifest}`\n")

    def text(self) -> str:
        """Plain text for a terminal: the per-repository table, then the matrix."""
        lines = [f"{'repository':<24} {'R@1':>7} {'R@10':>7} {'MRR':>7} {'epoch':>5}  checkpoint"]
        lines += [f"{r['repository']:<24} {_f(r['R@1']):>7} {_f(r['R@10']):>7} {_f(r['MRR']):>7} "
                  f"{r['epoch']!s:>5}  {r['checkpoint']}" for r in self.rows]
        lines += ["", f"{MATRIX_METRIC} (row: trained through; column: evaluated on)",
                  f"{'':<24} " + " ".join(f"{n[:10]:>10}" for n in self.names)]
        lines += [f"{label[:24]:<24} " + " ".join(f"{_f(v):>10}" for v in row) for label, row in self._matrix_rows()]
        lines += ["", self._summary_line()]
        return "\n".join(lines)

    def _matrix_rows(self) -> list[tuple[str, list[float | None]]]:
        rows = [(UNTRAINED, list(self.baseline))] if self.baseline else []
        return rows + [(self.names[i], row) for i, row in enumerate(self.matrix)]

    def _summary_line(self) -> str:
        lm = self.lifelong_metrics()
        return (f"Average final {MATRIX_METRIC}: {_f(lm['average'])}; gain over untrained: "
                f"{_f(lm['gain_over_untrained'])}; backward transfer: {_f(lm['backward_transfer'])}")


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


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
