"""Fixtures shared by the data-layer tests: hand-built corpora, a tokenizer, synthetic datasets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from data_helpers import CORE, HAND_RECORDS, load_json

from leanagent.data.corpus import Corpus


@pytest.fixture
def hand_corpus() -> Corpus:
    return Corpus.from_records(HAND_RECORDS)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


@pytest.fixture
def demo_dir(tmp_path: Path) -> Path:
    """A fresh, valid one-repository synthetic dataset that a test may corrupt."""
    from leanagent.data.synthetic import write_demo_repos

    return write_demo_repos(tmp_path / "demo", 1, seed=7)[0]


@pytest.fixture()
def repos(tmp_path: Path) -> list[Path]:
    """Three synthetic repositories edited so that LeanAgent's merge rules have something to decide (`merge_all`,
    `replay`): a theorem repeated by a later repository, and a shared corpus path whose later copy differs."""
    from leanagent.data.synthetic import write_demo_repos

    repos = write_demo_repos(tmp_path / "data", 3)
    # A theorem of the shared core file is in repo_0's validation split and, with one tactic fewer, in repo_1's
    # training split.
    val = load_json(repos[0] / "random" / "val.json")
    theorem = val[0] = {**val[0], "file_path": CORE, "traced_tactics": [
        {**t, "annotated_tactic": [t["annotated_tactic"][0], [a for a in t["annotated_tactic"][1]
                                                              if a["def_path"] == CORE]]}
        for t in val[0]["traced_tactics"]]}
    (repos[0] / "random" / "val.json").write_text(json.dumps(val))
    repeated = {**theorem, "traced_tactics": theorem["traced_tactics"][:1]}
    train = load_json(repos[1] / "random" / "train.json")
    (repos[1] / "random" / "train.json").write_text(json.dumps([repeated, *train]))
    # repo_2's copy of the shared core file differs (another version of a dependency).
    lines = (repos[2] / "corpus.jsonl").read_text().splitlines()
    core = json.loads(lines[0])
    assert core["path"] == CORE
    core["premises"][0]["code"] += "  -- a later version"
    (repos[2] / "corpus.jsonl").write_text("\n".join([json.dumps(core), *lines[1:]]) + "\n")
    return repos
