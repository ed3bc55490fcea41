"""The mathlib-scale generator: deterministic, the sizes asked for, valid, deep imports, long-tailed premises."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from leanagent.cli import main as cli_main
from leanagent.data.corpus import Corpus
from leanagent.data.examples import build_train_examples, located_positives
from leanagent.data.synthetic_scale import MATHLIB_SCALE, ScaleSpec, plan_imports, write_scale_dataset
from leanagent.data.theorems import load_split
from leanagent.data.validate import validate_dataset

SMALL = ScaleSpec(files=120, premises=3000, theorems=200, seed=3)


def _run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as stop:
        cli_main(list(argv))
    return int(stop.value.code or 0)


def _depth_of(corpus: Corpus) -> int:
    """Files on the longest import chain, by walking the corpus's own import lists."""
    memo: dict[str, int] = {}
    for path in corpus.paths:  # imports point to earlier files of the topological order, not of the corpus
        stack = [path]
        while stack:
            p = stack[-1]
            todo = [i for i in corpus.imports[p] if i not in memo]
            if todo:
                stack.extend(todo)
                continue
            memo[p] = 1 + max((memo[i] for i in corpus.imports[p]), default=0)
            stack.pop()
    return max(memo.values())


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scale_dataset(tmp_path_factory.mktemp("scale") / "ds", SMALL)



def import_depth(imports: list[list[int]]) -> int:
    """Files on the longest import chain (topological numbers, as `plan_imports` gives them)."""
    depth = [0] * len(imports)
    for t, imps in enumerate(imports):
        depth[t] = 1 + max((depth[j] for j in imps), default=0)
    return max(depth, default=0)

def test_deterministic_per_seed(small: Path, tmp_path: Path) -> None:
    again = write_scale_dataset(tmp_path / "again", SMALL)
    other = write_scale_dataset(tmp_path / "other", ScaleSpec(files=120, premises=3000, theorems=200, seed=4))
    for name in ("corpus.jsonl", "random/train.json", "random/val.json", "random/test.json"):
        assert (small / name).read_bytes() == (again / name).read_bytes(), name
    assert (small / "corpus.jsonl").read_bytes() != (other / "corpus.jsonl").read_bytes()


def test_sizes_validity_and_shape(small: Path) -> None:
    assert validate_dataset(small) == []
    corpus = Corpus.from_jsonl(small / "corpus.jsonl")
    assert len(corpus.paths) == SMALL.files and len(corpus) == SMALL.premises
    splits = {s: json.loads((small / "random" / f"{s}.json").read_text()) for s in ("train", "val", "test")}
    assert sum(len(v) for v in splits.values()) == SMALL.theorems and all(splits.values())
    # Corpus order is not the import order: some file imports one listed after it.
    position = {p: k for k, p in enumerate(corpus.paths)}
    assert any(position[i] > position[p] for p in corpus.paths for i in corpus.imports[p])
    assert any(p.startswith(".lake/packages/") for p in corpus.paths)
    # Long-tailed code, every premise declaring its own name (so its text is tagged).
    lengths = np.array([len(p.code.encode()) for p in corpus.premises])
    assert np.median(lengths) < 400 and lengths.max() > 2000
    assert all(f"<a>{p.full_name}</a>" in p.text for p in corpus.premises)
    assert any(not p.code.isascii() for p in corpus.premises)
    # Every annotation finds its premise by position, and every positive is accessible to its theorem.
    theorems = load_split(small / "random" / "train.json")
    annotated = [t for th in theorems for t in th.tactics if t.annotations]
    assert annotated
    for tactic in annotated:
        assert len(located_positives(corpus, tactic)) == len({(a.def_path, a.def_pos) for a in tactic.annotations})
    examples = build_train_examples(corpus, theorems)
    assert len(examples) > SMALL.theorems
    for ex in examples[:300]:
        accessible = set(corpus.accessible_indices(ex.file_path, ex.theorem_start).tolist())
        assert ex.pos_premise in accessible
        assert corpus.premises[ex.pos_premise].end < ex.theorem_start or corpus.file_of(ex.pos_premise) != ex.file_path


def test_import_chains_are_deep(small: Path) -> None:
    corpus = Corpus.from_jsonl(small / "corpus.jsonl")
    assert _depth_of(corpus) >= SMALL.files // 5
    assert import_depth(plan_imports(MATHLIB_SCALE.files, 0)) >= 200  # mathlib scale: hundreds deep
    closure = np.mean([len(corpus.transitive_imports(p)) for p in corpus.paths])
    assert closure > SMALL.files / 4  # most files see a large part of the corpus


def test_cli_writes_one_dataset(tmp_path: Path) -> None:
    out = tmp_path / "big"
    assert _run_cli("demo-data", str(out), "--files", "40", "--premises", "600", "--theorems", "60",
                    "--seed", "2") == 0
    assert sorted(p.name for p in out.iterdir()) == ["corpus.jsonl", "random"]
    assert _run_cli("validate", str(out)) == 0
    assert _run_cli("demo-data", str(tmp_path / "bad"), "--mathlib-scale", "--repos", "2") == 1
    assert _run_cli("demo-data", str(tmp_path / "bad"), "--files", "10", "--premises", "5") == 1
    assert _run_cli("demo-data", str(out), "--files", "40", "--premises", "600") == 1  # not empty


def test_hinted_states_show_their_premises_words_at_the_lengths_asked(tmp_path: Path) -> None:
    """`hinted` puts the first words of each used premise's statement, together, into the state, and
    `state_lengths` sizes the state (here one length, so each state's size is known), `eval_share` the val and
    test splits; the dataset stays valid."""
    spec = ScaleSpec(files=60, premises=900, theorems=60, seed=5, hinted=True, state_lengths=(300,), eval_share=0.2)
    out = write_scale_dataset(tmp_path / "ds", spec)
    assert validate_dataset(out) == []
    assert [len(load_split(out / "random" / f"{s}.json")) for s in ("train", "val", "test")] == [36, 12, 12]
    code = {}
    for line in (out / "corpus.jsonl").read_text().splitlines():
        record = json.loads(line)
        for p in record["premises"]:
            for line_no in range(p["start"][0], p["end"][0] + 1):  # an annotation points inside the span
                code[(record["path"], line_no)] = p["code"]
    hinted = 0
    for theorem in json.loads((out / "random" / "train.json").read_text()):
        for tactic in theorem["traced_tactics"]:
            state = tactic["state_before"]
            assert 300 <= len(state.encode()) <= 360, state
            words = state.split()
            for a in tactic["annotated_tactic"][1]:
                lines = code[(a["def_path"], a["def_pos"][0])].split("\n")
                statement = lines[2:] if lines[0].startswith("@[") else lines[1:]  # after attribute and header
                hint = " ".join(statement).split()[:4]
                assert any(words[i:i + len(hint)] == hint for i in range(len(words))), (hint, state)
                hinted += 1
    assert hinted > 50
    plain = write_scale_dataset(tmp_path / "plain", ScaleSpec(files=60, premises=900, theorems=60, seed=5))
    assert (plain / "corpus.jsonl").read_bytes() == (out / "corpus.jsonl").read_bytes()
