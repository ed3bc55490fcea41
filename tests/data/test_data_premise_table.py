"""What a job embeds: each distinct premise once over several corpora (`PremiseTable`), and only those some
context may use (`Corpus.accessible_union`); and repositories that carry one shared dependency to show it on."""

from __future__ import annotations

import copy
import filecmp
import json
from pathlib import Path

import numpy as np
import pytest
from data_helpers import HAND_RECORDS
from transformers import ByT5Tokenizer

from leanagent.cli import main as cli_main
from leanagent.data.corpus import Corpus
from leanagent.data.dataset import build_eval_examples, build_train_examples, tokenize_premises
from leanagent.data.premise_table import PremiseTable
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.synthetic_scale import ScaleSpec
from leanagent.data.theorems import load_split
from leanagent.data.tokenize import tokenize
from leanagent.data.validate import validate_dataset

DEPENDENCY = ScaleSpec(files=20, premises=300)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_demo_repos(tmp_path_factory.mktemp("shared") / "data", 3, seed=2, dependency=DEPENDENCY)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_every_repository_carries_the_dependency_byte_for_byte(shared: list[Path], tmp_path: Path) -> None:
    dependency = [[line for line in _lines(d / "corpus.jsonl") if '"path": ".lake/packages/mathlib/' in line]
                  for d in shared]
    assert len(dependency[0]) == DEPENDENCY.files
    assert dependency[0] == dependency[1] == dependency[2]
    assert sum(len(json.loads(line)["premises"]) for line in dependency[0]) == DEPENDENCY.premises
    for d in shared:
        assert validate_dataset(d) == []
    again = write_demo_repos(tmp_path / "again", 3, seed=2, dependency=DEPENDENCY)
    for a, b in zip(shared, again, strict=True):
        for name in ("corpus.jsonl", "random/train.json", "random/test.json"):
            assert filecmp.cmp(a / name, b / name, shallow=False), name


def test_repositories_import_parts_of_it_and_their_tactics_use_it(shared: list[Path]) -> None:
    seen = []
    for d in shared:
        corpus = Corpus.from_jsonl(d / "corpus.jsonl")
        dependency = {p for p in corpus.paths if p.startswith(".lake/packages/mathlib/")}
        own = [p for p in corpus.paths if not p.startswith(".lake/")]
        imported = corpus.transitive_imports(own[0]) & dependency
        assert 0 < len(imported) < len(dependency)  # a part of it
        assert all(corpus.transitive_imports(p) >= imported for p in own)  # every own file sees it
        seen.append(imported)
        theorems = load_split(d / "random" / "train.json")
        assert all(not t.file_path.startswith(".lake/") for t in theorems)  # its theorems are its own
        positives = {corpus.premises[e.pos_premise].path for e in build_train_examples(corpus, theorems)}
        assert positives & dependency and positives - dependency  # the dependency's premises and its own
    assert seen[0] != seen[1]  # each repository its own part


def test_a_premise_is_one_row_by_path_name_and_code() -> None:
    first = Corpus.from_records(HAND_RECORDS)
    records = copy.deepcopy(HAND_RECORDS)
    records[0]["premises"][1]["code"] = "theorem a2 : False"  # another version of A.lean's second premise
    records[2]["premises"].append(dict(records[2]["premises"][0]))  # a premise repeated in one corpus
    second = Corpus.from_records(records)
    table = PremiseTable([first, second])
    assert table.corpus_premises == len(first) + len(second)
    assert len(table) == len(first) + 2  # the edited premise and the repeat are rows of their own
    a, b = table.row_of(0), table.row_of(1)
    assert np.array_equal(a, np.arange(len(first)))
    assert b[0] == a[0] and b[1] != a[1]  # a1 shared; a2's two versions stay two
    c1, again = [i for i, p in enumerate(second.premises) if p.full_name == "c1"]
    assert b[c1] == a[c1] and b[again] not in a  # the repeat is a row of its own, not merged into c1's
    assert len(set(b.tolist())) == len(second)
    for k, corpus in enumerate((first, second)):
        inverse = table.corpus_index(k)
        held = inverse >= 0
        assert np.array_equal(table.row_of(k)[inverse[held]], np.flatnonzero(held))
        # A row reads the bytes of the corpus premise it stands for.
        rows = table.row_of(k)
        assert table.premise_utf8(rows.tolist()) == corpus.premise_utf8(range(len(corpus)))
        assert table.premise_texts(rows.tolist()) == [p.text for p in corpus.premises]


