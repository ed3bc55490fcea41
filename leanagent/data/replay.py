"""Replay's draw: which of an earlier repository's training theorems a stage trains on again.

Under `lifelong.dataset_strategy: replay` stage i trains on repository i and `lifelong.replay_fraction` of the
training theorems of each of repositories 0..i-1 (`leanagent.data.strategies`). Which ones is decided here, from
nothing but a key: the run's seed, the stage's position, and the content (SHA-256 of the dataset files) of the
stage's repository and of the repository drawn from. Each theorem of the source's `train.json` is ranked by the
SHA-256 of the key and its position there, and the `round(fraction × count)` (halves up) of lowest rank are kept,
in their order in the file.

Why a hash and not a random generator: the sample must not depend on what else drew random numbers before it
(another stage, a library, the order of a rerun), nor on a generator's algorithm across versions. A resumed job,
a rerun and a run continued with a repository appended later draw the same sample, bit for bit, on any machine;
and for one key the sample at a smaller fraction is part of the sample at a larger one. At fraction 1 every
theorem is kept, so the stage's dataset is `merge_all`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Draw:
    """A share of one source repository's training theorems, drawn by `key` (`replay_key`)."""

    fraction: float
    key: str


def replay_key(seed: int, stage: int, repository: Mapping[str, str], source: Mapping[str, str]) -> str:
    """The draw's key: the run's seed, the stage's position, and the digests (`leanagent.data.merge.digests`) of
    the stage's repository and of the repository drawn from."""
    canonical = json.dumps({"seed": seed, "stage": stage, "repository": dict(repository), "source": dict(source)},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def kept_count(count: int, fraction: float) -> int:
    """How many of `count` theorems a share keeps: `fraction × count` rounded, halves up (all of them at 1)."""
    return min(count, math.floor(fraction * count + 0.5))


def drawn(count: int, draw: Draw) -> list[int]:
    """The positions, ascending, of the theorems of a `train.json` of `count` theorems that `draw` keeps."""
    ranked = sorted(range(count), key=lambda j: hashlib.sha256(f"{draw.key}:{j}".encode()).digest())
    return sorted(ranked[: kept_count(count, draw.fraction)])
