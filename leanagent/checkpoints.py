"""Reading our checkpoints and Fisher files safely, checking them cheaply, and pruning old checkpoints.

A crash while a checkpoint or a Fisher file is written, a full disk, or a copy cut short leaves a
truncated file. Torch then says `PytorchStreamReader failed reading zip archive` in a long traceback
that names no file; here every unreadable file becomes ONE line that names it (`BadFileError`).

Checkpoints are loaded with `torch.load(weights_only=True)`: our Lightning checkpoints hold only
tensors, numbers, strings, lists and dicts (state dict, optimizer and scheduler states, loop and
callback states, our hparams with the encoder's config as a plain dict), which torch's restricted
unpickler accepts without any `add_safe_globals`; a file that needs anything else (arbitrary code on
load) is refused, naming the global it asked for. Lightning's `fit(ckpt_path=..., weights_only=True)`
restores through the same loader.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from leanagent.atomic import write_bytes_atomic

LAST = "last.ckpt"
EPOCH_PATTERN = re.compile(r"^epoch=\d+.*\.ckpt$")
# Bytes per element of the safetensors dtypes (the header names them).
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit


class BadFileError(ValueError):
    """A checkpoint or Fisher file that cannot be used; the message is one line naming the file."""


class CheckpointError(BadFileError):
    pass


class FisherFileError(BadFileError):
    pass


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """The informative line of an exception's message (torch's are many lines long)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    # The weights-only unpickler puts the reason on a line of its own, after an explanation.
    reason = next((ln for ln in lines if "WeightsUnpickler error" in ln or "Unsupported global" in ln), lines[0])
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _unreadable(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {reason}); use another "
                           f"checkpoint, or rerun the job that wrote it")


# ---- checkpoints ------------------------------------------------------------------------------

def read_checkpoint(path: Path, safe_globals: Sequence[Any] = ()) -> dict:
    """A checkpoint's dict, loaded weights-only and memory-mapped (tensors are read when touched).

    `safe_globals` widens the restricted unpickler for this one load only (torch's `safe_globals`
    context), e.g. the Lightning `AttributeDict` of a reference checkpoint's hyper-parameters.
    Raises FileNotFoundError for a missing file and CheckpointError (one line naming the file)
    for a truncated, corrupt, or unsafe one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    _check_zip(path)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        unsafe = re.search(r"GLOBAL (\S+)", str(exc))
        if unsafe or "WeightsUnpickler" in str(exc):
            what = f"an object of type {unsafe.group(1)}" if unsafe else "a Python object"
            raise CheckpointError(f"{path}: holds {what}, which weights-only loading refuses (it could run code); "
                                  f"only checkpoints of tensors, numbers, strings, lists and dicts are read, as "
                                  f"leanagent writes them") from None
        raise _unreadable(path, _one_line(exc)) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, struct.error) as exc:
        raise _unreadable(path, _one_line(exc).split(". ")[0]) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (holds a {type(checkpoint).__name__}, "
                              f"not a dict)")
    return checkpoint


def _check_zip(path: Path) -> None:
    """torch's format is a zip: a truncated file has lost its directory (the end of the file), a damaged
    directory points past the end. Reads the directory only."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        if not isinstance(exc, zipfile.BadZipFile):
            reason = _one_line(exc)
        elif _starts_like_zip(path):
            reason = "no zip directory at its end: the file was cut short"
        else:
            reason = "not a zip archive, which torch.save writes"
        raise _unreadable(path, f"{reason}, {size} bytes") from None
    if not any(info.filename.endswith("/data.pkl") or info.filename == "data.pkl" for info in infos):
        raise _unreadable(path, "a zip archive without torch's data.pkl record")
    for info in infos:
        if info.header_offset + info.compress_size > size:
            raise _unreadable(path, f"record {info.filename} ends past the end of the file ({size} bytes)")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    size_bytes: int
    hparams: dict[str, Any] = field(default_factory=dict)
    global_step: int = -1

    @property
    def encoder_config(self) -> dict[str, Any] | None:
        return self.hparams.get("encoder_config")


