"""The premise corpus (``corpus.jsonl``) and what each theorem is allowed to see of it.

Accessibility follows LeanDojo: a theorem may use premises of its own file that end before it
starts, and every premise of the files its file imports, transitively. Everything is indexed per
file once so that a mathlib-size corpus (~180k premises, ~5k files) answers in milliseconds.
"""

from __future__ import annotations

import bisect
import gc
import json
import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanagent.data.errors import DatasetError
from leanagent.data.imports import bits_to_mask, import_closures

IMPORTED_CACHE_SIZE = 64

Pos = tuple[int, int]
LAKE_PREFIX = ".lake/packages/"


@dataclass(frozen=True)
class Premise:
    full_name: str
    path: str
    code: str
    start: Pos
    end: Pos
    kind: str | None = None

    @cached_property
    def text(self) -> str:
        """`serialize()`, computed once: collate and corpus embedding ask for it again and again."""
        return serialize_premise(self.full_name, self.code)

    def serialize(self) -> str:
        return self.text


MARK_START, MARK_END = "<a>", "</a>"


def serialize_premise(full_name: str, code: str) -> str:
    """The text the retriever encodes: the code with the premise's own name tagged where it is declared.

    LeanDojo, ReProver and LeanAgent tag the name *inside* the code (``protected theorem
    <a>Nat.add_comm</a> : ...``), and the published retrievers were trained on that text, so we
    produce it byte for byte: first ``_root_.NAME`` is tagged; then the longest dotted suffix of
    the name (the whole name, then without its first component, ...) that occurs after whitespace,
    optionally in «guillemets», is tagged at every such occurrence, and the search stops there.
    The replacement is literal (the reference passes it as a regex template, which would
    misread a backslash in a «name»).
    """
    tagged = f"{MARK_START}{full_name}{MARK_END}"
    code = code.replace(f"_root_.{full_name}", tagged)
    fields = full_name.split(".")
    for i in range(len(fields)):
        pattern = re.compile(r"(?<=\s)«?" + re.escape(".".join(fields[i:])) + "»?")
        new_code = pattern.sub(lambda _: tagged, code)
        if new_code != code:
            return new_code
    return code


@dataclass
class FileRecord:
    """One parsed line of corpus.jsonl; kept separate so validation can parse lines one at a time."""

    path: str
    imports: list[str]
    premises: list[Premise]


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


def keep_premise(full_name: Any, code: Any) -> bool:
    """LeanDojo drops auto-generated, anonymous and mutual-block names; keeping them adds unlearnable targets."""
    if not isinstance(full_name, str) or not full_name:
        return False
    if "user__.n" in full_name or not code:
        return False
    return not (full_name.startswith("[") and full_name.endswith("]"))


def parse_record(record: Any, where: str) -> FileRecord:
    """Turn one corpus.jsonl object into a FileRecord; `where` (``corpus.jsonl:17``) prefixes every error."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("path", "imports", "premises") if k not in record]
    if missing:
        raise DatasetError(f"{where}: missing key(s) {', '.join(missing)}")
    path, imports, raw = record["path"], record["imports"], record["premises"]
    if not isinstance(path, str):
        raise DatasetError(f"{where}: path must be a string, got {path!r}")
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise DatasetError(f"{where}: imports must be a list of paths")
    if not isinstance(raw, list):
        raise DatasetError(f"{where}: premises must be a list")
    premises = []
    for k, p in enumerate(raw):
        if not isinstance(p, dict):
            raise DatasetError(f"{where}: premise #{k} is not an object")
        name, code = p.get("full_name"), p.get("code")
        if not keep_premise(name, code):
            continue
        lacking = [key for key in ("start", "end") if key not in p]
        if lacking:
            raise DatasetError(f"{where}: premise {name} is missing key(s) {', '.join(lacking)}")
        start = parse_pos(p["start"], where, f"premise {name} start")
        end = parse_pos(p["end"], where, f"premise {name} end")
        kind = p.get("kind")
        premises.append(Premise(name, path, str(code), start, end, kind if isinstance(kind, str) else None))
    return FileRecord(path, list(imports), premises)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building millions of acyclic objects; its repeated scans cost ~40% of load time."""
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


