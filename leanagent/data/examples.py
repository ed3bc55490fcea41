"""Turn theorems into retrieval examples exactly as LeanAgent does.

A context is the state before a tactic (``format_context``). Its positives are the premises its
annotations point at, located by position (`Corpus.locate_at`), not by name. Training has one
example per (tactic, positive); tactics without a positive give none. Evaluation has one example
per tactic, with or without positives: those without are carried (users inspect them with
`leanagent examples`) but not scored, as in the reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from leanagent.data.corpus import Corpus
from leanagent.data.records import Pos
from leanagent.data.theorems import Tactic, Theorem, format_context


@dataclass
class TrainExample:
    index: int
    context: str
    file_path: str  # the corpus path of the theorem's file (where accessibility is looked up)
    theorem_start: Pos
    pos_premise: int
    all_pos_premises: list[int]
    theorem: str = ""
    tactic_index: int = 0
    theorem_file: str = ""  # the theorem's file_path as its split file gives it


@dataclass
class EvalExample:
    index: int
    context: str
    file_path: str
    theorem_start: Pos
    all_pos_premises: list[int]
    theorem: str
    tactic_index: int = 0
    theorem_file: str = ""


def located_positives(corpus: Corpus, tactic: Tactic) -> list[int]:
    """Corpus indices of a tactic's premises in annotation order, without repeats.

    An annotation whose position falls in no premise of its file (or whose file is not in the
    corpus) is dropped, as the reference drops it.
    """
    found: dict[int, None] = {}
    for a in tactic.annotations or []:
        idx = corpus.locate_at(a.def_path, a.def_pos)
        if idx is not None:
            found.setdefault(idx, None)
    return list(found)


def _tactics(corpus: Corpus, theorems: Iterable[Theorem]) -> Iterator[tuple[Theorem, str, int, Tactic, list[int]]]:
    for thm in theorems:
        path = corpus.resolve_path(thm.file_path)
        if path is None:
            continue  # validate.py reports it; training on the rest is still meaningful
        for k, tactic in enumerate(thm.tactics):
            yield thm, path, k, tactic, located_positives(corpus, tactic)


def build_train_examples(corpus: Corpus, theorems: Iterable[Theorem]) -> list[TrainExample]:
    examples: list[TrainExample] = []
    for thm, path, k, tactic, positives in _tactics(corpus, theorems):
        context = format_context(tactic)
        for pos in positives:
            examples.append(TrainExample(len(examples), context, path, thm.start, pos, list(positives),
                                         thm.full_name, k, thm.file_path))
    return examples


def build_eval_examples(corpus: Corpus, theorems: Iterable[Theorem], unlabelled: bool = False) -> list[EvalExample]:
    """The scored contexts (those with a positive); with `unlabelled`, every tactic, as the reference lists them."""
    examples: list[EvalExample] = []
    for thm, path, k, tactic, positives in _tactics(corpus, theorems):
        if positives or unlabelled:
            examples.append(EvalExample(len(examples), format_context(tactic), path, thm.start, positives,
                                        thm.full_name, k, thm.file_path))
    return examples
