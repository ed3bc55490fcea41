"""Negative premises for contrastive training.

The reference implementation crashes when a context sees fewer premises than it wants
negatives (the first file of a repository). Here the sampler widens its pool step by step
(in-file, imported, rest of the file, whole corpus, finally repeats) and only fails when the
corpus holds nothing but positives, since then no negative exists at all.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from leanagent.data.corpus import Corpus
from leanagent.data.errors import DatasetError
from leanagent.data.examples import TrainExample

_FILTER_BELOW = 4096  # pools up to this size are filtered outright; larger ones use rejection sampling


def _draw(pool: Sequence[int] | np.ndarray, k: int, banned: set[int], rng: random.Random) -> list[int]:
    """Up to k distinct members of `pool` not in `banned`, uniformly; never copies a large pool."""
    if k <= 0 or len(pool) == 0:
        return []
    if len(pool) <= _FILTER_BELOW:
        allowed = [int(i) for i in pool if int(i) not in banned]
        return rng.sample(allowed, min(k, len(allowed)))
    picked: list[int] = []
    taken = set(banned)
    attempts = 0
    while len(picked) < k and attempts < 20 * k + 100:
        attempts += 1
        i = int(pool[rng.randrange(len(pool))])
        if i not in taken:
            taken.add(i)
            picked.append(i)
    if len(picked) < k:  # the pool is mostly banned; fall back to an exact filter
        allowed = [int(i) for i in pool if int(i) not in taken]
        picked += rng.sample(allowed, min(k - len(picked), len(allowed)))
    return picked


def sample_negatives(
    corpus: Corpus,
    example: TrainExample,
    num_negatives: int,
    num_in_file_negatives: int,
    rng: random.Random,
) -> list[int]:
    if num_negatives <= 0:
        return []
    positives = set(example.all_pos_premises)
    in_file = corpus.in_file_indices(example.file_path, example.theorem_start)
    chosen = _draw(in_file, min(num_in_file_negatives, num_negatives), positives, rng)
    banned = positives | set(chosen)
    stages: list[Sequence[int] | np.ndarray] = [corpus.imported_array(example.file_path), in_file, range(len(corpus))]
    for pool in stages:
        need = num_negatives - len(chosen)
        if need == 0:
            break
        extra = _draw(pool, need, banned, rng)
        chosen += extra
        banned.update(extra)
    if len(chosen) < num_negatives:
        # Fewer non-positives in the whole corpus than requested: repeat them (the corpus is then tiny).
        non_positive = [i for i in range(len(corpus)) if i not in positives]
        if not non_positive:
            raise DatasetError(
                f"theorem {example.theorem or '?'} ({example.file_path}:{example.theorem_start[0]}): "
                f"every premise in the corpus is a positive of this tactic, so no negative exists"
            )
        chosen += [rng.choice(non_positive) for _ in range(num_negatives - len(chosen))]
    return chosen
