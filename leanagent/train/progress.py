"""Where rank 0 is in its job (stage, epoch, step of total, examples, time), for the launcher to show.

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
                "elapsed": time.monotonic() - s.started}


def format_duration(seconds: float) -> str:
    """`4m10s`, `1h02m`, `35s`."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def rate_and_eta(p: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """Examples per second and seconds left, from this attempt's own counts."""
    elapsed, done = float(p.get("elapsed") or 0.0), int(p.get("done") or 0)
    if elapsed <= 0 or done <= 0:
        return None, None
    rate = float(p.get("examples") or 0) / elapsed
    total, step = p.get("total"), int(p.get("step") or 0)
    eta = elapsed / done * max(0, int(total) - step) if total else None
    return rate, eta


def heading(label: str, p: Mapping[str, Any]) -> str:
    """`train repo_1`, or `train repo_1 (validate)` while the job is in another stage than its own."""
    stage = p.get("stage", "?")
    return label if label.split(" ", 1)[0] == stage else f"{label} ({stage})"


def epoch_text(p: Mapping[str, Any]) -> str | None:
    return f"epoch {p.get('epoch')}/{p['epochs']}" if p.get("epochs") else None


def speed_texts(p: Mapping[str, Any]) -> list[str]:
    """`85.2 examples/s` and `ETA 4m10s`, each when known."""
    rate, eta = rate_and_eta(p)
    return ([f"{rate:.1f} examples/s"] if rate is not None else []) + \
        ([f"ETA {format_duration(eta)}"] if eta is not None else [])


def describe(label: str, p: Mapping[str, Any]) -> str:
    """`train repo_1: epoch 2/5, step 120/400 (30%), 85.2 examples/s, ETA 4m10s`."""
    epoch = epoch_text(p)
    total, step = p.get("total"), int(p.get("step") or 0)
    parts = ([epoch] if epoch else []) + \
        [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"] + speed_texts(p)
    return f"{heading(label, p)}: {', '.join(parts)}"
