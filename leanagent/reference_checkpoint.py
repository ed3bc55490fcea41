"""Starting from LeanAgent's or ReProver's retriever checkpoints, which leanagent did not write.

Their layout (ReProver's `retrieval/model.py`, kept by LeanAgent): a Lightning checkpoint whose
`state_dict` holds the `T5EncoderModel` under the attribute `encoder` (`encoder.shared.weight`,
`encoder.encoder.block.0...`), the very keys of our `PremiseRetriever`, with the constructor's
arguments (`model_name`, `lr`, `warmup_steps`, `max_seq_len`, `num_retrieved`) as hyper-parameters
and `epoch`/`global_step` at the top level. They were trained under DeepSpeed, so a checkpoint may
also be a `*.ckpt/` folder, usable once consolidated by `zero_to_fp32.py` (into `pytorch_model.bin`,
a bare state dict, possibly with Lightning's `_forward_module.` prefix) or by Lightning's
`convert_zero_checkpoint_to_fp32_state_dict` (a Lightning-layout file).

What they lack is the encoder's architecture, which ours store (`encoder_config`); it is looked up
locally, never downloaded (`reference_architecture`). Their trainer state (optimizer, scheduler,
loops) is not resumed: the weights go into a fresh model trained with our optimizer and schedule,
and only the epoch count carries over (`epochs_completed`), as LeanAgent's max_epochs does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import T5Config, T5EncoderModel

from leanagent.checkpoints import CheckpointError, read_checkpoint

# Lightning pickles hyper-parameters as an AttributeDict (a dict subclass), under the module where
# the installed version defines it. The weights-only unpickler cannot fill a dict subclass, so these
# exact names, and nothing else, are read back as plain dicts.
ATTRIBUTE_DICT_NAMES = (
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning.fabric.utilities.data.AttributeDict",
)
SAFE_GLOBALS: tuple[tuple[type, str], ...] = tuple((dict, name) for name in ATTRIBUTE_DICT_NAMES)

ENCODER_PREFIX = "encoder."
# Wrappers whose names DeepSpeed-era Lightning put in front of the module's own keys.
WRAPPER_PREFIXES = ("_forward_module.", "module.")
# Where zero_to_fp32 output is looked for in a DeepSpeed checkpoint folder, first found wins.
CONSOLIDATED_NAMES = ("pytorch_model.bin", "checkpoint/pytorch_model.bin", "lightning_model.pt",
                      "checkpoint/lightning_model.pt")
DEEPSPEED_MODEL_STATES = "checkpoint/mp_rank_00_model_states.pt"
# T5 ties its token embeddings to `shared`; a consolidated file may store only one of the two names.
TIED = {ENCODER_PREFIX + "encoder.embed_tokens.weight": ENCODER_PREFIX + "shared.weight",
        ENCODER_PREFIX + "shared.weight": ENCODER_PREFIX + "encoder.embed_tokens.weight"}


def read_any_checkpoint(path: Path) -> dict:
    """A checkpoint file or a consolidated DeepSpeed folder as a Lightning-layout dict (`state_dict` and,
    where known, `hyper_parameters`, `epoch`, `loops`), weights-only, naming `path` in any error."""
    path = Path(path)
    if path.is_dir():
        return _read_folder(path)
    return _as_lightning(read_checkpoint(path, SAFE_GLOBALS), path)


def _read_folder(folder: Path) -> dict:
    weights = next((folder / n for n in CONSOLIDATED_NAMES if (folder / n).is_file()), None)
    if weights is None:
        hint = (f"; consolidate it first: python {folder / 'zero_to_fp32.py'} {folder} {folder / 'pytorch_model.bin'}"
                if (folder / "checkpoint").is_dir() or (folder / "zero_to_fp32.py").is_file() else "")
        raise CheckpointError(f"{folder}: a folder without consolidated weights (looked for "
                              f"{', '.join(CONSOLIDATED_NAMES)}){hint}")
    checkpoint = _as_lightning(read_checkpoint(weights, SAFE_GLOBALS), weights)
    states = folder / DEEPSPEED_MODEL_STATES
    if "epoch" not in checkpoint and states.is_file():
        # zero_to_fp32.py keeps only the weights; Lightning's own state (epoch, loops, hyper-parameters)
        # stayed in DeepSpeed's model-states file next to them.
        try:
            meta = read_checkpoint(states, SAFE_GLOBALS)
        except CheckpointError:
            meta = {}
        for key in ("epoch", "global_step", "loops", "hyper_parameters", "pytorch-lightning_version"):
            if key in meta and key not in checkpoint:
                checkpoint[key] = meta[key]
    return checkpoint


def _as_lightning(raw: dict, path: Path) -> dict:
    """A bare state dict (zero_to_fp32.py's output) wrapped as Lightning's layout; a Lightning one as is."""
    if "state_dict" in raw:
        if not isinstance(raw["state_dict"], Mapping):
            raise CheckpointError(f"{path}: its state_dict is a {type(raw['state_dict']).__name__}, not a mapping")
        return dict(raw)
    if raw and all(torch.is_tensor(v) for v in raw.values()):
        return {"state_dict": raw}
    raise CheckpointError(f"{path}: neither a Lightning checkpoint (no state_dict) nor a bare state dict of "
                          f"tensors (keys: {', '.join(sorted(map(str, raw))[:5])})")


def is_leanagent(checkpoint: Mapping[str, Any]) -> bool:
    """Ours store the encoder's architecture; a reference checkpoint's hyper-parameters do not."""
    return "encoder_config" in (checkpoint.get("hyper_parameters") or {})


def reference_state_dict(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The reference's weights under our keys: wrapper prefixes dropped, `encoder.*` as they are."""
    out = {}
    for key, value in checkpoint["state_dict"].items():
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix) and key[len(prefix):].startswith(ENCODER_PREFIX):
                key = key[len(prefix):]
                break
        out[key] = value
    return out


