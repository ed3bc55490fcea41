"""The bench's data path: the corpus load, training examples and tokenization, and the batches the training
and Fisher rows run (as the data module builds them, optionally with real proof states as contexts)."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

from transformers import ByT5Tokenizer

from leanagent.bench.results import CorpusFigures, DataFigures
from leanagent.bench.timing import rate
from leanagent.data.corpus import Corpus
from leanagent.data.dataset import (
    TrainDataset,
    build_eval_examples,
    build_train_examples,
    tokenize_premises,
    with_lengths,
)
from leanagent.data.theorems import load_split
from leanagent.ground.config import DataConfig
from leanagent.ground.names import CORPUS_FILE, TEST_PART, TRAIN_PART, VAL_PART, part_file
from leanagent.ground.timings import rss_mb


def bench_corpus(dataset: Path) -> tuple[Corpus, CorpusFigures]:
    """Loading the dataset's corpus: seconds and the resident memory it added."""
    before = rss_mb()
    start = time.perf_counter()
    corpus = Corpus.from_jsonl(dataset / CORPUS_FILE)
    seconds = time.perf_counter() - start
    return corpus, CorpusFigures(corpus_load_s=seconds, corpus_rss_mb=rss_mb() - before, num_premises=len(corpus),
                                 num_files=len(corpus.paths))


def bench_data(dataset: Path, corpus: Corpus, split: str, min_seconds: float) -> tuple[DataFigures, list, list]:
    """Training examples (negative sampling + collate) and premise tokenization, per second; the training and
    evaluation examples, for the sections that follow."""
    tokenizer = ByT5Tokenizer()
    cfg = DataConfig()  # LeanAgent's: batch 4, 3 negatives (1 in-file), 1024 bytes
    train = build_train_examples(corpus, load_split(dataset / split / part_file(TRAIN_PART)))
    evals: list = []
    for part in (TEST_PART, VAL_PART):
        path = dataset / split / part_file(part)
        if path.is_file():
            evals += build_eval_examples(corpus, load_split(path))
    ds = TrainDataset(corpus, train, tokenizer, cfg.num_negatives, cfg.num_in_file_negatives, cfg.max_seq_len,
                      cfg.max_seq_len, seed=0)
    rng = random.Random(0)

    def one_batch() -> int:
        items = [ds[rng.randrange(len(ds))] for _ in range(cfg.batch_size)]
        ds.collate(items)
        return cfg.batch_size

    sample = rng.sample(range(len(corpus)), min(len(corpus), 4096))

    def tokenize() -> int:
        for i in range(0, len(sample), 64):
            tokenize_premises(tokenizer, corpus, sample[i: i + 64], cfg.max_seq_len)
        return len(sample)

    figures = DataFigures(num_train_examples=len(train), train_examples_per_s=rate(one_batch, min_seconds),
                          tokenize_premises_per_s=rate(tokenize, min_seconds, min_calls=1))
    return figures, train, evals


def bench_batches(corpus, train: list, tokenizer, batches: int, max_len: int, states: list[str] | None = None,
                  seed: int = 2) -> list[dict[str, Any]]:
    """Training batches as the data module builds them (LeanAgent's batch 4, 3 negatives, one in-file; fixed
    negatives), cut at `max_len` bytes, host-side lengths added. With `states`, each example's context is
    replaced by one of those proof states (a seeded order): the batches then have the contexts' real lengths
    while the premises come from the dataset's corpus."""
    cfg = DataConfig()
    if states:
        order = list(states)
        random.Random(seed).shuffle(order)
        train = [dataclasses.replace(e, context=order[k % len(order)]) for k, e in enumerate(train)]
    ds = TrainDataset(corpus, train, tokenizer, cfg.num_negatives, cfg.num_in_file_negatives, max_len, max_len,
                      seed=0, deterministic=True)
    size = cfg.batch_size
    picked = random.Random(seed).sample(range(len(ds)), min(batches * size, len(ds) - len(ds) % size))
    return [with_lengths(ds.collate([ds[i] for i in picked[j: j + size]])) for j in range(0, len(picked), size)]
