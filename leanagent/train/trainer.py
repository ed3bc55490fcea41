"""The reference's Lightning Trainer, setting by setting, built from config.

Every value comes from `TrainerConfig`, whose defaults are the seed's: DDPStrategy with a
one-year timeout, 4 GPUs, bf16-mixed, gradient clipping 1.0, 4-step accumulation, log every
step, no sanity validation, and the LR-monitor / checkpoint / early-stopping callbacks.
`trainer.precision: auto` becomes a concrete precision here, in the ranks (`job_precision`): on a CPU it is the
CPU that runs the matmuls whose bf16 support decides.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy

from leanagent.ground.atomic import write_atomic
from leanagent.ground.config import TrainerConfig
from leanagent.ground.job import STOP_FILE_ENV
from leanagent.ground.names import AUTO
from leanagent.model.dtypes import AUTO_PRECISION_CPU, resolve_precision
from leanagent.train.callbacks import (
    MONITOR,
    DatasetEpoch,
    RandomState,
    RepositoryEarlyStopping,
    StepCheckpoint,
    StopOnRequest,
)

TENSORBOARD_DIR = "tensorboard"


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


class Trainer(pl.Trainer):
    """Lightning's Trainer, whose checkpoint writes are charged to the job's `checkpoints` time (the module's
    `clock`, `leanagent.ground.timings`): ModelCheckpoint's, the step checkpoints and the stop-request ones alike."""

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        clock = getattr(self.lightning_module, "clock", None)
        if clock is None:
            return super().save_checkpoint(*args, **kwargs)
        with clock.part("checkpoints"):
            return super().save_checkpoint(*args, **kwargs)


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


def job_precision(cfg: TrainerConfig) -> str:
    """The precision this job's trainers run: `cfg.precision`, with `auto` resolved on these ranks' hardware
    (`leanagent.model.dtypes.resolve_precision`: bf16-mixed on a GPU; on a CPU by its bf16 matmuls), one answer
    for every rank: where the ranks' CPUs disagree (nodes of two kinds), 32-true, which none of them runs slowly.
    Collective once the process group exists (`init_process_group`): every rank calls it."""
    resolved = resolve_precision(cfg.precision, cfg.accelerator)
    if cfg.precision != AUTO or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return resolved
    answers: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, resolved)
    return resolved if len(set(answers)) == 1 else AUTO_PRECISION_CPU[False]


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
        "precision": resolve_precision(cfg.precision, cfg.accelerator),  # the ranks resolve `auto` first: job_precision
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
        StopOnRequest(job_dir / "checkpoints", os.environ.get(STOP_FILE_ENV)),
        DatasetEpoch(),
        *(extra_callbacks or []),
    ]
    return Trainer(
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
    return Trainer(
        **_common(cfg, job_dir),
        max_epochs=1,
        callbacks=list(extra_callbacks or []),
        enable_checkpointing=False,
        limit_val_batches=0,
    )


def build_eval_trainer(cfg: TrainerConfig, job_dir: Path, extra_callbacks: list[Callback] | None = None
                       ) -> pl.Trainer:
    set_nccl_environment(cfg)
    return Trainer(**_common(cfg, job_dir), callbacks=list(extra_callbacks or []), enable_checkpointing=False)
