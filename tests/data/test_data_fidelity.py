"""What the retriever is fed must be what LeanAgent feeds it: premise texts, positives, contexts, negatives.

Expected values are written out by hand from the reference's definitions (LeanDojo/ReProver's
`Premise.serialize`, `Corpus.locate_premise`, `format_state`, `RetrievalDataset.__getitem__`),
not computed by the code under test.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from leanagent.cli import main as cli_main
from leanagent.data.corpus import Corpus
from leanagent.data.examples import TrainExample, build_eval_examples, build_train_examples
from leanagent.data.negatives import sample_negatives
from leanagent.data.premise_text import serialize_premise
from leanagent.data.theorems import parse_theorem

# ---- premise text ------------------------------------------------------------------------------

GOLDEN = [
    # The whole name, tagged where it is declared.
    ("Nat.add_comm", "protected theorem Nat.add_comm (n m : ℕ) : n + m = m + n",
     "protected theorem <a>Nat.add_comm</a> (n m : ℕ) : n + m = m + n"),
    # Declared inside `namespace Nat`: the longest suffix found is tagged, with the full name.
    ("Nat.add_comm", "protected theorem add_comm (n m : ℕ) : n + m = m + n",
     "protected theorem <a>Nat.add_comm</a> (n m : ℕ) : n + m = m + n"),
    # _root_ names are replaced first; the tagged name is then not preceded by whitespace.
    ("foo", "theorem _root_.foo : True := trivial", "theorem <a>foo</a> : True := trivial"),
    # «guillemets» around the declared name are swallowed by the tag.
    ("Foo.bar", "theorem «bar» : True := trivial", "theorem <a>Foo.bar</a> : True := trivial"),
    ("Foo.«bar baz»", "def Foo.«bar baz» : Nat := 1", "def <a>Foo.«bar baz»</a> : Nat := 1"),
    # The last component also in the proof body: every occurrence after whitespace is tagged,
    # prefixes of longer identifiers included (the reference has no word boundary).
    ("Nat.succ_le", "theorem succ_le : n < m ↔ succ n ≤ m := by\n  exact succ_le_of_lt",
     "theorem <a>Nat.succ_le</a> : n < m ↔ succ n ≤ m := by\n  exact <a>Nat.succ_le</a>_of_lt"),
    # Not preceded by whitespace ([succ_le]): untouched.
    ("Nat.le", "theorem le : True := by simp [le]", "theorem <a>Nat.le</a> : True := by simp [le]"),
    # A name that does not occur (an instance): the code unchanged.
    ("Foo.instBarFoo", "instance : Bar Foo := ⟨⟩", "instance : Bar Foo := ⟨⟩"),
    # A regex metacharacter and a backslash in a name are literal.
    ("Op.«a+b\\1»", "def «a+b\\1» : Nat := 0", "def <a>Op.«a+b\\1»</a> : Nat := 0"),
]


@pytest.mark.parametrize(("name", "code", "expected"), GOLDEN)
def test_premise_text_is_leandojo_format(name: str, code: str, expected: str) -> None:
    assert serialize_premise(name, code) == expected


# ---- a small LeanDojo-format dataset on disk ---------------------------------------------------

def _premise(name: str, start: tuple[int, int], end: tuple[int, int], code: str | None = None) -> dict[str, Any]:
    return {"full_name": name, "code": code or f"theorem {name.split('.')[-1]} : True := trivial",
            "start": list(start), "end": list(end), "kind": "commonTheorem"}


CORPUS = [
    {"path": "Lib/A.lean", "imports": [], "premises": [
        _premise("A.mul_one", (3, 1), (4, 20), "@[to_additive]\ntheorem mul_one (a : M) : a * 1 = a := by\n  simp"),
        _premise("A.one_mul", (6, 1), (7, 20)),
        _premise("A.other", (9, 1), (9, 40)),
    ]},
    {"path": "Lib/B.lean", "imports": ["Lib/A.lean"], "premises": [
        _premise("B.one", (1, 1), (2, 10)),
        _premise("B.two", (4, 1), (5, 10)),
    ]},
    {"path": "Lib/C.lean", "imports": ["Lib/B.lean"], "premises": [
        _premise("C.first", (1, 1), (2, 5)),
        _premise("C.second", (4, 1), (10, 1)),   # ends exactly where `C.thm` starts
        _premise("C.thm", (10, 1), (12, 9)),
    ]},
    {"path": "Lib/Z.lean", "imports": [], "premises": [_premise("Z.z", (1, 1), (1, 9))]},
]
# Global indices: A.mul_one 0, A.one_mul 1, A.other 2, B.one 3, B.two 4, C.first 5, C.second 6, C.thm 7, Z.z 8.


def _ann(name: str, path: str, pos: tuple[int, int]) -> dict[str, Any]:
    return {"full_name": name, "def_path": path, "def_pos": list(pos), "def_end_pos": [pos[0], pos[1] + 5]}


def _tactic(state: str, annotations: list[dict[str, Any]] | None) -> dict[str, Any]:
    t = {"tactic": "simp", "state_before": state, "state_after": "no goals"}
    if annotations is not None:
        t["annotated_tactic"] = ["simp [<a>x</a>]", annotations]
    return t


THEOREM = {
    "url": "https://example.org/lib", "commit": "0" * 40, "file_path": "Lib/C.lean", "full_name": "C.thm",
    "start": [10, 1], "end": [12, 9],
    "traced_tactics": [
        # to_additive: `A.add_zero` is not in the corpus; its position is inside A.mul_one. Also one by "./" path,
        # one pointing between premises (dropped), and a repeat of the same premise.
        _tactic("2 goals\nM : Type\n⊢ a + 0 = a\n\n⊢ True ", [
            _ann("A.add_zero", "Lib/A.lean", (3, 19)), _ann("B.two", "./Lib/B.lean", (4, 9)),
            _ann("A.nothing", "Lib/A.lean", (5, 1)), _ann("A.mul_one", "Lib/A.lean", (4, 2))]),
        _tactic("⊢ True", []),                       # no positive: no training example, one eval line
        _tactic("⊢ True", None),                     # no annotated_tactic at all
        _tactic("a : Nat\n⊢ a = a", [_ann("C.second", "Lib/C.lean", (4, 3))]),
    ],
}


def _write_dataset(root: Path) -> Path:
    (root / "random").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in CORPUS))
    for split in ("train", "val", "test"):
        (root / "random" / f"{split}.json").write_text(json.dumps([THEOREM], ensure_ascii=False))
    return root


# ---- positives by position ---------------------------------------------------------------------

def test_positives_are_located_by_position_not_name() -> None:
    corpus = Corpus.from_records(CORPUS)
    thm = parse_theorem(THEOREM, "random/train.json", 0)
    train = build_train_examples(corpus, [thm])
    # Tactic 0: A.add_zero -> A.mul_one (0), B.two (4) via "./", the in-between position dropped, the repeat merged.
    # Tactic 3: C.second (6). One example per (tactic, positive).
    assert [(e.tactic_index, e.pos_premise, e.all_pos_premises) for e in train] == [
        (0, 0, [0, 4]), (0, 4, [0, 4]), (3, 6, [6])]
    assert train[0].context == "M : Type\n⊢ a + 0 = a\n\n⊢ True"  # "2 goals" dropped, then stripped
    assert train[2].context == "a : Nat\n⊢ a = a"
    scored = build_eval_examples(corpus, [thm])
    every = build_eval_examples(corpus, [thm], unlabelled=True)
    assert [e.tactic_index for e in scored] == [0, 3]
    assert [(e.tactic_index, e.all_pos_premises) for e in every] == [(0, [0, 4]), (1, []), (2, []), (3, [6])]


def test_overlapping_premises_first_in_corpus_order_wins() -> None:
    corpus = Corpus.from_records([{"path": "S.lean", "imports": [], "premises": [
        _premise("S.struct", (1, 1), (9, 1)), _premise("S.struct.field", (2, 3), (2, 20))]}])
    assert corpus.locate_at("S.lean", (2, 5)) == 0
    assert corpus.locate_at("S.lean", (9, 1)) == 0  # both ends inclusive
    assert corpus.locate_at("S.lean", (9, 2)) is None
    assert corpus.locate_at("Missing.lean", (1, 1)) is None


# ---- composition of the negatives --------------------------------------------------------------

def _drawn(corpus: Corpus, start: tuple[int, int], pos: int, positives: list[int], k: int = 3, k_in: int = 1,
           trials: int = 300) -> tuple[set[int], set[int]]:
    """(every in-file slot value seen, every other slot value seen) over many seeds."""
    ex = TrainExample(0, "⊢ p", "Lib/C.lean", start, pos, positives, "C.thm")
    first, rest = set(), set()
    for seed in range(trials):
        negs = sample_negatives(corpus, ex, k, k_in, random.Random(seed))
        assert len(negs) == k == len(set(negs)) and not set(negs) & set(positives)
        first.update(negs[:k_in])
        rest.update(negs[k_in:])
    return first, rest


def test_in_file_negatives_come_from_the_positive_premises_file() -> None:
    corpus = Corpus.from_records(CORPUS)
    # Positive A.one_mul (1) in an imported file: in-file = A's other premises; the rest = C before the
    # theorem (strictly: C.second ends at the theorem's start, so it is out) and B.
    first, rest = _drawn(corpus, (10, 1), 1, [1])
    assert first == {0, 2}
    assert rest == {5, 3, 4}


def test_in_file_negatives_from_the_theorems_own_file_end_strictly_before_it() -> None:
    corpus = Corpus.from_records(CORPUS)
    # Positive C.first (5) in the theorem's own file; C.second ends exactly at (10, 1): not a negative.
    first, rest = _drawn(corpus, (10, 1), 5, [5], k=3, k_in=1)
    assert first == {0, 1, 2, 3, 4}  # nothing else in C before the theorem: the in-file pool is empty
    assert rest == {0, 1, 2, 3, 4}
    # A theorem further down: C.second and C.thm now end strictly before it.
    first, rest = _drawn(corpus, (20, 1), 5, [5])
    assert first == {6, 7}
    assert rest == {0, 1, 2, 3, 4}


def test_other_positives_are_not_negatives_and_an_inaccessible_positive_has_no_in_file_pool() -> None:
    corpus = Corpus.from_records(CORPUS)
    first, rest = _drawn(corpus, (10, 1), 0, [0, 4])
    assert first == {1, 2} and rest == {3, 5}
    # Z.z (8) is not imported by C: no in-file pool, so every slot draws from what C can see.
    first, rest = _drawn(corpus, (10, 1), 8, [8])
    assert first == rest == {0, 1, 2, 3, 4, 5}


# ---- `leanagent examples` ----------------------------------------------------------------------

def _run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as stop:
        cli_main(list(argv))
    return int(stop.value.code or 0)


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_examples_command_writes_what_the_retriever_is_fed(tmp_path: Path) -> None:
    dataset = _write_dataset(tmp_path / "lib")
    out = tmp_path / "examples"
    assert _run_cli("examples", str(dataset), "--out", str(out), "--seed", "11") == 0
    train, val, test = (_read(out / f"{s}.jsonl") for s in ("train", "val", "test"))
    mul_one = {"full_name": "A.mul_one", "path": "Lib/A.lean", "start": [3, 1],
               "text": "@[to_additive]\ntheorem <a>A.mul_one</a> (a : M) : a * 1 = a := by\n  simp"}
    two = {"full_name": "B.two", "path": "Lib/B.lean", "start": [4, 1],
           "text": "theorem <a>B.two</a> : True := trivial"}
    assert [(t["tactic_index"], t["positive"]["full_name"]) for t in train] == [
        (0, "A.mul_one"), (0, "B.two"), (3, "C.second")]
    first = train[0]
    assert (first["theorem"], first["file_path"], first["theorem_start"]) == ("C.thm", "Lib/C.lean", [10, 1])
    assert first["context"] == "M : Type\n⊢ a + 0 = a\n\n⊢ True"
    assert first["positive"] == mul_one and first["positives"] == [mul_one, two]
    assert len(first["negatives"]) == 3
    assert first["negatives"][0]["path"] == "Lib/A.lean"  # in-file: from the positive's file
    assert {n["full_name"] for n in first["negatives"]}.isdisjoint({"A.mul_one", "B.two"})
    # Evaluation files: one line per tactic, with or without positives, no negatives.
    assert val == test
    assert [(t["tactic_index"], len(t["positives"])) for t in val] == [(0, 2), (1, 0), (2, 0), (3, 1)]
    assert "negatives" not in val[0] and "positive" not in val[0]
    # The same seed writes the same files; a different one other negatives; a used folder is refused.
    again = tmp_path / "again"
    assert _run_cli("examples", str(dataset), "--out", str(again), "--seed", "11") == 0
    assert (again / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()
    assert _run_cli("examples", str(dataset), "--out", str(out)) == 1
