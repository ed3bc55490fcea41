"""A retriever from what a job or a user points at: a base model, one of our checkpoints, LeanAgent's or
ReProver's checkpoints, or a Hugging Face folder.

`load_retriever` is what the rank programs use (training, the Fisher, evaluation): the job's config gives the
retriever's options (`RetrieverOptions.from_config`). `load_model` is what `export`, `index`, `retrieve` and
`serve` use: the options are those the checkpoint stored (`RetrieverOptions.from_hparams`), so the premise
length and batch budget it was evaluated with carry over, and it reads what the model learned on (dataset,
metrics) from the checkpoint and its job folder.

A LeanAgent/ReProver checkpoint (read by `leanagent.checkpoints.ours.read_any_checkpoint`) lacks the encoder's
architecture, which ours store: it is looked up locally, never downloaded (`reference_architecture`), the
weights are checked against it, and they go into a fresh model trained with our optimizer and schedule;
only the epoch count carries over (`epochs_completed`), as LeanAgent's max_epochs does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import T5Config, T5EncoderModel

from leanagent.checkpoints.files import CheckpointError
from leanagent.checkpoints.foreign import (
    ENCODER_PREFIX,
    TIED,
    complete_tied,
    first_few,
    is_leanagent,
    read_any_checkpoint,
    reference_hparams,
    reference_state_dict,
)
from leanagent.ground.config import PipelineConfig
from leanagent.ground.json_files import MIB, read_json_file
from leanagent.ground.names import BYT5_SMALL
from leanagent.ground.results import ResultUnreadableError, read_result
from leanagent.model.options import RetrieverOptions, stored_encoder_config
from leanagent.model.presets import encoder_config
from leanagent.model.progress_bars import no_progress_bars
from leanagent.model.retriever import PremiseRetriever

# Written by `leanagent export` beside config.json: what a plain HF folder cannot say about the retriever.
RETRIEVER_FILE = "retriever.json"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # owner/name, as the Hugging Face hub spells ids


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


def load_retriever(cfg: PipelineConfig, checkpoint: Path | None, weights: bool = True) -> PremiseRetriever:
    """The retriever for a job, reading a checkpoint once.

    From one of our checkpoints the architecture comes from its hparams, so no hub access is needed;
    `weights=False` when Lightning's `fit(ckpt_path=...)` restores them anyway. A LeanAgent/ReProver
    checkpoint (file or consolidated DeepSpeed folder) always has its weights loaded: Lightning
    never resumes from it (see `leanagent.checkpoints.ours`).
    """
    options = RetrieverOptions.from_config(cfg)
    if checkpoint is None:
        return PremiseRetriever(options)
    ckpt = read_any_checkpoint(checkpoint)
    if not is_leanagent(ckpt):
        return reference_retriever(checkpoint, ckpt, options)
    return retriever_from_checkpoint(ckpt, options, weights)


def retriever_from_checkpoint(ckpt: Mapping[str, Any], options: RetrieverOptions,
                              weights: bool = True) -> PremiseRetriever:
    """One of our checkpoints, read: its architecture and weights, run with `options`; the base model it names
    stays the checkpoint's (the encoder's origin, recorded in what it writes next)."""
    hparams = ckpt["hyper_parameters"]
    stored = RetrieverOptions.from_hparams(hparams)
    model = PremiseRetriever(options.replace(name_or_path=stored.name_or_path),
                             encoder_config=stored_encoder_config(hparams))
    if weights:
        model.load_state_dict(ckpt["state_dict"])
    return model


def reference_architecture(path: Path, checkpoint: Mapping[str, Any], name_or_path: str) -> tuple[T5Config, str]:
    """The encoder's T5Config and where it came from, with no hub access.

    In order: `model.name_or_path` (a local folder or a hub id already in the HF cache), the checkpoint's
    own `model_name` if cached, and failing both google/byt5-small's shape, which LeanAgent and ReProver
    fine-tune. The caller checks that the weights fit it.
    """
    hparams = checkpoint.get("hyper_parameters") or {}
    for source in (name_or_path, hparams.get("model_name")):
        if not source:
            continue
        try:
            return T5Config.from_pretrained(str(source), local_files_only=True), f"{source}'s config"
        except (OSError, ValueError):
            continue  # not a local folder, not in the cache: try the next source
    return encoder_config(BYT5_SMALL), "the byt5-small shape (no local config found)"


def check_weights(path: Path, state_dict: Mapping[str, torch.Tensor], config: T5Config, source: str) -> None:
    """Refuse, in one line naming the file, weights whose keys or shapes are not those of this architecture.

    The expected shapes come from the model built on the meta device: nothing is allocated.
    """
    with torch.device("meta"):
        expected = {ENCODER_PREFIX + k: tuple(v.shape) for k, v in T5EncoderModel(config).state_dict().items()}
    missing = [k for k in expected if k not in state_dict and TIED.get(k) not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{path}: its keys do not match the retriever's encoder ({source}): missing "
                              f"{first_few(missing)}, unexpected {first_few(unexpected)} ({len(state_dict)} keys in "
                              f"the file, {len(expected)} expected); if it was trained from another encoder, set "
                              f"model.name_or_path to it")
    for key, shape in expected.items():
        tensor = state_dict.get(key, state_dict.get(TIED.get(key, "")))
        if tensor is not None and tuple(tensor.shape) != shape:
            raise CheckpointError(f"{path}: {key} has shape {tuple(tensor.shape)}, but {source} gives {shape}; set "
                                  f"model.name_or_path to the encoder it was trained from")




def reference_retriever(path: Path, checkpoint: Mapping[str, Any], options: RetrieverOptions) -> PremiseRetriever:
    """A fresh `PremiseRetriever` holding the reference's weights, its architecture stored in our hparams
    so that every checkpoint written from here on is one of ours."""
    state_dict = reference_state_dict(checkpoint)
    config, source = reference_architecture(path, checkpoint, options.name_or_path)
    check_weights(path, state_dict, config, source)
    model = PremiseRetriever(options, encoder_config=config.to_dict())
    model.load_state_dict(complete_tied(state_dict))
    return model


def reference_encoder_config(path: Path, checkpoint: Mapping[str, Any], name_or_path: str) -> dict[str, Any]:
    """The architecture of a LeanAgent/ReProver start checkpoint (read from `path`), looked up locally and its
    weights checked against it, for checks before a job is launched. Raises CheckpointError naming the file."""
    config, source = reference_architecture(path, checkpoint, name_or_path)
    check_weights(path, reference_state_dict(checkpoint), config, source)
    return config.to_dict()


def model_path(source: str | Path) -> Path:
    """The file or folder `source` names: itself when it exists; a hub id (`owner/name`, e.g. ReProver's
    kaiyuy/leandojo-lean4-retriever-byt5-small) as its snapshot in the Hugging Face cache, never downloaded (the
    snapshot's path is what index.json then records, and its files' digests). Anything else as it is, for the
    caller to refuse."""
    path = Path(source)
    if path.exists() or not HUB_ID.fullmatch(str(source)):
        return path
    from huggingface_hub import snapshot_download  # transformers' own dependency; imported only for a hub id
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(source), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise ModelSourceError(f"{source}: no such file or folder, and no snapshot of that Hugging Face model in "
                               f"this machine's cache (nothing is downloaded: fetch it where there is network, "
                               f"`huggingface-cli download {source}`, or give its folder)") from None


def load_model(path: str | Path, device: str = "cpu", base_model: str | None = None) -> LoadedModel:
    """A checkpoint file, an HF model folder or a cached hub id (`model_path`), loaded once, in eval mode (dropout
    off) on `device`.

    `base_model` (a local folder or cached hub id) gives the architecture of a LeanAgent/ReProver
    checkpoint, which does not store it; default: its `model_name`, else byt5-small's shape."""
    path = model_path(path)
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
    ckpt = read_any_checkpoint(path)  # memory-mapped: its tensors are read when loaded into the retriever
    if not is_leanagent(ckpt):
        return _from_reference(path, ckpt, reference_hparams(ckpt), base_model)
    # The settings it was trained and evaluated with (premise length, embedding batch), read back typed; how this
    # machine runs it (`compile`) is this machine's default, not the training cluster's.
    stored = RetrieverOptions.from_hparams(ckpt["hyper_parameters"])
    retriever = retriever_from_checkpoint(ckpt, stored.replace(compile=RetrieverOptions().compile))
    epoch, step = ckpt.get("epoch"), ckpt.get("global_step")
    history = [dict(h) for h in ckpt.get("leanagent_validation_history", [])]
    return LoadedModel(retriever, checkpoint=path.resolve(), base_model=stored.name_or_path,
                       dataset=_job_dataset(path), epoch=epoch, global_step=step,
                       metrics=_metrics_at(history, epoch, step, ckpt.get("callbacks", {})), history=history)


