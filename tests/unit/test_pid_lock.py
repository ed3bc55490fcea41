"""The lock that names its holder (`leanagent.ground.pid_lock`): a waiter says once that it waits, takes the lock when
the holder lets go or dies, and gives up after its wait naming the holder. Real processes, synchronised by pipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from leanagent.ground.pid_lock import LockHeld, PidLock

HOLD = ("import sys; from leanagent.ground.pid_lock import PidLock; lock = PidLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); sys.stdin.readline(); lock.release(); print('released', flush=True); "
        "sys.stdin.readline()")


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_waiter_says_so_once_and_takes_the_lock_when_the_holder_lets_go(tmp_path):
    path = tmp_path / "home" / ".start.lock"
    holder = _holder(path)
    told: list[str] = []
    try:
        with pytest.raises(LockHeld) as info:
            PidLock(path).acquire()  # no wait asked: refused at once
        assert info.value.holder == str(holder.pid)

        def let_go(pid: str) -> None:  # called as the wait begins: the holder lets go only then
            told.append(pid)
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "released"

        with PidLock(path).acquire(wait_s=300, on_wait=let_go):
            assert path.read_text().strip() == str(os.getpid())
        assert told == [str(holder.pid)]
        assert path.read_text() == ""  # emptied on release; the file itself stays
    finally:
        holder.kill()
        holder.wait()


def test_a_wait_ends_naming_the_holder_and_a_dead_holder_blocks_nobody(tmp_path):
    path = tmp_path / ".start.lock"
    holder = _holder(path)
    told: list[str] = []
    try:
        with pytest.raises(LockHeld) as info:
            PidLock(path).acquire(wait_s=0.5, on_wait=told.append)
        assert info.value.holder == str(holder.pid) and told == [str(holder.pid)]
        with pytest.raises(LockHeld):
            PidLock(path).probe()
    finally:
        holder.kill()
        holder.wait()
    with PidLock(path):  # the kernel let go of the killed holder's lock
        pass
    PidLock(tmp_path / "never").probe()  # no file: nobody holds it, and nothing is made
    assert not (tmp_path / "never").exists()
