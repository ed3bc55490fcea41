"""The Lightning data module end to end on a synthetic dataset (CPU, no workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.data.errors import DatasetError
from leanagent.ground.config import DataConfig


def make(demo_dir: Path, tokenizer, **overrides) -> RetrievalDataModule:
    cfg = DataConfig(batch_size=4, eval_batch_size=8, num_negatives=3, num_in_file_negatives=1, num_workers=0)
    cfg = cfg.model_copy(update=overrides)
    return RetrievalDataModule(demo_dir, tokenizer, cfg, premise_max_len=256, seed=3)


def test_loaders(demo_dir: Path, tokenizer) -> None:
    dm = make(demo_dir, tokenizer)
    assert len(dm.train_theorems) == 28 and dm.train_examples and dm.val_examples
    batch = next(iter(dm.train_dataloader()))
    assert batch["context_ids"].shape[0] == 4
    assert batch["premise_ids"].shape[0] == 4 * 4
    assert batch["label"].shape == (4, 16)
    assert batch["label"][:, :4].diagonal().eq(1).all()
    val = next(iter(dm.val_dataloader()))
    assert val["accessible_mask"].shape[1] == len(dm.corpus)
    for row, positives in zip(val["accessible_mask"], val["pos_premises"], strict=True):
        assert row[positives].all()
    fisher = dm.fisher_dataset()
    assert fisher.deterministic and fisher[0]["negatives"] == dm.fisher_dataset()[0]["negatives"]


def test_missing_val_and_test_are_empty(demo_dir: Path, tokenizer) -> None:
    (demo_dir / "random" / "val.json").unlink()
    (demo_dir / "random" / "test.json").unlink()
    dm = make(demo_dir, tokenizer)
    assert dm.val_theorems == [] and dm.test_examples == []
    assert len(dm.val_dataloader().dataset) == 0


def test_empty_train_names_the_file(demo_dir: Path, tokenizer) -> None:
    (demo_dir / "random" / "train.json").write_text(json.dumps([]))
    with pytest.raises(DatasetError, match=r"repo_0/random/train\.json"):
        make(demo_dir, tokenizer)