def _from_reference(path: Path, ckpt: dict, hparams: dict[str, Any], base_model: str | None) -> LoadedModel:
    """A LeanAgent/ReProver retriever checkpoint: its architecture from its `model_name` when cached locally,
    else byt5-small's (`reference_architecture`); premises cut at its `max_seq_len`."""
    with no_progress_bars():
        retriever = reference_retriever(path, ckpt, RetrieverOptions.for_reference(hparams, base_model))
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
        dataset = read_result(result).get("dataset")
    except ResultUnreadableError:
        return None
    return str(dataset) if dataset else None


def _from_folder(path: Path) -> LoadedModel:
    """An HF model folder (`load_model` has seen its config.json), with an export's `retriever.json` if any."""
    meta = _read_retriever_meta(path)
    with no_progress_bars():
        options = RetrieverOptions(name_or_path=str(path))
        if "max_seq_len" in meta:
            options = options.replace(max_seq_len=int(meta["max_seq_len"]))
        retriever = PremiseRetriever(options)
    return LoadedModel(retriever, model_dir=path.resolve(), base_model=meta.get("base_model"),
                       dataset=meta.get("dataset"), epoch=meta.get("epoch"), global_step=meta.get("global_step"),
                       metrics=dict(meta.get("metrics", {})))


def _read_retriever_meta(path: Path) -> dict[str, Any]:
    file = path / RETRIEVER_FILE
    if not file.is_file():
        return {}
    meta = read_json_file(file, MIB, "retriever settings file", ModelSourceError)
    return meta if isinstance(meta, dict) else {}
