"""Where a job's output goes: split into lines, attributed to ranks (torchrun prefixes `[rank N]`), known noise
dropped on the way to the terminal and Prefect's logs (the rank logs under JOB/logs/ keep everything), rank 0's
progress drawn as a bar or `[progress]` lines, and each rank's last lines kept to name a failure.

The launcher seam (`base.py`) feeds a `JobOutput` whatever a `RunningJob` reads, for every launcher alike.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from pathlib import Path

from leanagent.ground.job import read_progress
from leanagent.launch.progress_view import progress_view
from leanagent.launch.quiet import NoiseFilter, verbose

RANK_LINE = re.compile(r"^\[rank (\d+)\] ?(.*)$")
FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)")
TAIL_LINES = 30


class JobOutput:
    """A job's output on its way to `on_line`: split into lines, attributed to ranks, filtered, with progress."""

    def __init__(self, label: str, on_line: Callable[[str], None] | None, progress_interval_s: float | None) -> None:
        self.sink = on_line or (lambda line: print(line, flush=True))
        self.view = progress_view(label, self.sink, progress_interval_s)
        self.noise = NoiseFilter(enabled=not verbose())
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.launcher_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._buffer = b""

    def emit(self, line: str) -> None:
        if self.view is None:
            self.sink(line)
            return
        with self.view.writing():
            self.sink(line)

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            self._route(raw.decode("utf-8", "replace").rstrip("\r"))

    def _route(self, line: str) -> None:
        m = RANK_LINE.match(line)
        if m:
            self.tails[int(m.group(1))].append(m.group(2))
            if self.noise.keep(int(m.group(1)), m.group(2)):
                self.emit(line)
        else:
            self.launcher_tail.append(line)
            self.emit(f"[launcher] {line}" if line else line)

    def show_progress(self, job_dir: Path) -> None:
        if self.view is not None:
            progress = read_progress(job_dir)
            if progress is not None:
                self.view.update(progress)

    def close(self, job_dir: Path) -> None:
        """The last progress snapshot (written as the job ended), then whatever output had no newline yet."""
        if self.view is not None:
            self.show_progress(job_dir)
            self.view.close()
        if self._buffer:
            self._route(self._buffer.decode("utf-8", "replace"))
            self._buffer = b""

    def failure(self, label: str, job_dir: Path, returncode: int) -> tuple[str, int | None, list[str]]:
        """A failed job's message, its failing rank (None: torchrun itself) and that rank's last lines: what
        `LaunchError` carries."""
        tails = {r: list(t) for r, t in self.tails.items()}
        rank = failing_rank(tails, list(self.launcher_tail))
        lines = tails.get(rank, []) if rank is not None else list(self.launcher_tail)
        where = f"rank {rank}" if rank is not None else "torchrun"
        body = "\n".join(f"  {line}" for line in lines[-TAIL_LINES:])
        return f"{label} job in {job_dir} failed (exit {returncode}); last lines of {where}:\n{body}", rank, lines


def failing_rank(tails: dict[int, list[str]], launcher_tail: list[str]) -> int | None:
    """torchrun's summary names the first failed rank; otherwise the rank that printed a traceback."""
    summary = "\n".join(launcher_tail)
    if "Root Cause" in summary:
        m = FAILED_RANK.search(summary[summary.index("Root Cause"):])
        if m:
            return int(m.group(1))
    for rank in sorted(tails):
        if any(line.startswith("Traceback") for line in tails[rank]):
            return rank
    return min(tails) if tails else None
