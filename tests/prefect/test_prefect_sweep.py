"""A sweep through the real flows: its setups as child flow runs, `max_parallel` at once, the jobs they share run once,
and each setup exactly what running it alone gives.

Three setups of the tests' CPU config on the three demo repositories, two at a time: `single` (the session's
`lifelong_run3` config), `merge_all` (the session's `merge_all_run3`), and `pruned` (single's, keeping only the best
and last checkpoints: the same jobs, which it takes from the others). Alone the three launch 30 jobs; the sweep
launches 16 (the untrained evaluation and the first repository's three jobs once for all, then single's and
merge_all's own). Then a sweep of one repository interrupted twice through `leanagent sweep` (a terminal's Ctrl-C,
then a SIGKILL), each time mid-setup, and rerun: the table of an uninterrupted run, and nothing finished run again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.settings import PREFECT_API_URL

from leanagent.flows.sweep import TABLE_KEY, lifelong_sweep
from leanagent.ground.config import ConfigError
from leanagent.report import load_run
from leanagent.run.shared import shared_program
from tests.conftest import FinishedRun, MergeAllRun, file_times, read_json
from tests.ddp.conftest import REPO_ROOT, fault_env
from tests.prefect.prefect_api import flow_run_artifacts

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]

SETUPS = {"single": [], "merge_all": ["lifelong.dataset_strategy=merge_all"],
          "pruned": ["lifelong.keep_checkpoints=best_and_last"]}


@dataclass
class Sweep:
    path: Path
    sweep_dir: Path
    flow_run_id: UUID
    result: dict



def _sweep_file(path: Path, setups: dict[str, list[str]], max_parallel: int = 2) -> Path:
    path.write_text(yaml.safe_dump({"base": "base.yaml", "sweep_dir": "sweep", "max_parallel": max_parallel,
                                    "setups": setups}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def sweep(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory, demo_assets, write_cpu_config) -> Sweep:
    root = tmp_path_factory.mktemp("sweep")
    write_cpu_config(root / "base.yaml", root / "replaced", demo_assets.repos[:3])
    path = _sweep_file(root / "sweep.yaml", SETUPS)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as the runs alone it is compared with
        state = lifelong_sweep(sweep_path=str(path), return_state=True)
    assert state.is_completed(), state.message
    return Sweep(path, root / "sweep", state.state_details.flow_run_id, state.result())


def _children(flow_run_id: UUID) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))


def test_setups_are_child_flow_runs_at_most_max_parallel_at_once(sweep: Sweep) -> None:
    children = _children(sweep.flow_run_id)
    assert sorted(run.name for run in children) == sorted(SETUPS)
    assert all(run.state.is_completed() for run in children)
    with get_client(sync_client=True) as client:
        assert {client.read_flow(run.flow_id).name for run in children} == {"lifelong-retrieval"}
    # When each child flow run started and ended, as the server recorded them: how many ran at once.
    edges = sorted([(run.start_time, 1) for run in children] + [(run.end_time, -1) for run in children],
                   key=lambda edge: (edge[0], edge[1]))
    running, most = 0, 0
    for _, step in edges:
        running += step
        most = max(most, running)
    assert most == 2, [(run.name, run.start_time, run.end_time) for run in children]


def _metrics(run_dir: Path) -> dict[str, object]:
    """Every stage's metrics as the manifest records them."""
    manifest = read_json(run_dir / "manifest.json")
    return {f"{key}/{stage}": entry["result"].get("metrics") for key, repo in manifest["repos"].items()
            for stage, entry in repo["stages"].items() if entry["result"].get("metrics") is not None}


def _same_run(mine: Path, theirs: Path) -> None:
    a, b = load_run(mine), load_run(theirs)
    assert a.report.matrix == b.report.matrix and a.report.baseline == b.report.baseline
    assert a.metrics() == b.metrics()
    assert _metrics(mine) == _metrics(theirs)
    assert [{k: v for k, v in row.items() if k != "checkpoint"} for row in a.report.rows] == \
        [{k: v for k, v in row.items() if k != "checkpoint"} for row in b.report.rows]
    assert [Path(r["checkpoint"]).name for r in a.report.rows] == [Path(r["checkpoint"]).name for r in b.report.rows]


