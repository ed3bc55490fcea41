"""JSON files the project reads back (a run's manifest, a job's result.json, an index's index.json, heartbeats, job
records), read one way: a regular file, its size checked on the open file before a byte is read, its text parsed,
and its shape checked by a pydantic model.

Why a cap: these files live in folders that users share, copy, sync and edit. A manifest cut short or edited by hand
must give one line naming the file; so must a file that grew to gigabytes (a sparse file, a log copied over it): read
whole, a 2 GB file costs about twice its size in memory and tens of seconds before the parser fails. Each reader
names the most its file can legitimately hold, and anything larger is refused from its size alone.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from leanagent.ground.atomic import format_bytes

M = TypeVar("M", bound=BaseModel)

KIB = 1 << 10
MIB = 1 << 20


def describe_error(exc: ValidationError, prefix: str = "") -> str:
    """The first problem of a validation, as `key.path: what is wrong` (one line; the rest counted)."""
    errors = exc.errors()
    first = errors[0]
    key = ".".join(str(p) for p in (*([prefix] if prefix else []), *first["loc"])) or "(top level)"
    got = first.get("input")
    shown = json.dumps(got, default=str)[:40] if not isinstance(got, dict | list) else type(got).__name__
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = re.sub(r"^Input should be a valid dictionary or instance of \w+", "must be an object", first["msg"])
    message = re.sub(r"^(Input|Value) should be ", "must be ", message).replace("Value error, ", "")
    found = "" if first["type"] == "value_error" else f" (found {shown})"  # a rule's own message says it
    return f"{key}: {message.rstrip('.')}{found}{more}"



class JsonFileError(ValueError):
    """A JSON file missing, unreadable, too large, not JSON, or not of its model's shape (one line naming it)."""


def read_capped(path: Path, limit: int, what: str = "file", error: type[Exception] = JsonFileError,
                advice: str = "") -> bytes:
    """The bytes of the regular file `path`, refused with `error` (one line naming the file, then `advice` where the
    file's content is at fault) when it is not a regular file (a FIFO would block the reader), cannot be read, or
    holds more than `limit` bytes: checked on the open file before reading, and again while reading (a file growing
    meanwhile), so at most `limit` + 1 bytes are ever read."""
    tail = f"; {advice}" if advice else ""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{path}: not a regular file (a folder, a pipe or a device){tail}")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise error(f"{path}: {format_bytes(st.st_size)}, more than a {what} ever holds ({format_bytes(limit)}); "
                        f"it is not one{tail}")
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{path}: grew past {format_bytes(limit)} while it was read, more than a {what} ever holds{tail}")
    return data


def parse_json(data: bytes, path: Path, error: type[Exception] = JsonFileError, advice: str = "") -> Any:
    """`data` (the bytes of `path`) as JSON, or `error` with one line: where the JSON breaks, and whether the file
    ends before the JSON does (cut short by a full disk or a copy)."""
    tail = f"; {advice}" if advice else ""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}){tail}") from None
    except json.JSONDecodeError as exc:
        cut = " (cut short: it ends before the JSON does)" if exc.pos >= len(exc.doc.rstrip()) \
            or exc.msg.startswith("Unterminated string") else ""
        raise error(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}){cut}{tail}") \
            from None
    except RecursionError:
        raise error(f"{path}: nests deeper than any file of ours does{tail}") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise error(f"{path}: {str(exc).split(';')[0]}{tail}") from None


def read_json_file(path: Path, limit: int, what: str = "file", error: type[Exception] = JsonFileError,
                   advice: str = "") -> Any:
    """The JSON value in `path`, read with its size capped (`read_capped`) and parsed (`parse_json`)."""
    return parse_json(read_capped(path, limit, what, error, advice), path, error, advice)


def validate_as(data: Any, model: type[M], where: str, what: str = "file", error: type[Exception] = JsonFileError,
                advice: str = "") -> M:
    """`data` as `model`, or `error` naming `where` and the first wrong key (`describe_error`); `what` names what
    the file should be, for data that is no JSON object at all."""
    tail = f"; {advice}" if advice else ""
    if not isinstance(data, dict):
        raise error(f"{where}: a JSON {type(data).__name__}, not a {what} (an object){tail}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{where}: {describe_error(exc)}{tail}") from None


def read_model(path: Path, model: type[M], limit: int, what: str = "file", error: type[Exception] = JsonFileError,
               advice: str = "") -> M:
    """The JSON object in `path`, capped and parsed, as `model`: the one way this project reads a JSON file back."""
    return validate_as(read_json_file(path, limit, what, error, advice), model, str(path), what, error, advice)
