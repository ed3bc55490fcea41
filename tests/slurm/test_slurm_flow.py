"""The lifelong flow under `launcher: slurm`: a run continued with a third repository after its SLURM jobs are long
gone, which submits only the new repository's jobs and ends with the local recall matrix; reruns that submit
nothing; a SIGKILLed `leanagent run` whose rerun reattaches; and a Prefect cancel that leaves nothing in the queue."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from leanagent.flows.lifelong import lifelong_retrieval
from leanagent.ground.supervision import descendants, find_process, running
from tests.prefect.prefect_api import served_deployment, stop_serving
from tests.slurm.cluster import Cluster
from tests.slurm.test_slurm import REPO_ROOT, STARTUP_S, held_at, job_ids
from tests.waiting import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.prefect]


def slurm_config(write_cpu_config, path: Path, run_dir: Path, repos: list[Path], **lifelong) -> Path:
    """The tests' 2-rank CPU config, its ranks on 2 nodes of 1 (one SLURM task each) instead of 2 local ones."""
    return write_cpu_config(path, run_dir, repos, launcher="slurm", trainer={"devices": 1, "num_nodes": 2},
                            slurm={"partition": "debug", "poll_s": 0.5},
                            lifelong=lifelong)


def all_job_ids(run_dir: Path) -> dict[str, list[int]]:
    return {str(p.parent.parent.relative_to(run_dir)): json.loads(p.read_text())["job_ids"]
            for p in sorted(run_dir.glob("jobs/**/slurm/job.json"))}


def _forget_every_job(cluster: Cluster) -> None:
    """The first run's jobs long gone: a controller restarted on fresh state knows none of them (and numbers its
    jobs from 1 again, so a stale id would even name another job)."""
    cluster.stop()
    shutil.rmtree(cluster.root / "spool")
    cluster.start()


def test_a_slurm_run_continued_after_its_jobs_are_gone_submits_only_the_new_repository_and_gives_the_local_matrix(
        cluster: Cluster, lifelong_run3, write_cpu_config, demo_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun gives 2 local ranks: the same sums, bit for bit
    local = lifelong_run3.summary  # the session's fresh run of the three repositories under `launcher: local`
    run_dir = tmp_path / "slurm"
    two = slurm_config(write_cpu_config, tmp_path / "two.yaml", run_dir, demo_assets.repos[:2])
    started = time.monotonic()
    first = lifelong_retrieval(config_path=str(two))
    took = time.monotonic() - started
    assert first["order"] == local["order"][:2]
    submitted = all_job_ids(run_dir)
    # One SLURM job per train, Fisher and evaluation job of the flow: 2 x (train, fisher, evaluate) + untrained.
    assert len(submitted) == 7 and all(len(ids) == 1 for ids in submitted.values()), submitted
    _forget_every_job(cluster)
    three = slurm_config(write_cpu_config, tmp_path / "three.yaml", run_dir, demo_assets.repos[:3])
    continued = lifelong_retrieval(config_path=str(three))
    assert continued["order"] == local["order"]
    assert continued["matrix"] == local["matrix"] and continued["baseline"] == local["baseline"]
    assert continued["lifelong"] == local["lifelong"]
    now = all_job_ids(run_dir)
    assert {k: v for k, v in now.items() if k in submitted} == submitted  # the first run's jobs, untouched
    assert sorted(set(now) - set(submitted)) == ["jobs/02-repo_2/evaluate-00-01-02", "jobs/02-repo_2/fisher",
                                                 "jobs/02-repo_2/train", "jobs/untrained/evaluate-02"], now
    print(f"\n[slurm] 2-repository flow: {took:.0f} s under slurm for {len(submitted)} jobs; continued with 1 more")
    again = lifelong_retrieval(config_path=str(three))
    assert again["nothing_new"] and again["matrix"] == continued["matrix"]
    assert all_job_ids(run_dir) == now  # nothing was submitted again
    assert not cluster.jobs()


def _cli(log: Path, config: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config)], stdout=f,
                                stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env, start_new_session=True)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                           "PREFECT_API_URL")}
    (tmp_path / "prefect-home").mkdir(exist_ok=True)
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               OMP_NUM_THREADS="1")
    return env


def _running_job(cluster: Cluster, job_dir: Path) -> int | None:
    ids = job_ids(job_dir) if (job_dir / "slurm" / "job.json").is_file() else []
    if ids and cluster.run("squeue", "-h", "-j", str(ids[-1]), "-o", "%T", check=False).stdout.strip() == "RUNNING":
        return ids[-1]
    return None


