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

No pool is written out per example: a file's premises are a contiguous index range and a file's
imports a union of such ranges (`Corpus.imported_ranges`), so the r-th member of a pool is a binary
search. The random calls are exactly those of filtering and sampling written-out lists, so a seed
gives the same negatives as the list-based definition (tests/data/test_data_fastpath.py checks it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np

from leanagent.data.corpus import Corpus
from leanagent.data.errors import DatasetError
from leanagent.data.examples import TrainExample
from leanagent.data.ranges import RangeUnion

_FILTER_BELOW = 4096  # pools up to this size are filtered outright; larger ones use rejection sampling


class _Without:
    """A RangeUnion minus the members inside one index range, without copying: positions past the hole shift."""

    def __init__(self, union: RangeUnion, drop: range) -> None:
        self.union = union
        self.drop = drop
        self.lo = union.rank(drop.start)
        self.gap = union.rank(drop.stop) - self.lo

    def __len__(self) -> int:
        return len(self.union) - self.gap

    def __getitem__(self, r: int) -> int:
        return self.union[r if r < self.lo else r + self.gap]

    def index(self, x: int) -> int:
        if x in self.drop:
            return -1
        k = self.union.index(x)
        return k if k < self.lo else k - self.gap

    def __iter__(self) -> Iterator[int]:
        return (i for i in self.union if i not in self.drop)


# A pool is a list of disjoint segments, walked in order: a file's index range, a sorted array of a file's
# premises, the union of a file's imported ranges (minus the positive's file). None is copied per example.
Segment = range | np.ndarray | RangeUnion | _Without


def _position(seg: Segment, x: int) -> int:
    """Where `x` is in `seg` (its rank), or -1."""
    if isinstance(seg, range):
        return x - seg.start if x in seg else -1
    if isinstance(seg, np.ndarray):
        k = int(np.searchsorted(seg, x))
        return k if k < len(seg) and seg[k] == x else -1
    return seg.index(x)


def pool_members(segments: Sequence[Segment]) -> list[int]:
    """The pool written out, in the order the sampler numbers it (for tests and inspection)."""
    return [int(i) for s in segments for i in s]


def _at(segments: Sequence[Segment], sizes: list[int], r: int) -> int:
    for seg, size in zip(segments, sizes, strict=True):
        if r < size:
            return int(seg[r])
        r -= size
    raise IndexError(r)


def _holes(segments: Sequence[Segment], sizes: list[int], excluded: set[int]) -> list[int]:
    """Sorted pool positions of the members of `excluded`."""
    holes = []
    for x in excluded:
        offset = 0
        for seg, size in zip(segments, sizes, strict=True):
            k = _position(seg, x) if size else -1
            if k >= 0:
                holes.append(offset + k)
                break
            offset += size
    holes.sort()
    return holes


def _sample_allowed(segments: Sequence[Segment], sizes: list[int], k: int, excluded: set[int],
                    rng: random.Random) -> list[int]:
    """``rng.sample(allowed, min(k, len(allowed)))`` where `allowed` lists the pool in order without `excluded`,
    drawing exactly what that call draws, without writing `allowed` out: the j-th allowed member is found by
    skipping the (few) excluded positions."""
    holes = _holes(segments, sizes, excluded)
    n = sum(sizes) - len(holes)
    picks = rng.sample(range(n), min(k, n))
    out = []
    for j in picks:
        for h in holes:
            if h <= j:
                j += 1
            else:
                break
        out.append(_at(segments, sizes, j))
    return out


def _draw(segments: Sequence[Segment], k: int, banned: set[int], rng: random.Random) -> list[int]:
    """Up to k distinct members of the union of disjoint `segments`, not in `banned`, uniformly.

    Small pools (up to `_FILTER_BELOW`) are filtered and sampled; larger ones by rejection, falling
    back to filtering when most of the pool is banned. The pool is numbered segment by segment, and
    the random calls are those of filtering a written-out list, so the same rng gives the same draw.
    """
    sizes = [len(s) for s in segments]
    total = sum(sizes)
    if k <= 0 or total == 0:
        return []
    if total <= _FILTER_BELOW:
        return _sample_allowed(segments, sizes, k, banned, rng)
    picked: list[int] = []
    taken = set(banned)
    attempts = 0
    while len(picked) < k and attempts < 20 * k + 100:
        attempts += 1
        i = _at(segments, sizes, rng.randrange(total))
        if i not in taken:
            taken.add(i)
            picked.append(i)
    if len(picked) < k:  # the pool is mostly banned; fall back to an exact filter
        picked += _sample_allowed(segments, sizes, k - len(picked), taken, rng)
    return picked


def negative_pools(corpus: Corpus, example: TrainExample) -> tuple[list[Segment], list[Segment]]:
    """The reference's (in-file, outside) pools for one example, positive included (it is banned later)."""
    path = example.file_path
    own_before = corpus.in_file_segment(path, example.theorem_start, strict=True)
    imported = corpus.imported_ranges(path)
    pos_file = corpus.file_of(example.pos_premise)
    if pos_file == path:
        return [own_before], [imported]
    if corpus.imports_file(path, pos_file):
        pos_range = corpus.file_range(pos_file)
        return [pos_range], [own_before, _Without(imported, pos_range)]
    return [], [own_before, imported]


def mined_pools(in_file: list[Segment], outside: list[Segment], mined: Sequence[int]
                ) -> tuple[list[Segment], list[Segment]]:
    """The mined candidates (`data.negatives: mined`) that lie in each of the reference's pools, as sorted arrays:
    the in-file count rule then applies to them as to the whole pools."""
    def within(pool: list[Segment]) -> np.ndarray:
        members = [int(x) for x in mined if x >= 0 and any(_position(seg, int(x)) >= 0 for seg in pool if len(seg))]
        return np.unique(np.asarray(members, dtype=np.int64))
    return [within(in_file)], [within(outside)]


def sample_negatives(
    corpus: Corpus,
    example: TrainExample,
    num_negatives: int,
    num_in_file_negatives: int,
    rng: random.Random,
    mined: Sequence[int] | None = None,
) -> list[int]:
    """LeanAgent's draw (the module docstring). With `mined` (the example's row of the mined table: the model's
    top premises for its context, best first, -1 past the end) the in-file negatives come from the mined ones in
    the in-file pool and the rest from those outside it, each uniformly; only when they run short do the
    reference's whole pools fill up, as without mining."""
    if num_negatives <= 0:
        return []
    positives = set(example.all_pos_premises) | {example.pos_premise}
    in_file, outside = negative_pools(corpus, example)
    pools: list[list[Segment]] = [outside, in_file, [range(len(corpus))]]
    first = in_file
    if mined is not None:
        mined_in, mined_out = mined_pools(in_file, outside, mined)
        first, pools = mined_in, [mined_out, mined_in, *pools]
    chosen = _draw(first, min(num_in_file_negatives, num_negatives), positives, rng)
    banned = positives | set(chosen)
    for pool in pools:
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
