"""The callbacks of a rank's Trainer, beyond Lightning's own: what training on one repository needs.

- `RepositoryEarlyStopping`: the seed's early stopping, scoped to one repository;
- `DatasetEpoch`: the dataset and sampler learn which epoch starts (negatives depend on it);
- `MinedNegatives`: `data.negatives: mined`, the table refreshed at each validation;
- `StepCheckpoint`: `last.ckpt` during an epoch as well, for a mid-epoch resume;
- `RandomState`: every rank's RNG in every checkpoint, so that a resumed run draws what an uninterrupted one did;
- `Heartbeat`: liveness and progress for the launcher's watchdog and display (`leanagent.ground.job.beat`);
- `JobTimings`: where the training loop's time goes, for result.json's `timings`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint

from leanagent.ground.job import beat
from leanagent.ground.ranks import global_rank
from leanagent.ground.timings import JobClock
from leanagent.model.mining import mine_table
from leanagent.train.progress import ProgressTracker

MONITOR = "Recall@10_val"
LAST_CHECKPOINT = "last.ckpt"
PROGRESS_INTERVAL_SECONDS = 1.0  # rank 0: often enough for a live bar, rare enough to cost nothing


class RepositoryEarlyStopping(EarlyStopping):
    """The seed's EarlyStopping, scoped to one repository.

    `fit(ckpt_path=...)` from the previous repository's checkpoint would restore its best score
    and patience count, comparing this repository's Recall@10_val with another dataset's. A retry
    of the same job (`restore_state=True`) keeps them.
    """

    def __init__(self, *args, restore_state: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restore_state = restore_state

    def load_state_dict(self, state_dict: dict) -> None:
        if self.restore_state:
            super().load_state_dict(state_dict)


class MinedNegatives(Callback):
    """`data.negatives: mined`: at the end of each validation, mine the training contexts' negatives from the
    premise embedding that validation computed (`leanagent.model.mining`) and hand the table to the data module,
    which draws the next epoch's negatives from it and keeps it in checkpoints. Callbacks' epoch-end hooks run
    before the retriever's own, which frees that embedding, and before the epoch's checkpoint is saved."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        embedding = pl_module.corpus_embedding
        if trainer.sanity_checking or embedding is None:
            return
        cfg = datamodule.cfg
        with pl_module.clock.part("mining"):
            table = mine_table(pl_module, embedding, datamodule.corpus, datamodule.train_examples, cfg.mined_pool,
                               cfg.max_seq_len, cfg.eval_batch_size, pl_module.progress_hook)
        datamodule.set_mined(table.numpy())


class JobTimings(Callback):
    """Charges a training loop to the job's clock (`leanagent.ground.timings`): each batch's step to `train_steps`, the
    rest of an epoch to `train_loader` (fetching batches, the loop between steps), except what other parts claim
    inside it (validation's `embed` and `rank`, `mining`, `checkpoints`). Startup ends when the first epoch
    starts."""

    def __init__(self, clock: JobClock) -> None:
        self.clock = clock

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.ready()
        self.clock.start("train_loader")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.clock.ready()  # a run resumed mid-epoch starts with a batch, not an epoch
        self.clock.start("train_loader")
        self.clock.start("train_steps")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.clock.stop("train_steps")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.stop("train_loader")


class DatasetEpoch(Callback):
    """Tells the training dataset (and sampler) which epoch starts: its negatives are a function of it.

    The data module sets the same epoch when it builds the loader (from the trainer's restored
    epoch), which covers a run resumed mid-epoch, where Lightning calls no `on_train_epoch_start`.
    """

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = trainer.train_dataloader
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        elif not isinstance(loaders, (list, tuple)):
            loaders = [loaders]
        for loader in loaders:
            for obj in (getattr(loader, "dataset", None), getattr(loader, "sampler", None)):
                if callable(getattr(obj, "set_epoch", None)):
                    obj.set_epoch(trainer.current_epoch)