def test_each_setup_gives_what_running_it_alone_gives_bit_for_bit(sweep: Sweep, lifelong_run3: FinishedRun,
                                                                  merge_all_run3: MergeAllRun) -> None:
    _same_run(sweep.sweep_dir / "single", lifelong_run3.run_dir)
    _same_run(sweep.sweep_dir / "merge_all", merge_all_run3.run_dir)
    _same_run(sweep.sweep_dir / "pruned", lifelong_run3.run_dir)


def test_the_jobs_the_setups_share_run_once_and_each_setup_holds_its_own(sweep: Sweep) -> None:
    launched = sorted(shared_program(p) for p in (sweep.sweep_dir / "shared" / "jobs").iterdir())
    # Alone: 3 x (1 untrained evaluation + 3 x (train, fisher, evaluation)) = 30 jobs.
    assert launched.count("evaluate") == 1 + 1 + 2 * 2 and launched.count("train") == launched.count("fisher") == 5
    order = sweep.result["setups"][0]
    assert order["status"] == "done"
    first = f"00-{read_json(sweep.sweep_dir / 'single' / 'manifest.json')['order'][0]}"
    single, pruned = (sweep.sweep_dir / name / "jobs" for name in ("single", "pruned"))
    for name in ("merge_all", "pruned"):  # the first repository's training: one job, linked into every setup
        train = sweep.sweep_dir / name / "jobs" / first / "train"
        result = read_json(train / "result.json")
        assert Path(result["checkpoint"]).parent == train / "checkpoints"
        assert os.path.samefile(result["checkpoint"], read_json(single / first / "train" / "result.json")
                                ["checkpoint"])
    # `pruned` kept its best and last checkpoints: its links went, the shared job's files stay.
    shared_train = next((sweep.sweep_dir / "shared" / "jobs").glob("train-*/checkpoints"))
    assert len(list((pruned / first / "train" / "checkpoints").iterdir())) <= \
        len(list((single / first / "train" / "checkpoints").iterdir())) <= len(list(shared_train.iterdir()))
    # Each setup's premise index is its own folder, naming its own checkpoint.
    index = read_json(sweep.sweep_dir / "merge_all" / "index" / first / "index.json")
    assert Path(index["checkpoint"]).is_relative_to(sweep.sweep_dir / "merge_all" / "jobs")


def test_the_report_and_the_flow_runs_artifact_show_one_row_per_setup(sweep: Sweep, tmp_path: Path) -> None:
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(sweep.sweep_dir), "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    table = json.loads(out.read_text())["setups"]
    assert [row["setup"] for row in table] == list(SETUPS) and {row["status"] for row in table} == {"done"}
    assert all(row["composite"] is not None for row in table)
    assert table[0]["final_R@10"] == table[2]["final_R@10"]  # single and pruned: the same jobs
    # Refreshed as each setup finished: the first version before any, one per setup, the last at the end.
    versions = sorted((a for a in flow_run_artifacts(sweep.flow_run_id) if a.key == TABLE_KEY),
                      key=lambda a: a.created)
    assert len(versions) == 2 + len(SETUPS)
    assert sorted(a.description for a in versions[1:-1]) == \
        sorted(f"Lifelong metrics per setup (setup {name}: done)" for name in SETUPS)
    rows = json.loads(versions[-1].data) if isinstance(versions[-1].data, str) else versions[-1].data
    assert [row["setup"] for row in rows] == list(SETUPS) and {row["state"] for row in rows} == {"done"}
    assert [row["R@10"] for row in rows] == [f"{row['final_R@10']:.2f}" for row in table]


def test_a_sweep_with_one_more_setup_runs_only_that_setup(sweep: Sweep) -> None:
    before = {name: file_times(sweep.sweep_dir / name) for name in SETUPS}
    jobs = sorted(os.listdir(sweep.sweep_dir / "shared" / "jobs"))
    more = _sweep_file(sweep.path.with_name("more.yaml"), {**SETUPS, "every-premise": ["model.embed_premises=all"]})
    state = lifelong_sweep(sweep_path=str(more), return_state=True)
    assert state.is_completed(), state.message
    assert [run.name for run in _children(state.state_details.flow_run_id)] == ["every-premise"]
    # Which premises a job embeds never changes its result: every job of the new setup was the others'.
    assert {name: file_times(sweep.sweep_dir / name) for name in SETUPS} == before
    assert sorted(os.listdir(sweep.sweep_dir / "shared" / "jobs")) == jobs
    _same_run(sweep.sweep_dir / "every-premise", sweep.sweep_dir / "single")


