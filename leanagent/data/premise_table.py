"""The distinct premises a job embeds: one row per premise, shared by every corpus that holds it.

A real LeanDojo corpus carries its dependencies: every repository that imports Mathlib has Mathlib's ~10^5
premises in its `corpus.jsonl`. An evaluation over several such repositories that embeds each corpus on its
own embeds Mathlib once per repository, with the same weights. A premise's embedding depends only on its text
and the weights, so a `PremiseTable` lists each distinct premise once, and each corpus maps its premise indices
onto the table's rows.

- **One premise:** the same path, full name and code. Two versions of a file (repositories pinned to different
  Mathlib commits) differ in code and stay two rows; two premises of one corpus that agree on all three (a
  corpus may repeat one) stay two rows too, so a corpus's premises never merge among themselves.
- **Only what can be ranked:** `wanted[k]` marks the premises of corpus k that some context may use (the
  union of their accessible sets, `Corpus.accessible_union`). A premise no context may use is never ranked,
  so leaving it out changes no result. Unwanted premises get no row from that corpus (`-1`).
- **The rest, later:** `add_rest()` appends every premise of the corpora that has no row yet, each distinct one
  once: what a premise index over the whole union needs, embedded by the same job without embedding twice.

The table reads texts through its corpora (`premise_utf8`, `premise_texts`), so tokenizing a row is tokenizing
a corpus premise, byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from leanagent.data.corpus import Corpus, FileRecord


class PremiseTable:
    """Rows of distinct premises over `corpora`; `row_of(k)[i]` is the row of premise i of corpus k, or -1."""

    def __init__(self, corpora: Sequence[Corpus], wanted: Sequence[np.ndarray | None] | None = None) -> None:
        if wanted is not None and len(wanted) != len(corpora):
            raise ValueError(f"{len(wanted)} masks for {len(corpora)} corpora")
        self.corpora = list(corpora)
        self._keys: dict[tuple[str, str, str, int], int] = {}
        self._owner: list[tuple[int, int]] = []  # (corpus, index) of each row's first holder
        self._rows = [np.full(len(c), -1, dtype=np.int64) for c in self.corpora]
        self._inverse: dict[int, np.ndarray] = {}
        for k, corpus in enumerate(self.corpora):
            mask = None if wanted is None else wanted[k]
            if mask is not None and len(mask) != len(corpus):
                raise ValueError(f"corpus {k}: a mask of {len(mask)} for {len(corpus)} premises")
            self._add(k, range(len(corpus)) if mask is None else np.flatnonzero(mask).tolist())
        self.first_rest = len(self._owner)  # rows from here on were added by `add_rest`

    def _add(self, k: int, indices: Iterable[int]) -> None:
        corpus, rows, seen = self.corpora[k], self._rows[k], self._ordinals(k)
        for i in indices:
            if rows[i] >= 0:
                continue
            p = corpus.premises[i]
            base = (p.path, p.full_name, p.code)
            ordinal = seen.get(base, 0)
            seen[base] = ordinal + 1
            key = (*base, ordinal)
            row = self._keys.get(key)
            if row is None:
                row = self._keys[key] = len(self._owner)
                self._owner.append((k, i))
            rows[i] = row
        self._inverse.clear()

    def _ordinals(self, k: int) -> dict[tuple[str, str, str], int]:
        """How many premises of corpus k with each (path, name, code) have a row: the next one's ordinal. Counted
        in index order over the corpus's rows so far, so `add_rest` numbers a corpus's repeats as its first call."""
        seen: dict[tuple[str, str, str], int] = {}
        corpus = self.corpora[k]
        for i in np.flatnonzero(self._rows[k] >= 0).tolist():
            p = corpus.premises[i]
            seen[(p.path, p.full_name, p.code)] = seen.get((p.path, p.full_name, p.code), 0) + 1
        return seen

    def add_rest(self) -> range:
        """Rows for every premise of the corpora that has none yet; the new rows (to embed next)."""
        first = len(self._owner)
        for k, corpus in enumerate(self.corpora):
            self._add(k, np.flatnonzero(self._rows[k] < 0).tolist() if len(corpus) else [])
        return range(first, len(self._owner))

    def match(self, corpus: Corpus) -> np.ndarray:
        """Per premise of `corpus` (one of the table's or another), the row of the same premise (path, full name,
        code; a repeat in `corpus` matched to the same repeat, counted in index order), or -1."""
        rows = np.full(len(corpus), -1, dtype=np.int64)
        seen: dict[tuple[str, str, str], int] = {}
        for i, p in enumerate(corpus.premises):
            base = (p.path, p.full_name, p.code)
            ordinal = seen.get(base, 0)
            seen[base] = ordinal + 1
            rows[i] = self._keys.get((*base, ordinal), -1)
        return rows

    def __len__(self) -> int:
        return len(self._owner)

    @property
    def corpus_premises(self) -> int:
        """Premises in the corpora, counted once per corpus: what embedding each corpus on its own would embed."""
        return sum(len(c) for c in self.corpora)

    def row_of(self, k: int) -> np.ndarray:
        """Per premise of corpus k, its row (-1: not in the table). Read-only."""
        view = self._rows[k].view()
        view.setflags(write=False)
        return view

    def corpus_index(self, k: int) -> np.ndarray:
        """Per row, the index of that premise in corpus k (-1: corpus k has no premise on that row)."""
        inverse = self._inverse.get(k)
        if inverse is None or len(inverse) != len(self):
            inverse = np.full(len(self), -1, dtype=np.int64)
            rows = self._rows[k]
            held = np.flatnonzero(rows >= 0)
            inverse[rows[held]] = held
            inverse.setflags(write=False)
            self._inverse[k] = inverse
        return inverse

    def owner(self, row: int) -> tuple[int, int]:
        """(corpus, index) of the premise on `row`, in the first corpus that holds it."""
        return self._owner[row]

    # The premise source protocol that tokenization and embedding read (a `Corpus` offers the same).
    def premise_utf8(self, rows: Iterable[int]) -> list[bytes]:
        return [self.corpora[k].premise_utf8((i,))[0] for k, i in (self._owner[r] for r in rows)]

    def premise_texts(self, rows: Iterable[int]) -> list[str]:
        return [self.corpora[k].premises[i].text for k, i in (self._owner[r] for r in rows)]


def newest_union(corpora: Sequence[Corpus]) -> tuple[Corpus, np.ndarray, np.ndarray]:
    """One corpus of every file the corpora hold, each file as the newest corpus (the last that has it) holds it,
    and, per premise of it, the corpus and index it comes from.

    What a server answers from after a stage: a user may import anything any repository seen so far carries, and
    where two repositories carry one file at two versions (pinned to different Mathlib commits), the newest
    repository's is the one a user of the newest stage is most likely to have. Files come in the order they first
    appear (the first corpus's, then those the next one adds, ...), so a later stage's files extend an earlier's.
    """
    newest: dict[str, int] = {}
    order: list[str] = []
    for k, corpus in enumerate(corpora):
        for path in corpus.paths:
            if path not in newest:
                order.append(path)
            newest[path] = k
    records, source_corpus, source_index = [], [], []
    for path in order:
        k = newest[path]
        corpus = corpora[k]
        rows = corpus.file_range(path)
        records.append(FileRecord(path, list(corpus.imports[path]), [corpus.premises[i] for i in rows]))
        source_corpus.extend([k] * len(rows))
        source_index.extend(rows)
    return (Corpus(records), np.asarray(source_corpus, dtype=np.int64).reshape(-1),
            np.asarray(source_index, dtype=np.int64).reshape(-1))
