"""One run's report: a row per repository, the recall matrix and LeanAgent's lifelong metrics, from its manifest.

Kept in the library (no Prefect) so that the CLI's plain-text table, the Prefect artifacts and the tests all read
one representation. The matrix is the point of lifelong learning: row i is the model after training on
repository i, column j the repository it is evaluated on, so the column under an early repository shows what
later training forgot. The untrained model's row (the baseline) shows what training gained at all. The metrics
(WF5, FM, EBWT, WP5, IP, CFR; see `leanagent.report.metrics`) are LeanAgent's summary of that matrix and of the
validation recall curve, and are recomputed after every repository, so a run can be judged while it is still going.
A continued run (repositories that arrive later) grows by rows and columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from leanagent.ground.names import AUTO
from leanagent.report.cells import fit, mean, mean_of, metric, mrr, pct
from leanagent.report.metrics import REGISTRY, check_matrix, glossary, lifelong_metrics, metric_names
from leanagent.report.timing import JobCost, job_costs, time_markdown, time_summary, time_text
from leanagent.run.manifest import EVAL_UNTRAINED, TRAIN, eval_stage, stage_result

MATRIX_METRIC = "Recall@10"
VAL_METRIC = "Recall@10_val"  # the train stage's best validation Recall@10, percent
CHECKPOINT_VAL_METRIC = "checkpoint_Recall@10_val"  # that of the checkpoint the next repository starts from
COLUMNS_NOTE = ("val R@10: the best epoch's validation R@10 (what IP reads); next starts from: the checkpoint the "
                "next repository trains from (lifelong.checkpoint), with its own validation R@10 in brackets.")
UNTRAINED = "(untrained)"


def glossary_text() -> str:
    """What each lifelong metric means, printed under every table of them."""
    return f"{glossary()}\nRecall in percent; LeanAgent (ICLR 2025), Table 3."


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
    # Each finished job's seconds by part and the premises it embedded (`report/timing.py`), in the order they ran.
    costs: list[JobCost] = field(default_factory=list)
    # The run's setup (`run_setup`: strategy, curriculum, EWC, recipe, precision), when read from a manifest.
    setup: str | None = None

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
            "avg R@1 (seen)": mean_of(m.get("Recall@1") for m in seen),
            "avg R@10 (seen)": mean_of(m.get(MATRIX_METRIC) for m in seen),
            "avg MRR (seen)": mean_of(m.get("MRR") for m in seen),
        }
        metrics = lifelong_metrics(self._triangle(), [*self.val_r10, val])
        row.update({m: metrics[m] for m in metric_names()})
        # Epochs trained so far, counted from 1 (the checkpoint's own name holds the 0-based index of its epoch).
        row.update({"epochs": train.get("epoch"), "checkpoint": train.get("checkpoint"),
                    "checkpoint val R@10": (train.get("metrics") or {}).get(CHECKPOINT_VAL_METRIC)})
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
        out["gain_over_untrained"] = mean(gain)
        return out

    def markdown(self, manifest: str) -> str:
        header = ("| repository | R@1 | R@10 | MRR | val R@10 | epochs | next starts from |\n"
                  "|---|---|---|---|---|---|---|\n")
        body = "".join(f"| {r['repository']} | {pct(r.get('R@1'))} | {pct(r.get('R@10'))} | {mrr(r.get('MRR'))} | "
                       f"{pct(r.get('val R@10'))} | {r.get('epochs')} | `{r.get('checkpoint')}`"
                       f"{_checkpoint_val(r)} |\n" for r in self.rows)
        cols = " | ".join(self.names)
        matrix = f"| trained through \\ evaluated on | {cols} |\n|---|" + "---|" * len(self.names) + "\n"
        matrix += "".join(f"| {label} | " + " | ".join(pct(v) for v in row) + " |\n"
                          for label, row in self._matrix_rows())
        setup = f"Setup: {self.setup}\n\n" if self.setup else ""
        return (f"# Lifelong retrieval: {len(self.rows)} of {len(self.names)} repositories\n\n{setup}"
                f"## Per repository (on its own test split)\n\n{header}{body}\n{COLUMNS_NOTE}\n\n"
                f"## Lifelong metrics after each repository\n\nOver the repositories seen so far; recall in percent. "
                f"\n\n{self._metrics_markdown()}\n{_bullets(glossary_text())}\n\n"
                f"## {MATRIX_METRIC} matrix\n\nRow i: the model after training on repository i; column j: the "
                f"repository evaluated. Read a column downwards to see forgetting.\n\n{matrix}\n"
                f"{self._summary_lines()}\n\n{time_markdown(self.costs)}\nManifest: `{manifest}`\n")

    def text(self, time_table: bool = True) -> str:
        """Plain text for a terminal: the per-repository table, the metrics after each repository, the run's setup
        (precision included) and the matrix, then where the time went (a table per job, or with `time_table=False`
        one line for all of them)."""
        lines = [f"{'repository':<24} {'R@1':>7} {'R@10':>7} {'MRR':>7} {'val R@10':>8} {'epochs':>6}  "
                 f"next starts from"]
        lines += [f"{fit(r['repository'], 24):<24} {pct(r.get('R@1')):>7} {pct(r.get('R@10')):>7} "
                  f"{mrr(r.get('MRR')):>7} {pct(r.get('val R@10')):>8} {r.get('epochs')!s:>6}  {r.get('checkpoint')}"
                  f"{_checkpoint_val(r)}" for r in self.rows]
        lines.append(COLUMNS_NOTE)
        lines += ["", "Lifelong metrics after each repository (over the repositories seen so far)",
                  self._metrics_text(), "", *([f"Setup: {self.setup}"] if self.setup else []),
                  f"{MATRIX_METRIC} (row: trained through; column: evaluated on)",
                  f"{'':<24} " + " ".join(f"{fit(n, 10):>10}" for n in self.names)]
        lines += [f"{fit(label, 24):<24} " + " ".join(f"{pct(v):>10}" for v in row)
                  for label, row in self._matrix_rows()]
        lines += ["", self._summary_lines(), glossary_text()]
        if self.costs:
            lines += ["", time_text(self.costs) if time_table else time_summary(self.costs)]
        return "\n".join(lines)

    def _triangle(self) -> list[list[float]]:
        """The finished rows of the matrix, each cut to the repositories seen (the metrics' input)."""
        return check_matrix(self.matrix)

    def _metric_rows(self) -> list[tuple[str, list[str]]]:
        out = []
        for i, m in enumerate(self.metrics_after_each()):
            row = self.rows[i] if i < len(self.rows) else {}
            cells = [pct(row.get("avg R@1 (seen)")), pct(m["avg"][-1]), mrr(row.get("avg MRR (seen)"))]
            out.append((self.names[i], cells + [metric(c, m[c]) for c in metric_names()]))
        return out

    def _metrics_markdown(self) -> str:
        head = ["after repository", "avg R@1", "avg R@10", "avg MRR", *metric_names()]
        text = "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
        return text + "".join(f"| {name} | " + " | ".join(cells) + " |\n" for name, cells in self._metric_rows())

    def _metrics_text(self) -> str:
        head = ["avg R@1", "avg R@10", "avg MRR", *metric_names()]
        lines = [f"{'after':<24} " + " ".join(f"{h:>8}" for h in head)]
        lines += [f"{fit(name, 24):<24} " + " ".join(f"{c:>8}" for c in cells) for name, cells in self._metric_rows()]
        return "\n".join(lines)

    def _matrix_rows(self) -> list[tuple[str, list[float | None]]]:
        rows = [(UNTRAINED, list(self.baseline))] if self.baseline else []
        return rows + [(self.names[i], row) for i, row in enumerate(self.matrix)]

    def _summary_lines(self) -> str:
        lm = self.lifelong_metrics()
        k = len(self.matrix)
        return (f"Final model over the {k} repositories seen: R@1 {pct(lm['final_R@1'])}, R@10 "
                f"{pct(lm['final_R@10'])}, MRR {mrr(lm['final_MRR'])}; R@10 gain over untrained: "
                f"{pct(lm['gain_over_untrained'])}\n"
                + ", ".join(f"{name} {metric(name, lm[name])}" for name in REGISTRY))


def report_from_manifest(manifest: dict) -> RunReport:
    """Rebuild the report of a run (finished or not) from its manifest, as `leanagent report` prints it."""
    names = list(manifest.get("order") or [])
    report = RunReport(names, costs=job_costs(manifest), setup=run_setup(manifest.get("config")))
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




def run_setup(config: Any) -> str | None:
    """`merge_all, curriculum, EWC 0.1, precision bf16-mixed`: LeanAgent's three switches (replay with its fraction:
    `replay 0.5`), from a manifest's config (a run recorded before `dataset_strategy` existed ran `single`, the
    default), the training recipe when it is another one (`infonce + mined negatives`), and the precision the run's
    jobs ran in (`trainer.precision`, as the run recorded it: `auto` resolved by its first job; left out while no
    job has)."""
    lifelong = config.get("lifelong") if isinstance(config, dict) else None
    if not isinstance(lifelong, dict):
        return None
    ewc = lifelong.get("ewc_lambda") or 0
    strategy = str(lifelong.get("dataset_strategy", "single"))
    if lifelong.get("replay_fraction") is not None:
        strategy += f" {lifelong['replay_fraction']:g}"
    return ", ".join([strategy,
                      "curriculum" if lifelong.get("curriculum", True) else "given order",
                      f"EWC {ewc:g}" if ewc else "no EWC", *_recipe(config), *_precision(config)])


def _recipe(config: dict[str, Any]) -> list[str]:
    """The training recipe where it is not LeanAgent's (`model.loss`, `data.negatives`); nothing for LeanAgent's,
    and for a run recorded before the keys existed (it trained LeanAgent's)."""
    model, data = config.get("model") or {}, config.get("data") or {}
    loss, negatives = model.get("loss", "mse"), data.get("negatives", "random")
    if (loss, negatives) == ("mse", "random"):
        return []
    return [f"{loss} + {negatives} negatives"]


def _precision(config: dict[str, Any]) -> list[str]:
    precision = (config.get("trainer") or {}).get("precision")
    return [f"precision {precision}"] if isinstance(precision, str) and precision != AUTO else []


def _bullets(text: str) -> str:
    return "\n".join(f"- {line}" for line in text.splitlines())


def _checkpoint_val(row: dict) -> str:
    value = row.get("checkpoint val R@10")
    return "" if value is None else f" ({pct(value)})"
