"""Fixtures shared by the data-layer tests: hand-built corpora, a tokenizer, synthetic datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from data_helpers import HAND_RECORDS

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
