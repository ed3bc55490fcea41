"""Reading our checkpoints and Fisher files safely (torch): the tensors, weights-only, each bad file one line.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from leanagent.checkpoints.files import (
    EPOCH_PATTERN,
    LAST,
    BadFileError,
    CheckpointError,
    FisherFileError,
    check_fisher,
    check_zip,
    epoch_step,
    one_line,
    unreadable,
)
from leanagent.ground.atomic import write_bytes_atomic

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
    check_zip(path)
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
        raise unreadable(path, one_line(exc)) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, struct.error) as exc:
        raise unreadable(path, one_line(exc).split(". ")[0]) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (holds a {type(checkpoint).__name__}, "
                              f"not a dict)")
    return checkpoint


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    size_bytes: int
    hparams: dict[str, Any] = field(default_factory=dict)
    global_step: int = -1

    @property
    def encoder_config(self) -> dict[str, Any] | None:
        return self.hparams.get("encoder_config")


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


# ---- Fisher files ---------------------------------------------------------------------------

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
        reason = one_line(exc)
        if reason.startswith(str(path)):
            raise FisherFileError(reason) from None
        raise FisherFileError(f"{path}: not a readable Fisher file ({reason}); rerun the Fisher job that wrote "
                              f"it") from None


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
