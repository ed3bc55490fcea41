"""Faults injected into real processes: whatever happens to a rank or to its supervisor, nothing of the job is
left running.

Each test learns the job's processes by pid AND start time (pid files the ranks write, or the supervisor's
descendants as psutil sees them just before the fault), so a recycled pid never counts as a survivor, and a zombie
(ended, waiting for init to reap it) counts as gone. Deadlines are generous (this runs on a busy 2-core
machine); the measured times are printed (`pytest -s`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from leanagent.ground.config import TrainerConfig
from leanagent.ground.supervision import descendants, find_process, is_running, start_time
from leanagent.launch.base import LaunchError
from leanagent.launch.local import LocalLauncher
from tests.conftest import TORCHRUN
from tests.prefect.prefect_api import served_deployment, stop_serving
from tests.waiting import wait_for

from .conftest import REPO_ROOT

pytestmark = pytest.mark.ddp
CPU2 = TrainerConfig(accelerator="cpu", devices=2, precision="32-true")
STARTUP_S = 180.0  # torchrun + two Python ranks (+ Prefect) starting on a loaded 2-core machine
GONE_S = 30.0  # the brief's "within a few seconds", with room for a busy machine
# Offline, Prefect's telemetry flush at exit can hold a process for ~30 s: noise, not what is measured here.
NO_TELEMETRY = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

# Run under torchrun. Options (comma-separated): watch (start leanagent's supervision like the real programs),
# ignore-term (SIGTERM does nothing), beat (touch the heartbeat file every 0.2 s), beat-once. Each rank writes
# `pid{rank}` = "pid start" once its options are in force, then waits forever.
PROBE = '''
import os, signal, sys, time
from pathlib import Path

options, out = set(sys.argv[1].split(",")), Path(sys.argv[2])
rank = int(os.environ["RANK"])
if "watch" in options:
    from leanagent.ground import supervision
    supervision.start()
if "ignore-term" in options:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
from leanagent.ground.supervision import start_time
out.mkdir(parents=True, exist_ok=True)
(out / f"pid{rank}").write_text(f"{os.getpid()} {start_time(os.getpid())}")
print(f"rank {rank} ready with {sorted(options)}", flush=True)
beats = out / "heartbeat"
first = True
while True:
    if "beat" in options or ("beat-once" in options and first):
        beats.mkdir(exist_ok=True)
        tmp = beats / f".rank{rank}.tmp"
        tmp.write_text("{}")
        os.replace(tmp, beats / f"rank{rank}.json")
    first = False
    time.sleep(0.2)
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "fault_probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture
def leftovers() -> dict[int, float]:
    """Processes a test started (pid -> start time); any still running at teardown are SIGKILLed."""
    known: dict[int, float] = {}
    yield known
    for pid, start in known.items():
        if is_running(pid, start):
            os.kill(pid, signal.SIGKILL)


def _cmdline(proc: int | psutil.Process) -> str:
    try:
        return " ".join((proc if isinstance(proc, psutil.Process) else psutil.Process(proc)).cmdline())
    except psutil.Error:
        return "?"


def _running(procs: dict[int, float]) -> list[str]:
    """Those of `procs` still running (same pid and start time, not a zombie), described."""
    running = []
    for pid, start in procs.items():
        proc = find_process(pid, start)
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                running.append(f"{pid} [{proc.status()}] {_cmdline(proc)[:160]}")
    return running


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Output to a file, never a pipe: nobody reads a pipe while the test waits, and a full one would block the
    process in a write (a Prefect flow logs every rank line), which is a hang, not the fault under test."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def _log(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def _wait_gone(procs: dict[int, float], timeout_s: float = GONE_S) -> float:
    """Seconds until none of `procs` runs; fails naming the survivors."""
    started = time.monotonic()
    while _running(procs):
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"still running {timeout_s:.0f} s after the fault:\n" + "\n".join(_running(procs)))
        time.sleep(0.1)
    return time.monotonic() - started


def _rank_pids(out: Path, n: int = 2) -> dict[int, float]:
    procs = {}
    for rank in range(n):
        pid, start = (out / f"pid{rank}").read_text().split()
        procs[int(pid)] = float(start)
    return procs


def _ranks_ready(out: Path, n: int = 2) -> bool:
    return all((out / f"pid{r}").is_file() and (out / f"pid{r}").read_text().strip() for r in range(n))


def _tree(pid: int) -> dict[int, float]:
    """The live descendants of `pid`, by start time: what must be gone once `pid` is."""
    return _starts(descendants(psutil.Process(pid)))


def _starts(procs: list[psutil.Process]) -> dict[int, float]:
    """pid -> start time of those of `procs` still running."""
    found = {}
    for p in procs:
        start = start_time(p.pid)
        if start is not None and is_running(p.pid, start):
            found[p.pid] = start
    return found


# --- the launcher ends every rank itself -----------------------------------------------------------------


def test_a_stopped_rank_that_ignores_sigterm_is_killed_before_launch_returns(tmp_path, probe, leftovers):
    """SIGSTOP on rank 1 (as a rank stuck in a collective): the heartbeat watchdog ends the job, and the
    stopped rank (in its own session, out of reach of torchrun's group) is gone when supervise() returns."""
    out = tmp_path / "job"

    def stop_rank_1() -> None:
        deadline = time.monotonic() + STARTUP_S
        while not _ranks_ready(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _ranks_ready(out):
            leftovers.update(_rank_pids(out))
            time.sleep(1.0)
            os.kill(_pid_of_rank(out, 1), signal.SIGSTOP)

    stopper = threading.Thread(target=stop_rank_1, daemon=True)
    stopper.start()
    started = time.monotonic()
    # timeout_s only guards the test against a hang; the heartbeat is what must end the job.
    with pytest.raises(LaunchError, match=r"no heartbeat for 10 s from rank1"):
        LocalLauncher(CPU2, entry=[str(probe), "beat,ignore-term", str(out)]).supervise(
            [], out, heartbeat_timeout_s=10, grace_s=2, timeout_s=STARTUP_S + 60)
    returned = time.monotonic() - started
    stopper.join(timeout=5)
    procs = _rank_pids(out)
    assert not _running(procs), f"ranks outlived supervise(): {_running(procs)}"
    print(f"\n[faults] stopped rank: supervise() returned {returned:.1f} s after the start, no rank left")


def _pid_of_rank(out: Path, rank: int) -> int:
    return int((out / f"pid{rank}").read_text().split()[0])


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_not_orphaned(tmp_path, probe, leftovers):
    """torchrun waits 30 s before it SIGKILLs its workers; the launcher must not kill torchrun first and leave
    the ranks behind: it SIGKILLs the ranks themselves after its own grace (2 s here)."""
    out = tmp_path / "job"
    with pytest.raises(LaunchError, match=r"no heartbeat for 20 s"):
        LocalLauncher(CPU2, entry=[str(probe), "beat-once,ignore-term", str(out)]).supervise(
            [], out, heartbeat_timeout_s=20, grace_s=2, timeout_s=STARTUP_S + 60)
    procs = _rank_pids(out)
    leftovers.update(procs)
    assert not _running(procs), f"ranks outlived supervise(): {_running(procs)}"


# --- the supervisor dies ----------------------------------------------------------------------------------

SUPERVISOR = (
    "import sys; from pathlib import Path;"
    "from leanagent.ground.config import TrainerConfig; from leanagent.launch.local import LocalLauncher;"
    "out = Path(sys.argv[1]);"
    "LocalLauncher(TrainerConfig(accelerator='cpu', devices=2), entry=[sys.argv[2], sys.argv[3], str(out)])"
    ".supervise([], out)"
)


@pytest.mark.parametrize("options, stop_rank_1", [
    ("plain", False),  # the ranks cannot watch: torchrun's parent-death signal must end them
    ("watch,ignore-term", False),  # only the ranks' own watchers can end them quickly
    ("watch,ignore-term", True),  # a stopped rank cannot watch: its sibling's watcher kills it
    ("ignore-term", False),  # torchrun's clean-up would wait 30 s: its watchdog (leanagent.launch.torchrun) ends all
], ids=["pdeathsig", "watchers", "stopped-sibling", "torchrun-watchdog"])
def test_sigkill_of_the_supervisor_leaves_nothing(tmp_path, probe, leftovers, options, stop_rank_1):
    out = tmp_path / "job"
    sup = _spawn([sys.executable, "-c", SUPERVISOR, str(out), str(probe), options], tmp_path / "supervisor.log")
    leftovers[sup.pid] = start_time(sup.pid)
    wait_for(lambda: _ranks_ready(out), STARTUP_S, "both ranks started", sup, lambda: _log(sup)[-3000:])
    job = {**_tree(sup.pid), **_rank_pids(out)}
    leftovers.update(job)
    assert len(job) >= 3, f"expected torchrun and two ranks under the supervisor, found {job}"
    if stop_rank_1:
        os.kill(_pid_of_rank(out, 1), signal.SIGSTOP)
        time.sleep(0.5)
    sup.kill()
    elapsed = _wait_gone(job)
    sup.wait(timeout=10)
    print(f"\n[faults] SIGKILL of the supervisor ({options}, stopped rank: {stop_rank_1}): "
          f"all {len(job)} processes gone after {elapsed:.1f} s")
    if "ignore-term" in options:
        # torchrun's own fallback (SIGKILL 30 s after its SIGTERM) did not do it: the watchers did.
        assert elapsed < 20, f"took {elapsed:.1f} s: the watchers did not act"


# --- the command line -----------------------------------------------------------------------------------


def _cli(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    # No PREFECT_API_URL (not even empty: Prefect would then take "" for a server): `leanagent run` starts its own.
    dropped = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "PREFECT_API_URL")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    return _spawn([sys.executable, "-m", "leanagent.cli", *args], log, env={**base, **(env or {})})


def _pid_records(folder: Path) -> dict[int, float]:
    """The pid records the real rank programs write into their job folder (JOB/pids/rankN.json)."""
    records = {}
    for path in folder.glob("rank*.json"):
        data = json.loads(path.read_text())
        records[data["pid"]] = data["start"]
    return records


def test_sigterm_to_leanagent_train_ends_the_job_and_exits_143(tmp_path, ddp_assets, leftovers, write_cpu_config):
    cfg = write_cpu_config(tmp_path / "cfg.yaml", encoder=ddp_assets["model"], launcher=TORCHRUN,
                           lifelong={"epochs_per_repo": 50})
    out = tmp_path / "job"
    cli = _cli(tmp_path / "cli.log", "train", "--config", str(cfg), "--dataset", str(ddp_assets["repo_a"]),
               "--out", str(out))
    leftovers[cli.pid] = start_time(cli.pid)
    wait_for(lambda: len(_pid_records(out / "pids")) == 2 and (out / "heartbeat" / "rank1.json").is_file(),
             STARTUP_S, "both ranks running", cli, lambda: _log(cli)[-3000:])
    time.sleep(2.0)
    job = {**_tree(cli.pid), **_pid_records(out / "pids")}
    leftovers.update(job)
    cli.send_signal(signal.SIGTERM)
    started = time.monotonic()
    cli.wait(timeout=120)
    output = _log(cli)
    exited = time.monotonic() - started
    assert cli.returncode == 143, output[-3000:]
    assert "interrupted by SIGTERM" in output
    assert not _running(job), f"left behind by `leanagent train`: {_running(job)}"
    assert not (out / "result.json").exists()
    print(f"\n[faults] SIGTERM to leanagent train: exited 143 after {exited:.1f} s, all {len(job)} processes gone")


def _run_config(write_cpu_config, tmp_path: Path, ddp_assets: dict[str, Path]) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    cfg = write_cpu_config(tmp_path / "cfg.yaml", run_dir, [ddp_assets["repo_a"]], encoder=ddp_assets["model"],
                           launcher=TORCHRUN, lifelong={"epochs_per_repo": 50})
    return cfg, run_dir


def _own_prefect_home(tmp_path: Path) -> dict[str, str]:
    """`leanagent run` with Prefect's temporary server, in a Prefect home of its own (not the user's database)."""
    return {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
            **NO_TELEMETRY}


def _train_pids(run_dir: Path) -> dict[int, float]:
    records: dict[int, float] = {}
    for folder in (run_dir / "jobs").glob("*/train/pids"):
        records.update(_pid_records(folder))
    return records


def _manifest_stage(run_dir: Path, stage: str) -> dict:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (repo,) = manifest["repos"].values()
    return repo["stages"][stage]


def _run_until_training(write_cpu_config, tmp_path: Path, ddp_assets,
                        leftovers) -> tuple[subprocess.Popen, Path, dict[int, float]]:
    """`leanagent run` started with its own Prefect home, once both training ranks run: the CLI, the run
    folder, and every process of it (pid -> start time), all registered for clean-up."""
    cfg, run_dir = _run_config(write_cpu_config, tmp_path, ddp_assets)
    cli = _cli(tmp_path / "cli.log", "run", "--config", str(cfg), env=_own_prefect_home(tmp_path))
    leftovers[cli.pid] = start_time(cli.pid)
    wait_for(lambda: len(_train_pids(run_dir)) == 2, 2 * STARTUP_S, "the training job's ranks running", cli,
              lambda: _log(cli)[-3000:])
    time.sleep(2.0)
    job = {**_tree(cli.pid), **_train_pids(run_dir)}
    leftovers.update(job)
    return cli, run_dir, job


def test_sigkill_to_leanagent_run_leaves_no_rank_and_no_prefect_server(tmp_path, ddp_assets, leftovers,
                                                                       write_cpu_config):
    cli, run_dir, job = _run_until_training(write_cpu_config, tmp_path, ddp_assets, leftovers)
    commands = {pid: _cmdline(pid) for pid in job}
    assert any("uvicorn" in c and "prefect.server" in c for c in commands.values()), commands
    assert sum("leanagent.train.programs" in c and "leanagent.launch.torchrun" not in c for c in commands.values()) == 2
    assert any("leanagent.launch.torchrun" in c for c in commands.values()), commands
    cli.kill()
    elapsed = _wait_gone(job)
    cli.wait(timeout=10)
    print(f"\n[faults] SIGKILL of leanagent run: ranks, torchrun and the Prefect server ({len(job)} processes) "
          f"gone after {elapsed:.1f} s")


def test_sigint_to_leanagent_run_records_the_stage_interrupted(tmp_path, ddp_assets, leftovers, write_cpu_config):
    cli, run_dir, job = _run_until_training(write_cpu_config, tmp_path, ddp_assets, leftovers)
    cli.send_signal(signal.SIGINT)
    started = time.monotonic()
    cli.wait(timeout=120)
    output = _log(cli)
    exited = time.monotonic() - started
    assert cli.returncode == 130, output[-3000:]
    assert not _running(job), f"left behind by `leanagent run`: {_running(job)}"
    stage = _manifest_stage(run_dir, "train")
    assert stage["status"] == "interrupted", stage
    assert "SIGINT" in stage["reason"]
    assert _manifest_stage(run_dir, "eval-untrained")["status"] == "done"
    print(f"\n[faults] SIGINT to leanagent run: exited 130 after {exited:.1f} s, all {len(job)} processes gone, "
          f"train stage recorded interrupted")


# --- a served deployment, cancelled ---------------------------------------------------------------------


def _flow_run_tree(runner: int) -> dict[int, float]:
    """The flow-run process (the runner's child above torchrun) and its descendants; not the runner's helpers."""
    (torchrun,) = [p for p in descendants(psutil.Process(runner)) if "leanagent.launch.torchrun" in _cmdline(p)]
    flow_run = torchrun
    while flow_run.ppid() != runner:
        flow_run = flow_run.parent()
    return _starts([flow_run, *descendants(flow_run)])


@pytest.mark.prefect
def test_cancelling_a_served_deployment_run_ends_its_job(tmp_path, ddp_assets, leftovers, prefect_harness,
                                                         write_cpu_config):
    """`prefect flow-run cancel` (or the UI's Cancel) on a run of `deployments/serve.py`: the runner sends the
    flow-run process SIGTERM (after a cancel intent on its control channel); the launcher ends the job, the
    stage is recorded interrupted, the run shows Cancelled, and no process of it is left."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    cfg, run_dir = _run_config(write_cpu_config, tmp_path, ddp_assets)
    name = f"cancel-{os.getpid()}-{tmp_path.name}"[:60]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_RUNNER_POLL_FREQUENCY="1", **NO_TELEMETRY)
    serve = _spawn([sys.executable, "deployments/serve.py", "--name", name], tmp_path / "serve.log", env=env)
    leftovers[serve.pid] = start_time(serve.pid)
    try:
        with get_client(sync_client=True) as client:
            deployment = served_deployment(client, name, STARTUP_S, serve)
            run = client.create_flow_run_from_deployment(deployment.id, parameters={"config_path": str(cfg)})
            wait_for(lambda: len(_train_pids(run_dir)) == 2, 2 * STARTUP_S, "the training job's ranks running",
                     serve, lambda: _log(serve)[-3000:])
            time.sleep(2.0)
            job = {**_flow_run_tree(serve.pid), **_train_pids(run_dir)}
            leftovers.update(job)
            assert sum("leanagent.train.programs" in _cmdline(p) and "leanagent.launch.torchrun" not in _cmdline(p)
                       for p in job) == 2
            client.set_flow_run_state(run.id, Cancelling(message="cancelled by test_faults"))
            cancelled = time.monotonic()
            elapsed = _wait_gone(job, timeout_s=90)  # the runner's own SIGKILL comes 30 s after its SIGTERM
            wait_for(lambda: client.read_flow_run(run.id).state.type == StateType.CANCELLED, 120,
                     "the flow run shown as Cancelled")
            shown = time.monotonic() - cancelled
        stage = _manifest_stage(run_dir, "train")
        assert stage["status"] == "interrupted", f"{stage}\n{_log(serve)[-5000:]}"
        print(f"\n[faults] cancel of a served run: its {len(job)} processes gone {elapsed:.1f} s after the cancel, "
              f"run Cancelled after {shown:.1f} s; train stage {stage['status']} ({stage['reason']})")
    finally:
        stop_serving(serve)
