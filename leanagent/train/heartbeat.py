"""Liveness of each rank, observable from outside the process group.

With a one-year collective timeout a stuck all-reduce is never detected by torch. Each rank
touches a small file as it makes progress; the launcher's watchdog ends the job when a file
goes stale.
"""

from __future__ import annotations

import time
from pathlib import Path

from pytorch_lightning.callbacks import Callback

from leanagent.atomic import write_json_atomic
from leanagent.ranks import global_rank


def heartbeat_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "heartbeat"


def beat(job_dir: Path, stage: str, step: int | None = None) -> None:
    rank = global_rank()
    write_json_atomic(heartbeat_dir(job_dir) / f"rank{rank}.json",
                      {"rank": rank, "time": time.time(), "stage": stage, "step": step})


def stale_ranks(job_dir: Path, timeout_s: float, now: float | None = None) -> list[str]:
    """Ranks whose heartbeat file exists and has not changed for `timeout_s` seconds."""
    now = time.time() if now is None else now
    folder = heartbeat_dir(job_dir)
    if not folder.is_dir():
        return []
    stale = []
    for f in sorted(folder.glob("rank*.json")):
        try:
            age = now - f.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > timeout_s:
            stale.append(f"{f.stem} ({age:.0f} s)")
    return stale


class Heartbeat(Callback):
    """Beats at most every `interval_s` seconds, at batch boundaries of every stage."""

    def __init__(self, job_dir: Path, interval_s: float = 5.0) -> None:
        self.job_dir = Path(job_dir)
        self.interval_s = interval_s
        self._last = 0.0
        # Wall-clock time of this process's first finished training batch: `leanagent bench` measures
        # the launch overhead (torchrun, imports, rendezvous, data and model loading) up to it.
        self.first_train_batch_time: float | None = None

    def _maybe_beat(self, trainer, stage: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            beat(self.job_dir, stage, trainer.global_step)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._maybe_beat(trainer, f"setup:{stage}", force=True)
        # Long loops inside a hook (embedding a mathlib-size corpus before validation) beat through this.
        if hasattr(pl_module, "progress_hook"):
            pl_module.progress_hook = lambda what: self._maybe_beat(trainer, what)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_train_batch_time is None:
            self.first_train_batch_time = time.time()
        self._maybe_beat(trainer, "train")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._maybe_beat(trainer, "validate")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._maybe_beat(trainer, "test")
