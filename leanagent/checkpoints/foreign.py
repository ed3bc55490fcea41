"""LeanAgent's and ReProver's checkpoints, and DeepSpeed's consolidated folders, read into Lightning's layout.

Their layout (ReProver's `retrieval/model.py`, kept by LeanAgent): a Lightning checkpoint whose `state_dict`
holds the `T5EncoderModel` under the attribute `encoder` (`encoder.shared.weight`, `encoder.encoder.block.0...`),
the very keys of our `PremiseRetriever`, with the constructor's arguments (`model_name`, `lr`, `warmup_steps`,
`max_seq_len`, `num_retrieved`) as hyper-parameters and `epoch`/`global_step` at the top level. Trained under
DeepSpeed, a checkpoint may also be a `*.ckpt/` folder, usable once consolidated by `zero_to_fp32.py` (into
`pytorch_model.bin`, a bare state dict, possibly with Lightning's `_forward_module.` prefix) or by Lightning's
`convert_zero_checkpoint_to_fp32_state_dict` (a Lightning-layout file). What they lack is the encoder's
architecture, which ours store; turning their weights into a model is `leanagent.model.loading`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from leanagent.checkpoints.files import CheckpointError
from leanagent.checkpoints.ours import read_checkpoint

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


def complete_tied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with a tied alias filled in from its twin where the file stored only one."""
    out = dict(state_dict)
    for key, twin in TIED.items():
        if key not in out and twin in out:
            out[key] = out[twin]
    return out


def first_few(keys: list[str], n: int = 3) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def reference_hparams(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The reference's retriever settings, for the record; our config's settings are the ones trained with."""
    hparams = checkpoint.get("hyper_parameters") or {}
    return {k: hparams[k] for k in ("model_name", "lr", "warmup_steps", "max_seq_len", "num_retrieved")
            if k in hparams}
