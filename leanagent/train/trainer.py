"""The reference's Lightning Trainer, setting by setting, built from config.

Every value comes from `TrainerConfig`, whose defaults are the seed's: DDPStrategy with a
one-year timeout, 4 GPUs, bf16-mixed, gradient clipping 1.0, 4-step accumulation, log every
step, no sanity validation, and the LR-monitor / checkpoint / early-stopping callbacks.
"""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy

from leanagent.atomic import write_atomic
from leanagent.config import TrainerConfig

MONITOR = "Recall@10_val"
LAST_CHECKPOINT = "last.ckpt"
TENSORBOARD_DIR = "tensorboard"


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


class AtomicCheckpointIO(TorchCheckpointIO):
    """Every checkpoint of a training job is written whole or not at all.

    `torch.save` into a temporary file in the same folder (`.NAME.XXXX.tmp`, which no checkpoint
    pattern matches), `fsync`, `os.replace` over the target, then `fsync` of the folder so that the
    rename itself survives a power cut. A crash at any point leaves the previous file as it was
    (Lightning's own `_atomic_save` writes into the target). Serialising straight into the file also
    avoids Lightning's in-memory copy of the whole checkpoint. Temporary files that a killed writer
    left behind for the same target are removed before the next write.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        write_atomic(path, lambda f: torch.save(checkpoint, f), mode="wb", suffix=".tmp")
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


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
        path = str(self.path)
        # The same file as the ModelCheckpoint of this folder writes at the epoch's end, and known to it as its
        # last.ckpt (before saving: it is part of the state); else it would find a last.ckpt it did not write
        # and put its own in last-v1.ckpt.
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath \
                    and Path(callback.dirpath).resolve() == self.dirpath.resolve():
                path = callback.last_model_path = callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)
        trainer.save_checkpoint(path)
        self.save_seconds.append(time.monotonic() - started)
        self._last_step, self._last_time = step, time.monotonic()
        if trainer.global_rank == 0:
            print(f"step checkpoint: epoch {trainer.current_epoch} step {step} -> {path} "
                  f"in {self.save_seconds[-1]:.2f}s", flush=True)


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


def set_nccl_environment(cfg: TrainerConfig) -> None:
    """As the seed does, before any trainer exists. NCCL_TIMEOUT is not read by NCCL itself;
    the timeout that matters is the one passed to the process group (see `ddp_strategy`)."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    os.environ["NCCL_TIMEOUT"] = str(cfg.ddp_timeout_seconds * 1000)


def process_group_backend(cfg: TrainerConfig) -> str:
    return "gloo" if cfg.accelerator == "cpu" else "nccl"


def ddp_strategy(cfg: TrainerConfig) -> DDPStrategy:
    return DDPStrategy(timeout=timedelta(seconds=cfg.ddp_timeout_seconds),
                       process_group_backend=process_group_backend(cfg))


def init_process_group(cfg: TrainerConfig) -> None:
    """Create the process group before the Trainer, so that barriers before `fit` synchronize.

    Under torchrun Lightning would only create it inside `fit`; until then `strategy.barrier()`
    returns at once (a silent no-op in the reference). Lightning finds the group already
    initialised and reuses it, so backend and timeout must be the strategy's own.
    """
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != cfg.world_size:
        raise RuntimeError(
            f"torchrun started {world_size} processes but the config asks for devices={cfg.devices} x "
            f"num_nodes={cfg.num_nodes} = {cfg.world_size}"
        )
    backend = process_group_backend(cfg)
    kwargs = {}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.ddp_timeout_seconds),
                            rank=int(os.environ["RANK"]), world_size=world_size, **kwargs)


def tensorboard_logger(job_dir: Path) -> TensorBoardLogger:
    """JOB/tensorboard/, no version folder: the job is the run, so `tensorboard --logdir RUN_DIR/jobs` lists
    one run per repository by its job folder (`00-repo_0/train/tensorboard`). Lightning logs at the global
    step, which a repository's training continues from the previous one's checkpoint, so the runs line up
    end to end over the curriculum; a retry of the job appends to the same run from where it resumed."""
    return TensorBoardLogger(save_dir=str(job_dir), name=TENSORBOARD_DIR, version="", default_hp_metric=False)


def _common(cfg: TrainerConfig, job_dir: Path, tensorboard: bool = False) -> dict:
    return {
        "accelerator": cfg.accelerator,
        "devices": cfg.devices,
        "num_nodes": cfg.num_nodes,
        "precision": cfg.precision,
        "strategy": ddp_strategy(cfg),
        "log_every_n_steps": cfg.log_every_n_steps,
        "num_sanity_val_steps": cfg.num_sanity_val_steps,
        "default_root_dir": str(job_dir),
        # Explicit, so the metrics file is always JOB/lightning_logs/version_N/metrics.csv (the first logger
        # names the log_dir Lightning reports).
        "logger": [CSVLogger(save_dir=str(job_dir), name="lightning_logs"),
                   *([tensorboard_logger(job_dir)] if tensorboard else [])],
        "enable_progress_bar": False,
    }


def build_training_trainer(cfg: TrainerConfig, job_dir: Path, max_epochs: int,
                           extra_callbacks: list[Callback] | None = None,
                           resuming_this_job: bool = True) -> pl.Trainer:
    """`resuming_this_job`: the checkpoint fit restores is this job's own (a retry): its early-stopping count and
    RNG states are taken up. Otherwise it is where a new repository starts, which starts both afresh."""
    set_nccl_environment(cfg)
    checkpoint = ModelCheckpoint(
        dirpath=job_dir / "checkpoints",
        filename="{epoch}-{step}-{Recall@10_val:.2f}",  # percent, as LeanAgent names them
        monitor=MONITOR,
        mode="max",
        every_n_epochs=1,
        save_top_k=cfg.save_top_k,
        save_last=True,
        auto_insert_metric_name=True,
    )
    callbacks: list[Callback] = [
        LearningRateMonitor(logging_interval="step"),
        checkpoint,
        RepositoryEarlyStopping(monitor=MONITOR, patience=cfg.early_stopping_patience, mode="max",
                                restore_state=resuming_this_job),
        StepCheckpoint(job_dir / "checkpoints", cfg.checkpoint_every_n_steps, cfg.checkpoint_every_minutes),
        RandomState(restore=resuming_this_job),
        DatasetEpoch(),
        *(extra_callbacks or []),
    ]
    return pl.Trainer(
        **_common(cfg, job_dir, tensorboard=True),
        plugins=[AtomicCheckpointIO()],
        gradient_clip_val=cfg.gradient_clip_val,
        accumulate_grad_batches=cfg.accumulate_grad_batches,
        callbacks=callbacks,
        max_epochs=max_epochs,
    )


def build_fisher_trainer(cfg: TrainerConfig, job_dir: Path, extra_callbacks: list[Callback] | None = None
                         ) -> pl.Trainer:
    set_nccl_environment(cfg)
    return pl.Trainer(
        **_common(cfg, job_dir),
        max_epochs=1,
        callbacks=list(extra_callbacks or []),
        enable_checkpointing=False,
        limit_val_batches=0,
    )


def build_eval_trainer(cfg: TrainerConfig, job_dir: Path, extra_callbacks: list[Callback] | None = None
                       ) -> pl.Trainer:
    set_nccl_environment(cfg)
    return pl.Trainer(**_common(cfg, job_dir), callbacks=list(extra_callbacks or []), enable_checkpointing=False)
