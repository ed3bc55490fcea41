"""File writes that lose nothing: atomic replacement, so a reader (another rank, a rerun, a Prefect
task) never sees half a file, and a refusal to write into a folder that already holds something."""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, write: Callable[[IO], None], mode: str = "w", suffix: str = "") -> None:
    """Write a temporary file beside `path` with `write`, fsync it, then rename it over `path`.

    The file gets the mode a plain `open(path, "w")` would give it (0666 less the user's umask), not
    mkstemp's 0600: checkpoints, indexes and reports are read by a team's other users.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_file(path.parent, f".{path.name}.", suffix)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data), mode="wb")


def _new_file(folder: Path, prefix: str, suffix: str) -> tuple[int, Path]:
    """A new file of a unique name in `folder`, opened for writing, created as `open(path, "w")` creates one:
    the kernel applies the umask (or the folder's default ACL) to 0666, on every POSIX system."""
    for _ in range(100):
        candidate = Path(folder) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            return os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free temporary name {prefix}*{suffix}")


def file_mode(folder: Path) -> int:
    """The mode a plain `open(path, "w")` gives a new file in `folder`, found without changing the umask
    (setting it to read it back would race with other threads creating files)."""
    fd, probe = _new_file(folder, ".mode.", ".tmp")
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, lambda f: json.dump(data, f, indent=2, sort_keys=True, default=str))


def format_bytes(n: float) -> str:
    """A size as a person reads it in a message: `2.1 GB`."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def refuse_non_empty(folder: Path) -> None:
    """Generators write whole folders; one that holds anything may hold a user's work."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty; nothing was overwritten")
