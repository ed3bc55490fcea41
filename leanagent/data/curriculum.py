"""LeanAgent's curriculum: learn repositories with many easy theorems first.

This is LeanAgent's `calculate_difficulty` / `categorize_difficulty` /
`sort_repositories_by_difficulty` (leanagent.py), rule for rule:

* A theorem's difficulty is e^S, S its number of traced tactics. A theorem with a tactic that
  contains "sorry" is rated infinitely hard (inf); one with no tactic is unrated (None).
* The 33rd and 67th percentiles are `numpy.percentile(rated, [33, 67])` over every rated
  difficulty of every repository together, inf included, so one repository is judged relative
  to the others. numpy's linear interpolation is kept as it is: a percentile that falls between
  a finite value and inf is inf, and one that falls between two infs is nan (then every finite
  theorem compares false and is Hard), exactly as in the reference.
* inf is "hard, no proof", a class of its own (not counted in Hard). Otherwise Easy is
  `<= p33`, Medium `<= p67`, Hard above.
* Per repository the unrated theorems are cut into three chunks of `n // 3`: Easy gets the
  first, Medium the second, Hard the rest (so the remainder goes to Hard).
* Repositories are sorted by their Easy count, descending; the sort is stable, so ties keep the
  given order.

A run that continues (repositories that arrive later) keeps the repositories it already has in their
positions (`kept`) and appends the new ones, ordered among themselves by the same rule. The percentiles are
taken over every repository the run knows, kept and new, so that "easy" keeps one meaning within a run;
the counts of a kept repository can then move, its position does not.

Where the reference would crash, we do not:

* More than 709 tactics: `math.exp` raises OverflowError (the reference crashes). We rate such a
  theorem `sys.float_info.max`: still rated and finite, larger than every other finite rating,
  so it is Hard (it is a long proof, not a missing one; inf would wrongly make it "hard, no
  proof"). It can only be Medium or Easy if more than a third of all rated theorems are that long.
* No rated theorem at all: `numpy.percentile([])` raises; we report no percentiles (None) and
  only distribute the unrated theorems.
* A repository with no theorem never enters the reference's table and silently drops out of its
  order; we keep it, with all counts 0 (so it sorts among the repositories with 0 Easy).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leanagent.data.theorems import Theorem, has_sorry, load_split
from leanagent.ground.names import DEFAULT_SPLIT, PARTS, part_file

PERCENTILES = (33, 67)
# e^S for S > 709 does not fit in a float; see the module docstring.
LARGEST_RATING = sys.float_info.max

EASY, MEDIUM, HARD, HARD_NO_PROOF, TO_DISTRIBUTE = "easy", "medium", "hard", "hard_no_proof", "to_distribute"


def difficulty(theorem: Theorem) -> float | None:
    """e^(number of traced tactics); inf for a proof with "sorry" in a tactic; None without tactics."""
    if has_sorry(theorem):
        return math.inf
    if not theorem.tactics:
        return None
    try:
        return math.exp(len(theorem.tactics))
    except OverflowError:
        return LARGEST_RATING


def category(rating: float | None, percentiles: tuple[float, float] | None) -> str:
    """LeanAgent's `categorize_difficulty`: one of EASY, MEDIUM, HARD, HARD_NO_PROOF, TO_DISTRIBUTE."""
    if rating is None:
        return TO_DISTRIBUTE
    if rating == math.inf:
        return HARD_NO_PROOF
    assert percentiles is not None, "a rated theorem implies percentiles"
    if rating <= percentiles[0]:
        return EASY
    if rating <= percentiles[1]:
        return MEDIUM
    return HARD


@dataclass(frozen=True)
class RepoDifficulty:
    """A repository's theorem counts per class, unrated theorems already distributed."""

    name: str
    easy: int
    medium: int
    hard: int
    hard_no_proof: int = 0

    def counts(self) -> dict[str, int]:
        return {EASY: self.easy, MEDIUM: self.medium, HARD: self.hard, HARD_NO_PROOF: self.hard_no_proof}


