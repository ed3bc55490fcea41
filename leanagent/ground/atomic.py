"""File writes that lose nothing: atomic replacement, so a reader (another rank, a rerun, a Prefect
task) never sees half a file; a refusal to write into a folder that already holds something; and the one check of a
folder (or a file) a command is about to write, before any work."""

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


def out_folder_problem(folder: Path, new_or_empty: bool = False) -> str | None:
    """Why a command cannot write into `folder` (made, with its parents, where missing), in one line that starts
    with the folder; None when it can. Asked before any work, so that a slip costs a second, not a job:

    - something other than a folder (a file, a link to nothing) stands where the folder or a parent of it goes;
    - the nearest folder that exists takes no new file (a read-only filesystem, permissions, an immutable folder):
      found by creating a file there and removing it at once, the one answer the filesystem itself gives
      (`os.access` says yes to root whatever the mount or the folder's attributes say);
    - with `new_or_empty`, it holds something: a generator writes whole folders, and one that holds anything may
      hold a user's work.
    """
    folder = Path(folder)
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is not a folder" if existing.exists() else "is a link to nothing"
        if existing == folder:
            return f"{folder} exists and {what}; nothing was overwritten"
        return f"{folder}: its parent {existing} {what}"
    try:
        file_mode(existing)  # a file created and removed: the filesystem's own answer
        held = new_or_empty and existing == folder and any(folder.iterdir())
    except OSError as exc:
        return f"{folder}: cannot write in {existing} ({exc.strerror or exc}); choose a folder you can write to"
    return f"{folder} exists and is not empty; nothing was overwritten" if held else None


def refuse_non_empty(folder: Path) -> None:
    """A folder a generator writes whole: FileExistsError with `out_folder_problem`'s line when it holds anything,
    when something other than a folder stands where it goes, or when it cannot be written."""
    problem = out_folder_problem(folder, new_or_empty=True)
    if problem is not None:
        raise FileExistsError(problem)


def out_file_problem(path: Path) -> str | None:
    """Why a command cannot write the file `path` (its folder made where missing), in one line; None when it can.
    Asked before the work whose figures the file is to hold."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a folder; give a file name"
    problem = out_folder_problem(path.parent)
    return None if problem is None else f"{path}: {problem}"
