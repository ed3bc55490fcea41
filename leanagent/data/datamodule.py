"""Lightning data module for one LeanDojo dataset folder; everything is loaded once, up front.

Loading in `__init__` (not `setup`) means a bad dataset fails before the trainer spawns workers
or touches a GPU, and every DDP rank parses the same files deterministically.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from leanagent.data.corpus import Corpus
from leanagent.data.dataset import (
    EvalDataset,
    TrainDataset,
    build_eval_examples,
    build_train_examples,
    with_lengths,
)
from leanagent.data.errors import DatasetError
from leanagent.data.premise_table import PremiseTable
from leanagent.data.records import Pos
from leanagent.data.theorems import Theorem, load_split
from leanagent.ground.config import DataConfig
from leanagent.ground.names import CORPUS_FILE, TEST_PART, TRAIN_PART, VAL_PART, part_file


def next_training_epoch(trainer: pl.Trainer) -> int:
    """The epoch the next training batch belongs to, from the trainer's (restored) loop state.

    Lightning builds the training loader, and with it the sampler's shard order for the coming epoch,
    before it has decided where a restored run goes on: then `current_epoch` still counts the epochs
    *completed*, and a checkpoint written at an epoch's end (validation's, after its last batch) counts
    that epoch as started but not completed, although all its batches were trained. So (0-based) the next
    batch is in epoch `processed`, the one in progress (a mid-epoch checkpoint, a fresh trainer), unless
    that epoch's last batch was trained (Lightning's own `is_last_batch`, which holds also when the
    checkpoint is another repository's, whose epochs had another length): then in epoch `started`.
    """
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.started > epochs.processed and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        return epochs.started
    return epochs.processed


class RetrievalDataModule(pl.LightningDataModule):
    def __init__(
        self,
        dataset_dir: Path,
        tokenizer: Any,
        data_cfg: DataConfig,
        premise_max_len: int,
        seed: int,
    ) -> None:
        super().__init__()
        self.dataset_dir = Path(dataset_dir)
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        self.premise_max_len = premise_max_len
        self.seed = seed
        self.corpus = Corpus.from_jsonl(self.dataset_dir / CORPUS_FILE)
        split_dir = self.dataset_dir / data_cfg.split
        self.train_theorems: list[Theorem] = load_split(split_dir / part_file(TRAIN_PART))
        self.val_theorems = self._load_optional(split_dir / part_file(VAL_PART))
        self.test_theorems = self._load_optional(split_dir / part_file(TEST_PART))
        self.train_examples = build_train_examples(self.corpus, self.train_theorems)
        if not self.train_examples:
            raise DatasetError(
                f"{self.dataset_dir.name}/{data_cfg.split}/{part_file(TRAIN_PART)}: no training example "
                f"(no tactic has a premise annotation found in the corpus)"
            )
        self.val_examples = build_eval_examples(self.corpus, self.val_theorems)
        self.test_examples = build_eval_examples(self.corpus, self.test_theorems)
        self.mined: np.ndarray | None = None  # `data.negatives: mined`: the table (`set_mined`), None before it
        self._train_ds: TrainDataset | None = None
        self._tables: dict[tuple[str, bool], PremiseTable] = {}

    @staticmethod
    def _load_optional(path: Path) -> list[Theorem]:
        """Validation and test files are optional for training; a missing one is an empty split."""
        return load_split(path) if path.is_file() else []

    def train_dataset(self, deterministic: bool = False) -> TrainDataset:
        return TrainDataset(
            self.corpus,
            self.train_examples,
            self.tokenizer,
            num_negatives=self.cfg.num_negatives,
            num_in_file_negatives=self.cfg.num_in_file_negatives,
            context_max_len=self.cfg.max_seq_len,
            premise_max_len=self.premise_max_len,
            seed=self.seed,
            deterministic=deterministic,
            mined=None if deterministic else self.mined,
        )

    # ---- mined negatives: the table, and its place in checkpoints -------------------------------
    def set_mined(self, table: np.ndarray) -> None:
        """Negatives from this mined table from the next epoch on (its loader's workers copy the dataset then)."""
        if table.shape[0] != len(self.train_examples):
            raise ValueError(f"a mined table of {table.shape[0]} rows for {len(self.train_examples)} examples")
        self.mined = table
        if self._train_ds is not None:
            self._train_ds.mined = table

    def _identity(self) -> str:
        """Which training data a mined table indexes: another repository's checkpoint holds another's."""
        return f"{self.dataset_dir.resolve()}:{self.cfg.split}:{len(self.train_examples)}:{len(self.corpus)}"

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint (Lightning's data module state): the mined table, so a resumed epoch draws
        the negatives the interrupted one did. Nothing without one (random negatives are a pure function)."""
        if self.mined is None:
            return {}
        return {"mined": torch.from_numpy(self.mined), "mined_for": self._identity()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored before the training loader is built. A table of another dataset (the checkpoint a new
        repository starts from) is not taken: the new repository's negatives are random until it validates."""
        if self.cfg.negatives == "mined" and state_dict.get("mined_for") == self._identity():
            self.set_mined(state_dict["mined"].numpy())

    def fisher_dataset(self) -> TrainDataset:
        """Fixed negatives so the Fisher estimate does not depend on which worker drew what."""
        return self.train_dataset(deterministic=True)

    def _loader(self, dataset: Dataset, collate: Any, batch_size: int, shuffle: bool, drop_last: bool = False
                ) -> DataLoader:
        workers = self.cfg.num_workers
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=workers,
            collate_fn=collate,
            persistent_workers=workers > 0,
            # Page-locked batches let Lightning's non-blocking copy to the GPU overlap the step.
            pin_memory=torch.cuda.is_available(),
            drop_last=drop_last,
            generator=self._generator(),
        )

    def _generator(self) -> torch.Generator:
        """The loader's own RNG. Every iterator a DataLoader creates draws its workers' base seed from its
        `generator`, or from the global torch RNG when it has none: that draw would shift the dropout masks of
        the training that follows by as many draws as iterators were made (a validation, a resumed run's setup),
        so a resumed run could not match an uninterrupted one. Our data draws nothing from it (negatives are a
        function of seed, example and epoch), so its seed only has to be fixed."""
        return torch.Generator().manual_seed(self.seed)

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled, with `drop_last` as in LeanAgent: every training batch has `batch_size` examples.

        Resumable mid-epoch: a `StatefulDataLoader`, whose state (batches yielded this epoch) Lightning
        saves in every checkpoint and restores before the first batch, skipping the sampler's indices
        (not the data) already trained. For that the shard order must be the one the interrupted epoch
        used before the iterator exists, so the `DistributedSampler` is built here (Lightning leaves a
        DistributedSampler as it is) with the trainer's restored epoch; Lightning's own would still hold
        epoch 0 when the resumed iterator is created and only get `set_epoch` afterwards. Its seed is
        `trainer.seed`, as Lightning's. The dataset gets the same epoch (its negatives depend on it);
        `DatasetEpoch` sets both again at every epoch start. Workers are not persistent, so each epoch's
        workers copy the dataset with that epoch.
        """
        replicas, rank, epoch = self._shard()
        ds = self._train_ds = self.train_dataset()
        ds.set_epoch(epoch)
        sampler = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=True, seed=self.seed)
        sampler.set_epoch(epoch)
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, deprecated in recent torch: noise in every rank's log.
            warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated", category=UserWarning)
            return StatefulDataLoader(
                ds,
                batch_size=self.cfg.batch_size,
                sampler=sampler,
                num_workers=self.cfg.num_workers,
                collate_fn=ds.collate,
                persistent_workers=False,
                pin_memory=torch.cuda.is_available(),
                drop_last=True,
                generator=self._generator(),
            )

    def _shard(self) -> tuple[int, int, int]:
        """(ranks, this rank, epoch) of the training loader: the trainer's when attached; else the process
        group's (the reference Fisher builds this loader for a trainer the data module is not attached to)."""
        trainer = self.trainer
        if trainer is not None:
            return trainer.world_size, trainer.global_rank, next_training_epoch(trainer)
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank(), 0
        return 1, 0, 0

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The sequences' real lengths as host lists, for the retriever's sub-batches (`with_lengths`)."""
        return with_lengths(batch)

    def unsharded_train_batches(self) -> int:
        """Batches per epoch of the training loader before DDP shards it: LeanAgent's LR horizon unit."""
        return len(self.train_examples) // self.cfg.batch_size

    # ---- what a validation or test embeds ---------------------------------------------------------
    def retrieval_positions(self, split: str) -> list[tuple[str, Pos]]:
        """(file, theorem start) of every context a `split` ("val" or "test") evaluation ranks premises for.

        Validation under `data.negatives: mined` also ranks the training contexts' premises (mining reuses its
        embedding), so their positions count too."""
        examples: list = list(self.val_examples if split == "val" else self.test_examples)
        if split == "val" and self.cfg.negatives == "mined":
            examples += self.train_examples
        return [(e.file_path, e.theorem_start) for e in examples]

    def premise_table(self, split: str, needed_only: bool) -> PremiseTable:
        """The premises a `split` evaluation embeds (`PremiseTable`): with `needed_only`, those accessible to at
        least one of its contexts (`retrieval_positions`), which are all it can rank; else the whole corpus, as
        LeanAgent re-embeds it. Built once per data module (it does not depend on the weights)."""
        key = (split, needed_only)
        if key not in self._tables:
            wanted = self.corpus.accessible_union(self.retrieval_positions(split)) if needed_only else None
            self._tables[key] = PremiseTable([self.corpus], None if wanted is None else [wanted])
        return self._tables[key]

    def _eval_loader(self, examples: list) -> DataLoader:
        ds = EvalDataset(self.corpus, examples, self.tokenizer, self.cfg.max_seq_len)
        return self._loader(ds, ds.collate, self.cfg.eval_batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_examples)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_examples)


def union_table(datamodules: list[RetrievalDataModule], split: str,
                also: Sequence[tuple[Corpus, np.ndarray]] = ()) -> PremiseTable:
    """The premises evaluations of `split` over several data modules need, each distinct premise once
    (`PremiseTable`): corpus k is data module k's, and its rows are the premises its contexts may use. `also`:
    more premises to embed with them, (corpus, mask) each (a premise index's), a data module's corpus or another."""
    corpora = [dm.corpus for dm in datamodules]
    wanted = [dm.corpus.accessible_union(dm.retrieval_positions(split)) for dm in datamodules]
    for corpus, mask in also:
        k = next((k for k, c in enumerate(corpora) if c is corpus), None)
        if k is None:
            corpora.append(corpus)
            wanted.append(mask.copy())
        else:
            wanted[k] |= mask
    return PremiseTable(corpora, wanted)
