"""Length-sorted sub-batches: how a pool of sequences is cut so that little compute goes to padding.

A training batch pads every context to the longest context and every premise to the longest premise.
On real LeanDojo lengths (proof states of 314 bytes on average, p90 592; premises from a few bytes to
the 1024-byte cut) only about 37% of the tokens processed that way are real. Sorting a pool by length
and cutting it into a few runs, each padded to its own longest, removes most of that padding; the
encoder sees every sequence with the same real tokens, and attention masks the padding, so every
embedding is the same up to float rounding (`tests/unit/test_sub_batches.py` checks gradients too).

Where to cut is a small dynamic programme over the sorted lengths: minimise the padded tokens of all
runs plus a fixed cost per run (`CALL_COST_TOKENS`: one more encoder call is not free), with no run
above the token budget (a single sequence longer than the budget is a run of its own). Widths are
rounded up to a multiple of 8, which matmul tiles and tensor cores prefer and which lets a compiled
encoder see fewer distinct shapes. No torch here: the plan is made from host-side lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH_MULTIPLE = 8
# What one more encoder call costs, in tokens of compute, by device type. On a CPU a call's overhead
# (Python, 12 layers of small ops) costs about as much as a token of byt5-small, so cutting often pays (nearly
# every processed token real on LeanDojo lengths, at about a dozen calls a step for batch 4). On a GPU a token
# costs far less and a call of a few hundred tokens is bound by kernel launches, so cuts must save more (fewer
# calls, more padding). The GPU figure is an estimate until measured (`scripts/gpu_run.sh` times both; the
# figures: docs/measurements.md).
CALL_COST_TOKENS = {"cpu": 64, "cuda": 512}
DEFAULT_CALL_COST_TOKENS = 512


def padded_width(length: int, multiple: int = WIDTH_MULTIPLE) -> int:
    return -(-int(length) // multiple) * multiple


@dataclass(frozen=True)
class SubBatch:
    """Positions (into the pool, in ascending length) encoded together, padded to `width` tokens."""

    rows: tuple[int, ...]
    width: int

    @property
    def tokens(self) -> int:
        return len(self.rows) * self.width


def plan_sub_batches(lengths: Sequence[int], budget: int, call_cost: int = DEFAULT_CALL_COST_TOKENS,
                     multiple: int = WIDTH_MULTIPLE) -> list[SubBatch]:
    """Cut a pool of sequences of these token lengths into sub-batches (see the module docstring).

    Every position appears in exactly one sub-batch; within one, positions are in ascending length
    (ties in their pool order), and the sub-batches come shortest first.
    """
    order = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    widths = [padded_width(max(int(lengths[i]), 1), multiple) for i in order]
    n = len(order)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = widths[j - 1]  # the longest of order[i:j]: widths ascend
        best_cost, best_i = None, j - 1
        for i in range(j - 1, -1, -1):
            if (j - i) * width > budget and j - i > 1:
                break
            cost = best[i] + (j - i) * width + call_cost
            if best_cost is None or cost < best_cost:
                best_cost, best_i = cost, i
        best[j], cut[j] = best_cost, best_i
    runs: list[SubBatch] = []
    j = n
    while j > 0:
        i = cut[j]
        runs.append(SubBatch(tuple(order[i:j]), widths[j - 1]))
        j = i
    return runs[::-1]


def call_cost_for(device_type: str) -> int:
    return CALL_COST_TOKENS.get(device_type, DEFAULT_CALL_COST_TOKENS)