def _rng_state() -> dict[str, Any]:
    """This process's RNG streams that training draws from (dropout), in types weights-only loading accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class StepCheckpoint(Callback):
    """Writes the job's `last.ckpt` during the epoch, every N optimizer steps and/or every M minutes.

    What a retry resumes from (`plan_training` tries `last.ckpt` first). `Trainer.save_checkpoint`
    is collective, so every rank decides alike: a step count is the same on every rank, and the
    clock of rank 0 is broadcast (only when `every_minutes` is set, once per optimizer step). Not
    on an epoch's last batch: ModelCheckpoint writes `last.ckpt` after validation a moment later,
    and a checkpoint from between the two would resume past the epoch's validation.

    The checkpoint holds Lightning's loop state and the loader's (see `RetrievalDataModule.
    train_dataloader`). `start_global_step` is the optimizer step training (re)started at.
    """

    def __init__(self, dirpath: Path, every_n_steps: int | None = None, every_minutes: float | None = None) -> None:
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self.start_global_step = 0
        self.save_seconds: list[float] = []  # wall time of each step checkpoint written by this process
        self._last_step = 0
        self._last_time = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.every_n_steps or self.every_seconds)

    @property
    def path(self) -> Path:
        return self.dirpath / LAST_CHECKPOINT

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_global_step = self._last_step = trainer.global_step
        self._last_time = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if not self.enabled or step == self._last_step:
            return  # no optimizer step since the last save (or accumulating gradients)
        if batch_idx + 1 >= trainer.num_training_batches:
            return  # the epoch's end: ModelCheckpoint writes last.ckpt after validation
        due = bool(self.every_n_steps and step % self.every_n_steps == 0)
        if self.every_seconds:
            due_time = time.monotonic() - self._last_time >= self.every_seconds
            due = due or bool(trainer.strategy.broadcast(due_time, src=0))
        if not due:
            return
        started = time.monotonic()
        path = save_step_checkpoint(trainer, self.dirpath)
        self.save_seconds.append(time.monotonic() - started)
        self._last_step, self._last_time = step, time.monotonic()
        if trainer.global_rank == 0:
            print(f"step checkpoint: epoch {trainer.current_epoch} step {step} -> {path} "
                  f"in {self.save_seconds[-1]:.2f}s", flush=True)


def save_step_checkpoint(trainer: pl.Trainer, dirpath: Path) -> str:
    """Write the job's `last.ckpt` now, mid-epoch (collective: every rank calls it); its path.

    The same file as the ModelCheckpoint of this folder writes at the epoch's end, and known to it as its
    last.ckpt (before saving: it is part of the state); else it would find a last.ckpt it did not write and
    put its own in last-v1.ckpt.
    """
    path = str(Path(dirpath) / LAST_CHECKPOINT)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath \
                and Path(callback.dirpath).resolve() == Path(dirpath).resolve():
            path = callback.last_model_path = callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)
    trainer.save_checkpoint(path)
    return path


class StopRequested(Exception):
    """The ranks were asked to stop (a time limit ahead) and saved a step checkpoint: the job is to be resumed."""


class StopOnRequest(Callback):
    """Checkpoint and stop when the launcher's stop file appears (SLURM, before the time limit or on preemption).

    Checked after every optimizer step; the ranks agree with one all-reduce (one rank may see the file a
    step before another), save a step checkpoint together and raise `StopRequested`, which the train
    program turns into `needs-resume.json`. Not on an epoch's last batch (ModelCheckpoint's epoch checkpoint
    follows it; a step checkpoint there would resume past the epoch's validation): one step later. Inactive
    without a stop file to watch (`leanagent.ground.job.STOP_FILE_ENV`), so the local launcher pays nothing.
    """

    def __init__(self, dirpath: Path, stop_file: str | None) -> None:
        self.dirpath = Path(dirpath)
        self.stop_file = Path(stop_file) if stop_file else None
        self._last_step = -1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.stop_file is None or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        if batch_idx + 1 >= trainer.num_training_batches:
            return
        if not trainer.strategy.reduce_boolean_decision(self.stop_file.exists(), all=False):
            return
        path = save_step_checkpoint(trainer, self.dirpath)
        if trainer.global_rank == 0:
            print(f"stopping to be resumed: epoch {trainer.current_epoch} step {trainer.global_step} -> {path}",
                  flush=True)
        raise StopRequested(path)


class RandomState(Callback):
    """Every rank's RNG streams (dropout) in every checkpoint of the job, put back when the job resumes from one.

    Every checkpoint, the epoch ones included: a rerun resumes from whichever was written last, and a
    resumed run must draw the dropout masks the uninterrupted one drew. Nothing else in training draws
    from these streams between a save and the next batch (the loaders have RNGs of their own,
    `RetrievalDataModule._generator`), so the state at the save is the state at the next batch.
    `Trainer.save_checkpoint` is collective (every rank dumps the state), so the states are gathered to
    rank 0's file. Restored only when `restore` (this job's own checkpoint, `TrainPlan.is_retry`): a new
    repository starting from the previous one's checkpoint starts from the seed, as LeanAgent's does.
    """

    def __init__(self, restore: bool = True) -> None:
        self.restore = restore
        self._trainer: pl.Trainer | None = None
        self._loaded: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is None:
            return {}
        local = _rng_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, local)
        else:
            states = [local]
        return {"global_step": self._trainer.global_step, "rng_states": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded, self._loaded = self._loaded, None
        if self.restore and loaded and loaded.get("global_step") == trainer.global_step:
            states = loaded.get("rng_states") or []
            if len(states) == trainer.world_size:
                _set_rng_state(states[trainer.global_rank])


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
