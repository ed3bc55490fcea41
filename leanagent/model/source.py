"""A trained retriever from what a user points at: one of our Lightning checkpoints or a Hugging Face folder.

`export`, `index` and `retrieve` all take either, so the three agree on one loader. A checkpoint goes
through `programs.load_retriever` (the loader training and evaluation use), with a config made from
the checkpoint's own hyper-parameters, so the premise length and batch budget it was evaluated with
carry over; what it learned on (dataset, metrics) is read from the checkpoint and its job folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leanagent.model.retriever import PremiseRetriever

# Written by `leanagent export` beside config.json: what a plain HF folder cannot say about the retriever.
RETRIEVER_FILE = "retriever.json"
DEFAULT_MAX_SEQ_LEN = 512


class ModelSourceError(ValueError):
    """A CHECKPOINT/--model argument that names nothing loadable; the message is one line naming it."""


@dataclass
class LoadedModel:
    """A retriever in eval mode, and what is known about where it came from (for model cards and index.json)."""

    retriever: PremiseRetriever
    checkpoint: Path | None = None  # a Lightning .ckpt
    model_dir: Path | None = None  # a Hugging Face folder
    base_model: str | None = None  # the name_or_path training started from
    dataset: str | None = None
    epoch: int | None = None
    global_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def source(self) -> Path:
        return self.checkpoint if self.checkpoint is not None else self.model_dir  # type: ignore[return-value]


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Transformers' "Loading weights"/"Writing model shards" bars, on every retrieve or export, are noise."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_model(path: str | Path, device: str = "cpu", base_model: str | None = None) -> LoadedModel:
    """A checkpoint file or an HF model folder, loaded once, in eval mode (dropout off) on `device`.

    `base_model` (a local folder or cached hub id) gives the architecture of a LeanAgent/ReProver
    checkpoint, which does not store it; default: its `model_name`, else byt5-small's shape."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        loaded = _from_folder(path)
    elif path.exists():
        loaded = _from_checkpoint(path, base_model)  # ours, or a LeanAgent/ReProver file or DeepSpeed folder
    else:
        raise ModelSourceError(f"{path}: no such checkpoint file or model folder")
    loaded.retriever.eval()
    loaded.retriever.to(device)
    return loaded


def _from_checkpoint(path: Path, base_model: str | None = None) -> LoadedModel:
    from leanagent.config import DataConfig, ModelConfig, PipelineConfig
    from leanagent.reference_checkpoint import is_leanagent, read_any_checkpoint, reference_hparams
    from leanagent.train.programs import load_retriever

    ckpt = read_any_checkpoint(path)  # memory-mapped: its tensors are read by `load_retriever` below
    if not is_leanagent(ckpt):
        return _from_reference(path, ckpt, reference_hparams(ckpt), base_model)
    hparams = dict(ckpt["hyper_parameters"])
    model_fields = {k: hparams[k] for k in ("name_or_path", "lr", "warmup_steps", "max_seq_len", "num_retrieved")
                    if k in hparams}
    data = DataConfig(eval_batch_size=hparams["eval_batch_size"]) if "eval_batch_size" in hparams else DataConfig()
    cfg = PipelineConfig(model=ModelConfig(**model_fields), data=data)
    retriever = load_retriever(cfg, path)
    epoch, step = ckpt.get("epoch"), ckpt.get("global_step")
    history = [dict(h) for h in ckpt.get("leanagent_validation_history", [])]
    return LoadedModel(retriever, checkpoint=path.resolve(), base_model=hparams.get("name_or_path"),
                       dataset=_job_dataset(path), epoch=epoch, global_step=step,
                       metrics=_metrics_at(history, epoch, step, ckpt.get("callbacks", {})), history=history)


def _from_reference(path: Path, ckpt: dict, hparams: dict[str, Any], base_model: str | None) -> LoadedModel:
    """A LeanAgent/ReProver retriever checkpoint: its architecture from its `model_name` when cached locally,
    else byt5-small's (`reference_checkpoint.reference_architecture`); premises cut at its `max_seq_len`."""
    from leanagent.config import ModelConfig, PipelineConfig
    from leanagent.train.programs import load_retriever

    model = {"name_or_path": base_model or hparams.get("model_name", ModelConfig().name_or_path)}
    if "max_seq_len" in hparams:
        model["max_seq_len"] = int(hparams["max_seq_len"])
    with no_progress_bars():
        retriever = load_retriever(PipelineConfig(model=ModelConfig(**model)), path)
    return LoadedModel(retriever, checkpoint=path.resolve(), base_model=hparams.get("model_name"),
                       epoch=ckpt.get("epoch"), global_step=ckpt.get("global_step"))


def _metrics_at(history: list[dict[str, Any]], epoch: Any, step: Any, callbacks: dict) -> dict[str, float]:
    """The validation metrics of this checkpoint's own epoch: the history entry it wrote at that step, else the
    score its ModelCheckpoint callback recorded (a checkpoint from before the history was kept)."""
    for entry in reversed(history):
        if entry.get("epoch") == epoch and entry.get("step") == step:
            return {k: float(v) for k, v in entry.items() if k not in ("epoch", "step")}
    for name, state in callbacks.items():
        if name.startswith("ModelCheckpoint") and isinstance(state, dict) and state.get("current_score") is not None:
            return {str(state.get("monitor")): float(state["current_score"])}
    return {}


def _job_dataset(path: Path) -> str | None:
    """The dataset a job trained on, from the job's result.json (JOB/checkpoints/X.ckpt); None when unknown."""
    result = path.resolve().parent.parent / "result.json"
    if path.resolve().parent.name != "checkpoints" or not result.is_file():
        return None
    try:
        dataset = json.loads(result.read_text()).get("dataset")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return str(dataset) if dataset else None


def _from_folder(path: Path) -> LoadedModel:
    """An HF model folder (`load_model` has seen its config.json), with an export's `retriever.json` if any."""
    meta = _read_retriever_meta(path)
    with no_progress_bars():
        retriever = PremiseRetriever(str(path), max_seq_len=int(meta.get("max_seq_len", DEFAULT_MAX_SEQ_LEN)))
    return LoadedModel(retriever, model_dir=path.resolve(), base_model=meta.get("base_model"),
                       dataset=meta.get("dataset"), epoch=meta.get("epoch"), global_step=meta.get("global_step"),
                       metrics=dict(meta.get("metrics", {})))


def _read_retriever_meta(path: Path) -> dict[str, Any]:
    file = path / RETRIEVER_FILE
    if not file.is_file():
        return {}
    try:
        meta = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"{file}: not valid JSON ({exc})") from None
    return meta if isinstance(meta, dict) else {}