@dataclass(frozen=True)
class Curriculum:
    """The order LeanAgent learns repositories in, and why."""

    order: list[str]
    counts: dict[str, RepoDifficulty]
    # (p33, p67) over all rated difficulties; None when no theorem of any repository is rated.
    percentiles: tuple[float, float] | None
    kept: int = 0  # the first `kept` names of `order` were in the run already, in that order

    def to_json(self) -> dict:
        return {
            "order": list(self.order),
            "counts": {name: self.counts[name].counts() for name in self.order},
            "percentiles": list(self.percentiles) if self.percentiles is not None else None,
        }


def rate_percentiles(rated: Sequence[float]) -> tuple[float, float] | None:
    """`numpy.percentile(rated, [33, 67])`, called as the reference calls it (inf included)."""
    if not rated:
        return None
    with np.errstate(invalid="ignore"):  # inf - inf inside numpy's interpolation: nan, as in the reference
        p33, p67 = np.percentile(rated, list(PERCENTILES))
    return float(p33), float(p67)


def _distribute(n: int) -> tuple[int, int, int]:
    """The reference's split of n unrated theorems: n // 3 to Easy, n // 3 to Medium, the rest to Hard."""
    chunk = n // 3
    return chunk, chunk, n - 2 * chunk


def build_curriculum(repos: Mapping[str, Sequence[Theorem]], kept: Sequence[str] = ()) -> Curriculum:
    """The one implementation behind the flow's order-curriculum task and `leanagent curriculum`.

    `kept`: names of `repos` already in the run's sequence, in its order; they stay first, the others follow.
    """
    ratings = {name: [difficulty(t) for t in theorems] for name, theorems in repos.items()}
    rated = [r for rs in ratings.values() for r in rs if r is not None]
    percentiles = rate_percentiles(rated)
    counts: dict[str, RepoDifficulty] = {}
    for name, rs in ratings.items():
        tally = dict.fromkeys((EASY, MEDIUM, HARD, HARD_NO_PROOF, TO_DISTRIBUTE), 0)
        for r in rs:
            tally[category(r, percentiles)] += 1
        e, m, h = _distribute(tally[TO_DISTRIBUTE])
        counts[name] = RepoDifficulty(name, tally[EASY] + e, tally[MEDIUM] + m, tally[HARD] + h, tally[HARD_NO_PROOF])
    # sorted() is stable: repositories with equal Easy counts keep the given order.
    known = set(kept)
    new = sorted((name for name in repos if name not in known), key=lambda name: counts[name].easy, reverse=True)
    return Curriculum([*kept, *new], counts, percentiles, len(kept))


def load_repo_theorems(dataset_dir: Path, split: str = DEFAULT_SPLIT) -> list[Theorem]:
    """Every theorem of the split folder: train.json, val.json and test.json (a missing file adds none)."""
    folder = Path(dataset_dir) / split
    theorems: list[Theorem] = []
    for part in PARTS:
        path = folder / part_file(part)
        if path.is_file():
            theorems += load_split(path)
    return theorems


def curriculum_of_datasets(datasets: Mapping[str, Path], split: str = DEFAULT_SPLIT, kept: Sequence[str] = ()
                           ) -> Curriculum:
    """The curriculum of dataset folders, keyed by the names given (display names, folder names)."""
    return build_curriculum({name: load_repo_theorems(path, split=split) for name, path in datasets.items()}, kept)


def _tactics(difficulty: float) -> str:
    """A difficulty e^S read back as S, the number of tactics it stands for."""
    if math.isnan(difficulty):
        return "undefined"
    if math.isinf(difficulty):
        return "a proof with sorry"
    return f"{math.log(difficulty):.3g} tactics" if difficulty > 0 else "0 tactics"


def describe(curriculum: Curriculum) -> list[str]:
    """Human-readable lines: the percentiles, one line per repository in order, the order."""
    p = curriculum.percentiles
    lines = [f"percentiles of difficulty (e^tactics): p33 = {p[0]:.6g} ({_tactics(p[0])}), p67 = {p[1]:.6g} "
             f"({_tactics(p[1])})" if p is not None else "percentiles: none (no theorem has traced tactics)"]
    for k, name in enumerate(curriculum.order, 1):
        c = curriculum.counts[name]
        where = " (in the run already: keeps its place)" if k <= curriculum.kept else ""
        lines.append(f"{k}. {name}{where}: easy {c.easy}, medium {c.medium}, hard {c.hard}, "
                     f"hard (no proof) {c.hard_no_proof}")
    lines.append("order: " + ", ".join(curriculum.order))
    return lines