def _starts_like_zip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04"


def check_checkpoint(path: Path) -> CheckpointInfo:
    """Cheap: the zip's records are all inside the file and the pickle loads (tensors mapped, not read)."""
    checkpoint = read_checkpoint(Path(path))
    hparams = checkpoint.get("hyper_parameters") or {}
    step = checkpoint.get("global_step")
    return CheckpointInfo(Path(path), Path(path).stat().st_size, dict(hparams) if isinstance(hparams, dict) else {},
                          int(step) if isinstance(step, int) else -1)


def resume_candidates(checkpoint_dir: Path) -> list[Path]:
    """A job's own checkpoints, the newest resume point first: by optimizer step, last.ckpt first among equals.

    last.ckpt is usually the newest (step checkpoints, and the copy written after each epoch's own file),
    but not when the job died while writing it: then the epoch's own file, written just before, is newer
    and saves retraining that epoch. An unreadable last.ckpt stays first, for `first_readable` to report.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    epochs = sorted((p for p in checkpoint_dir.iterdir() if p.is_file() and EPOCH_PATTERN.match(p.name)),
                    key=epoch_step, reverse=True)
    last = checkpoint_dir / LAST
    if not last.is_file():
        return epochs
    try:
        last_step = check_checkpoint(last).global_step
    except (BadFileError, FileNotFoundError):
        return [last, *epochs]
    newer = [p for p in epochs if epoch_step(p)[1] > last_step]
    return [*newer, last, *(p for p in epochs if p not in newer)]


def first_readable(candidates: Iterable[Path]) -> tuple[Path | None, list[str]]:
    """The first candidate that passes `check_checkpoint`, and one line per candidate skipped before it."""
    skipped: list[str] = []
    for candidate in candidates:
        try:
            check_checkpoint(candidate)
        except (BadFileError, FileNotFoundError) as exc:
            skipped.append(str(exc))
            continue
        return Path(candidate), skipped
    return None, skipped


def epoch_step(path: Path) -> tuple[int, int]:
    """(epoch, step) from a Lightning checkpoint name such as `epoch=2-step=120-Recall@10_val=62.93.ckpt`."""
    fields = dict(part.split("=", 1) for part in Path(path).stem.split("-") if "=" in part)
    try:
        return int(fields.get("epoch", -1)), int(fields.get("step", -1))
    except ValueError:
        return -1, -1


# ---- Fisher files -----------------------------------------------------------------------------

@dataclass(frozen=True)
class FisherInfo:
    path: Path
    size_bytes: int
    num_tensors: int
    num_elements: int
    metadata: dict[str, str]


def check_fisher(path: Path) -> FisherInfo:
    """Cheap: the safetensors header parses and its tensors exactly fill the rest of the file.

    Layout: 8 bytes little-endian header length n, n bytes of JSON (dtype, shape and data offsets of
    each tensor, `__metadata__`), then the data. A truncated file is shorter than the header says.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Fisher file")
    size = path.stat().st_size

    def bad(reason: str) -> FisherFileError:
        return FisherFileError(f"{path}: not a readable Fisher file (truncated or corrupt: {reason}); rerun the "
                               f"Fisher job that wrote it")

    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the safetensors length prefix")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise bad(f"the header claims {n} bytes, the file has {size - 8} after its length prefix")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"header is not JSON: {_one_line(exc)}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    end, elements = 0, 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = 1
            for dim in shape:
                count *= int(dim)
            expected = count * SAFETENSORS_DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed header entry") from None
        if stop - begin != expected or begin < 0:
            raise bad(f"tensor {name!r} spans {stop - begin} bytes, its dtype and shape need {expected}")
        end, elements = max(end, stop), elements + count
    if 8 + n + end != size:
        raise bad(f"{size} bytes, the header describes {8 + n + end}")
    return FisherInfo(path, size, len(header), elements, metadata if isinstance(metadata, dict) else {})


