"""The demo generator: valid, deterministic, learnable-looking and with the edge cases it promises."""

from __future__ import annotations

import filecmp
from pathlib import Path

from leanagent.data.corpus import Corpus
from leanagent.data.curriculum import build_curriculum, load_repo_theorems
from leanagent.data.dataset import build_eval_examples, build_train_examples
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import load_split
from leanagent.data.validate import validate_dataset


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_repos_validate_clean_and_are_deterministic(tmp_path: Path) -> None:
    first = write_demo_repos(tmp_path / "a", 3, seed=11)
    write_demo_repos(tmp_path / "b", 3, seed=11)
    other = write_demo_repos(tmp_path / "c", 3, seed=12)
    assert [d.name for d in first] == ["repo_0", "repo_1", "repo_2"]
    for d in first:
        assert validate_dataset(d) == []
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    for rel in _files(tmp_path / "a"):
        assert filecmp.cmp(tmp_path / "a" / rel, tmp_path / "b" / rel, shallow=False), rel
    assert (first[0] / "corpus.jsonl").read_text() != (other[0] / "corpus.jsonl").read_text()


def test_shapes_and_edge_cases(tmp_path: Path) -> None:
    dirs = write_demo_repos(tmp_path, 3, seed=0, theorems_per_repo=40)
    for d in dirs:
        corpus = Corpus.from_jsonl(d / "corpus.jsonl")
        assert 30 <= len(corpus) <= 60
        assert all(corpus.transitive_imports(p) >= {".lake/packages/core/Core/Basic.lean"} for p in corpus.paths[1:])
        theorems = load_repo_theorems(d)
        assert len(theorems) == 40
        assert len(load_split(d / "random" / "train.json")) == 28
        states = [t.state_before for th in theorems for t in th.tactics]
        assert any(s.startswith("2 goals\n") for s in states)
        assert max(len(s) for s in states) < 200
        assert any(not th.tactics for th in theorems)
        train = build_train_examples(corpus, load_split(d / "random" / "train.json"))
        evals = build_eval_examples(corpus, theorems)
        assert train and evals
        # Every positive is accessible, and some theorem sees no premise of its own file.
        for ex in evals:
            assert set(ex.all_pos_premises) <= set(corpus.accessible_indices(ex.file_path, ex.theorem_start).tolist())
        assert any(not corpus.in_file_indices(ex.file_path, ex.theorem_start) for ex in evals)
        # States share the lemma's symbols: the lemma's left-hand side appears in the proof state.
        for ex in evals[:20]:
            lemma = corpus.premises[ex.all_pos_premises[0]]
            head = lemma.code.split("\n")[1].strip().split(" ")[0]
            assert head in ex.context


def test_curriculum_is_not_trivial(tmp_path: Path) -> None:
    dirs = write_demo_repos(tmp_path, 4, seed=0)
    counts = build_curriculum({d.name: load_repo_theorems(d) for d in dirs}).counts
    assert len({c.easy for c in counts.values()}) > 1
