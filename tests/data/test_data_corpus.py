"""Accessibility, path resolution and premise lookup on a hand-built corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import premise

from leanagent.data.corpus import Corpus
from leanagent.data.errors import DatasetError


def test_dropped_premises_take_no_index(hand_corpus: Corpus) -> None:
    assert [p.full_name for p in hand_corpus.premises] == ["a1", "a2", "b1", "b2", "c1", "c2", "c3", "x1", "y1"]
    assert len(hand_corpus) == 9
    assert hand_corpus.file_of(3) == "B.lean"
    assert hand_corpus.premises[0].text == "theorem <a>a1</a> : True"


def test_in_file_premises_end_before_the_theorem(hand_corpus: Corpus) -> None:
    assert hand_corpus.in_file_indices("C.lean") == [4, 5, 6]
    assert hand_corpus.in_file_indices("C.lean", (6, 2)) == [4, 5]  # c2 ends exactly at the start: usable
    assert hand_corpus.in_file_indices("C.lean", (6, 1)) == [4]
    assert hand_corpus.in_file_indices("C.lean", (1, 1)) == []


def test_accessible_is_in_file_prefix_plus_transitive_imports(hand_corpus: Corpus) -> None:
    assert hand_corpus.transitive_imports("C.lean") == {"A.lean", "B.lean"}
    assert hand_corpus.imported_indices("C.lean") == [0, 1, 2, 3]
    acc = hand_corpus.accessible_indices("C.lean", (6, 2))
    assert acc.dtype == np.int64
    assert acc.tolist() == [0, 1, 2, 3, 4, 5]
    assert hand_corpus.accessible_indices("C.lean", (1, 1)).tolist() == [0, 1, 2, 3]
    assert hand_corpus.accessible_indices("A.lean", (1, 1)).tolist() == []
    mask = hand_corpus.accessible_mask("B.lean", (11, 1))
    assert mask.dtype == torch.bool and mask.shape == (9,)
    assert mask.nonzero().flatten().tolist() == [0, 1, 2]


def test_import_cycles_terminate(hand_corpus: Corpus) -> None:
    assert hand_corpus.transitive_imports("X.lean") == {"Y.lean"}
    assert hand_corpus.accessible_indices("X.lean", (100, 1)).tolist() == [7, 8]
    assert hand_corpus.accessible_indices("Y.lean", (1, 1)).tolist() == [7]


def test_resolve_repo_relative_paths() -> None:
    corpus = Corpus.from_records(
        [
            {"path": ".lake/packages/mathlib/Mathlib/Foo.lean", "imports": [], "premises": []},
            {"path": "vendor/Mathlib/Foo.lean", "imports": [], "premises": []},
            {"path": "x/Bar.lean", "imports": [], "premises": []},
            {"path": "y/Bar.lean", "imports": [], "premises": []},
            {"path": "Top.lean", "imports": [], "premises": []},
        ]
    )
    assert corpus.resolve_path("Top.lean") == "Top.lean"
    assert corpus.resolve_path("Mathlib/Foo.lean") == ".lake/packages/mathlib/Mathlib/Foo.lean"
    assert corpus.resolve_path("Bar.lean") is None  # ambiguous and neither is a lake package
    assert corpus.resolve_path("Missing.lean") is None


def test_from_jsonl_names_the_bad_line(tmp_path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"path": "A.lean", "imports": [], "premises": []}\n{oops\n')
    with pytest.raises(DatasetError, match=r"corpus\.jsonl:2"):
        Corpus.from_jsonl(path)
    path.write_text('{"path": "A.lean", "imports": []}\n')
    with pytest.raises(DatasetError, match=r"corpus\.jsonl:1: missing key\(s\) premises"):
        Corpus.from_jsonl(path)


def test_closures_through_self_imports_and_long_cycles() -> None:
    records = [
        {"path": "S.lean", "imports": ["S.lean", "P.lean"], "premises": [premise("s", (1, 1), (1, 2))]},
        {"path": "P.lean", "imports": ["Q.lean"], "premises": [premise("p", (1, 1), (1, 2))]},
        {"path": "Q.lean", "imports": ["R.lean", "Missing.lean"], "premises": [premise("q", (1, 1), (1, 2))]},
        {"path": "R.lean", "imports": ["P.lean", "Leaf.lean"], "premises": [premise("r", (1, 1), (1, 2))]},
        {"path": "Leaf.lean", "imports": [], "premises": [premise("leaf", (1, 1), (1, 2))]},
    ]
    corpus = Corpus.from_records(records)
    assert corpus.transitive_imports("S.lean") == {"P.lean", "Q.lean", "R.lean", "Leaf.lean"}
    assert corpus.transitive_imports("Q.lean") == {"P.lean", "R.lean", "Leaf.lean"}
    assert corpus.transitive_imports("Leaf.lean") == set()
    assert corpus.transitive_imports("Unknown.lean") == set()
    assert corpus.imported_indices("P.lean") == [2, 3, 4]
