"""Theorems of a LeanDojo split file (``random/train.json`` and friends) and their proof states.

Every variant seen in real benchmark files is accepted: no ``theorem_statement``, a local path as
``url``, term-mode theorems with no traced tactics, and tactics without ``annotated_tactic``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leanagent.data.errors import DatasetError
from leanagent.data.records import Pos, gc_paused, parse_pos

_GOAL_COUNT = re.compile(r"\d+ goals")
THEOREM_KEYS = ("full_name", "file_path", "start", "end", "traced_tactics")
TACTIC_KEYS = ("tactic", "state_before", "state_after")
ANNOTATION_KEYS = ("full_name", "def_path", "def_pos", "def_end_pos")
_KEYSETS = {keys: frozenset(keys) for keys in (THEOREM_KEYS, TACTIC_KEYS, ANNOTATION_KEYS)}


@dataclass
class Annotation:
    full_name: str
    def_path: str
    def_pos: Pos
    def_end_pos: Pos


@dataclass
class Tactic:
    tactic: str
    state_before: str
    state_after: str
    annotations: list[Annotation] | None


@dataclass
class Theorem:
    full_name: str
    file_path: str
    start: Pos
    end: Pos
    url: str
    commit: str
    tactics: list[Tactic]
    theorem_statement: str | None
    source: str


def split_source(path: Path) -> str:
    """``random/train.json``: short enough for messages, long enough to tell splits apart."""
    return f"{path.parent.name}/{path.name}"


def read_split_json(path: Path) -> list[Any]:
    """The raw list of theorem objects; a syntax error names the line JSON reports."""
    source = split_source(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise DatasetError(f"{source}: no such file ({path})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{source}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from exc
    if not isinstance(data, list):
        raise DatasetError(f"{source}: expected a JSON list of theorems, got {type(data).__name__}")
    return data


def _missing(obj: Any, keys: tuple[str, ...]) -> list[str]:
    if isinstance(obj, dict):
        return [] if obj.keys() >= _KEYSETS[keys] else [k for k in keys if k not in obj]
    return list(keys)


def parse_annotation(raw: Any, where: str) -> Annotation:
    missing = _missing(raw, ANNOTATION_KEYS)
    if missing:
        raise DatasetError(f"{where}: annotation missing key(s) {', '.join(missing)}")
    return Annotation(
        str(raw["full_name"]),
        str(raw["def_path"]),
        parse_pos(raw["def_pos"], where, "def_pos"),
        parse_pos(raw["def_end_pos"], where, "def_end_pos"),
    )


def parse_tactic(raw: Any, where: str) -> Tactic:
    missing = _missing(raw, TACTIC_KEYS)
    if missing:
        raise DatasetError(f"{where}: missing key(s) {', '.join(missing)}")
    annotations: list[Annotation] | None = None
    annotated = raw.get("annotated_tactic")
    if annotated is not None:
        if not isinstance(annotated, (list, tuple)) or len(annotated) != 2 or not isinstance(annotated[1], list):
            raise DatasetError(f"{where}: annotated_tactic must be [text, [annotations]]")
        annotations = [parse_annotation(a, where) for a in annotated[1]]
    return Tactic(str(raw["tactic"]), str(raw["state_before"]), str(raw["state_after"]), annotations)


def parse_theorem(raw: Any, source: str, index: int) -> Theorem:
    """One theorem object; errors name the split file, the theorem's position and (if known) its name."""
    name = raw.get("full_name") if isinstance(raw, dict) else None
    where = f"{source}: theorem #{index}" + (f" ({name})" if name else "")
    missing = _missing(raw, THEOREM_KEYS)
    if missing:
        raise DatasetError(f"{where}: missing key(s) {', '.join(missing)}")
    if not isinstance(raw["traced_tactics"], list):
        raise DatasetError(f"{where}: traced_tactics must be a list")
    tactics = [parse_tactic(t, f"{where}, tactic {k}") for k, t in enumerate(raw["traced_tactics"])]
    statement = raw.get("theorem_statement")
    return Theorem(
        full_name=str(raw["full_name"]),
        file_path=str(raw["file_path"]),
        start=parse_pos(raw["start"], where, "start"),
        end=parse_pos(raw["end"], where, "end"),
        url=str(raw.get("url", "")),
        commit=str(raw.get("commit", "")),
        tactics=tactics,
        theorem_statement=statement if isinstance(statement, str) else None,
        source=source,
    )


def load_split(path: Path) -> list[Theorem]:
    path = Path(path)
    source = split_source(path)
    with gc_paused():
        return [parse_theorem(raw, source, k) for k, raw in enumerate(read_split_json(path))]


def strip_goal_count(state: str) -> str:
    """The context text, as LeanDojo formats a state: a leading ``N goals`` header is dropped and the rest
    stripped; a state without that header is kept as it is (not stripped), exactly as the reference does."""
    m = _GOAL_COUNT.match(state)
    return state[m.end():].strip() if m is not None else state


def format_context(tactic: Tactic) -> str:
    return strip_goal_count(tactic.state_before)


def load_states(files: list[Path]) -> list[str]:
    """The contexts of every tactic in LeanDojo split files, formatted as training formats them: real lengths."""
    return [format_context(tactic) for path in files for theorem in load_split(Path(path))
            for tactic in theorem.tactics]


def has_sorry(theorem: Theorem) -> bool:
    """The reference's own test for an unfinished proof: "sorry" anywhere in a tactic (the curriculum's rule)."""
    return any("sorry" in t.tactic for t in theorem.tactics)
