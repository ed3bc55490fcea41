"""Check a dataset folder completely before any GPU time is spent on it.

Every problem is collected, not just the first: a run on a cluster costs a queue wait, and a
report that lists one error at a time turns one fix into many round trips. All passes are linear
in the size of the data so that a mathlib-size dataset is checked in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from leanagent.data.corpus import Corpus, FileRecord, parse_record
from leanagent.data.errors import DatasetError
from leanagent.data.examples import located_positives
from leanagent.data.imports import strongly_connected_components
from leanagent.data.records import gc_paused, iter_lines, parse_json_line
from leanagent.data.theorems import Theorem, parse_theorem, read_split_json, split_source
from leanagent.ground.names import CORPUS_FILE, DEFAULT_SPLIT, PARTS, TRAIN_PART, part_file


@dataclass
class Problem:
    location: str
    message: str

    def __str__(self) -> str:
        return f"{self.location}: {self.message}"


class _Report:
    """Collects problems with locations prefixed by the dataset folder's name."""

    def __init__(self, dataset_dir: Path) -> None:
        self.name = dataset_dir.name
        self.problems: list[Problem] = []

    def add(self, where: str, message: str) -> None:
        self.problems.append(Problem(f"{self.name}/{where}" if where else self.name, message))

    def add_error(self, exc: DatasetError) -> None:
        """DatasetError messages already read ``file:line: message``; split them back apart."""
        where, sep, message = str(exc).partition(": ")
        self.add(where if sep else "", message if sep else where)


def _read_corpus(path: Path, report: _Report) -> tuple[Corpus | None, list[str], int]:
    """The corpus of the lines that parse, where the others are (`corpus.jsonl:4`), and how many imports name files
    it lacks when some lines are unreadable (most likely files on those lines: counted for one summary, not
    listed)."""
    records: list[FileRecord] = []
    lines: dict[str, int] = {}
    unreadable: list[str] = []
    try:
        for lineno, where, line in iter_lines(path):
            try:
                rec = parse_record(parse_json_line(line, where), where)
            except DatasetError as exc:
                report.add_error(exc)
                unreadable.append(where)
                continue
            if rec.path in lines:
                report.add(where, f"duplicate path {rec.path} (first at line {lines[rec.path]})")
                continue
            lines[rec.path] = lineno
            records.append(rec)
            for p in rec.premises:
                if p.start > p.end:
                    report.add(where, f"premise {p.full_name} starts at {list(p.start)} after it ends at {list(p.end)}")
    except OSError as exc:
        report.add(CORPUS_FILE, f"cannot be read: {exc}")
        return None, unreadable, 0
    missing_imports = 0
    for rec in records:
        for imp in rec.imports:
            if imp not in lines:
                if unreadable:  # most likely a file on an unreadable line: counted below, not listed
                    missing_imports += 1
                else:
                    report.add(f"{CORPUS_FILE}:{lines[rec.path]}", f"imports {imp} which is not in the corpus")
    for cycle in _import_cycles({r.path: r.imports for r in records}):
        report.add(f"{CORPUS_FILE}:{lines[cycle[0]]}", "import cycle: " + " -> ".join(cycle + [cycle[0]]))
    return Corpus(records), unreadable, missing_imports


