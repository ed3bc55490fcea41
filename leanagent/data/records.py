"""Reading LeanDojo's JSON and JSONL files record by record, every error naming its file and line."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from leanagent.data.errors import DatasetError

Pos = tuple[int, int]


def parse_pos(value: Any, where: str, key: str) -> Pos:
    """Positions arrive as JSON lists; a malformed one must fail here, not deep inside a comparison."""
    if type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return (value[0], value[1])  # the common case, checked cheaply: corpora hold millions of positions
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise DatasetError(f"{where}: {key} must be [line, column], got {value!r}")
    return (value[0], value[1])


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building millions of acyclic objects; its repeated scans cost a large share of the
    load time (docs/measurements.md)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from exc


def iter_lines(path: Path) -> Iterator[tuple[int, str, str]]:
    """Yield (line number, location such as ``corpus.jsonl:17``, text) of every non-blank line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, f"{path.name}:{lineno}", line


def iter_jsonl(path: Path) -> Iterable[tuple[int, str, Any]]:
    """Yield (line number, location, object); bad JSON raises naming the line."""
    for lineno, where, line in iter_lines(path):
        yield lineno, where, parse_json_line(line, where)
