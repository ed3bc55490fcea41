"""Negative sampling at the edges where the reference implementation raised ValueError."""

from __future__ import annotations

import random

import pytest

from leanagent.data.corpus import Corpus
from leanagent.data.dataset import TrainDataset, TrainExample, sample_negatives
from leanagent.data.errors import DatasetError


def example(path: str, start: tuple[int, int], positives: list[int], name: str = "T.thm") -> TrainExample:
    return TrainExample(0, "⊢ True", path, start, positives[0], positives, name)


def check(negatives: list[int], count: int, positives: list[int]) -> None:
    assert len(negatives) == count
    assert not set(negatives) & set(positives)


def test_first_file_without_in_file_or_imported_premises(hand_corpus: Corpus) -> None:
    # A theorem at the top of A.lean sees nothing at all; negatives come from the rest of the corpus.
    negs = sample_negatives(hand_corpus, example("A.lean", (1, 1), [0]), 3, 1, random.Random(0))
    check(negs, 3, [0])
    assert len(set(negs)) == 3


def test_in_file_negatives_come_first(hand_corpus: Corpus) -> None:
    negs = sample_negatives(hand_corpus, example("C.lean", (21, 1), [6]), 2, 2, random.Random(0))
    assert sorted(negs) == [4, 5]


def test_fewer_accessible_than_requested_fills_from_the_corpus(hand_corpus: Corpus) -> None:
    negs = sample_negatives(hand_corpus, example("C.lean", (6, 2), [4]), 7, 1, random.Random(1))
    check(negs, 7, [4])
    assert len(set(negs)) == 7
    assert {0, 1, 2, 3, 5} <= set(negs)  # every accessible non-positive is used before any other premise


def test_more_than_the_corpus_repeats_non_positives(hand_corpus: Corpus) -> None:
    negs = sample_negatives(hand_corpus, example("C.lean", (6, 2), [4, 5]), 20, 1, random.Random(2))
    check(negs, 20, [4, 5])
    assert set(negs) == {0, 1, 2, 3, 6, 7, 8}


def test_zero_negatives() -> None:
    corpus = Corpus.from_records([{"path": "A.lean", "imports": [], "premises": []}])
    assert sample_negatives(corpus, example("A.lean", (1, 1), [0]), 0, 0, random.Random(0)) == []


def test_corpus_of_positives_only_names_the_theorem() -> None:
    corpus = Corpus.from_records(
        [
            {
                "path": "A.lean",
                "imports": [],
                "premises": [{"full_name": "p", "code": "c", "start": [1, 1], "end": [1, 2]}],
            }
        ]
    )
    with pytest.raises(DatasetError, match="Only.positives"):
        sample_negatives(corpus, example("A.lean", (5, 1), [0], "Only.positives"), 1, 0, random.Random(0))


def test_large_import_pool_uses_rejection_sampling() -> None:
    big = [{"full_name": f"p{i}", "code": "c", "start": [i + 1, 1], "end": [i + 1, 5]} for i in range(6000)]
    corpus = Corpus.from_records(
        [
            {"path": "Big.lean", "imports": [], "premises": big},
            {"path": "T.lean", "imports": ["Big.lean"], "premises": []},
        ]
    )
    positives = list(range(0, 6000, 7))
    negs = sample_negatives(corpus, example("T.lean", (1, 1), positives), 50, 3, random.Random(3))
    check(negs, 50, positives)
    assert len(set(negs)) == 50


def test_deterministic_dataset_gives_the_same_negatives(hand_corpus: Corpus, tokenizer) -> None:
    examples = [example("C.lean", (21, 1), [6]), example("B.lean", (20, 1), [3])]
    examples[1].index = 1

    def make(deterministic: bool, seed: int = 5) -> TrainDataset:
        return TrainDataset(hand_corpus, examples, tokenizer, 4, 1, 64, 64, seed=seed, deterministic=deterministic)

    first, second = make(True), make(True)
    for i in range(2):
        assert first[i]["negatives"] == second[i]["negatives"] == first[i]["negatives"]
        check(first[i]["negatives"], 4, examples[i].all_pos_premises)
    stochastic = make(False)
    for _ in range(5):
        check(stochastic[0]["negatives"], 4, [6])
