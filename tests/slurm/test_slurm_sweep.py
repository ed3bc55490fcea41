"""A sweep under `launcher: slurm`: two setups at once, each submitting its own jobs, queued together.

One repository, two setups that differ in their learning rate: the untrained evaluation (which reads no learning
rate) is one SLURM job for both, then each setup trains, computes its Fisher and evaluates in jobs of its own. Each
training job is held after its first step (the fault hook's HOLD, limited to the shared training folders) until the
test has seen both setups' training jobs in the queue at the same time: concurrency shown by the queue itself, not
by timing.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from leanagent.flows.sweep import lifelong_sweep
from leanagent.run.shared import shared_program
from tests.ddp.conftest import fault_env
from tests.slurm.cluster import Cluster
from tests.slurm.test_slurm import STARTUP_S
from tests.slurm.test_slurm_flow import slurm_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.prefect]


def _ids(job_dir: Path) -> list[int]:
    record = job_dir / "slurm" / "job.json"
    return json.loads(record.read_text())["job_ids"] if record.is_file() else []


def test_two_setups_run_at_once_their_jobs_queued_together(cluster: Cluster, prefect_harness: None, demo_assets,
                                                         write_cpu_config, tmp_path: Path, monkeypatch) -> None:
    slurm_config(write_cpu_config, tmp_path / "base.yaml", tmp_path / "replaced", demo_assets.repos[:1])
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "base": "base.yaml", "sweep_dir": "sweep", "max_parallel": 2,
        "setups": {"slow": [], "fast": ["model.lr=0.002"]}}))
    shared = tmp_path / "sweep" / "shared" / "jobs"
    release = tmp_path / "release"
    for key, value in fault_env("step:1:HOLD:train-", tmp_path / "held", release).items():
        monkeypatch.setenv(key, value)  # sbatch hands the submitting environment to the ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    together: list[list[str]] = []
    stop = threading.Event()

    def watch() -> None:
        """Until both setups' training jobs are in the queue at once, then let them train on."""
        while not stop.wait(0.5):
            trains = [str(i) for folder in shared.glob("train-*") for i in _ids(folder)[-1:]]
            queued = cluster.jobs()
            if len(trains) == 2 and all(job in queued for job in trains):
                together.append(queued)
                release.touch()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        state = lifelong_sweep(sweep_path=str(tmp_path / "sweep.yaml"), return_state=True)
    finally:
        stop.set()
        release.touch()
        watcher.join(timeout=STARTUP_S)
    assert state.is_completed(), state.message
    assert together, "the two setups' training jobs were never in the queue at the same time"
    submitted = {shared_program(folder): _ids(folder) for folder in shared.iterdir()}
    jobs = sorted(shared_program(folder) for folder in shared.iterdir())
    # One untrained evaluation for both setups, then each setup's own three jobs: 7 SLURM jobs, 8 alone.
    assert jobs == ["evaluate"] * 3 + ["fisher"] * 2 + ["train"] * 2, submitted
    assert all(len(_ids(folder)) == 1 for folder in shared.iterdir())
    for name in ("slow", "fast"):
        manifest = json.loads((tmp_path / "sweep" / name / "manifest.json").read_text())
        assert {e["status"] for repo in manifest["repos"].values() for e in repo["stages"].values()} == {"done"}
    assert not cluster.jobs()
