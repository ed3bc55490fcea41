"""A terminal's Ctrl-C on `leanagent run`, in any stage, then a rerun: the same recall matrix as no interruption.

Real `leanagent run`, 2 repositories, 2 gloo ranks, EWC on. A terminal sends SIGINT to the whole foreground
process group; here rank 0 of the chosen stage's job does it from inside a Trainer hook
(`tests/ddp_scripts/faults/sitecustomize.py`, `SIGINT-group`), so the point is exact. Each time `leanagent run`
must exit 130 soon, with the rerun hint and no traceback, record the stage `interrupted`, and leave no process
behind. Two of the interrupted runs start Prefect's temporary server, which must be stopped too; the others, the
uninterrupted reference and the rerun that finishes the curriculum talk to the session's Prefect server, as a
user's `leanagent run` with PREFECT_API_URL set does (the same flow; a temporary server costs ~14 s to start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prefect.settings import PREFECT_API_URL

from leanagent.report import load_run
from tests.conftest import TORCHRUN, WARM

from .conftest import REPO_ROOT, fault_env

pytestmark = pytest.mark.ddp

ENDED_S = 30.0  # measured: ~3 s; a busy 2-core machine gets ten times that
# (part of the job folder the fault is limited to, where in that job, part of the stages then interrupted, whether
# `leanagent run` starts its temporary server): the untrained evaluation, the first Fisher pass, the second
# repository's training between its two epochs
INTERRUPTIONS = [("untrained/", "test:0", "eval-untrained", True), ("/fisher", "batch:1", "00-", False),
                 ("01-", "epoch_start:3", "01-", True)]


def _env(tmp_path: Path, fault: str | None = None, temporary_server: bool = False) -> dict[str, str]:
    """`leanagent run`'s environment: the session's Prefect server, or none (then it starts its temporary one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                           "PREFECT_API_URL")}
    (tmp_path / "prefect-home").mkdir(parents=True, exist_ok=True)
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
               DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if not temporary_server:
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    if fault is not None:
        env.update(fault_env(fault, mark=tmp_path / "signalled"))
    return env


def _run(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    # A session of its own, as a shell gives a foreground job its own process group.
    return subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config)],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=REPO_ROOT,
                          start_new_session=True)


def _config(write_cpu_config, path: Path, ddp_assets, run_dir: Path, launcher: str = TORCHRUN) -> Path:
    return write_cpu_config(path, run_dir, [ddp_assets["repo_a"], ddp_assets["repo_b"]], encoder=ddp_assets["model"],
                            launcher=launcher, lifelong={"epochs_per_repo": 2, "ewc_lambda": 0.1})


def _servers_of(prefect_home: Path) -> list[int]:
    """Running processes whose environment names this Prefect home: the temporary server, if left behind."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get("PREFECT_HOME") == str(prefect_home) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _stages(run_dir: Path) -> dict[str, str]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {f"{key}/{stage}": entry["status"] for key, repo in manifest["repos"].items()
            for stage, entry in repo["stages"].items()}


@pytest.mark.usefixtures("prefect_harness")
def test_group_ctrl_c_in_any_stage_then_rerun_gives_the_uninterrupted_recall_matrix(ddp_assets, tmp_path,
                                                                                    write_cpu_config):
    whole_dir = tmp_path / "whole"
    # The uninterrupted reference under the warm launcher (its results equal torchrun's, bit for bit); every
    # interrupted run and the rerun under torchrun, whose signals are what this test is about.
    whole = _run(_config(write_cpu_config, tmp_path / "whole.yaml", ddp_assets, whole_dir, WARM), _env(tmp_path / "a"))
    assert whole.returncode == 0, whole.stderr[-3000:]

    run_dir = tmp_path / "interrupted"
    config = _config(write_cpu_config, tmp_path / "interrupted.yaml", ddp_assets, run_dir)
    for i, (job, where, stages, temporary_server) in enumerate(INTERRUPTIONS):
        home = tmp_path / f"b{i}"
        env = _env(home, f"{where}:SIGINT-group:{job}", temporary_server)
        mark = Path(env["LEANAGENT_TEST_FAULT_MARK"])
        mark.unlink(missing_ok=True)
        stopped = _run(config, env)
        ended = time.time() - float(mark.read_text())
        print(f"\n[ctrl-c] {job} ({where}): exit {stopped.returncode} {ended:.1f} s after the group SIGINT")
        assert stopped.returncode == 130, stopped.stderr[-3000:]
        assert ended < ENDED_S, stopped.stderr[-3000:]
        assert "rerun the same command to resume" in stopped.stderr
        assert "Traceback" not in stopped.stderr and "Error logging to API" not in stopped.stderr, stopped.stderr
        interrupted = [stage for stage, status in _stages(run_dir).items() if status == "interrupted"]
        assert interrupted and all(stages in stage for stage in interrupted), _stages(run_dir)
        # The temporary server's database is in the Prefect home: it was started there, and then stopped.
        assert (home / "prefect-home" / "prefect.db").is_file() == temporary_server
        assert not _servers_of(home / "prefect-home")
    finished = _run(config, _env(tmp_path / "c"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert set(_stages(run_dir).values()) == {"done"}
    mine, theirs = load_run(run_dir), load_run(whole_dir)
    assert mine.report.matrix == theirs.report.matrix and mine.report.baseline == theirs.report.baseline
    def rows(run):  # everything but where the checkpoint lies (another run_dir)
        return [{k: v for k, v in row.items() if k != "checkpoint"} for row in run.report.rows]

    assert rows(mine) == rows(theirs)
    assert [Path(r["checkpoint"]).name for r in mine.report.rows] == [Path(r["checkpoint"]).name
                                                                     for r in theirs.report.rows]
