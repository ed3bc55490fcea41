"""Checkpoint and Fisher files by their names and bytes, without torch: what a file is called, whether it is whole,
which to prune. The flow prunes a finished repository's checkpoints and the checks before a launch read a Fisher
file's header with this module alone; loading a checkpoint's tensors is `leanagent.checkpoints.ours`'.

A crash while a checkpoint or a Fisher file is written, a full disk, or a copy cut short leaves a truncated file.
Torch then says `PytorchStreamReader failed reading zip archive` in a long traceback that names no file; here every
unreadable file becomes ONE line that names it (`BadFileError`).
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from leanagent.ground.results import TrainResult

LAST = "last.ckpt"
EPOCH_PATTERN = re.compile(r"^epoch=\d+.*\.ckpt$")
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit


class BadFileError(ValueError):
    """A checkpoint or Fisher file that cannot be used; the message is one line naming the file."""


class CheckpointError(BadFileError):
    pass


class FisherFileError(BadFileError):
    pass


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The informative line of an exception's message (torch's are many lines long)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    # The weights-only unpickler puts the reason on a line of its own, after an explanation.
    reason = next((ln for ln in lines if "WeightsUnpickler error" in ln or "Unsupported global" in ln), lines[0])
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def unreadable(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {reason}); use another "
                           f"checkpoint, or rerun the job that wrote it")


def check_zip(path: Path) -> None:
    """torch's format is a zip: a truncated file has lost its directory (the end of the file), a damaged
    directory points past the end. Reads the directory only."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        if not isinstance(exc, zipfile.BadZipFile):
            reason = one_line(exc)
        elif starts_like_zip(path):
            reason = "no zip directory at its end: the file was cut short"
        else:
            reason = "not a zip archive, which torch.save writes"
        raise unreadable(path, f"{reason}, {size} bytes") from None
    if not any(info.filename.endswith("/data.pkl") or info.filename == "data.pkl" for info in infos):
        raise unreadable(path, "a zip archive without torch's data.pkl record")
    for info in infos:
        if info.header_offset + info.compress_size > size:
            raise unreadable(path, f"record {info.filename} ends past the end of the file ({size} bytes)")


def starts_like_zip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04"


def epoch_step(path: Path) -> tuple[int, int]:
    """(epoch, step) from a Lightning checkpoint name such as `epoch=2-step=120-Recall@10_val=62.93.ckpt`."""
    fields = dict(part.split("=", 1) for part in Path(path).stem.split("-") if "=" in part)
    try:
        return int(fields.get("epoch", -1)), int(fields.get("step", -1))
    except ValueError:
        return -1, -1



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
        raise bad(f"header is not JSON: {one_line(exc)}") from None
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


# ---- retention --------------------------------------------------------------------------------

def prune_checkpoints(train: TrainResult, keep: str = "best_and_last") -> list[Path]:
    """Delete a finished training job's other epoch checkpoints; return what was deleted.

    Kept: the checkpoint the next repository starts from (`checkpoint`), the best one
    (`best_checkpoint`) and `last.ckpt`. Only `epoch=*.ckpt` files directly inside the job's
    `checkpoints` folder are ever deleted. `keep="all"` deletes nothing.
    """
    if keep == "all":
        return []
    if keep != "best_and_last":
        raise ValueError(f"unknown keep_checkpoints {keep!r}; choose 'all' or 'best_and_last'")
    if not train.checkpoint:
        return []  # what the next repository starts from is unknown: keep everything
    named = [train.checkpoint, train.best_checkpoint, train.last_checkpoint]
    kept = {Path(p).resolve() for p in named if p}
    folder = Path(train.last_checkpoint or train.checkpoint).resolve().parent
    if folder.name != "checkpoints" or not folder.is_dir():
        return []  # not a job's checkpoints folder: touch nothing
    deleted = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink() and EPOCH_PATTERN.match(path.name) \
                and path.resolve() not in kept:
            path.unlink()
            deleted.append(path)
    return deleted
