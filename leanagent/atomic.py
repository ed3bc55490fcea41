"""File writes that lose nothing: atomic replacement, so a reader (another rank, a rerun, a Prefect
task) never sees half a file, and a refusal to write into a folder that already holds something."""

from __future__ import annotations

import json
import os
import tempfile
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
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


def file_mode() -> int:
    """0666 less the process's umask, read without changing it (Linux); less the usual 022 elsewhere."""
    umask = 0o022
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
                    break
    except OSError:
        pass
    return 0o666 & ~umask


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, lambda f: json.dump(data, f, indent=2, sort_keys=True, default=str))


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def refuse_non_empty(folder: Path) -> None:
    """Generators write whole folders; one that holds anything may hold a user's work."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty; nothing was overwritten")