def test_only_wanted_premises_get_rows_and_the_rest_comes_once(shared: list[Path]) -> None:
    corpora = [Corpus.from_jsonl(d / "corpus.jsonl") for d in shared]
    wanted = []
    for d, corpus in zip(shared, corpora, strict=True):
        evals = build_eval_examples(corpus, load_split(d / "random" / "test.json"))
        wanted.append(corpus.accessible_union((e.file_path, e.theorem_start) for e in evals))
    table = PremiseTable(corpora, wanted)
    for k in range(len(corpora)):
        assert np.array_equal(table.row_of(k) >= 0, wanted[k])
    distinct = {(p.path, p.full_name, p.code) for c in corpora for p in c.premises}
    assert len(table) < len(distinct) < table.corpus_premises
    rest = table.add_rest()
    assert rest.start == table.first_rest and len(table) == len(distinct)  # each distinct premise once in all
    assert all((table.row_of(k) >= 0).all() for k in range(len(corpora)))
    rows = table.row_of(2)[:5].tolist()
    assert table.premise_utf8(rows) == corpora[2].premise_utf8(range(5))


def test_the_accessible_union_is_every_context_mask_together(shared: list[Path]) -> None:
    corpus = Corpus.from_jsonl(shared[1] / "corpus.jsonl")
    evals = build_eval_examples(corpus, load_split(shared[1] / "random" / "val.json"))
    union = corpus.accessible_union((e.file_path, e.theorem_start) for e in evals)
    by_hand = np.zeros(len(corpus), dtype=bool)
    for e in evals:
        by_hand |= corpus.accessible_mask(e.file_path, e.theorem_start).numpy()
    assert np.array_equal(union, by_hand) and 0 < union.sum() < len(corpus)
    assert not corpus.accessible_union([]).any()


def test_the_cli_writes_repositories_with_a_shared_dependency(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["demo-data", str(tmp_path / "out"), "--repos", "2", "--shared-dependency", "small",
                  "--files", "15", "--premises", "200"])
    assert done.value.code in (0, None)
    lines = [_lines(tmp_path / "out" / f"repo_{i}" / "corpus.jsonl") for i in (0, 1)]
    dep = [[x for x in ls if ".lake/packages/mathlib/" in x.split('"imports"')[0]] for ls in lines]
    assert len(dep[0]) == 15 and dep[0] == dep[1]
    with pytest.raises(SystemExit) as refused:
        cli_main(["demo-data", str(tmp_path / "other"), "--shared-dependency", "small", "--mathlib-scale"])
    assert refused.value.code == 1 and "do not go together" in capsys.readouterr().err


@pytest.mark.parametrize("tokenizer", [ByT5Tokenizer(), "plain"])
def test_tokenizing_a_row_is_tokenizing_its_premise(tokenizer) -> None:
    """ByT5's bytes through the fast path, and a tokenizer that takes strings (any HF model) through the texts."""
    tokenizer = ByT5Tokenizer(extra_ids=0) if tokenizer == "plain" else tokenizer
    corpus = Corpus.from_records(HAND_RECORDS)
    table = PremiseTable([Corpus.from_records(HAND_RECORDS[:1]), corpus])
    rows = table.row_of(1).tolist()
    want = tokenize(tokenizer, [p.text for p in corpus.premises], 32)
    got = tokenize_premises(tokenizer, table, rows, 32)
    assert all(np.array_equal(w.numpy(), g.numpy()) for w, g in zip(want, got, strict=True))
