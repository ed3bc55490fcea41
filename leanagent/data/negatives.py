"""Negative premises for contrastive training, of LeanAgent's composition.

The reference splits the premises a context may use into two pools:
- "in-file": the premises of the *positive premise's* file, other than the positive. When that
  file is the theorem's own file, only the premises ending strictly before the theorem count;
  when it is neither the theorem's file nor one it imports, the pool is empty;
- "outside": every other premise accessible for negatives (the theorem's own file, strictly
  before the theorem, and every imported file).
It draws min(num_in_file_negatives, |in-file|) from the first pool and the rest from the second.
The tactic's other positives are left out of both pools (a drawn positive would be labelled 1
anyway, teaching nothing as a negative).

The reference crashes when the outside pool is too small (the first file of a repository).
Here the sampler then widens step by step (the rest of the in-file pool, the whole corpus,
finally repeats) and only fails when the corpus holds nothing but positives.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from leanagent.data.corpus import Corpus
from leanagent.data.errors import DatasetError
from leanagent.data.examples import TrainExample

_FILTER_BELOW = 4096  # pools up to this size are filtered outright; larger ones use rejection sampling

Segment = Sequence[int] | np.ndarray | range


def _draw(segments: list[Segment], k: int, banned: set[int], rng: random.Random) -> list[int]:
    """Up to k distinct members of the union of disjoint `segments`, not in `banned`, uniformly.

    A pool is a list of segments (a file's index range, a slice of the cached imported array)
    so that a 100k-premise pool is never copied per example.
    """
    sizes = [len(s) for s in segments]
    total = sum(sizes)
    if k <= 0 or total == 0:
        return []
    if total <= _FILTER_BELOW:
        allowed = [int(i) for s in segments for i in s if int(i) not in banned]
        return rng.sample(allowed, min(k, len(allowed)))
    picked: list[int] = []
    taken = set(banned)
    attempts = 0
    while len(picked) < k and attempts < 20 * k + 100:
        attempts += 1
        r = rng.randrange(total)
        for seg, size in zip(segments, sizes, strict=True):
            if r < size:
                i = int(seg[r])
                break
            r -= size
        if i not in taken:
            taken.add(i)
            picked.append(i)
    if len(picked) < k:  # the pool is mostly banned; fall back to an exact filter
        allowed = [int(i) for s in segments for i in s if int(i) not in taken]
        picked += rng.sample(allowed, min(k - len(picked), len(allowed)))
    return picked


def _without(arr: np.ndarray, drop: range) -> list[Segment]:
    """`arr` (sorted) minus the contiguous index range `drop`, as at most two views."""
    if not len(drop):
        return [arr]
    lo, hi = np.searchsorted(arr, [drop.start, drop.stop])
    return [arr[:lo], arr[hi:]]


def negative_pools(corpus: Corpus, example: TrainExample) -> tuple[list[Segment], list[Segment]]:
    """The reference's (in-file, outside) pools for one example, positive included (it is banned later)."""
    path = example.file_path
    own_before = np.asarray(corpus.in_file_indices(path, example.theorem_start, strict=True), dtype=np.int64)
    imported = corpus.imported_array(path)
    pos_file = corpus.file_of(example.pos_premise)
    if pos_file == path:
        return [own_before], [imported]
    if corpus.imports_file(path, pos_file):
        pos_range = corpus.file_range(pos_file)
        return [pos_range], [own_before, *_without(imported, pos_range)]
    return [], [own_before, imported]


def sample_negatives(
    corpus: Corpus,
    example: TrainExample,
    num_negatives: int,
    num_in_file_negatives: int,
    rng: random.Random,
) -> list[int]:
    if num_negatives <= 0:
        return []
    positives = set(example.all_pos_premises) | {example.pos_premise}
    in_file, outside = negative_pools(corpus, example)
    chosen = _draw(in_file, min(num_in_file_negatives, num_negatives), positives, rng)
    banned = positives | set(chosen)
    for pool in (outside, in_file, [range(len(corpus))]):
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
