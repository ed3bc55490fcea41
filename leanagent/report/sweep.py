"""A sweep's setups side by side, Table 4's way: `leanagent report SWEEP_DIR`, and the sweep flow's artifact.

One row per setup (what it is: dataset strategy, order, EWC; its state), then the final model's R@1, R@10 and MRR
over the repositories, every lifelong metric and the composite score across the finished setups, as LeanAgent's
Table 4 compares its setups. A setup that failed, is running, was stopped (its sweep was killed) or has not started
is shown as such, with no number: a blank is not a zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leanagent.report.cells import metric, mrr, pct
from leanagent.report.compare import LifelongRun, SourceError, compare, load_run
from leanagent.report.metrics import REGISTRY
from leanagent.report.run import glossary_text
from leanagent.run.manifest import MANIFEST_NAME
from leanagent.run.state import RunLock, RunLockedError
from leanagent.run.sweep import SWEEP_RECORD, read_sweep_record

DONE = "done"


@dataclass
class SetupRow:
    """One setup of a sweep as the table shows it."""

    name: str
    status: str  # done, running, failed, interrupted, stopped (the sweep was killed while it ran), waiting
    overrides: list[str]
    run: LifelongRun | None = None  # its run, once finished
    message: str | None = None
    progress: str | None = None  # `2 of 3 repositories` for a setup that has not finished


def is_sweep(folder: Path) -> bool:
    return (Path(folder) / SWEEP_RECORD).is_file()


def load_sweep(sweep_dir: str | Path) -> list[SetupRow]:
    """Every setup of the sweep in `sweep_dir`, in the order the sweep first gave them; SourceError naming the file
    when sweep.json cannot be read."""
    sweep_dir = Path(sweep_dir)
    try:
        record = read_sweep_record(sweep_dir)
    except ValueError as exc:
        raise SourceError(str(exc)) from None
    if record is None:
        raise SourceError(f"{sweep_dir}: a folder without {SWEEP_RECORD} (not a sweep_dir of `leanagent sweep`)")
    rows = []
    for name, setup in record.ordered():
        run_dir = sweep_dir / name
        status = setup.status
        if status == "running" and not _locked(run_dir):
            status = "stopped"  # nobody holds its run_dir: the sweep that ran it is gone
        run, progress, message = None, None, setup.message
        if (run_dir / MANIFEST_NAME).is_file():
            try:
                loaded = load_run(run_dir)
            except SourceError as exc:
                message = str(exc)
            else:
                total = len(loaded.report.names) if loaded.report is not None else len(loaded.names)
                finished = len(loaded.test_r10)
                if status == DONE and finished == total:
                    run = loaded
                else:
                    progress = f"{finished} of {total} repositories"
        rows.append(SetupRow(name, status, list(setup.overrides), run, message, progress))
    return rows


def _locked(run_dir: Path) -> bool:
    try:
        RunLock(run_dir).probe()
    except RunLockedError:
        return True
    return False


COLUMNS = ("setup", "what", "state", "R@1", "R@10", "MRR", *REGISTRY, "composite")


def sweep_table(rows: list[SetupRow]) -> list[dict[str, Any]]:
    """Each setup's row as JSON values: its metrics (None where the setup has not finished or a metric is undefined)
    and the composite score across the finished setups."""
    finished = [row for row in rows if row.run is not None]
    metrics = dict(zip([row.name for row in finished], compare([row.run for row in finished]), strict=True))
    out = []
    for row in rows:
        m = metrics.get(row.name, {})
        out.append({"setup": row.name, "what": row.run.setup if row.run is not None else None,
                    "status": row.status, "progress": row.progress, "message": row.message,
                    "overrides": row.overrides, "source": str(row.run.source) if row.run is not None else None,
                    "repositories": len(row.run.test_r10) if row.run is not None else None,
                    "final_R@1": m.get("final_R@1"), "final_R@10": m.get("final_R@10"),
                    "final_MRR": m.get("final_MRR"), **{k: m.get(k) for k in REGISTRY},
                    "composite": m.get("composite")})
    return out


def sweep_json(rows: list[SetupRow]) -> dict[str, Any]:
    """What `leanagent report SWEEP_DIR --json` writes: {"setups": [...]}, in the sweep's order."""
    return {"setups": sweep_table(rows)}


def _cells(entry: dict[str, Any]) -> list[str]:
    state = entry["status"] + (f" ({entry['progress']})" if entry["progress"] and entry["status"] != DONE else "")
    if entry["status"] != DONE or entry["final_R@10"] is None:
        return [entry["setup"], entry["what"] or "", state] + [""] * (len(COLUMNS) - 3)
    return [entry["setup"], entry["what"] or "", state, pct(entry["final_R@1"]), pct(entry["final_R@10"]),
            mrr(entry["final_MRR"]), *(metric(k, entry[k]) for k in REGISTRY),
            "-" if entry["composite"] is None else f"{entry['composite']:.4f}"]


def sweep_text(rows: list[SetupRow], markdown: bool = False, source: str | None = None) -> str:
    """The table (plain text or markdown), then what a blank means, each failed setup's reason, and the glossary."""
    table = sweep_table(rows)
    cells = [_cells(entry) for entry in table]
    heads = list(COLUMNS)
    notes = ["R@1, R@10, MRR: the final model's, averaged over every repository; the lifelong metrics as LeanAgent's "
             "Table 4 (lower or higher is better: below); composite: LeanAgent's score across the finished setups."]
    if any(entry["status"] != DONE for entry in table):
        notes.append("A setup that has not finished (running, failed, stopped, waiting) has no numbers: a blank is "
                     "not a zero.")
    notes += [f"{entry['setup']}: {entry['message']}" for entry in table if entry["message"]
              and entry["status"] != DONE]
    title = f"Sweep {source}: {len(table)} setups" if source else f"Sweep: {len(table)} setups"
    if markdown:
        text = f"## {title}\n\n| " + " | ".join(heads) + " |\n|" + "---|" * len(heads) + "\n"
        text += "".join("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |\n" for row in cells)
        return text + "\n" + "\n".join(f"- {line}" for line in notes) + f"\n\n{glossary_text()}"
    width = [max(len(h), *(len(row[k]) for row in cells)) for k, h in enumerate(heads)]
    lines = [title, "  ".join(f"{h:<{w}}" if k < 3 else f"{h:>{w}}" for k, (h, w) in enumerate(zip(heads, width,
                                                                                                 strict=True)))]
    lines += ["  ".join(f"{c:<{w}}" if k < 3 else f"{c:>{w}}" for k, (c, w) in enumerate(zip(row, width, strict=True)))
              .rstrip() for row in cells]
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n" + glossary_text()


def artifact_rows(rows: list[SetupRow]) -> list[dict[str, str]]:
    """The table as Prefect's table artifact takes it: one dict per setup, every cell text (blank when unfinished)."""
    return [dict(zip(COLUMNS, _cells(entry), strict=True)) for entry in sweep_table(rows)]


def finished_runs(rows: list[SetupRow]) -> list[LifelongRun]:
    """The finished setups' runs, for `--png`."""
    return [row.run for row in rows if row.run is not None]
