"""A lock on a file, held by one process at a time, that names its holder: a run's folder (`leanagent.run.state.
RunLock`), and the start of Prefect's temporary server on one database (`flows/temporary_server.py`).

Why an fcntl.flock: the kernel releases it when its holder dies, so a stale lock file never blocks anyone. The file
holds the holder's pid, for the message that names it, and is emptied on release (a reader between the release and
the close must not blame a process that has let go). The file itself is never removed: removed while another process
waits on it, a third could lock a new file of the same name beside the held one.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

POLL_S = 0.2  # how often a waiting process tries the lock again


class LockHeld(Exception):  # noqa: N818 (a state, not a fault: callers turn it into their own error)
    """Another process holds the lock; `holder` is its pid as the file gives it ("unknown" if it gives none)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.holder = holder


class PidLock:
    """An exclusive flock on `path`, holding the owner's pid. `with lock:` takes it without waiting."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None) -> PidLock:
        """Take the lock, waiting up to `wait_s` seconds for its holder to let go (`on_wait(holder)` is called once,
        when the wait begins); LockHeld when it is still held then. Acquiring a held lock again is a no-op."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._lock(fd, fcntl.LOCK_EX, wait_s, on_wait)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:  # held, or interrupted while waiting: nothing is left open
            os.close(fd)
            raise
        self._fd = fd
        return self

    def probe(self) -> None:
        """LockHeld now, writing nothing, when another process holds the lock: a shared lock, taken and let go at
        once. No lock file means nobody holds it."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            self._lock(fd, fcntl.LOCK_SH, 0.0, None)
        finally:
            os.close(fd)

    def _lock(self, fd: int, kind: int, wait_s: float, on_wait: Callable[[str], None] | None) -> None:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            if time.monotonic() >= deadline:
                raise LockHeld(self.path, holder)
            if on_wait is not None and not waiting:
                on_wait(holder)
            waiting = True
            time.sleep(POLL_S)

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> PidLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
