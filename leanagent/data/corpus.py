"""The premise corpus (``corpus.jsonl``) and what each theorem is allowed to see of it.

Accessibility follows LeanDojo: a theorem may use premises of its own file that end before it
starts, and every premise of the files its file imports, transitively. Everything is indexed per
file once so that a mathlib-size corpus (~180k premises, ~5k files) answers in milliseconds.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from leanagent.data.errors import DatasetError
from leanagent.data.imports import bits_to_mask, import_closures
from leanagent.data.premise_text import serialize_premise
from leanagent.data.ranges import RangeUnion
from leanagent.data.records import Pos, gc_paused, iter_jsonl, parse_pos

IMPORTED_CACHE_SIZE = 64
IMPORTED_RANGES_BUDGET = 1 << 20  # ranges held by the imported-ranges cache (24 bytes each), in every process

LAKE_PREFIX = ".lake/packages/"

if TYPE_CHECKING:  # torch is imported where a mask is made: validating a dataset (`leanagent run`'s checks) needs none
    import torch


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
        """`serialize_premise`, computed once: collate and corpus embedding ask for it again and again."""
        return serialize_premise(self.full_name, self.code)


@dataclass
class FileRecord:
    """One parsed line of corpus.jsonl; kept separate so validation can parse lines one at a time."""

    path: str
    imports: list[str]
    premises: list[Premise]


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


class Corpus:
    """All premises of a traced repository; a premise's global index is its position in `premises`."""

    def __init__(self, files: Iterable[FileRecord]) -> None:
        self.source: Path | None = None  # the corpus.jsonl it was read from (`from_jsonl`)
        self.premises: list[Premise] = []
        self.paths: list[str] = []
        self.imports: dict[str, list[str]] = {}
        self._file_premises: dict[str, range] = {}
        for rec in files:
            if rec.path in self.imports:
                raise DatasetError(f"corpus: duplicate path {rec.path}")
            self.paths.append(rec.path)
            self.imports[rec.path] = rec.imports
            first = len(self.premises)
            self.premises.extend(rec.premises)
            self._file_premises[rec.path] = range(first, len(self.premises))
        self._build_indexes()

    def _build_indexes(self) -> None:
        # Per file, indices sorted by end position so "ends before X" is one bisect.
        self._by_end: dict[str, tuple[list[Pos], list[int]]] = {}
        for path, idx in self._file_premises.items():
            ordered = sorted(idx, key=lambda i: self.premises[i].end)
            self._by_end[path] = ([self.premises[i].end for i in ordered], ordered)
        self._by_suffix: dict[str, list[str]] = defaultdict(list)
        for path in self.paths:
            parts = path.split("/")
            for k in range(1, len(parts)):
                self._by_suffix["/".join(parts[k:])].append(path)
        self._path_number = {p: k for k, p in enumerate(self.paths)}
        self._closure_bits: list[int] | None = None
        self._file_bounds: tuple[np.ndarray, np.ndarray] | None = None
        # Bounded: at mathlib scale a file imports ~100k premises, and 5k cached arrays would be gigabytes
        # in every rank and loader worker. Recomputing one from its ranges is a vectorised cumsum.
        self._imported: OrderedDict[str, np.ndarray] = OrderedDict()
        # Bounded by the ranges held (see IMPORTED_RANGES_BUDGET); recomputing one costs tens of microseconds.
        self._imported_ranges: OrderedDict[str, RangeUnion] = OrderedDict()
        self._imported_ranges_held = 0
        self._in_order: dict[str, bool] = {}
        self._utf8: list[bytes | None] | None = None
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
            corpus = cls(records)
        corpus.source = path.resolve()
        return corpus

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
        return self._file_premises.get(path, range(0))

    def imports_file(self, path: str, other: str) -> bool:
        """Whether `path` imports `other`, directly or transitively."""
        k, j = self._path_number.get(path), self._path_number.get(other)
        return k is not None and j is not None and bool((self._closures()[k] >> j) & 1)

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

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """First and one-past-last premise index of every file, by file number."""
        if self._file_bounds is None:
            ranges = [self._file_premises[p] for p in self.paths]
            self._file_bounds = (np.fromiter((r.start for r in ranges), dtype=np.int64, count=len(ranges)),
                                 np.fromiter((r.stop for r in ranges), dtype=np.int64, count=len(ranges)))
        return self._file_bounds

    def imported_ranges(self, path: str) -> RangeUnion:
        """`imported_indices` as a union of index ranges: a file's premises are contiguous, so its imports are
        a union of file ranges (adjacent ones merged); built from the closure bitset in O(files), cached (LRU)."""
        union = self._imported_ranges.get(path)
        if union is not None:
            self._imported_ranges.move_to_end(path)
            return union
        k = self._path_number.get(path)
        if k is None:
            union = RangeUnion.empty()
        else:
            files = np.flatnonzero(bits_to_mask(self._closures()[k], len(self.paths)))
            starts, stops = self._bounds()
            union = RangeUnion.from_ranges(starts[files], stops[files])
        self._imported_ranges[path] = union
        self._imported_ranges_held += union.num_ranges + 1
        while self._imported_ranges_held > IMPORTED_RANGES_BUDGET and len(self._imported_ranges) > 1:
            _, dropped = self._imported_ranges.popitem(last=False)
            self._imported_ranges_held -= dropped.num_ranges + 1
        return union

    def in_file_segment(self, path: str, before: Pos, strict: bool = False) -> range | np.ndarray:
        """`in_file_indices(path, before, strict)` without building a list: a range when the file's premises end
        in corpus order (the usual layout), else a sorted read-only array."""
        ends, ordered = self._by_end.get(path, ([], []))
        cut = (bisect.bisect_left if strict else bisect.bisect_right)(ends, tuple(before))
        in_order = self._in_order.get(path)
        if in_order is None:
            in_order = self._in_order[path] = all(a < b for a, b in zip(ordered, ordered[1:], strict=False))
        if in_order:
            return range(ordered[0], ordered[0] + cut) if cut else range(0)
        arr = np.sort(np.asarray(ordered[:cut], dtype=np.int64))
        arr.setflags(write=False)
        return arr

    def premise_utf8(self, indices: Iterable[int]) -> list[bytes]:
        """UTF-8 bytes of each premise's `text`, encoded once per corpus (in each process) and then reused.

        A premise whose text was never asked for is serialized here without caching the string as well.
        """
        cache = self._utf8
        if cache is None:
            cache = self._utf8 = [None] * len(self.premises)
        out = []
        for i in indices:
            data = cache[i]
            if data is None:
                p = self.premises[i]
                text = p.__dict__.get("text")
                if text is None:
                    text = serialize_premise(p.full_name, p.code)
                data = cache[i] = text.encode("utf-8")
            out.append(data)
        return out

    def premise_texts(self, indices: Iterable[int]) -> list[str]:
        """Each premise's `text` (what the retriever encodes), for a tokenizer that takes strings."""
        return [self.premises[i].text for i in indices]

    def accessible_union(self, positions: Iterable[tuple[str, Pos]]) -> np.ndarray:
        """A boolean mask of the premises accessible at one or more of `positions` ((corpus path, position) each):
        the only premises a retrieval over those positions can ever rank.

        Per file: everything it imports (the same for every position in it), and its own premises up to its
        furthest position (the in-file cut is monotone in the position), as `accessible_mask` decides each."""
        furthest: dict[str, Pos] = {}
        for path, pos in positions:
            pos = tuple(pos)
            if path not in furthest or pos > furthest[path]:
                furthest[path] = pos
        mask = np.zeros(len(self.premises), dtype=bool)
        for path, pos in furthest.items():
            self._mark_accessible(mask, path, pos)
        return mask

    def _mark_accessible(self, mask: np.ndarray, path: str, pos: Pos) -> None:
        """Set `mask` at every premise accessible at `pos` of `path`: its imports range by range, then its own."""
        union = self.imported_ranges(path)
        for lo, hi in zip(union.starts.tolist(), union.stops.tolist(), strict=True):
            mask[lo:hi] = True
        mask[np.asarray(self.in_file_indices(path, pos), dtype=np.int64)] = True

    def _imported_array(self, path: str) -> np.ndarray:
        arr = self._imported.get(path)
        if arr is not None:
            self._imported.move_to_end(path)
            return arr
        arr = self.imported_ranges(path).to_array()
        arr.setflags(write=False)
        self._imported[path] = arr
        if len(self._imported) > IMPORTED_CACHE_SIZE:
            self._imported.popitem(last=False)
        return arr

    def imported_indices(self, path: str) -> list[int]:
        return self._imported_array(path).tolist()

    def accessible_indices(self, path: str, start: Pos) -> np.ndarray:
        in_file = np.asarray(self.in_file_indices(path, start), dtype=np.int64)
        imported = self._imported_array(path)
        # Disjoint by construction (a file is never in its own closure), so a sorted merge suffices.
        return np.insert(imported, np.searchsorted(imported, in_file), in_file)

    def accessible_mask(self, path: str, start: Pos) -> torch.Tensor:
        """`accessible_indices` as a boolean mask over the corpus, filled range by range (no index array)."""
        mask = np.zeros(len(self.premises), dtype=bool)
        self._mark_accessible(mask, path, start)
        import torch

        return torch.from_numpy(mask)
