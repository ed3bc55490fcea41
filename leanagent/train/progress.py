"""Where rank 0 is in its job (stage, epoch, step of total, examples, time), for the launcher to show.

The launcher turns the snapshot into text (`leanagent/launch/progress_view.py`); this side only counts.

Rank 0 puts a snapshot into its heartbeat file (see `Heartbeat`), which the launcher already reads:
one file, one writer, no extra output line to parse out of the ranks' logs. Lightning's own
per-rank progress bar stays off (`enable_progress_bar=False`): under torchrun every rank would
draw one into the same terminal.

A stage's counts start when the stage does in this process, so a resumed job's rate and ETA are
this attempt's own, while `step` is the position in the whole stage (epochs already done count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def batch_size(batch: Any) -> int:
    """Examples in a batch: the first dimension of the first tensor found in it."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (str, bytes)):
        return 0
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else ()
    for value in values:
        n = batch_size(value)
        if n:
            return n
    return 0


def _count(value: Any) -> int | None:
    """Lightning's batch counts: an int, a list (one per dataloader), or inf for an unsized loader."""
    if isinstance(value, (list, tuple)):
        counts = [_count(v) for v in value]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return None
    return int(value)


class StageProgress:
    """One stage's counters in this process: batches and examples since it started, over wall time."""

    def __init__(self, stage: str, total: int | None, first_step: int = 0) -> None:
        self.stage = stage
        self.total = total
        self.step = first_step
        self.done = 0
        self.examples = 0
        self.started = time.monotonic()

    def advance(self, step: int, examples: int) -> None:
        self.step = step
        self.done += 1
        self.examples += examples


class ProgressTracker:
    """Follows the trainer's hooks (called by `Heartbeat`) and answers `snapshot()`."""

    def __init__(self) -> None:
        self.current: StageProgress | None = None
        self._train: StageProgress | None = None
        self._start_epoch = 0

    def train_start(self, trainer) -> None:
        self._start_epoch = trainer.current_epoch
        per_epoch = _count(trainer.num_training_batches)
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        total = per_epoch * (epochs - self._start_epoch) if per_epoch is not None and epochs is not None else None
        self._train = StageProgress("train", total)
        self.current = self._train

    def train_batch(self, trainer, batch, batch_idx: int) -> None:
        if self._train is None:
            self.train_start(trainer)
        assert self._train is not None
        self.current = self._train
        per_epoch = _count(trainer.num_training_batches) or 0
        step = (trainer.current_epoch - self._start_epoch) * per_epoch + batch_idx + 1
        self.current.advance(step, batch_size(batch) * trainer.world_size)

    def eval_start(self, trainer, stage: str) -> None:
        counts = trainer.num_val_batches if stage == "validate" else trainer.num_test_batches
        self.current = StageProgress(stage, _count(counts))

    def eval_batch(self, trainer, stage: str, batch) -> None:
        if self.current is None or self.current.stage != stage:
            self.eval_start(trainer, stage)
        assert self.current is not None
        self.current.advance(self.current.step + 1, batch_size(batch) * trainer.world_size)

    def snapshot(self, trainer) -> dict[str, Any] | None:
        s = self.current
        if s is None:
            return None
        epochs = trainer.max_epochs if s.stage != "test" and trainer.max_epochs and trainer.max_epochs > 0 else None
        return {"stage": s.stage, "epoch": trainer.current_epoch + 1 if epochs else None, "epochs": epochs,
                "step": s.step, "total": s.total, "done": s.done, "examples": s.examples,
                "elapsed": time.monotonic() - s.started, "precision": str(trainer.precision)}
