"""Sets of premise indices as unions of index ranges: a file's premises are contiguous in the corpus, so
what a file can see (its imports) is a handful of ranges, not a list of 100k indices."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class RangeUnion:
    """A sorted set of premise indices stored as disjoint, non-adjacent half-open ranges [starts[i], stops[i]).

    `before[i]` counts the members below `starts[i]`, so the r-th member (uniform sampling without a
    100k-element array) and the position of a member are each one binary search.
    """

    __slots__ = ("starts", "stops", "before", "size")

    def __init__(self, starts: np.ndarray, stops: np.ndarray) -> None:
        self.starts, self.stops = starts, stops
        self.before = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(stops - starts, out=self.before[1:])
        self.size = int(self.before[-1])
        for arr in (self.starts, self.stops, self.before):
            arr.setflags(write=False)

    @classmethod
    def empty(cls) -> RangeUnion:
        return cls(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

    @classmethod
    def from_ranges(cls, starts: np.ndarray, stops: np.ndarray) -> RangeUnion:
        """From ranges sorted by start and disjoint (empty ones allowed); touching ranges are merged."""
        keep = stops > starts
        starts, stops = starts[keep], stops[keep]
        if len(starts) > 1:
            gap = starts[1:] != stops[:-1]
            starts = starts[np.concatenate(([True], gap))]
            stops = stops[np.concatenate((gap, [True]))]
        return cls(np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(stops, dtype=np.int64))

    @property
    def num_ranges(self) -> int:
        return len(self.starts)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, r: int) -> int:
        """The r-th smallest member (0 <= r < len)."""
        if not 0 <= r < self.size:
            raise IndexError(r)
        i = int(np.searchsorted(self.before, r, side="right")) - 1
        return int(self.starts[i] + (r - self.before[i]))

    def rank(self, x: int) -> int:
        """How many members are smaller than `x`."""
        i = int(np.searchsorted(self.starts, x, side="right")) - 1
        if i < 0:
            return 0
        return int(self.before[i] + min(x, int(self.stops[i])) - self.starts[i])

    def index(self, x: int) -> int:
        """The position of `x` among the members, or -1 when it is not one."""
        i = int(np.searchsorted(self.starts, x, side="right")) - 1
        if i < 0 or x >= self.stops[i]:
            return -1
        return int(self.before[i] + (x - self.starts[i]))

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self.starts.tolist(), self.stops.tolist(), strict=True):
            yield from range(a, b)

    def to_array(self) -> np.ndarray:
        """The members as a sorted int64 array (a cumulative sum of steps, no Python loop)."""
        steps = np.ones(self.size, dtype=np.int64)
        if self.size:
            steps[0] = self.starts[0]
            steps[self.before[1:-1]] = self.starts[1:] - self.stops[:-1] + 1
        return np.cumsum(steps)
