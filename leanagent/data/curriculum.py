"""LeanAgent's curriculum: learn repositories with many easy theorems first.

A theorem's difficulty is e^(number of tactics), so long proofs dominate; unproved theorems
(sorry) are Hard, and theorems without traced tactics carry no signal and are spread evenly
over the three classes. Class boundaries are the 33rd and 67th percentiles over every finite
difficulty of every repository, so one repository is judged relative to the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leanagent.data.theorems import Theorem, has_sorry, load_split

SPLIT_NAMES = ("train", "val", "test")


def difficulty(theorem: Theorem) -> float | None:
    if has_sorry(theorem):
        return math.inf
    if not theorem.tactics:
        return None
    try:
        return math.exp(len(theorem.tactics))
    except OverflowError:  # > 709 tactics: beyond float range, and certainly Hard
        return math.inf


@dataclass
class RepoDifficulty:
    name: str
    easy: int
    medium: int
    hard: int


def _thirds(n: int) -> tuple[int, int, int]:
    """Sizes numpy.array_split gives for 3 chunks: the first n % 3 chunks get one extra."""
    base, extra = divmod(n, 3)
    sizes = [base + (1 if k < extra else 0) for k in range(3)]
    return sizes[0], sizes[1], sizes[2]


def categorize(repos: dict[str, list[Theorem]]) -> dict[str, RepoDifficulty]:
    scores = {name: [difficulty(t) for t in thms] for name, thms in repos.items()}
    finite = [d for ds in scores.values() for d in ds if d is not None and math.isfinite(d)]
    p33, p67 = (float(np.percentile(finite, q)) for q in (33, 67)) if finite else (math.inf, math.inf)
    result = {}
    for name, ds in scores.items():
        easy = medium = hard = 0
        for d in ds:
            if d is None:
                continue
            if d < p33:
                easy += 1
            elif d < p67:
                medium += 1
            else:
                hard += 1
        e, m, h = _thirds(sum(d is None for d in ds))
        result[name] = RepoDifficulty(name, easy + e, medium + m, hard + h)
    return result


def order_repositories(repos: dict[str, list[Theorem]]) -> list[str]:
    """Most Easy theorems first; Python's sort is stable, so ties keep the given order."""
    counts = categorize(repos)
    return sorted(repos, key=lambda name: -counts[name].easy)


def load_repo_theorems(dataset_dir: Path, split: str = "random") -> list[Theorem]:
    folder = Path(dataset_dir) / split
    theorems: list[Theorem] = []
    for name in SPLIT_NAMES:
        path = folder / f"{name}.json"
        if path.is_file():
            theorems += load_split(path)
    return theorems
