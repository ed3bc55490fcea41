"""Turn theorems into retrieval examples: one proof state paired with the premises its tactic used."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from leanagent.data.corpus import Corpus, Pos
from leanagent.data.theorems import Tactic, Theorem, format_context


@dataclass
class TrainExample:
    index: int
    context: str
    file_path: str
    theorem_start: Pos
    pos_premise: int
    all_pos_premises: list[int]
    theorem: str = ""


@dataclass
class EvalExample:
    index: int
    context: str
    file_path: str
    theorem_start: Pos
    all_pos_premises: list[int]
    theorem: str


def located_positives(corpus: Corpus, tactic: Tactic) -> list[int]:
    """Corpus indices of a tactic's premises, in order, without repeats; unknown names are dropped."""
    found: dict[int, None] = {}
    for a in tactic.annotations or []:
        idx = corpus.locate(a.full_name, a.def_path)
        if idx is not None:
            found.setdefault(idx, None)
    return list(found)


def _labelled_tactics(corpus: Corpus, theorems: Iterable[Theorem]) -> Iterator[tuple[Theorem, str, Tactic, list[int]]]:
    for thm in theorems:
        path = corpus.resolve_path(thm.file_path)
        if path is None:
            continue  # validate.py reports it; training on the rest is still meaningful
        for tactic in thm.tactics:
            positives = located_positives(corpus, tactic)
            if positives:
                yield thm, path, tactic, positives


def build_train_examples(corpus: Corpus, theorems: Iterable[Theorem]) -> list[TrainExample]:
    examples: list[TrainExample] = []
    for thm, path, tactic, positives in _labelled_tactics(corpus, theorems):
        context = format_context(tactic)
        for pos in positives:
            examples.append(TrainExample(len(examples), context, path, thm.start, pos, list(positives), thm.full_name))
    return examples


def build_eval_examples(corpus: Corpus, theorems: Iterable[Theorem]) -> list[EvalExample]:
    return [
        EvalExample(k, format_context(tactic), path, thm.start, positives, thm.full_name)
        for k, (thm, path, tactic, positives) in enumerate(_labelled_tactics(corpus, theorems))
    ]
