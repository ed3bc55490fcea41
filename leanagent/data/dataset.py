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
from torch.utils.data import Dataset, get_worker_info

from leanagent.data.corpus import Corpus
from leanagent.data.examples import EvalExample, TrainExample, build_eval_examples, build_train_examples
from leanagent.data.negatives import sample_negatives
from leanagent.data.tokenize import byt5_spec, tokenize, tokenize_encoded
from leanagent.ranks import global_rank

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
]

_HASH_PRIME = 1_000_003


def tokenize_texts(tokenizer: Any, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokenizer(texts, padding="longest", truncation=True, max_length=max_len)``; built with numpy for ByT5."""
    return tokenize(tokenizer, texts, max_len)


def tokenize_premises(
    tokenizer: Any, corpus: Corpus, indices: Sequence[int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared by collate and by corpus embedding so that training and retrieval see the same bytes.

    For ByT5 the premises' UTF-8 bytes come from the corpus, encoded once per process.
    """
    idx = indices.tolist() if isinstance(indices, np.ndarray) else [int(i) for i in indices]
    spec = byt5_spec(tokenizer) if idx and max_len >= 2 else None
    if spec is None:
        return tokenize_texts(tokenizer, [corpus.premises[i].serialize() for i in idx], max_len)
    return tokenize_encoded(tokenizer, spec, corpus.premise_utf8(idx), None, max_len)


def example_seed(seed: int, index: int) -> int:
    """A process-independent seed (Python's hash() of tuples is salted per process for str members)."""
    return seed * _HASH_PRIME + index


class TrainDataset(Dataset):
    """(context, positive, negatives) triples; negatives are re-drawn every epoch unless `deterministic`."""

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
        self._rng: random.Random | None = None
        self._rng_key: int | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def _process_rng(self) -> random.Random:
        """One rng per worker, re-seeded when the worker's torch seed changes (a new epoch's workers).

        Seeding from the worker's torch seed, not from `self.seed` alone, keeps non-persistent workers
        from drawing the same negatives every epoch, and different workers from drawing the same ones.
        """
        info = get_worker_info()
        # Offset by the DDP rank: seed_everything gives every rank the same base seed, so without it
        # rank r's worker w would draw the same negatives as every other rank's worker w.
        key = (self.seed if info is None else info.seed) + _HASH_PRIME * global_rank()
        if self._rng is None or self._rng_key != key:
            self._rng = random.Random(key)
            self._rng_key = key
        return self._rng

    def __getitem__(self, i: int) -> dict[str, Any]:
        ex = self.examples[i]
        rng = random.Random(example_seed(self.seed, ex.index)) if self.deterministic else self._process_rng()
        negatives = sample_negatives(self.corpus, ex, self.num_negatives, self.num_in_file_negatives, rng)
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
        masks = [self.corpus.accessible_mask(e.file_path, e.theorem_start) for e in batch]
        return {
            "context_ids": context_ids,
            "context_mask": context_mask,
            "index": torch.tensor([e.index for e in batch], dtype=torch.long),
            "accessible_mask": torch.stack(masks) if masks else torch.zeros(0, len(self.corpus), dtype=torch.bool),
            "pos_premises": [list(e.all_pos_premises) for e in batch],
        }