def _import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle per group of files that import each other, as a path a user can follow.

    The groups are the strongly connected components that `imports.py` already computes; inside
    one, following any import that stays in the group must come back to a file already visited.
    """
    nodes = list(graph)
    number = {path: i for i, path in enumerate(nodes)}
    succ = [[number[t] for t in graph[path] if t in number] for path in nodes]
    cycles: list[list[str]] = []
    for component in strongly_connected_components(succ):
        members = set(component)
        if len(component) == 1 and component[0] not in succ[component[0]]:
            continue
        node = min(component)  # start at the file listed first in the corpus
        path, position = [node], {node: 0}
        while True:
            node = next(t for t in succ[node] if t in members)
            if node in position:
                cycles.append([nodes[i] for i in path[position[node]:]])
                break
            position[node] = len(path)
            path.append(node)
    return sorted(cycles, key=lambda cycle: number[cycle[0]])


def _read_split(path: Path, report: _Report) -> list[Theorem]:
    source = split_source(path)
    try:
        raw = read_split_json(path)
    except DatasetError as exc:
        report.add_error(exc)
        return []
    theorems = []
    for k, obj in enumerate(raw):
        try:
            theorems.append(parse_theorem(obj, source, k))
        except DatasetError as exc:
            report.add_error(exc)
    return theorems


@dataclass
class _Missing:
    """What refers to files a corpus with unreadable lines lacks (its own imports, the splits' theorems and
    annotations): counted, for one summary line after the unreadable lines themselves."""

    imports: int = 0
    theorems: int = 0
    annotations: int = 0

    def __bool__(self) -> bool:
        return bool(self.imports or self.theorems or self.annotations)

    def summary(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.imports, "import(s) in the corpus"),
                                               (self.theorems, "theorem(s) of the splits"),
                                               (self.annotations, "premise annotation(s) of the splits")) if n]
        listed = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
        return (f"{listed} refer to files not in the corpus, probably those on its unreadable line(s); fix those "
                f"first")


def _check_theorems(theorems: list[Theorem], corpus: Corpus, report: _Report, missing: _Missing | None = None) -> int:
    """Report unknown files and def_paths; return how many tactics would become training examples.

    With `missing` (a corpus line did not parse) they are only counted there: the files they name are
    probably on that line, and a knock-on line per theorem and annotation would bury the real problem.
    """
    labelled = 0
    for thm in theorems:
        if corpus.resolve_path(thm.file_path) is None:
            if missing is not None:
                missing.theorems += 1
            else:
                report.add(thm.source, f"theorem {thm.full_name}: file {thm.file_path} is not in the corpus")
            continue
        for k, tactic in enumerate(thm.tactics):
            bad = {a.def_path for a in tactic.annotations or [] if corpus.resolve_path(a.def_path) is None}
            if missing is not None:
                missing.annotations += len(bad)
                bad = set()
            for def_path in sorted(bad):
                report.add(thm.source, f"theorem {thm.full_name}, tactic {k}: def_path {def_path} is not in the corpus")
            if located_positives(corpus, tactic):
                labelled += 1
    return labelled


def validate_dataset(dataset_dir: Path, split: str = DEFAULT_SPLIT) -> list[Problem]:
    with gc_paused():
        return _validate(Path(dataset_dir), split)


def _validate(dataset_dir: Path, split: str) -> list[Problem]:
    report = _Report(dataset_dir)
    if not dataset_dir.is_dir():
        report.add("", f"dataset folder {dataset_dir} does not exist")
        return report.problems
    corpus_file = dataset_dir / CORPUS_FILE
    corpus: Corpus | None = None
    unreadable: list[str] = []
    missing_imports = 0
    if corpus_file.is_file():
        corpus, unreadable, missing_imports = _read_corpus(corpus_file, report)
    else:
        report.add(CORPUS_FILE, "missing (every dataset needs its premise corpus)")
    missing = _Missing(imports=missing_imports) if unreadable else None
    split_dir = dataset_dir / split
    if not split_dir.is_dir():
        report.add(split, "split folder is missing")
        if missing:
            report.add("", missing.summary())
        return report.problems
    for part in PARTS:
        name = part_file(part)
        path = split_dir / name
        if not path.is_file():
            report.add(f"{split}/{name}", "missing")
            continue
        theorems = _read_split(path, report)
        if corpus is None:
            continue
        labelled = _check_theorems(theorems, corpus, report, missing)
        if part == TRAIN_PART and labelled == 0 and missing is None:
            report.add(f"{split}/{name}", "no training example: no tactic has a premise annotation found in the corpus")
    if missing:
        report.add("", missing.summary())
    return report.problems


MAX_LISTED = 20  # problems listed per dataset; `leanagent validate DIR` prints them all


def dataset_problems(datasets: Sequence[Path], split: str, max_listed: int = MAX_LISTED) -> list[str]:
    """One message per invalid dataset, listing up to `max_listed` of its problems: what the checks before a job
    or a run refuse a dataset with (`leanagent.preflight.checks`)."""
    messages = []
    for d in datasets:
        problems = validate_dataset(Path(d), split=split)
        if problems:
            shown = problems[:max_listed]
            listed = "\n".join(f"  {p}" for p in shown)
            more = (f"\n  ... and {len(problems) - len(shown)} more (`leanagent validate {d}` lists them all)"
                    if len(problems) > len(shown) else "")
            messages.append(f"{d}: {len(problems)} problem(s); nothing was launched:\n{listed}{more}")
    return messages
