"""What a training job does, decided before it starts: where it starts from, how far it goes, where it resumes.

Target epochs are fixed on the job's first attempt and written to `JOB/job.json`: a retry resumes from
the job's newest whole checkpoint towards the same target, whatever happened to the start checkpoint's
folder meanwhile. `max_epochs` = the epochs the start checkpoint had trained + `lifelong.epochs_per_repo`,
read from the checkpoint's loop state, never from a Python counter (the reference's crashed with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytorch_lightning as pl
import torch

from leanagent.checkpoints.foreign import complete_tied, is_leanagent, read_any_checkpoint, reference_state_dict
from leanagent.checkpoints.ours import epochs_completed, first_readable, resume_candidates
from leanagent.ground.config import PipelineConfig
from leanagent.ground.json_files import MIB, read_json_file
from leanagent.model.loading import load_retriever

JOB_PLAN = "job.json"


@dataclass(frozen=True)
class TrainPlan:
    start_checkpoint: str | None
    start_epochs: int
    target_epochs: int
    resume_from: str | None
    unreadable: tuple[str, ...] = ()  # this job's checkpoints skipped as unreadable (one line each)
    # resume_from is a LeanAgent/ReProver checkpoint: its weights go into a fresh trainer started at
    # start_epochs; Lightning resumes only checkpoints of ours (loops, optimizer, scheduler).
    from_reference: bool = False

    @property
    def is_retry(self) -> bool:
        """An earlier attempt of this very job left a checkpoint behind."""
        return self.resume_from != self.start_checkpoint

    @property
    def ckpt_path(self) -> str | None:
        """What `fit(ckpt_path=...)` restores trainer state from."""
        return None if self.from_reference else self.resume_from


def plan_training(job_dir: Path, start_checkpoint: Path | None, epochs_per_repo: int) -> TrainPlan:
    """Target epochs are fixed on the first attempt: a retry resumes from last.ckpt towards the same target."""
    job_dir = Path(job_dir)
    start = str(Path(start_checkpoint).resolve()) if start_checkpoint else None
    plan_file = job_dir / JOB_PLAN
    if plan_file.is_file():
        saved = read_json_file(plan_file, MIB, "job plan")
        if saved.get("start_checkpoint") != start:
            raise ValueError(f"{plan_file}: this job started from {saved.get('start_checkpoint')}, not {start}; "
                             f"use a new --out folder")
        already, target = int(saved["start_epochs"]), int(saved["target_epochs"])
        start_ckpt = None
    else:
        # A reference checkpoint counts its epochs as ours do: LeanAgent's max_epochs = its epoch + epochs_per_repo.
        start_ckpt = read_any_checkpoint(Path(start)) if start else None
        already = epochs_completed(start_ckpt) if start_ckpt is not None else 0
        target = already + epochs_per_repo
    # A retry resumes from last.ckpt; if that was cut short, from the newest readable epoch checkpoint
    # of this job, and failing that from where the job started.
    resume, unreadable = first_readable(resume_candidates(job_dir / "checkpoints"))
    from_reference = False
    if resume is None and start:
        from_reference = not is_leanagent(start_ckpt if start_ckpt is not None else read_any_checkpoint(Path(start)))
    return TrainPlan(start, already, target, str(resume) if resume else start, tuple(unreadable), from_reference)


def start_at_epoch(trainer: pl.Trainer, epochs: int) -> None:
    """A fresh trainer counts from `epochs` finished epochs, as if resumed there, without any other state.

    Used for a reference checkpoint: max_epochs, checkpoint names (`epoch=N`), the loop state saved in
    our checkpoints (what the next repository counts from) and the epoch-seeded negatives then match
    LeanAgent's resumed run, while optimizer, schedule and step count start afresh.
    """
    for tracker in (trainer.fit_loop.epoch_progress.total, trainer.fit_loop.epoch_progress.current):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = epochs


def ewc_anchor(cfg: PipelineConfig, plan: TrainPlan) -> dict[str, torch.Tensor] | None:
    """theta*: the parameters when training on this repository began, not those of a retry's last.ckpt."""
    if not plan.is_retry:
        return None  # fit restores the start weights; the retriever snapshots them in on_fit_start
    if plan.start_checkpoint is None:
        return load_retriever(cfg, None).state_dict()
    start = read_any_checkpoint(Path(plan.start_checkpoint))
    if not is_leanagent(start):  # under our keys (its fit was checked by the first attempt's load)
        return complete_tied(reference_state_dict(start))
    return start["state_dict"]
