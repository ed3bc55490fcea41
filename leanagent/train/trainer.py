"""The reference's Lightning Trainer, setting by setting, built from config.

Every value comes from `TrainerConfig`, whose defaults are the seed's: DDPStrategy with a
one-year timeout, 4 GPUs, bf16-mixed, gradient clipping 1.0, 4-step accumulation, log every
step, no sanity validation, and the LR-monitor / checkpoint / early-stopping callbacks.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from leanagent.config import TrainerConfig

MONITOR = "Recall@10_val"


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


def _common(cfg: TrainerConfig, job_dir: Path) -> dict:
    return {
        "accelerator": cfg.accelerator,
        "devices": cfg.devices,
        "num_nodes": cfg.num_nodes,
        "precision": cfg.precision,
        "strategy": ddp_strategy(cfg),
        "log_every_n_steps": cfg.log_every_n_steps,
        "num_sanity_val_steps": cfg.num_sanity_val_steps,
        "default_root_dir": str(job_dir),
        # Explicit, so the metrics file is always JOB/lightning_logs/version_N/metrics.csv.
        "logger": CSVLogger(save_dir=str(job_dir), name="lightning_logs"),
        "enable_progress_bar": False,
    }


def build_training_trainer(cfg: TrainerConfig, job_dir: Path, max_epochs: int,
                           extra_callbacks: list[Callback] | None = None,
                           restore_early_stopping: bool = True) -> pl.Trainer:
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
                                restore_state=restore_early_stopping),
        *(extra_callbacks or []),
    ]
    return pl.Trainer(
        **_common(cfg, job_dir),
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
