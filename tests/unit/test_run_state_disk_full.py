"""A disk that fills up: the manifest is never left half-written, and a stage whose failure cannot be recorded ends in
one line naming the file and what to do. On a real full filesystem (a small tmpfs, where this machine lets the tests
mount one)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from leanagent.flows.stages import recording
from leanagent.run.manifest import stage_name
from leanagent.run.state import RunState, RunStateWriteError
from tests.unit.test_run_state import _cfg, _started


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 256 KiB tmpfs, unmounted afterwards; skipped where mounting is not allowed (not root, no tmpfs)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path) -> None:
    """Write until the filesystem says it is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_full_disk_leaves_the_manifest_as_it_was_and_says_so_in_one_line(small_disk: Path) -> None:
    cfg = _cfg(small_disk)
    state: RunState = _started(cfg)
    name = stage_name(0, "a", "train")
    with pytest.raises(RunStateWriteError) as failed:
        with recording(state, [name], None):  # the stage is recorded running, then the job fills the disk
            before = state.path.read_bytes()
            _fill(small_disk)
            raise OSError(errno.ENOSPC, "No space left on device: the rank's checkpoint")
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"{name} failed (")
    assert f"{state.path}: could not be written (No space left on device); free space" in message
    assert state.path.read_bytes() == before  # still the stage "running": the next run runs it again
    (small_disk / "filler").unlink()
    state.fail(name, "recorded once there is room")  # and with room, the record is written
    assert b'"failed"' in state.path.read_bytes()
