"""Negatives as a pure function of (seed, example, epoch), and the training loader resuming mid-epoch."""

from __future__ import annotations

import io
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from leanagent.data.datamodule import RetrievalDataModule, next_training_epoch
from leanagent.data.dataset import example_seed, sample_negatives
from leanagent.ground.config import DataConfig


def make(demo_dir: Path, tokenizer, seed: int = 3, **overrides) -> RetrievalDataModule:
    cfg = DataConfig(batch_size=4, eval_batch_size=8, num_negatives=3, num_in_file_negatives=1, num_workers=0)
    return RetrievalDataModule(demo_dir, tokenizer, cfg.model_copy(update=overrides), premise_max_len=256, seed=seed)


def negatives(ds, epoch: int, order=None) -> list[list[int]]:
    ds.set_epoch(epoch)
    order = range(len(ds)) if order is None else order
    got = {i: ds[i]["negatives"] for i in order}
    return [got[i] for i in range(len(ds))]


def test_negatives_are_a_function_of_seed_example_and_epoch(demo_dir: Path, tokenizer) -> None:
    first, rerun = make(demo_dir, tokenizer).train_dataset(), make(demo_dir, tokenizer).train_dataset()
    for epoch in (0, 1, 5):
        # The same in a rerun (another process, another rank or worker) and whatever the access order.
        assert negatives(first, epoch) == negatives(rerun, epoch, order=reversed(range(len(rerun))))
        assert negatives(first, epoch) == negatives(first, epoch)  # no hidden stream advances between calls
    # Different across epochs (re-drawn each epoch, as LeanAgent's loader does) and across seeds.
    e0, e1 = negatives(first, 0), negatives(first, 1)
    changed = sum(a != b for a, b in zip(e0, e1, strict=True))
    assert changed > len(e0) // 2
    other_seed = make(demo_dir, tokenizer, seed=4).train_dataset()
    assert negatives(other_seed, 0) != e0


def test_deterministic_mode_is_unchanged_and_ignores_the_epoch(demo_dir: Path, tokenizer) -> None:
    dm = make(demo_dir, tokenizer)
    fixed = dm.fisher_dataset()
    expected = [sample_negatives(dm.corpus, ex, 3, 1, random.Random(example_seed(3, ex.index)))
                for ex in dm.train_examples]
    assert negatives(fixed, 0) == negatives(fixed, 7) == expected


def batches(loader, skip: int = 0) -> list[tuple[list[int], list[int]]]:
    """(example indices, premise slots: positives then negatives) of each batch."""
    out = []
    for batch in loader:
        out.append((batch["index"].tolist(), batch["premise_index"].tolist()))
    return out[skip:]


def attach(dm: RetrievalDataModule, world_size: int, rank: int, epoch: int) -> RetrievalDataModule:
    """A trainer at the start of `epoch`, as far as the loader asks (a real one's loop state, below)."""
    loop = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False).fit_loop
    loop.epoch_progress.current.started = loop.epoch_progress.current.processed = epoch
    dm.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, current_epoch=epoch, fit_loop=loop)
    return dm


@pytest.mark.parametrize("started, processed, last_batch, expected", [
    (0, 0, False, 0),  # a fresh trainer
    (2, 1, False, 1),  # restored from a step checkpoint in epoch 1: it goes on with epoch 1
    (2, 1, True, 2),  # restored from epoch 1's checkpoint (validation's, after its last batch): epoch 2 comes next
    (2, 2, True, 2),  # restored from a checkpoint written once epoch 1 was processed
])
def test_the_loader_is_built_for_the_epoch_of_the_next_batch(started, processed, last_batch, expected) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    progress = trainer.fit_loop.epoch_progress.current
    progress.ready, progress.started, progress.processed, progress.completed = started, started, processed, processed
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = last_batch
    assert trainer.current_epoch == processed  # what Lightning reports at that point: not always the next epoch
    assert next_training_epoch(trainer) == expected


def test_loader_shards_with_the_trainers_epoch(demo_dir: Path, tokenizer) -> None:
    loader = attach(make(demo_dir, tokenizer), 2, 1, 3).train_dataloader()
    assert isinstance(loader, StatefulDataLoader) and not loader.persistent_workers
    sampler = loader.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.epoch, sampler.seed, sampler.shuffle) == (2, 1, 3, 3, True)
    assert loader.dataset.epoch == 3
    ranks = [batches(attach(make(demo_dir, tokenizer), 2, r, 3).train_dataloader()) for r in (0, 1)]
    seen = [i for rank in ranks for idx, _ in rank for i in idx]
    assert len(set(seen)) >= len(seen) - 1  # disjoint shards (DistributedSampler pads by at most one duplicate)
    assert batches(attach(make(demo_dir, tokenizer), 2, 1, 2).train_dataloader()) != ranks[1]  # epoch reshuffles


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_mid_epoch_with_the_same_batches(demo_dir: Path, tokenizer, workers: int) -> None:
    """What Lightning does with the loader state in a step checkpoint: saved after k batches, loaded into a
    fresh loader (another process), which then yields exactly the rest of the uninterrupted epoch."""
    whole = batches(attach(make(demo_dir, tokenizer, num_workers=workers), 2, 1, 2).train_dataloader())
    k = 3
    assert len(whole) > k + 1
    first = attach(make(demo_dir, tokenizer, num_workers=workers), 2, 1, 2).train_dataloader()
    it = iter(first)
    for _ in range(k):
        next(it)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as in the checkpoint, read back weights-only as a rerun does
    del it
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    resumed = attach(make(demo_dir, tokenizer, num_workers=workers), 2, 1, 2).train_dataloader()
    resumed.load_state_dict(state)
    assert batches(resumed) == whole[k:]
    # The next epoch starts from its first batch.
    resumed.sampler.set_epoch(3)
    resumed.dataset.set_epoch(3)
    assert batches(resumed) == batches(attach(make(demo_dir, tokenizer), 2, 1, 3).train_dataloader())
