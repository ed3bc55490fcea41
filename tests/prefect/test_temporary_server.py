"""Prefect's temporary server of `leanagent run`: how long it is waited for (long enough for a busy machine, unless
told), what of its output is shown, and two runs starting theirs at once on one Prefect home."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from leanagent.flows.temporary_server import STARTUP_FLOOR_S, ServerOutput, startup_timeout
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

from leanagent.data.synthetic import write_demo_repos
from leanagent.ground.pid_lock import PidLock
from tests.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_prefects_20_s_default_is_raised_to_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    assert PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() < STARTUP_FLOOR_S
    assert startup_timeout() == STARTUP_FLOOR_S


def test_a_timeout_the_user_set_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "7")
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 7}):
        assert startup_timeout() == 7


def test_the_servers_output_is_shown_until_the_stop_begins_then_dropped(tmp_path) -> None:
    """What the server prints while the command runs reaches the terminal; its shutdown noise (SQLAlchemy's
    cancelled-rollback tracebacks) does not. A real child process, synchronised by its stdin, not by a clock."""
    shown = tmp_path / "stderr"
    with shown.open("wb") as sink:
        output = ServerOutput(sink_fd=sink.fileno())
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys\nprint('while running', flush=True)\nsys.stdin.readline()\n"
             "print('Exception during reset or similar', file=sys.stderr, flush=True)"],
            stdin=subprocess.PIPE, stdout=output.writer, stderr=output.writer)
        output.started()
        wait_for(lambda: b"while running" in shown.read_bytes(), 120, "the line printed while running", child,
                 shown.read_text)
        output.cut()
        child.communicate(b"stop\n", timeout=120)
        output.close(timeout=120)
    assert shown.read_text() == "while running\n"
    assert not output._pump.is_alive()  # read to the end: the child was never left blocked on the pipe


@pytest.mark.prefect
@pytest.mark.slow
def test_two_runs_started_at_once_on_one_prefect_home_both_finish_without_a_traceback(tiny_model, tmp_path) -> None:
    """Two `leanagent run`s with no server configured, one Prefect home: their temporary servers used to migrate the
    one database at once (`no such table: ...`, "Application startup failed", 180 lines). Each now waits for the
    start lock, saying so in one line; this test holds that lock until both wait, so that both start at the same
    moment whatever the machine's load, then lets go. Both runs finish, their flow runs in the one database."""
    # The smallest repository that validates (6 training theorems): what is tested is the start, not the jobs.
    (repo,) = write_demo_repos(tmp_path / "data", 1, seed=3, theorems_per_repo=8)
    home = tmp_path / "prefect-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # One thread per run's single rank: two runs share the machine's cores.
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="600", DO_NOT_TRACK="1",
               OMP_NUM_THREADS="1")
    lock_path = subprocess.run([sys.executable, "-c", "from leanagent.flows.temporary_server import start_lock; "
                                "print(start_lock())"], env=env, capture_output=True, text=True, check=True,
                               timeout=300).stdout.strip()
    assert Path(lock_path).parent == home  # beside the database Prefect keeps in its home
    runs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    waiting = f"waiting for another run's temporary Prefect server (pid {os.getpid()}) to finish starting"
    try:
        with PidLock(Path(lock_path)):
            for name, log in logs.items():
                config = tmp_path / f"{name}.yaml"
                config.write_text(yaml.safe_dump({
                    "model": {"name_or_path": str(tiny_model), "warmup_steps": 2, "max_seq_len": 128},
                    "data": {"batch_size": 4, "eval_batch_size": 16, "num_workers": 0, "max_seq_len": 128},
                    "trainer": {"accelerator": "cpu", "devices": 1, "precision": "auto"},
                    "lifelong": {"epochs_per_repo": 1}, "run_dir": str(tmp_path / f"run-{name}"),
                    "repos": [{"path": str(repo)}]}))
                with log.open("w") as out:
                    runs[name] = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "run", "--config",
                                                   str(config)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                                  cwd=REPO_ROOT, start_new_session=True)
            for name, log in logs.items():
                wait_for(lambda log=log: waiting in log.read_text(), 600, f"run {name} waiting for the start lock",
                         runs[name], log.read_text)
        for proc in runs.values():
            proc.wait(timeout=1800)
        for name, log in logs.items():
            text = log.read_text()
            assert runs[name].returncode == 0, text[-5000:]
            assert "Traceback" not in text and "Application startup failed" not in text, text[-5000:]
            assert text.count("waiting for another run's temporary Prefect server") == 1, text[:2000]
            assert f"manifest: {tmp_path / f'run-{name}' / 'manifest.json'}" in text
        with sqlite3.connect(home / "prefect.db") as db:  # the one database holds both runs, as a user's home does
            assert db.execute("select count(*) from flow_run").fetchone() == (2,)
        left = [p.pid for p in psutil.process_iter() if _in_home(p, home)]
        assert not left, f"processes of the Prefect home left running: {left}"
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _in_home(proc: psutil.Process, home: Path) -> bool:
    try:
        return proc.environ().get("PREFECT_HOME") == str(home) and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.prefect
def test_a_prefect_home_that_is_a_file_is_one_line_naming_it(unit_repo, tiny_model, tmp_path) -> None:
    home = tmp_path / "prefect-home"
    home.write_text("a user's file")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), DO_NOT_TRACK="1")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model)},
                                      "trainer": {"accelerator": "cpu", "devices": 1},
                                      "run_dir": str(tmp_path / "run"), "repos": [{"path": str(unit_repo)}]}))
    run = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(config)], env=env,
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1 and run.stdout == "", run.stderr
    assert run.stderr == (f"error: Prefect's temporary server cannot start: {home} exists and is not a folder; "
                          f"nothing was overwritten; check that PREFECT_HOME ({home}) is a folder it can create and "
                          f"write, or set PREFECT_API_URL to a running server (`prefect server start`)\n")
    assert home.read_text() == "a user's file" and not (tmp_path / "run").exists()
