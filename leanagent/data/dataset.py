"""Torch datasets that tokenize proof states and premises exactly as ByT5Tokenizer does (`tokenize.py`).

Examples and negative sampling live in `examples.py` and `negatives.py`; they are re-exported
here so callers have one import site for the training data.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from leanagent.data.corpus import Corpus
from leanagent.data.examples import EvalExample, TrainExample, build_eval_examples, build_train_examples
from leanagent.data.negatives import sample_negatives
from leanagent.data.premise_table import PremiseTable
from leanagent.data.tokenize import byt5_spec, tokenize, tokenize_encoded

__all__ = [
    "EvalDataset",
    "EvalExample",
    "TrainDataset",
    "TrainExample",
    "build_eval_examples",
    "build_train_examples",
    "sample_negatives",
    "tokenize_premises",
    "tokenize_texts",
    "with_lengths",
]

_HASH_PRIME = 1_000_003


def tokenize_texts(tokenizer: Any, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokenizer(texts, padding="longest", truncation=True, max_length=max_len)``; built with numpy for ByT5."""
    return tokenize(tokenizer, texts, max_len)


def tokenize_premises(
    tokenizer: Any, source: Corpus | PremiseTable, indices: Sequence[int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared by collate and by corpus embedding so that training and retrieval see the same bytes.

    `source`: a corpus (indices are its premises) or a premise table (indices are its rows, each read from a corpus
    that holds it). For ByT5 the premises' UTF-8 bytes come from the corpus, encoded once per process.
    """
    idx = indices.tolist() if isinstance(indices, np.ndarray) else [int(i) for i in indices]
    spec = byt5_spec(tokenizer) if idx and max_len >= 2 else None
    if spec is None:
        return tokenize_texts(tokenizer, source.premise_texts(idx), max_len)
    return tokenize_encoded(tokenizer, spec, source.premise_utf8(idx), None, max_len)


def with_lengths(batch: Any) -> Any:
    """Adds each side's real sequence lengths (`context_lengths`, `premise_lengths`) as host lists, read from its
    attention mask while the batch is still on the CPU: planning sub-batches then never waits on the device."""
    if isinstance(batch, dict):
        for side in ("context", "premise"):
            mask = batch.get(f"{side}_mask")
            if torch.is_tensor(mask) and f"{side}_lengths" not in batch:
                batch[f"{side}_lengths"] = mask.sum(dim=1).tolist()
    return batch


def example_seed(seed: int, index: int) -> int:
    """A process-independent seed (Python's hash() of tuples is salted per process for str members)."""
    return seed * _HASH_PRIME + index


def epoch_example_seed(seed: int, index: int, epoch: int) -> str:
    """The seed of example `index`'s negatives in `epoch`: the same in every process, rank, worker and rerun.

    A string seeds `random.Random` through SHA-512 (not the per-process salted `hash()`), so distinct
    (seed, epoch, index) never collide, whatever their sizes or signs.
    """
    return f"leanagent-negatives:{seed}:{epoch}:{index}"


class TrainDataset(Dataset):
    """(context, positive, negatives) triples; negatives are re-drawn every epoch unless `deterministic`.

    The negatives of an example are a pure function of (seed, example index, epoch): no RNG stream
    lives in the dataset, so which rank or worker draws an example, in which order, and whether the
    run was resumed mid-epoch change nothing. Ranks and workers draw different negatives because
    they hold different examples. `set_epoch` is called at each epoch start (and when the loader is
    built, from the trainer's restored epoch); with `deterministic` the epoch is ignored (the Fisher
    pass and `leanagent examples`). With a mined table (`mined`) the draw is from its rows instead
    (`sample_negatives`), still a pure function of the table, seed, example and epoch.
    """

    def __init__(
        self,
        corpus: Corpus,
        examples: list[TrainExample],
        tokenizer: Any,
        num_negatives: int,
        num_in_file_negatives: int,
        context_max_len: int,
        premise_max_len: int,
        seed: int,
        deterministic: bool = False,
        epoch: int = 0,
        mined: np.ndarray | None = None,
    ) -> None:
        self.corpus = corpus
        self.examples = examples
        self.tokenizer = tokenizer
        self.num_negatives = num_negatives
        self.num_in_file_negatives = num_in_file_negatives
        self.context_max_len = context_max_len
        self.premise_max_len = premise_max_len
        self.seed = seed
        self.deterministic = deterministic
        self.epoch = epoch
        # `data.negatives: mined`: row e holds example e's mined candidates (`leanagent.model.mining`); None
        # (random negatives, LeanAgent's) until the first validation has mined them.
        self.mined = mined

    def __len__(self) -> int:
        return len(self.examples)

    def set_epoch(self, epoch: int) -> None:
        """Negatives of the given epoch from now on. Loader workers copy the dataset when they start, so
        call it before the epoch's iterator is created (the training loader's workers are not persistent)."""
        self.epoch = int(epoch)

    def rng_for(self, ex: TrainExample) -> random.Random:
        if self.deterministic:
            return random.Random(example_seed(self.seed, ex.index))
        return random.Random(epoch_example_seed(self.seed, ex.index, self.epoch))

    def __getitem__(self, i: int) -> dict[str, Any]:
        ex = self.examples[i]
        mined = None if self.mined is None else self.mined[i]
        negatives = sample_negatives(self.corpus, ex, self.num_negatives, self.num_in_file_negatives, self.rng_for(ex),
                                     mined)
        return {"example": ex, "negatives": negatives}

    def collate(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        examples: list[TrainExample] = [b["example"] for b in batch]
        context_ids, context_mask = tokenize_texts(self.tokenizer, [e.context for e in examples], self.context_max_len)
        # Slot-major order: all positives, then negative slot 0 of every example, and so on.
        order = [e.pos_premise for e in examples]
        for slot in range(self.num_negatives):
            order += [b["negatives"][slot] for b in batch]
        premise_ids, premise_mask = tokenize_premises(self.tokenizer, self.corpus, order, self.premise_max_len)
        positive_sets = [set(e.all_pos_premises) for e in examples]
        label = torch.tensor([[float(j in pos) for j in order] for pos in positive_sets], dtype=torch.float32)
        return {
            "context_ids": context_ids,
            "context_mask": context_mask,
            "premise_ids": premise_ids,
            "premise_mask": premise_mask,
            "premise_index": torch.tensor(order, dtype=torch.long),
            "label": label,
            "index": torch.tensor([e.index for e in examples], dtype=torch.long),
        }


class EvalDataset(Dataset):
    """Proof states with every positive and the mask of premises the theorem may legally use."""

    def __init__(self, corpus: Corpus, examples: list[EvalExample], tokenizer: Any, context_max_len: int) -> None:
        self.corpus = corpus
        self.examples = examples
        self.tokenizer = tokenizer
        self.context_max_len = context_max_len

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> EvalExample:
        return self.examples[i]

    def collate(self, batch: list[EvalExample]) -> dict[str, Any]:
        context_ids, context_mask = tokenize_texts(self.tokenizer, [e.context for e in batch], self.context_max_len)
        # The tactics of one theorem share their accessible set: build each mask once per batch.
        cache: dict[tuple, torch.Tensor] = {}
        masks = []
        for e in batch:
            key = (e.file_path, tuple(e.theorem_start))
            if key not in cache:
                cache[key] = self.corpus.accessible_mask(e.file_path, e.theorem_start)
            masks.append(cache[key])
        return {
            "context_ids": context_ids,
            "context_mask": context_mask,
            "index": torch.tensor([e.index for e in batch], dtype=torch.long),
            "accessible_mask": torch.stack(masks) if masks else torch.zeros(0, len(self.corpus), dtype=torch.bool),
            "pos_premises": [list(e.all_pos_premises) for e in batch],
        }
