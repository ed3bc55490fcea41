"""A lifelong run's stage index: the union of several datasets' corpora, each file at its newest version, with the
rows an evaluation job embedded for its tests (each premise embedded once)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanagent.data.corpus import Corpus
from leanagent.data.premise_table import PremiseTable, newest_union
from leanagent.ground.names import CORPUS_FILE
from leanagent.index.files import write_index


class StageIndex:
    """A premise index over several datasets' corpora, as a lifelong run's stage serves them: each file at the
    version of the last dataset that carries it (`newest_union`), embedded in a job's premise table (the table an
    evaluation job embeds for its tests, with these premises added: each premise embedded once)."""

    def __init__(self, datasets: Sequence[Path], known: Sequence[Corpus] = ()) -> None:
        """`known`: corpora already loaded (an evaluation's datasets'), reused for the datasets that are theirs."""
        loaded = {c.source: c for c in known if c.source is not None}
        self.corpora = [loaded.get((Path(d) / CORPUS_FILE).resolve()) or Corpus.from_jsonl(Path(d) / CORPUS_FILE)
                        for d in datasets]
        self.corpus, self.source_corpus, self.source_index = newest_union(self.corpora)
        self._table: PremiseTable | None = None

    def served(self) -> list[tuple[Corpus, np.ndarray]]:
        """Per corpus, the mask of its premises the index holds."""
        out = []
        for k, corpus in enumerate(self.corpora):
            mask = np.zeros(len(corpus), dtype=bool)
            mask[self.source_index[self.source_corpus == k]] = True
            out.append((corpus, mask))
        return out

    def table(self) -> PremiseTable:
        """A table of the served premises alone (when the tests embed their own)."""
        if self._table is None:
            self._table = PremiseTable(self.corpora, [mask for _, mask in self.served()])
        return self._table

    def write(self, out: Path, embedding: torch.Tensor, table: PremiseTable, meta: dict[str, Any],
              names_before: dict[str, list[str]] | None = None) -> dict[str, Any]:
        """The served premises' rows of `table`'s `embedding`, written as an INDEX folder (`write_index`)."""
        number = {id(c): k for k, c in enumerate(table.corpora)}
        rows = np.empty(len(self.corpus), dtype=np.int64)
        for k, corpus in enumerate(self.corpora):
            chosen = self.source_corpus == k
            rows[chosen] = table.row_of(number[id(corpus)])[self.source_index[chosen]]
        if (rows < 0).any():
            raise ValueError("a served premise has no row in the table")
        datasets = {"datasets": [str(c.source.parent) for c in self.corpora if c.source is not None]}
        return write_index(out, self.corpus, embedding[torch.from_numpy(rows).to(embedding.device)],
                           {**meta, **datasets}, names_before)
