"""How the report prints a number: recalls in percent (2 decimals), MRR a fraction (3), metrics as the paper; and a
repository's name in a column of fixed width."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leanagent.report.metrics import REGISTRY


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mean_of(values: Any) -> float | None:
    """The mean of the values, or None when one is missing (an average over part of the seen repositories misleads)."""
    vals = list(values)
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def pct(value: float | None) -> str:
    """A recall in percent (or a difference of recalls), 2 decimals."""
    return "-" if value is None else f"{value:.2f}"


def mrr(value: float | None) -> str:
    """An MRR, a fraction as in LeanAgent, 3 decimals."""
    return "-" if value is None else f"{value:.3f}"


def metric(name: str, value: float | None) -> str:
    """A lifelong metric as the paper prints it: its table entry's decimals (2; CFR, a ratio, 3)."""
    if value is None:
        return "-"
    entry = REGISTRY.get(name)
    return f"{value:.{entry.decimals if entry else 2}f}"


ELLIPSIS = "…"


def fit(name: str, width: int) -> str:
    """`name` in at most `width` characters: whole when it fits, else cut and ended with an ellipsis, so that a cut
    name never reads as a whole one ("Mathematics in" for "Mathematics in Lean Source"). In a wide column the cut
    falls at a word's end when one is near ("Mathematics in Lean…", not "Mathematics in Lean S…")."""
    if len(name) <= width:
        return name
    head = name[: max(0, width - 1)]
    space = head.rfind(" ")
    if width >= 16 and space >= width - 6:
        head = head[:space]
    return head.rstrip() + ELLIPSIS