def save_fisher(path: Path, fisher: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Safetensors (the reference pickled, which runs code on load), keyed by the retriever's parameter names,
    written atomically: a crash never leaves a truncated Fisher that EWC would later trust."""
    write_bytes_atomic(Path(path), save({n: t.contiguous() for n, t in fisher.items()},
                                        metadata={k: json.dumps(v) for k, v in metadata.items()}))


def load_fisher(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata; refuses negative or non-finite entries, which no sum of squares has."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Fisher file")
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        raw_meta = f.metadata() or {}
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    bad = [n for n, t in tensors.items() if not torch.isfinite(t).all() or (t < 0).any()]
    if bad:
        raise ValueError(f"{path}: Fisher entries are negative or not finite: {bad[:5]}")
    return tensors, {k: json.loads(v) for k, v in raw_meta.items()}


def read_fisher(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`load_fisher`, with any unreadable file reported as one line naming it."""
    check_fisher(path)
    try:
        return load_fisher(Path(path))
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError; load_fisher ValueError
        reason = _one_line(exc)
        if reason.startswith(str(path)):
            raise FisherFileError(reason) from None
        raise FisherFileError(f"{path}: not a readable Fisher file ({reason}); rerun the Fisher job that wrote "
                              f"it") from None


# ---- LeanAgent's and ReProver's checkpoints -------------------------------------------------------
# Their layout (ReProver's `retrieval/model.py`, kept by LeanAgent): a Lightning checkpoint whose `state_dict`
# holds the `T5EncoderModel` under the attribute `encoder` (`encoder.shared.weight`, `encoder.encoder.block.0...`),
# the very keys of our `PremiseRetriever`, with the constructor's arguments (`model_name`, `lr`, `warmup_steps`,
# `max_seq_len`, `num_retrieved`) as hyper-parameters and `epoch`/`global_step` at the top level. Trained under
# DeepSpeed, a checkpoint may also be a `*.ckpt/` folder, usable once consolidated by `zero_to_fp32.py` (into
# `pytorch_model.bin`, a bare state dict, possibly with Lightning's `_forward_module.` prefix) or by Lightning's
# `convert_zero_checkpoint_to_fp32_state_dict` (a Lightning-layout file). What they lack is the encoder's
# architecture, which ours store; turning their weights into a model is `leanagent.model.loading`'s job.

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




def epochs_completed(checkpoint: dict) -> int:
    """Epochs finished when the checkpoint was written, from Lightning's loop state.

    `processed` counts epochs whose batches all ran; Lightning's fit stops when it reaches
    max_epochs, so this is the number to add `epochs_per_repo` to. (`epoch` is an index, and
    `completed` lags by one in checkpoints written at the end of an epoch.)
    """
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    if "processed" in progress:
        return int(progress["processed"])
    return int(checkpoint.get("epoch", -1)) + 1


# ---- retention --------------------------------------------------------------------------------

def prune_checkpoints(train_result: dict, keep: str = "best_and_last") -> list[Path]:
    """Delete a finished training job's other epoch checkpoints; return what was deleted.

    Kept: the checkpoint the next repository starts from (`checkpoint`), the best one
    (`best_checkpoint`) and `last.ckpt`. Only `epoch=*.ckpt` files directly inside the job's
    `checkpoints` folder are ever deleted. `keep="all"` deletes nothing.
    """
    if keep == "all":
        return []
    if keep != "best_and_last":
        raise ValueError(f"unknown keep_checkpoints {keep!r}; choose 'all' or 'best_and_last'")
    if not train_result.get("checkpoint"):
        return []  # what the next repository starts from is unknown: keep everything
    named = [train_result.get(k) for k in ("checkpoint", "best_checkpoint", "last_checkpoint")]
    kept = {Path(p).resolve() for p in named if p}
    folder = Path(train_result.get("last_checkpoint") or train_result["checkpoint"]).resolve().parent
    if folder.name != "checkpoints" or not folder.is_dir():
        return []  # not a job's checkpoints folder: touch nothing
    deleted = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink() and EPOCH_PATTERN.match(path.name) \
                and path.resolve() not in kept:
            path.unlink()
            deleted.append(path)
    return deleted