def reference_architecture(path: Path, checkpoint: Mapping[str, Any], name_or_path: str) -> tuple[T5Config, str]:
    """The encoder's T5Config and where it came from, with no hub access.

    In order: `model.name_or_path` (a local folder or a hub id already in the HF cache), the checkpoint's
    own `model_name` if cached, and failing both google/byt5-small's shape, which LeanAgent and ReProver
    fine-tune. The caller checks that the weights fit it.
    """
    from leanagent.model.presets import encoder_config

    hparams = checkpoint.get("hyper_parameters") or {}
    for source in (name_or_path, hparams.get("model_name")):
        if not source:
            continue
        try:
            return T5Config.from_pretrained(str(source), local_files_only=True), f"{source}'s config"
        except (OSError, ValueError):
            continue  # not a local folder, not in the cache: try the next source
    return encoder_config("byt5-small"), "the byt5-small shape (no local config found)"


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
                              f"{_first(missing)}, unexpected {_first(unexpected)} ({len(state_dict)} keys in the "
                              f"file, {len(expected)} expected); if it was trained from another encoder, set "
                              f"model.name_or_path to it")
    for key, shape in expected.items():
        tensor = state_dict.get(key, state_dict.get(TIED.get(key, "")))
        if tensor is not None and tuple(tensor.shape) != shape:
            raise CheckpointError(f"{path}: {key} has shape {tuple(tensor.shape)}, but {source} gives {shape}; set "
                                  f"model.name_or_path to the encoder it was trained from")


def complete_tied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with a tied alias filled in from its twin where the file stored only one."""
    out = dict(state_dict)
    for key, twin in TIED.items():
        if key not in out and twin in out:
            out[key] = out[twin]
    return out


def _first(keys: list[str], n: int = 3) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def reference_hparams(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's retriever settings, for the record; our config's settings are the ones trained with."""
    hparams = checkpoint.get("hyper_parameters") or {}
    return {k: hparams[k] for k in ("model_name", "lr", "warmup_steps", "max_seq_len", "num_retrieved")
            if k in hparams}


def reference_retriever(path: Path, checkpoint: Mapping[str, Any], name_or_path: str, **settings: Any):
    """A fresh `PremiseRetriever` holding the reference's weights, its architecture stored in our hparams
    so that every checkpoint written from here on is one of ours."""
    from leanagent.model.retriever import PremiseRetriever

    state_dict = reference_state_dict(checkpoint)
    config, source = reference_architecture(path, checkpoint, name_or_path)
    check_weights(path, state_dict, config, source)
    model = PremiseRetriever(name_or_path, encoder_config=config.to_dict(), **settings)
    model.load_state_dict(complete_tied(state_dict))
    return model


def checkpoint_encoder_config(path: Path, name_or_path: str) -> dict[str, Any]:
    """The architecture a start checkpoint gives (ours: stored; a reference: looked up locally, its weights
    checked against it), for checks before a job is launched. Raises CheckpointError naming the file."""
    checkpoint = read_any_checkpoint(path)
    if is_leanagent(checkpoint):
        return dict(checkpoint["hyper_parameters"]["encoder_config"])
    config, source = reference_architecture(path, checkpoint, name_or_path)
    check_weights(path, reference_state_dict(checkpoint), config, source)
    return config.to_dict()
