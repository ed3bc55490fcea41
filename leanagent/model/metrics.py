"""Retrieval metrics as ReProver and LeanAgent report them.

Recall@k is the fraction of a context's ground-truth premises found in its top k, averaged
over contexts and reported in percent (LeanAgent logs `Recall@10_val` = 62.93, and its paper and
checkpoint names use the same unit); MRR is the mean reciprocal rank of the first ground-truth
premise (0 when none is retrieved), a fraction as in the reference. Contexts without ground
truth are not scored at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextScore:
    """One scored context; kept per context so that DDP shards can be merged without double counting."""

    index: int
    recall_at_1: float
    recall_at_10: float
    reciprocal_rank: float


def score_context(index: int, retrieved: Sequence[int], positives: Iterable[int]) -> ContextScore:
    pos = set(positives)
    if not pos:
        raise ValueError(f"context {index} has no ground-truth premise to score against")
    r1 = len(pos.intersection(retrieved[:1])) / len(pos)
    r10 = len(pos.intersection(retrieved[:10])) / len(pos)
    rr = 0.0
    for rank, premise in enumerate(retrieved, start=1):
        if premise in pos:
            rr = 1.0 / rank
            break
    return ContextScore(index, r1, r10, rr)


def aggregate(scores: Iterable[ContextScore]) -> dict[str, float]:
    """Recall@1/10 in percent and MRR, counting each context index once (DistributedSampler pads with repeats)."""
    unique: dict[int, ContextScore] = {}
    for s in scores:
        unique.setdefault(s.index, s)
    n = len(unique)
    if n == 0:
        return {"Recall@1": 0.0, "Recall@10": 0.0, "MRR": 0.0, "num_contexts": 0}
    vals = unique.values()
    return {
        "Recall@1": 100.0 * sum(s.recall_at_1 for s in vals) / n,
        "Recall@10": 100.0 * sum(s.recall_at_10 for s in vals) / n,
        "MRR": sum(s.reciprocal_rank for s in vals) / n,
        "num_contexts": n,
    }
