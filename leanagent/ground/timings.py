"""Where a job's time went: named parts of one process's wall time, and its memory high-water mark.

At LeanAgent's scale a curriculum's hours can go to re-embedding a Mathlib-sized corpus rather than to training,
and nothing shows that unless every job says where its time went. A `JobClock` splits the wall time of a rank
process, from the moment the process was created, into named parts that never overlap: a part started while
another is open pauses it (the inner part's seconds are not also counted in the outer one), so the parts and the
remainder (`other`) add up to the job's whole time, and each part's share means what it says.

Until `ready()` is called the time nobody claims is `startup` (imports, the rendezvous, loading the model);
after it, `other`. The part names are the `PARTS` table: the report shows them in that order, each with its
meaning. On a GPU, work is queued asynchronously, so a part's end would be read before its kernels ran; the rank
program gives the clock a `sync` (the device's synchronize) that runs at every switch between parts.

No torch here: the launcher side and the report read the same names.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

STARTUP, OTHER = "startup", "other"


@dataclass(frozen=True)
class Part:
    name: str
    short: str  # the report's column header
    meaning: str


# Every part a job may report, in the order the report shows them. A new part is one entry here.
PARTS: tuple[Part, ...] = (
    Part(STARTUP, "startup", "process start to the first step: imports, rendezvous, loading the model, building "
                             "the trainer"),
    Part("data", "data", "reading datasets and building examples, and the premise table an embedding needs"),
    Part("train_steps", "steps", "training batches: forward, backward and optimizer steps"),
    Part("train_loader", "loader", "waiting for training batches, and the training loop between steps"),
    Part("embed", "embed", "embedding premises for retrieval (validation and evaluation)"),
    Part("rank", "rank", "validation and test batches: their contexts encoded, premises ranked, metrics gathered"),
    Part("mining", "mining", "mining negatives from the validation embedding (data.negatives: mined)"),
    Part("fisher", "fisher", "the Fisher pass"),
    Part("checkpoints", "ckpt", "writing checkpoints and Fisher files"),
    Part("index", "index", "writing the stage's premise index (what a server answers from)"),
    Part(OTHER, "other", "everything else (the loops' own work, barriers, writing results)"),
)
PART_NAMES: tuple[str, ...] = tuple(p.name for p in PARTS)
# Not a rank's part: the job's wall time as its launcher saw it (`leanagent.preflight.run_job`: a result's
# `wall_seconds`), less the ranks' total.
LAUNCH = Part("launch", "launch", "before the ranks started and after they ended: checks, torchrun, a SLURM queue")


def process_start_time() -> float:
    """When this process was created (epoch seconds): a rank's startup includes its interpreter's imports.

    On Linux from its age since boot, read beside the time since boot (/proc/self/stat's start in clock ticks,
    /proc/uptime): both count from the boot, to 10 ms. psutil's `create_time` adds the boot time of /proc/stat, in
    whole seconds, so it is off by up to a second (0.17 s on the machine this was written on): more than a forked
    rank (the warm launcher's) takes to start."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(0.0, since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        pass
    try:
        return psutil.Process().create_time()
    except psutil.Error:  # pragma: no cover - a process can always read itself
        return time.time()


def peak_rss_mb() -> float:
    """This process's resident high-water mark so far, in MiB (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def rss_mb() -> float:
    """This process's resident memory now, in MiB."""
    return psutil.Process().memory_info().rss / 2**20


class JobClock:
    """Exclusive time per named part: each second belongs to the innermost open part (or to the base part)."""

    def __init__(self, started_at: float | None = None, sync: Callable[[], None] | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        # `started_at` is on the wall clock (a process's creation time); the parts are measured on `now`, a monotonic
        # clock (a test gives its own).
        started_wall = process_start_time() if started_at is None else started_at
        self._now = now
        self._origin = now() - max(0.0, time.time() - started_wall)
        self._last = self._origin  # the first part charged takes the time since the process started

        self._seconds: dict[str, float] = {}
        self._open: list[str] = []
        self.base = STARTUP
        self.sync = sync
        # Premise encodings for retrieval done by this job (every rank counts the whole table it embeds with the
        # others, so this is the sum over ranks): what `premises_embedded` in result.json reports.
        self.premises_embedded = 0
        # The premises of the corpora its evaluations ranked against, one count per evaluation: what embedding each
        # evaluation's whole corpus (LeanAgent's re-index) would have embedded for the same work.
        self.premises_in_corpora = 0
        # The paths its retrievals' products took (`leanagent.model.topk.SCORING`): result.json's `scoring`.
        self.scoring: set[str] = set()

    def _charge(self) -> None:
        if self.sync is not None:
            self.sync()
        now = self._now()
        name = self._open[-1] if self._open else self.base
        self._seconds[name] = self._seconds.get(name, 0.0) + (now - self._last)
        self._last = now

    def start(self, name: str) -> None:
        """Open `name` (a no-op when it is the innermost part already open)."""
        if self._open and self._open[-1] == name:
            return
        self._charge()
        self._open.append(name)

    def stop(self, name: str) -> None:
        """Close `name` and any part opened inside it that was left open; a no-op when `name` is not open."""
        if name not in self._open:
            return
        self._charge()
        while self._open:
            if self._open.pop() == name:
                break

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def ready(self) -> None:
        """Startup is over (the first step is about to run): unclaimed time is `other` from now on."""
        if self.base != OTHER:
            self._charge()
            self.base = OTHER

    def timings(self) -> dict[str, float]:
        """{part: seconds} of every part with time, in `PARTS` order, and `total`: the process's wall time so far."""
        self._charge()
        total = self._now() - self._origin
        seconds = {name: round(s, 3) for name, s in self._seconds.items() if round(s, 3) > 0}
        known = {name: seconds[name] for name in PART_NAMES if name in seconds}
        # A part outside the table still counts (a caller's own), after the known ones.
        known.update({name: s for name, s in seconds.items() if name not in known})
        known["total"] = round(total, 3)
        return known


class _NoClock(JobClock):
    """A clock that measures nothing: what a retriever has outside a rank program (the bench, an index build)."""

    def __init__(self) -> None:
        super().__init__(started_at=time.time())

    def start(self, name: str) -> None:
        pass

    def stop(self, name: str) -> None:
        pass

    def ready(self) -> None:
        pass


def no_clock() -> JobClock:
    return _NoClock()
