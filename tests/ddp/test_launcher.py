"""The launcher supervising real torchrun jobs: failures, deadlines, stale heartbeats, barriers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leanagent.ground.config import TrainerConfig
from leanagent.ground.supervision import find_process
from leanagent.launch.base import LaunchError, child_environment
from leanagent.launch.local import LocalLauncher

from .conftest import SCRIPTS

pytestmark = pytest.mark.ddp
CPU2 = TrainerConfig(accelerator="cpu", devices=2, precision="32-true")


def _probe(mode: str, out: Path) -> list[str]:
    return [str(SCRIPTS / "fail_probe.py"), mode, str(out)]


def _running(pid: int) -> bool:
    """Alive and not a zombie: a killed rank whose parent torchrun died waits for init to reap it, which takes
    seconds on a loaded machine; os.kill(pid, 0) would still succeed on it."""
    return find_process(pid) is not None


def _assert_all_gone(out: Path) -> None:
    for pid_file in out.glob("pid*"):
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 30  # generous: a busy 2-core machine
        while time.monotonic() < deadline:
            if not _running(pid):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"rank process {pid} ({pid_file.name}) survived the launcher")


def test_failing_rank_is_named_with_its_last_lines(tmp_path):
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        LocalLauncher(CPU2, entry=_probe("fail", tmp_path)).supervise([], tmp_path, on_line=lines.append)
    err = info.value
    assert err.failing_rank == 1
    assert "rank 1" in str(err) and "boom on rank 1" in str(err) and "the data on this rank is bad" in str(err)
    assert any(line.startswith("[rank 0] rank 0 started") for line in lines)
    assert time.monotonic() - started < 120  # rank 0 was sleeping for 600 s: it was ended, not waited for
    _assert_all_gone(tmp_path)


def test_deadline_ends_the_whole_process_group(tmp_path):
    # 30 s: torchrun and both ranks must have started before the deadline, even on a loaded machine.
    with pytest.raises(LaunchError, match="deadline of 30 s"):
        LocalLauncher(CPU2, entry=_probe("hang", tmp_path)).supervise([], tmp_path, timeout_s=30, grace_s=2)
    assert len(list(tmp_path.glob("pid*"))) == 2
    _assert_all_gone(tmp_path)


def test_stale_heartbeat_ends_the_job(tmp_path):
    with pytest.raises(LaunchError, match="no heartbeat for 2 s from rank"):
        LocalLauncher(CPU2, entry=_probe("stale", tmp_path)).supervise([], tmp_path, heartbeat_timeout_s=2,
                                                                       grace_s=2)
    _assert_all_gone(tmp_path)


def test_heartbeats_of_an_earlier_attempt_do_not_count(tmp_path):
    """A retry reuses the job folder; the failed attempt's old heartbeat must not end the new one at once."""
    old = tmp_path / "heartbeat" / "rank0.json"
    old.parent.mkdir()
    old.write_text("{}")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    written = LocalLauncher(CPU2, entry=_probe("ok", tmp_path)).supervise([], tmp_path, heartbeat_timeout_s=30,
                                                                          grace_s=2)
    assert json.loads(written.read_text()) == {"ok": True}


def test_interrupt_of_the_supervisor_ends_the_job(tmp_path):
    """SIGTERM to a supervising process (what Prefect sends on cancel) must not orphan the ranks."""
    code = (
        "import signal, sys; from pathlib import Path;"
        "from leanagent.ground.config import TrainerConfig; from leanagent.launch.local import LocalLauncher;"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143));"
        f"LocalLauncher(TrainerConfig(accelerator='cpu', devices=2), entry=[{str(SCRIPTS / 'fail_probe.py')!r}, 'hang',"
        f" {str(tmp_path)!r}]).supervise([], Path({str(tmp_path)!r}), grace_s=2)"
    )
    sup = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(tmp_path.glob("pid*"))) == 2, "ranks never started"
    sup.terminate()
    sup.wait(timeout=120)
    _assert_all_gone(tmp_path)


def _run_barrier_probe(out: Path, *extra: str) -> dict[int, dict]:
    out.mkdir()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(SCRIPTS / "barrier_probe.py"), str(out), *extra], check=True, env=child_environment(),
                   capture_output=True, timeout=120)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_barrier_before_fit_synchronizes_once_the_group_exists(tmp_path):
    ranks = _run_barrier_probe(tmp_path / "ours")
    # Rank 1 arrives 3 s late: rank 0 may only leave the barrier after rank 1 reached it.
    assert ranks[0]["left"] >= ranks[1]["arrived"] - 0.05
    assert ranks[0]["nccl_timeout"] == str(7 * 24 * 60 * 60 * 52 * 1000) and ranks[0]["async"] == "1"


def test_barrier_is_a_no_op_without_the_group_as_in_the_reference(tmp_path):
    """The control: the same probe without creating the group first does not wait at all."""
    ranks = _run_barrier_probe(tmp_path / "reference", "--no-init")
    assert ranks[0]["left"] < ranks[1]["arrived"] - 1.0
