"""LeanAgent's curriculum on a set small enough to compute by hand."""

from __future__ import annotations

import math

from leanagent.data.curriculum import RepoDifficulty, categorize, difficulty, order_repositories
from leanagent.data.theorems import Tactic, Theorem


def thm(n: int, sorry: bool = False) -> Theorem:
    tactics = [Tactic("simp", "⊢ p", "no goals", None) for _ in range(n)]
    if sorry:
        tactics.append(Tactic("sorry", "⊢ p", "no goals", None))
    return Theorem("t", "F.lean", (1, 1), (2, 1), "", "", tactics, None, "random/train.json")


def test_difficulty() -> None:
    assert difficulty(thm(2)) == math.exp(2)
    assert difficulty(thm(0)) is None
    assert difficulty(thm(1, sorry=True)) == math.inf
    assert difficulty(thm(800)) == math.inf  # e^800 overflows a float


def test_categorize_and_order() -> None:
    # Finite difficulties of all repos, sorted: e, e, e^2, e^2, e^3, e^4 (n = 6).
    # numpy linear percentile at rank q/100 * (n - 1):
    #   p33: rank 1.65 -> e   + 0.65 * (e^2 - e)   = 2.718 + 0.65 * 4.671  = 5.754
    #   p67: rank 3.35 -> e^2 + 0.35 * (e^3 - e^2) = 7.389 + 0.35 * 12.696 = 11.833
    # So e is Easy, e^2 Medium, e^3 and e^4 Hard, sorry (inf) Hard.
    # r2's four tactic-less theorems split like numpy.array_split(4, 3): 2 Easy, 1 Medium, 1 Hard.
    repos = {
        "r2": [thm(3), thm(1, sorry=True), thm(0), thm(0), thm(0), thm(0)],
        "r1": [thm(1), thm(1), thm(2)],
        "r3": [thm(2), thm(4)],
    }
    assert categorize(repos) == {
        "r2": RepoDifficulty("r2", 2, 1, 3),
        "r1": RepoDifficulty("r1", 2, 1, 0),
        "r3": RepoDifficulty("r3", 0, 1, 1),
    }
    assert order_repositories(repos) == ["r2", "r1", "r3"]  # r2 and r1 tie on 2 Easy: given order kept
    assert order_repositories({k: repos[k] for k in ("r3", "r1", "r2")}) == ["r1", "r2", "r3"]


def test_only_unproved_and_untraced() -> None:
    counts = categorize({"r": [thm(1, sorry=True), thm(0)]})
    assert counts["r"] == RepoDifficulty("r", 1, 0, 1)
