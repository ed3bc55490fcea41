"""Shared fixtures of the DDP tests: probes on 2 ranks, the CLI as a user runs it, and one lifelong sequence of jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from leanagent.ground.config import TrainerConfig
from leanagent.launch.local import LocalLauncher
from leanagent.launch.warm import WarmLauncher
from tests.conftest import TORCHRUN, WARM

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "tests" / "ddp_scripts"
PROBE_RANKS = TrainerConfig(accelerator="cpu", devices=2)


def fault_env(fault: str, mark: Path | None = None, release: Path | None = None) -> dict[str, str]:
    """What a command's environment needs for `tests/ddp_scripts/faults` to act in its ranks: the hook on PYTHONPATH
    and LEANAGENT_TEST_FAULT=`fault`; `mark` is written when it acts, `release` ends a HOLD (see the hook)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS / "faults"), str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH")])),
           "LEANAGENT_TEST_FAULT": fault}
    if mark is not None:
        env["LEANAGENT_TEST_FAULT_MARK"] = str(mark)
    if release is not None:
        env["LEANAGENT_TEST_FAULT_RELEASE"] = str(release)
    return env


@pytest.fixture
def run_probe(fork_server) -> Callable[..., str]:
    """`run_probe(source, folder, *args, timeout=900, launcher=WARM)`: `source` written to FOLDER/probe.py and run
    with 2 gloo ranks on this machine (forked by the warm launcher, or under torchrun), `args` after it, in the
    environment a launched job gets; it must exit 0. Its output, `[rank N] ` before each rank's lines."""

    def run(source: str, folder: Path, *args: str, timeout: float = 900, launcher: str = WARM) -> str:
        script = folder / "probe.py"
        script.write_text(source)
        if launcher == WARM:
            fork_server.ensure()
        kind = {WARM: WarmLauncher, TORCHRUN: LocalLauncher}[launcher]
        job = kind(PROBE_RANKS, entry=[str(script), *args]).start([], folder / "probe", folder / "probe" / "logs")
        output, deadline = b"", time.monotonic() + timeout
        while (chunk := job.read(1.0)) is not None and time.monotonic() < deadline:
            output += chunk
        if chunk is not None:  # the deadline: end it
            job.end(5.0, lambda line: None)
        code = job.wait()
        job.end(1.0, lambda line: None)
        text = output.decode(errors="replace")
        assert code == 0, f"exit {code} (a deadline of {timeout:.0f} s):\n{text[-6000:]}"
        return text

    return run


def leanagent(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed console script's code path, in a subprocess as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)


def shown_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`leanagent ARGS` as a terminal runs it (none of the suite's verbosity or thread settings); it must exit 0."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LEANAGENT_VERBOSE", "OMP_NUM_THREADS",
                         "LEANAGENT_PROGRESS")}
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**base, **env}, cwd=REPO_ROOT)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}"
                                  f"\nstderr:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def ddp_jobs(ddp_assets, tmp_path_factory, write_cpu_config) -> dict:
    """Repo A trained from the base model, its Fisher, repo B from A's checkpoint with EWC, B evaluated on A.

    Four real jobs (2 gloo ranks each) through the command line, run once for the tests that read them: the rank
    programs' results (test_programs) and what a person sees of them (test_logs_progress: A prints progress lines
    every 0.2 s; the evaluation is `--verbose`). A and the evaluation run under torchrun, whose banner and lines the
    output tests look at; the Fisher and B under the warm launcher (`cfg`). Tests only read these folders. Returns
    each job's result.json (`a`, `fa`, `b`, `ev`) and what the command printed (`shown_a`, `shown_ev`).
    """
    work = tmp_path_factory.mktemp("ddp_jobs")
    cfg = write_cpu_config(work / "cfg.yaml", encoder=ddp_assets["model"])
    shown_cfg = write_cpu_config(work / "torchrun.yaml", encoder=ddp_assets["model"], launcher=TORCHRUN)
    repo_a, repo_b = str(ddp_assets["repo_a"]), str(ddp_assets["repo_b"])

    def result(name: str) -> dict:
        return json.loads((work / name / "result.json").read_text())

    shown_a = shown_cli("train", "--config", str(shown_cfg), "--dataset", repo_a, "--out", str(work / "a"),
                        LEANAGENT_PROGRESS_INTERVAL="0.2")
    a = result("a")
    shown_cli("fisher", "--config", str(cfg), "--dataset", repo_a, "--checkpoint", a["checkpoint"], "--out",
              str(work / "fa"))
    fa = result("fa")
    shown_cli("train", "--config", str(cfg), "--dataset", repo_b, "--checkpoint", a["checkpoint"], "--fisher",
              fa["fisher"], "--out", str(work / "b"))
    b = result("b")
    shown_ev = shown_cli("evaluate", "--config", str(shown_cfg), "--dataset", repo_a, "--checkpoint", b["checkpoint"],
                         "--out", str(work / "ev"), "--verbose")
    return {"work": work, "cfg": cfg, "a": a, "fa": fa, "b": b, "ev": result("ev"), "shown_a": shown_a,
            "shown_ev": shown_ev, "repo_a": Path(repo_a).name}