class Corpus:
    """All premises of a traced repository; a premise's global index is its position in `premises`."""

    def __init__(self, files: Iterable[FileRecord]) -> None:
        self.premises: list[Premise] = []
        self.paths: list[str] = []
        self.imports: dict[str, list[str]] = {}
        self._file_premises: dict[str, list[int]] = {}
        for rec in files:
            if rec.path in self.imports:
                raise DatasetError(f"corpus: duplicate path {rec.path}")
            self.paths.append(rec.path)
            self.imports[rec.path] = rec.imports
            first = len(self.premises)
            self.premises.extend(rec.premises)
            self._file_premises[rec.path] = list(range(first, len(self.premises)))
        self._build_indexes()

    def _build_indexes(self) -> None:
        # Per file, indices sorted by end position so "ends before X" is one bisect.
        self._by_end: dict[str, tuple[list[Pos], list[int]]] = {}
        for path, idx in self._file_premises.items():
            ordered = sorted(idx, key=lambda i: self.premises[i].end)
            self._by_end[path] = ([self.premises[i].end for i in ordered], ordered)
        self._by_key: dict[tuple[str, str], int] = {}
        self._by_name: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(self.premises):
            self._by_key.setdefault((p.path, p.full_name), i)
            self._by_name[p.full_name].append(i)
        self._by_suffix: dict[str, list[str]] = defaultdict(list)
        for path in self.paths:
            parts = path.split("/")
            for k in range(1, len(parts)):
                self._by_suffix["/".join(parts[k:])].append(path)
        self._path_number = {p: k for k, p in enumerate(self.paths)}
        self._premise_file = np.asarray([self._path_number[p.path] for p in self.premises], dtype=np.int64)
        self._closure_bits: list[int] | None = None
        # Bounded: at mathlib scale a file imports ~100k premises, and 5k cached arrays would be gigabytes
        # in every rank and loader worker. Recomputing one costs about a millisecond.
        self._imported: OrderedDict[str, np.ndarray] = OrderedDict()
        self._resolved: dict[str, str | None] = {}
        self._located: dict[tuple[str, Pos], int | None] = {}

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Corpus:
        path = Path(path)
        if not path.is_file():
            raise DatasetError(f"{path}: no such corpus file")
        records, seen = [], {}
        with gc_paused():
            for lineno, where, obj in iter_jsonl(path):
                rec = parse_record(obj, where)
                if rec.path in seen:
                    raise DatasetError(f"{where}: duplicate path {rec.path} (first at line {seen[rec.path]})")
                seen[rec.path] = lineno
                records.append(rec)
            return cls(records)

    @classmethod
    def from_records(cls, records: list[Mapping[str, Any]]) -> Corpus:
        return cls(parse_record(r, f"record {k}") for k, r in enumerate(records))

    def __len__(self) -> int:
        return len(self.premises)

    def file_of(self, index: int) -> str:
        return self.premises[index].path

    def resolve_path(self, file_path: str) -> str | None:
        """Map a theorem's repo-relative path onto the traced root, where corpus paths live.

        Benchmarks store ``Mathlib/X.lean`` for theorems but ``.lake/packages/mathlib/Mathlib/X.lean``
        in the corpus; an ambiguous suffix is refused rather than guessed, unless exactly one
        candidate is a lake package (the layout LeanDojo produces).
        """
        if file_path in self._resolved:
            return self._resolved[file_path]
        result: str | None = None
        if file_path in self.imports:
            result = file_path
        else:
            candidates = self._by_suffix.get(file_path.lstrip("/"), [])
            if len(candidates) == 1:
                result = candidates[0]
            elif candidates:
                lake = [c for c in candidates if c.startswith(LAKE_PREFIX) or f"/{LAKE_PREFIX}" in c]
                result = lake[0] if len(lake) == 1 else None
        self._resolved[file_path] = result
        return result

    def locate_at(self, def_path: str, def_pos: Pos) -> int | None:
        """The premise an annotation points at, found by position as LeanDojo does: the first premise of
        `def_path` (in corpus order) whose [start, end] contains `def_pos`.

        The name is not used, so annotations of generated declarations (``to_additive`` and the like,
        whose names are not in the corpus) still find the declaration that generated them.
        """
        key = (def_path, def_pos)
        if key in self._located:
            return self._located[key]
        path = def_path[2:] if def_path.startswith("./") else def_path
        resolved = self.resolve_path(path)
        hit = None
        if resolved is not None:
            for i in self._file_premises[resolved]:
                p = self.premises[i]
                if p.start <= def_pos <= p.end:
                    hit = i
                    break
        self._located[key] = hit
        return hit

    def file_range(self, path: str) -> range:
        """A file's premises are contiguous in the corpus: their global indices as a range."""
        idx = self._file_premises.get(path, [])
        return range(idx[0], idx[-1] + 1) if idx else range(0)

    def imports_file(self, path: str, other: str) -> bool:
        """Whether `path` imports `other`, directly or transitively."""
        k, j = self._path_number.get(path), self._path_number.get(other)
        return k is not None and j is not None and bool((self._closures()[k] >> j) & 1)

    def locate(self, full_name: str, def_path: str | None = None) -> int | None:
        """Index of a premise; the name alone is trusted only when unique, since overloads across files exist."""
        if def_path is not None:
            hit = self._by_key.get((def_path, full_name))
            if hit is not None:
                return hit
            resolved = self.resolve_path(def_path)
            if resolved is not None and resolved != def_path:
                hit = self._by_key.get((resolved, full_name))
                if hit is not None:
                    return hit
        candidates = self._by_name.get(full_name, [])
        return candidates[0] if len(candidates) == 1 else None

    def _closures(self) -> list[int]:
        if self._closure_bits is None:
            self._closure_bits = import_closures(self.paths, self.imports)
        return self._closure_bits

    def transitive_imports(self, path: str) -> set[str]:
        """Every file reachable through imports, `path` itself excluded even when a cycle leads back to it."""
        k = self._path_number.get(path)
        if k is None:
            return set()
        mask = bits_to_mask(self._closures()[k], len(self.paths))
        return {self.paths[i] for i in np.flatnonzero(mask)}

    def in_file_indices(self, path: str, before: Pos | None = None, strict: bool = False) -> list[int]:
        """Premises of `path`, those ending at or before `before` (strictly before, if `strict`).

        Retrieval (LeanDojo's accessibility) admits a premise ending exactly where the theorem starts;
        LeanAgent's negative sampling admits only those ending strictly before it.
        """
        ends, ordered = self._by_end.get(path, ([], []))
        if before is None:
            return sorted(ordered)
        cut = (bisect.bisect_left if strict else bisect.bisect_right)(ends, tuple(before))
        return sorted(ordered[:cut])

    def _imported_array(self, path: str) -> np.ndarray:
        arr = self._imported.get(path)
        if arr is not None:
            self._imported.move_to_end(path)
            return arr
        k = self._path_number.get(path)
        if k is None:
            arr = np.empty(0, dtype=np.int64)
        else:
            file_mask = bits_to_mask(self._closures()[k], len(self.paths))
            arr = np.flatnonzero(file_mask[self._premise_file]).astype(np.int64)
        arr.setflags(write=False)
        self._imported[path] = arr
        if len(self._imported) > IMPORTED_CACHE_SIZE:
            self._imported.popitem(last=False)
        return arr

    def imported_indices(self, path: str) -> list[int]:
        return self._imported_array(path).tolist()

    def imported_array(self, path: str) -> np.ndarray:
        """Read-only cached array form of `imported_indices`, for samplers that must not copy 100k ints."""
        return self._imported_array(path)

    def accessible_indices(self, path: str, start: Pos) -> np.ndarray:
        in_file = np.asarray(self.in_file_indices(path, start), dtype=np.int64)
        imported = self._imported_array(path)
        # Disjoint by construction (a file is never in its own closure), so a sorted merge suffices.
        return np.insert(imported, np.searchsorted(imported, in_file), in_file)

    def accessible_mask(self, path: str, start: Pos) -> torch.Tensor:
        mask = torch.zeros(len(self.premises), dtype=torch.bool)
        mask[torch.from_numpy(self.accessible_indices(path, start))] = True
        return mask
