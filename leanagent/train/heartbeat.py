"""Liveness of each rank, observable from outside the process group.

With a one-year collective timeout a stuck all-reduce is never detected by torch. Each rank
touches a small file as it makes progress; the launcher's watchdog ends the job when a file
goes stale. Rank 0's file also carries where the job is (`leanagent/train/progress.py`), which the
launcher shows as a progress bar or line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pytorch_lightning.callbacks import Callback

from leanagent.atomic import read_json, write_json_atomic
from leanagent.ranks import global_rank
from leanagent.train.progress import ProgressTracker

PROGRESS_INTERVAL_SECONDS = 1.0  # rank 0: often enough for a live bar, rare enough to cost nothing


def heartbeat_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "heartbeat"


def beat(job_dir: Path, stage: str, step: int | None = None, progress: dict[str, Any] | None = None) -> None:
    rank = global_rank()
    record: dict[str, Any] = {"rank": rank, "time": time.time(), "stage": stage, "step": step}
    if progress is not None:
        record["progress"] = progress
    write_json_atomic(heartbeat_dir(job_dir) / f"rank{rank}.json", record)


def read_progress(job_dir: Path) -> dict[str, Any] | None:
    """Rank 0's latest progress snapshot, or None (no beat yet, or one without progress)."""
    try:
        progress = read_json(heartbeat_dir(job_dir) / "rank0.json").get("progress")
    except (OSError, ValueError, AttributeError):
        return None
    return progress if isinstance(progress, dict) else None


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
    """Beats at most every `interval_s` seconds, at batch boundaries of every stage.

    Rank 0 beats every `progress_interval_s` instead, with its progress snapshot in the file.
    """

    def __init__(self, job_dir: Path, interval_s: float = 5.0,
                 progress_interval_s: float = PROGRESS_INTERVAL_SECONDS) -> None:
        self.job_dir = Path(job_dir)
        self.progress = ProgressTracker() if global_rank() == 0 else None
        self.interval_s = min(interval_s, progress_interval_s) if self.progress is not None else interval_s
        self._last = 0.0
        # Wall-clock time of this process's first finished training batch: `leanagent bench` measures
        # the launch overhead (torchrun, imports, rendezvous, data and model loading) up to it.
        self.first_train_batch_time: float | None = None

    def _maybe_beat(self, trainer, stage: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            progress = self.progress.snapshot(trainer) if self.progress is not None else None
            beat(self.job_dir, stage, trainer.global_step, progress)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._maybe_beat(trainer, f"setup:{stage}", force=True)
        # Long loops inside a hook (embedding a mathlib-size corpus before validation) beat through this.
        if hasattr(pl_module, "progress_hook"):
            pl_module.progress_hook = lambda what: self._maybe_beat(trainer, what)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.progress is not None:
            self.progress.train_start(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.progress is not None:
            self.progress.eval_start(trainer, "validate")

    def on_test_start(self, trainer, pl_module) -> None:
        if self.progress is not None:
            self.progress.eval_start(trainer, "test")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.progress is not None:  # where each epoch ended, however short: the launcher's last line
            self._maybe_beat(trainer, "train", force=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_train_batch_time is None:
            self.first_train_batch_time = time.time()
        if self.progress is not None:
            self.progress.train_batch(trainer, batch, batch_idx)
        self._maybe_beat(trainer, "train")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.progress is not None:
            self.progress.eval_batch(trainer, "validate", batch)
        self._maybe_beat(trainer, "validate")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.progress is not None:
            self.progress.eval_batch(trainer, "test", batch)
        self._maybe_beat(trainer, "test")
