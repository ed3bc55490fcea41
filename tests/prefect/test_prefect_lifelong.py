"""The lifelong flow end to end: two repositories, two CPU ranks under torchrun, EWC on.

One flow run is shared by the module (it is the slow part); the rerun test then checks that a
second run of the same config launches nothing and touches no file of the first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest
import yaml

from flows.lifelong import PROGRESS_KEY, SUMMARY_KEY, TABLE_KEY, lifelong_retrieval
from leanagent.atomic import read_json
from leanagent.report import RunReport
from leanagent.run_state import ManifestMismatchError
from tests.prefect.prefect_api import flow_run_artifacts, wait_for_logs

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


@dataclass
class FinishedRun:
    config_path: Path
    run_dir: Path
    flow_run_id: UUID
    summary: dict


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_repo_run(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory, demo_assets, write_cpu_config
                 ) -> FinishedRun:
    root = tmp_path_factory.mktemp("lifelong")
    config_path = write_cpu_config(root / "config.yaml", root / "run", demo_assets.repos[:2])
    state = lifelong_retrieval(config_path=str(config_path), return_state=True)
    assert state.is_completed(), state.message
    return FinishedRun(config_path, root / "run", state.state_details.flow_run_id, state.result())


def _job_results(run_dir: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(run_dir / "jobs")): read_json(p) for p in (run_dir / "jobs").rglob("result.json")}


def test_two_repositories_train_fisher_and_evaluate(two_repo_run: FinishedRun) -> None:
    results = _job_results(two_repo_run.run_dir)
    names = two_repo_run.summary["order"]
    first, second = f"00-{names[0]}", f"01-{names[1]}"
    assert set(results) == {f"{first}/eval-untrained", f"{second}/eval-untrained",
                            f"{first}/train", f"{first}/fisher", f"{first}/eval-00-{names[0]}",
                            f"{second}/train", f"{second}/fisher", f"{second}/eval-00-{names[0]}",
                            f"{second}/eval-01-{names[1]}"}
    # The untrained model is scored as it is: no checkpoint.
    assert not results[f"{first}/eval-untrained"]["checkpoint"].endswith(".ckpt")
    for key in (f"{first}/train", f"{second}/train"):
        assert Path(results[key]["checkpoint"]).is_file()
        assert results[key]["world_size"] == 2
    for key in (f"{first}/fisher", f"{second}/fisher"):
        assert Path(results[key]["fisher"]).is_file() and results[key]["fisher"].endswith(".safetensors")
    # The second repository trains from the first's best checkpoint, anchored by the first's Fisher.
    assert results[f"{first}/train"]["ewc"] is False
    assert results[f"{second}/train"]["ewc"] is True
    assert results[f"{second}/train"]["epoch"] > results[f"{first}/train"]["epoch"]

    summary = two_repo_run.summary
    assert [r["repository"] for r in summary["rows"]] == names
    assert summary["matrix"][0][1] is None and all(v is not None for v in summary["matrix"][1])
    assert len(summary["baseline"]) == 2 and all(v is not None for v in summary["baseline"])
    assert set(summary["lifelong"]) == {"average", "gain_over_untrained", "backward_transfer"}
    stages = read_json(Path(summary["manifest"]))["repos"]
    assert all(s["status"] == "done" for repo in stages.values() for s in repo["stages"].values())


def test_report_command_rebuilds_the_run_report_from_the_manifest(two_repo_run: FinishedRun) -> None:
    summary = two_repo_run.summary
    expected = RunReport(summary["order"], summary["rows"], summary["matrix"], summary["baseline"]).text()
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(two_repo_run.run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected.strip()
    assert "(untrained)" in proc.stdout and "backward transfer" in proc.stdout


def test_artifacts_are_on_the_server(two_repo_run: FinishedRun) -> None:
    # The table is re-created after each repository: keep the latest version of each key.
    artifacts = {a.key: a for a in sorted(flow_run_artifacts(two_repo_run.flow_run_id), key=lambda a: a.created)}
    assert {TABLE_KEY, PROGRESS_KEY, SUMMARY_KEY} <= set(artifacts)
    table = artifacts[TABLE_KEY].data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [r["repository"] for r in rows] == two_repo_run.summary["order"]
    assert {"R@1", "R@10", "MRR", "epoch", "checkpoint"} <= set(rows[0])
    assert float(artifacts[PROGRESS_KEY].data) == pytest.approx(100.0)
    assert "Recall@10 matrix" in str(artifacts[SUMMARY_KEY].data)


def test_rank_lines_reach_the_flow_run_logs(two_repo_run: FinishedRun) -> None:
    def both_ranks(messages: list[str]) -> bool:
        return all(any(m.startswith(f"[rank {r}] ") for m in messages) for r in (0, 1))

    messages = wait_for_logs(two_repo_run.flow_run_id, both_ranks)
    assert both_ranks(messages), f"{len(messages)} log lines, none from one of the ranks"


def test_rerun_skips_every_finished_stage(two_repo_run: FinishedRun) -> None:
    before = _files(two_repo_run.run_dir / "jobs")
    stages_before = read_json(two_repo_run.run_dir / "manifest.json")["repos"]
    state = lifelong_retrieval(config_path=str(two_repo_run.config_path), return_state=True)
    assert state.is_completed(), state.message
    assert _files(two_repo_run.run_dir / "jobs") == before  # no job launched, no file touched
    assert read_json(two_repo_run.run_dir / "manifest.json")["repos"] == stages_before
    assert state.result()["rows"] == two_repo_run.summary["rows"]
    messages = wait_for_logs(state.state_details.flow_run_id, lambda m: sum("skipped" in x for x in m) >= 9)
    assert sum("finished in an earlier run; skipped" in m for m in messages) == 9
    assert not any(m.startswith("[rank ") for m in messages)


def test_changed_config_is_refused_without_touching_the_run(two_repo_run: FinishedRun, tmp_path: Path) -> None:
    raw = yaml.safe_load(two_repo_run.config_path.read_text())
    raw["lifelong"]["ewc_lambda"] = 0.5
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(raw))
    before = _files(two_repo_run.run_dir)
    with pytest.raises(ManifestMismatchError, match=r"lifelong\.ewc_lambda: 0\.1 -> 0\.5"):
        lifelong_retrieval(config_path=str(changed))
    after = _files(two_repo_run.run_dir)
    after.pop(".lock", None)
    before.pop(".lock", None)
    assert after == before
