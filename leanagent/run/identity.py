"""A job's identity: the content of everything that decides its result, never where its files are.

Two setups of a sweep often launch the same job: the untrained evaluation, identical for every setup of one order,
and the first repository's training, Fisher and evaluation, identical whether EWC is on (there is nothing to anchor
to yet) or off, and whether the stage trains on the repository or on the merge of that one repository. The sweep
runs such a job once (`leanagent.run.shared`), and tells it from another by `job_identity`:

- the program;
- each dataset's content: the SHA-256 of the files a run reads (`leanagent.data.merge.digests`). A dataset that
  is a merge of one repository (merge_all's and replay's first stage) is that repository, read back line for line
  (no duplicate theorem dropped, no corpus file in conflict), so it is identified by the repository's digests;
- the starting checkpoint's (or, without one, the base model's) and the Fisher file's SHA-256;
- for an evaluation that writes a premise index: its datasets' content, and the lists of the index it extends;
- the settings that change the result: the run's fingerprint (`leanagent.run.fingerprint`: the keys that make a
  run its experiment), less those this program does not read (`IGNORED`: a Fisher pass or an evaluation reads no
  learning rate), and less `lifelong.ewc_lambda` for a training job without a Fisher file (EWC has nothing to
  anchor to: the same job with EWC on or off).

A file is hashed once per process and state (path, inode, size, modification time): a checkpoint read by the Fisher,
the evaluation and the next training job is read from disk once.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from leanagent.data.merge import MERGE_FILE, dataset_files
from leanagent.ground.file_digest import sha256_file
from leanagent.ground.job import JobRequest
from leanagent.ground.model_identity import model_files
from leanagent.ground.names import NAMES_FILE
from leanagent.run.fingerprint import fingerprint_fields
from leanagent.run.strategy import merge_record

# Settings no job reads: where the data, the order and the start come from enter as content (datasets, checkpoint),
# and what is kept of a run's checkpoints is the flow's business after the job.
IGNORED_BY_EVERY_PROGRAM = ("lifelong.curriculum", "lifelong.dataset_strategy", "lifelong.replay_fraction",
                            "lifelong.keep_checkpoints", "lifelong.start_checkpoint")
# What only training reads: the optimizer and its schedule (`PremiseRetriever.configure_optimizers`; a Fisher pass
# configures none), and the training Trainer's clipping, accumulation, early stopping and checkpoints
# (`leanagent.train.trainer.build_training_trainer`; the Fisher and evaluation Trainers take none of them).
TRAINING_ONLY = ("lifelong.ewc_lambda", "lifelong.epochs_per_repo", "lifelong.checkpoint", "model.lr",
                 "model.warmup_steps", "trainer.gradient_clip_val", "trainer.accumulate_grad_batches",
                 "trainer.early_stopping_patience", "trainer.save_top_k", "trainer.checkpoint_every_n_steps",
                 "trainer.checkpoint_every_minutes")
# Settings a program does not read, by program (every program of leanagent.ground.job.PROGRAMS has an entry).
IGNORED: dict[str, tuple[str, ...]] = {
    "train": ("lifelong.fisher_estimator",),
    "fisher": TRAINING_ONLY,
    "evaluate": (*TRAINING_ONLY, "lifelong.fisher_estimator"),
}
# What a training job without a Fisher file does not read: EWC's weight multiplies a penalty it does not have.
IGNORED_WITHOUT_FISHER = ("lifelong.ewc_lambda",)


class JobIdentity(BaseModel):
    """What decides a job's result, by content (module docstring); `digest()` is the key the sweep shares it by."""

    model_config = ConfigDict(frozen=True)

    program: str
    settings: dict[str, Any]
    datasets: list[dict[str, str]]
    start: str  # the starting checkpoint's SHA-256, or the base model's (its files', or its hub name)
    fisher: str | None = None
    index: bool = False
    index_datasets: list[dict[str, str]] = []
    index_after: str | None = None  # the SHA-256 of the lists the index extends

    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def job_identity(job: JobRequest) -> JobIdentity:
    """The identity of `job`, run under the config it carries (module docstring)."""
    cfg = job.config
    settings = fingerprint_fields(cfg)
    ignored = [*IGNORED_BY_EVERY_PROGRAM, *IGNORED[job.program],
               *(IGNORED_WITHOUT_FISHER if job.program == "train" and job.fisher is None else ())]
    for dotted in ignored:
        *parents, leaf = dotted.split(".")
        node = settings
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    settings["model"]["name_or_path"] = model_digest(cfg.model.name_or_path)
    split = cfg.data.split
    return JobIdentity(
        program=job.program, settings=settings, datasets=[dataset_identity(d, split) for d in job.datasets],
        start=model_digest(job.checkpoint) if job.checkpoint is not None else settings["model"]["name_or_path"],
        fisher=file_digest(job.fisher) if job.fisher is not None else None, index=job.index is not None,
        index_datasets=[dataset_identity(d, split) for d in job.index_datasets] if job.index is not None else [],
        index_after=_lists_digest(job.index_after) if job.index is not None and job.index_after is not None
        else None)


_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}
_MUTEX = threading.Lock()


def file_digest(path: str | Path) -> str:
    """A file's SHA-256, hashed once per process while the file is unchanged (same inode, size and mtime)."""
    path = Path(path)
    st = os.stat(path)
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _MUTEX:
        known = _DIGESTS.get(key)
    if known is None:
        known = sha256_file(path)
        with _MUTEX:
            _DIGESTS[key] = known
    return known


def model_digest(path_or_name: str | Path) -> str:
    """A checkpoint file's SHA-256, a model folder's (its weight and architecture files, by name), or for a model
    named on a hub, `hub:NAME`."""
    path = Path(path_or_name)
    if path.is_file():
        return file_digest(path)
    if path.is_dir():
        parts = "".join(f"{name}:{file_digest(file)};" for name, file in model_files(path))
        return hashlib.sha256(parts.encode()).hexdigest()
    return f"hub:{path_or_name}"


def dataset_identity(dataset: Path, split: str) -> dict[str, str]:
    """{file: SHA-256} of what a job reads of `dataset` (`digests`); a merge of one repository that kept every line
    (no duplicate theorem, no corpus conflict, its files as merge.json wrote them) is that repository: its digests,
    as merge.json recorded them."""
    dataset = Path(dataset)
    own = {name: file_digest(dataset / name) if (dataset / name).is_file() else "missing"
           for name in dataset_files(split)}
    if not (dataset / MERGE_FILE).is_file():
        return own
    try:
        info = merge_record(dataset, ValueError)
    except ValueError:  # not a record of ours: the folder is what its own files are
        return own
    source = info.inputs.get(info.sources[0]) if len(info.sources) == 1 else None
    if (source is not None and set(source) == set(own) and info.outputs == own and not info.duplicate_theorems
            and not info.corpus_conflicts and not info.replay):
        return dict(source)
    return own

def _lists_digest(index: Path) -> str:
    """What an index extended by another contributes to it: its served lists (names.json)."""
    names = Path(index) / NAMES_FILE
    return file_digest(names) if names.is_file() else "missing"
