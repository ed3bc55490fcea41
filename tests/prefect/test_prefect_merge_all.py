"""`lifelong.dataset_strategy: merge_all` through the real flow, beside a `single` run of the same repositories.

Three demo repositories (copied, so that a test may edit one), the tiny model, 2 gloo ranks, one epoch per
repository: each run launches 3 training, 3 Fisher and 4 evaluation jobs. The `single` run is the session's
(`lifelong_run3`), on the original repositories. The merge_all run trains and computes
its Fisher on run_dir/merged/NN-name (repositories 0..i), reruns without launching anything, and
`leanagent report` prints it beside the single run with the composite score.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from leanagent.flows.lifelong import lifelong_retrieval
from leanagent.run.manifest import ManifestMismatchError
from tests.conftest import FinishedRun, MergeAllRun, file_times, read_json
from tests.prefect.prefect_api import wait_for_logs

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


@dataclass
class Runs:
    repos: list[Path]
    merge_config: Path
    merge_dir: Path
    single_dir: Path
    merge_summary: dict
    single_summary: dict


@pytest.fixture(scope="module")
def runs(merge_all_run3: MergeAllRun, lifelong_run3: FinishedRun) -> Runs:
    # The `single` run beside it is the session's (the same config but for the strategy, on the originals).
    return Runs(merge_all_run3.repos, merge_all_run3.config_path, merge_all_run3.run_dir, lifelong_run3.run_dir,
                merge_all_run3.summary, lifelong_run3.summary)



def _results(run_dir: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(run_dir / "jobs")): read_json(p) for p in (run_dir / "jobs").rglob("result.json")}


def test_each_repository_trains_on_the_merge_of_those_before_it(runs: Runs) -> None:
    names = runs.merge_summary["order"]
    by_name = {r.name: r for r in runs.repos}
    results = _results(runs.merge_dir)
    manifest = read_json(runs.merge_dir / "manifest.json")
    for i, name in enumerate(names):
        key = f"{i:02d}-{name}"
        merged = runs.merge_dir / "merged" / key
        assert Path(results[f"{key}/train"]["dataset"]) == merged
        assert Path(results[f"{key}/fisher"]["dataset"]) == merged
        record = manifest["repos"][key]["stages"]["merge"]
        assert record["status"] == "done" and record["result"]["sources"] == [str(by_name[n]) for n in names[: i + 1]]
        train = sum(len(json.loads((by_name[n] / "random" / "train.json").read_text())) for n in names[: i + 1])
        assert record["result"]["theorems"]["train"] == train  # the demo repositories share no theorem
    # Evaluation is on each repository's own test split, as under `single`: the matrices compare.
    last = f"02-{names[2]}/evaluate-00-01-02"
    assert [Path(e["dataset"]) for e in results[last]["evaluations"]] == [by_name[n] for n in names]
    single = _results(runs.single_dir)
    assert Path(single[f"01-{names[1]}/train"]["dataset"]).name == names[1]  # the repository itself, not a merge
    assert runs.single_summary["order"] == names
    # The first stage merges one repository: the same theorems as `single` trains on.
    assert json.loads((runs.merge_dir / "merged" / f"00-{names[0]}" / "random" / "train.json").read_text()) == \
        json.loads((by_name[names[0]] / "random" / "train.json").read_text())


def test_rerun_with_nothing_new_launches_nothing_and_leaves_the_merges(runs: Runs) -> None:
    before = {part: file_times(runs.merge_dir / part) for part in ("jobs", "merged")}
    stages = read_json(runs.merge_dir / "manifest.json")["repos"]
    state = lifelong_retrieval(config_path=str(runs.merge_config), return_state=True)
    assert state.is_completed(), state.message
    assert {part: file_times(runs.merge_dir / part) for part in ("jobs", "merged")} == before  # nothing launched or
    # rewritten
    assert read_json(runs.merge_dir / "manifest.json")["repos"] == stages
    assert state.result()["rows"] == runs.merge_summary["rows"]
    line = "nothing new: 3 repositories trained, 0 waiting"
    messages = wait_for_logs(state.state_details.flow_run_id, lambda m: line in m)
    assert line in messages and not any(m.startswith("[rank ") for m in messages)


def test_report_prints_merge_all_beside_single_with_the_composite(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(runs.single_dir), str(runs.merge_dir),
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "1:single" in proc.stdout and "2:merge_all" in proc.stdout
    setup = next(line for line in lines if line.startswith("setup "))
    assert "single, curriculum, EWC 0.1" in setup and "merge_all, curriculum, EWC 0.1" in setup
    composite = next(line for line in lines if line.startswith("composite "))
    assert len(composite.split()) == 3 and "-" not in composite.split()[1:]
    single, merge = json.loads(out.read_text())["runs"]
    assert single["setup"].startswith("single") and merge["setup"].startswith("merge_all")
    assert merge["avg"] == pytest.approx(runs.merge_summary["lifelong"]["avg"])
    assert single["composite"] is not None and merge["composite"] is not None


def test_a_changed_repository_refuses_the_rerun_untouched(runs: Runs) -> None:
    name = runs.merge_summary["order"][1]
    edited = next(r for r in runs.repos if r.name == name) / "corpus.jsonl"
    original = edited.read_text()
    # Refused before any job or merge: job folders, merged datasets and recorded stages stay as they were.
    before = {part: file_times(runs.merge_dir / part) for part in ("jobs", "merged")}
    stages = read_json(runs.merge_dir / "manifest.json")["repos"]
    try:
        edited.write_text(original + "\n")  # a blank line: the same corpus to a reader, other bytes
        # The sequence's own record of the dataset refuses it first, naming the repository and the file.
        with pytest.raises(ManifestMismatchError, match=rf"the dataset of repository '{name}' \(#2 .*\) changed since "
                                                        rf"the run recorded it \({edited}: sha256 "):
            lifelong_retrieval(config_path=str(runs.merge_config))
    finally:
        edited.write_text(original)
    assert {part: file_times(runs.merge_dir / part) for part in ("jobs", "merged")} == before
    assert read_json(runs.merge_dir / "manifest.json")["repos"] == stages
