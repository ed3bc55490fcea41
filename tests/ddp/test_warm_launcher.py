"""`launcher: warm`, which starts most of this suite's jobs: ranks forked from the session's fork server give what
torchrun's give, bit for bit, and are watched, named and ended as torchrun's are (leanagent/launch/warm.py)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from leanagent.ground.config import TrainerConfig
from leanagent.ground.supervision import find_process
from leanagent.launch.base import LaunchError
from leanagent.launch.warm import WarmLauncher

from .conftest import REPO_ROOT, SCRIPTS, leanagent

pytestmark = pytest.mark.ddp
CPU2 = TrainerConfig(accelerator="cpu", devices=2, precision="32-true")
GONE_S = 60.0  # generous: a busy 2-core machine


@pytest.fixture
def server(fork_server) -> psutil.Process:
    """The session's fork server, its imports done (a deadline below counts from the launch)."""
    fork_server.wait_ready()
    return psutil.Process(fork_server.proc.pid)


def _probe(mode: str, out: Path) -> list[str]:
    return [str(SCRIPTS / "fail_probe.py"), mode, str(out)]


def _rank_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("pid*"))]


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + GONE_S
    while any(find_process(pid) for pid in pids):
        assert time.monotonic() < deadline, f"left running: {[pid for pid in pids if find_process(pid)]}"
        time.sleep(0.1)


def _losses(job: Path) -> dict[int, float]:
    with open(job / "lightning_logs" / "version_0" / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss_train_step"]) for r in csv.DictReader(f) if r.get("loss_train_step")}


def test_a_job_gives_torchruns_weights_and_metrics_bit_for_bit(ddp_jobs, ddp_assets, tmp_path):
    """Repo A's training job of `ddp_jobs`, run under torchrun there, again under the warm launcher."""
    out = tmp_path / "a"
    proc = leanagent("train", "--config", str(ddp_jobs["cfg"]), "--dataset", str(ddp_assets["repo_a"]),
                     "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warm, torchrun = json.loads((out / "result.json").read_text()), ddp_jobs["a"]
    # The ranks ran here, forked by the server's agent: their logs are where it writes them.
    assert sorted(p.parent.name for p in out.glob("logs/*/warm/attempt_0/*/stdout.log")) == ["0", "1"]
    assert warm["world_size"] == torchrun["world_size"] == 2
    for key in ("metrics", "history", "global_step", "epoch", "precision", "num_train_examples"):
        assert warm[key] == torchrun[key], key
    assert _losses(out) == _losses(ddp_jobs["work"] / "a")
    mine = torch.load(warm["last_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    theirs = torch.load(torchrun["last_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_failing_rank_is_named_and_the_others_are_ended(server, tmp_path):
    lines: list[str] = []
    with pytest.raises(LaunchError) as info:
        WarmLauncher(CPU2, entry=_probe("fail", tmp_path)).supervise([], tmp_path, on_line=lines.append, grace_s=2)
    err = info.value
    assert err.failing_rank == 1
    assert "boom on rank 1" in str(err) and "the data on this rank is bad" in str(err)
    assert any(line.startswith("[rank 0] rank 0 started") for line in lines)
    _wait_gone(_rank_pids(tmp_path))  # rank 0 was sleeping for 600 s: it was ended, not waited for
    # The server forks from one thread only, and stays so: it never ran a torch op.
    assert server.num_threads() == 1


def test_a_deadline_ends_the_agent_and_every_rank(server, tmp_path):
    with pytest.raises(LaunchError, match="deadline of 10 s"):
        WarmLauncher(CPU2, entry=_probe("hang", tmp_path)).supervise([], tmp_path, timeout_s=10, grace_s=2)
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2
    _wait_gone(pids)
    deadline = time.monotonic() + GONE_S
    while server.children():  # its agent too
        assert time.monotonic() < deadline, f"the agent was left running: {server.children()}"
        time.sleep(0.1)


def test_sigkill_of_the_launcher_leaves_nothing(server, tmp_path):
    """Nobody collects the job any more: the agent (its control socket closed) and the ranks' own watchers end it."""
    code = ("from pathlib import Path; from leanagent.ground.config import TrainerConfig;"
            "from leanagent.launch.warm import WarmLauncher;"
            f"WarmLauncher(TrainerConfig(accelerator='cpu', devices=2), entry={_probe('hang', tmp_path)!r})"
            f".supervise([], Path({str(tmp_path)!r}))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while len(_rank_pids(tmp_path)) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks never started"
            time.sleep(0.2)
        agents = [p.pid for p in server.children()]
        assert len(agents) == 1
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=60)
        _wait_gone([*_rank_pids(tmp_path), *agents])
    finally:
        if launcher.poll() is None:
            launcher.kill()
