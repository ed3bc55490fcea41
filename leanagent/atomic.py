"""File writes that lose nothing: atomic replacement, so a reader (another rank, a rerun, a Prefect
task) never sees half a file, and a refusal to write into a folder that already holds something."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, write: Callable[[IO], None], mode: str = "w", suffix: str = "",
                 permissions: int | None = None) -> None:
    """Write a temporary file beside `path` with `write`, fsync it, then rename it over `path`.

    `permissions` replaces mkstemp's 0600 (files others must read, such as checkpoints).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        if permissions is not None:
            os.fchmod(fd, permissions)
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