def test_a_changed_setup_is_refused_naming_its_changed_keys(sweep: Sweep) -> None:
    before = file_times(sweep.sweep_dir)
    changed = _sweep_file(sweep.path.with_name("changed.yaml"),
                          {**SETUPS, "merge_all": [*SETUPS["merge_all"], "lifelong.ewc_lambda=0.2"]})
    with pytest.raises(ConfigError, match=r"changed.yaml, line \d+: setup 'merge_all': .*merge_all/manifest.json "
                                          r"belongs to a run of a different config \(lifelong.ewc_lambda: 0.1 -> "
                                          r"0.2\); .* give the changed setup a new name"):
        lifelong_sweep(sweep_path=str(changed))
    assert file_times(sweep.sweep_dir) == before


# ---- interrupted, then rerun ---------------------------------------------------------------------------------------

def _cli(sweep_file: Path, home: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """`leanagent sweep` in a session of its own (a terminal's foreground job), on the session's Prefect server."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    home.mkdir(parents=True, exist_ok=True)
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1",
               DO_NOT_TRACK="1")
    if fault is not None:
        env.update(fault_env(fault, mark=home / "signalled"))
    return subprocess.run([sys.executable, "-m", "leanagent.cli", "sweep", "--config", str(sweep_file)],
                          capture_output=True, text=True, timeout=1800, env=env, cwd=REPO_ROOT,
                          start_new_session=True)


def _statuses(run_dir: Path) -> dict[str, str]:
    manifest = read_json(run_dir / "manifest.json")
    return {f"{key}/{stage}": entry["status"] for key, repo in manifest["repos"].items()
            for stage, entry in repo["stages"].items()}


def test_a_sweep_interrupted_mid_setup_and_rerun_gives_the_same_table_and_reruns_nothing_finished(
        prefect_harness: None, tmp_path: Path, demo_assets, write_cpu_config, lifelong_run3: FinishedRun) -> None:
    """One repository (the first of `lifelong_run3`'s order), two setups sharing every job. A Ctrl-C in the Fisher
    job, a SIGKILL in the evaluation after it, then a rerun that finishes: each setup's stages are those of
    `lifelong_run3`'s first repository, and the training job, finished before either, never ran again."""
    first = next(p for p in demo_assets.repos if p.name == lifelong_run3.summary["order"][0])
    write_cpu_config(tmp_path / "base.yaml", tmp_path / "replaced", [first])
    path = _sweep_file(tmp_path / "sweep.yaml", {"single": [], "merge_all": SETUPS["merge_all"]})
    sweep_dir = tmp_path / "sweep"
    stopped = _cli(path, tmp_path / "a", "batch:1:SIGINT-group:fisher-")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "rerun the same command to resume" in stopped.stderr and "Traceback" not in stopped.stderr
    for name in ("single", "merge_all"):  # both were at the Fisher: one running it, the other waiting for it
        assert _statuses(sweep_dir / name)[f"00-{first.name}/fisher"] == "interrupted"
    [train] = (sweep_dir / "shared" / "jobs").glob("train-*")
    trained = file_times(train)
    killed = _cli(path, tmp_path / "b", "test:0:SIGKILL:evaluate-")
    assert killed.returncode == -9 or killed.returncode == 137, killed.stderr[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _left_behind(tmp_path):
        time.sleep(1)
    assert not _left_behind(tmp_path)
    finished = _cli(path, tmp_path / "c")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert file_times(train) == trained  # finished before the interruptions: never run again
    for name in ("single", "merge_all"):
        assert set(_statuses(sweep_dir / name).values()) == {"done"}
        mine = _metrics(sweep_dir / name)
        alone = {stage: m for stage, m in _metrics(lifelong_run3.run_dir).items()
                 if stage.startswith(f"00-{first.name}/") and stage.split("/")[1] in ("train", f"eval-00-{first.name}")}
        assert {k: v for k, v in mine.items() if k in alone} == alone
    table = [line.split() for line in finished.stdout.splitlines() if line.startswith(("single ", "merge_all "))]
    assert len(table) == 2 and all("done" in row for row in table), finished.stdout
    assert table[0][-10:-1] == table[1][-10:-1]  # R@1 ... CFR: the same jobs


def _left_behind(root: Path) -> list[int]:
    """Processes of this test's jobs still running (a rank or torchrun whose job folder is under `root`)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if str(root) in " ".join(proc.cmdline()) and proc.pid != os.getpid() \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found