def test_a_sigkilled_leanagent_run_is_rerun_and_reattaches_to_its_job(cluster: Cluster, demo_assets,
                                                                     write_cpu_config, tmp_path):
    run_dir = tmp_path / "run"
    config = slurm_config(write_cpu_config, tmp_path / "cfg.yaml", run_dir, demo_assets.repos[:1])
    train = run_dir / "jobs" / "00-repo_0" / "train"
    # The training job is held after its first step until the rerun has reattached to it: still running then,
    # however long the rerun takes to start its own Prefect server.
    held, release = tmp_path / "held", tmp_path / "release"
    env = {**_env(tmp_path), **held_at(1, held, release)}
    cli = _cli(tmp_path / "first.log", config, env)
    try:
        wait_for(held.exists, 2 * STARTUP_S, "the training job held", cli,
                 lambda: (tmp_path / "first.log").read_text()[-4000:])
        job_id = _running_job(cluster, train)
        os.killpg(cli.pid, signal.SIGKILL)  # the flow, the temporary server: all of `leanagent run`, at once
        cli.wait(timeout=30)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert job_id is not None and cluster.jobs() == [str(job_id)]  # nothing could cancel it: the job goes on
    rerun = _cli(tmp_path / "rerun.log", config, env)
    try:
        wait_for(lambda: "slurm: reattached to job" in (tmp_path / "rerun.log").read_text(), 2 * STARTUP_S,
                 "the rerun reattached", rerun, lambda: (tmp_path / "rerun.log").read_text()[-4000:])
    finally:
        release.touch()
    rerun.wait(timeout=1800)
    log = (tmp_path / "rerun.log").read_text()
    assert rerun.returncode == 0, log[-4000:]
    assert f"slurm: reattached to job {job_id}" in log
    assert job_ids(train) == [job_id]  # one job id for the stage
    assert not cluster.jobs()


def _tree(pid: int) -> set[int]:
    return {pid} | {p.pid for p in descendants(psutil.Process(pid))}


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.usefixtures("prefect_harness")
def test_a_prefect_cancel_of_a_served_run_leaves_no_job_in_the_queue(cluster: Cluster, demo_assets,
                                                                     write_cpu_config, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    run_dir = tmp_path / "run"
    config = slurm_config(write_cpu_config, tmp_path / "cfg.yaml", run_dir, demo_assets.repos[:1],
                          epochs_per_repo=50)
    name = f"slurm-cancel-{os.getpid()}"
    env = _env(tmp_path)
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_RUNNER_POLL_FREQUENCY="1")
    with open(tmp_path / "serve.log", "w") as f:
        serve = subprocess.Popen([sys.executable, "deployments/serve.py", "--name", name], cwd=REPO_ROOT, env=env,
                                 stdout=f, stderr=subprocess.STDOUT)
    train = run_dir / "jobs" / "00-repo_0" / "train"
    try:
        with get_client(sync_client=True) as client:
            deployment = served_deployment(client, name, STARTUP_S, serve)
            serving = _tree(serve.pid)  # the runner and its helpers, before the run: not the run's processes
            run = client.create_flow_run_from_deployment(deployment.id, parameters={"config_path": str(config)})
            wait_for(lambda: _running_job(cluster, train) is not None, 2 * STARTUP_S, "the training job running",
                     serve, lambda: (tmp_path / "serve.log").read_text()[-4000:])
            # The flow-run process and what it started; not the resource tracker that the runner's multiprocessing
            # starts with its first run and keeps for the next.
            flow_processes = [p for p in map(find_process, _tree(serve.pid) - serving)
                              if p is not None and "resource_tracker" not in _cmdline(p)]
            client.set_flow_run_state(run.id, Cancelling(message="cancelled by test_slurm_flow"))
            cancelled = time.monotonic()
            wait_for(lambda: not cluster.jobs(), 120, "the queue empty")
            emptied = time.monotonic() - cancelled
            wait_for(lambda: client.read_flow_run(run.id).state.type == StateType.CANCELLED, 120,
                     "the flow run Cancelled")
        left = {p.pid: _cmdline(p)[:200] for p in flow_processes if running(p)}
        assert not left, left
        stage = json.loads((run_dir / "manifest.json").read_text())["repos"]["00-repo_0"]["stages"]["train"]
        assert stage["status"] == "interrupted", stage
        print(f"\n[slurm] Prefect cancel of a served run: the queue empty {emptied:.1f} s after the cancel")
    finally:
        stop_serving(serve)
