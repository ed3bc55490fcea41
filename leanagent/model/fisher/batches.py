"""A Fisher batch's examples: padding for the ranks, their lengths (read once per batch) and sub-batches.

Both per-example estimators take a training batch apart by example: item i's context is row i, its
premise columns are rows i + j * batch size. The lengths come from the host-side lists that
`with_lengths` adds before the batch goes to the device, so no per-example read stalls a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from leanagent.model.sub_batches import plan_sub_batches


class PaddedForRanks(Dataset):
    """Pads to a multiple of the world size with flagged items, so the sampler adds no silent duplicates."""

    def __init__(self, base, world_size: int) -> None:
        self.base = base
        self.n = len(base)
        self.total = -(-self.n // world_size) * world_size if self.n else 0

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int):
        return self.base[i % self.n], i >= self.n

    def collate(self, items):
        batch = self.base.collate([item for item, _ in items])
        batch["is_padding"] = torch.tensor([pad for _, pad in items], dtype=torch.bool)
        return batch


def example_lengths(batch: dict[str, Any]) -> tuple[list[bool], list[int], list[list[int]]]:
    """Per batch item: is it padding, its context's length, and its premise columns' lengths.

    From the host-side lengths `with_lengths` adds; else in one host read of the masks."""
    b = len(batch["index"])
    padding = [bool(p) for p in batch["is_padding"].tolist()]
    if "context_lengths" in batch and "premise_lengths" in batch:
        ctx_lens, rows = list(batch["context_lengths"]), list(batch["premise_lengths"])
    else:
        both = torch.cat([batch["context_mask"].sum(dim=1), batch["premise_mask"].sum(dim=1)]).tolist()
        ctx_lens, rows = both[:b], both[b:]
    prem_lens = [[int(rows[i + j * b]) for j in range(len(rows) // b)] for i in range(b)]
    return padding, [int(x) for x in ctx_lens], prem_lens


def example_groups(batch: dict[str, Any], budget: int, call_cost: int, sort_by_length: bool) -> list[list[int]]:
    """The batch's non-padding items in groups that go through the encoder together.

    One group without `sort_by_length` (today's batch); with it, the items sorted by the tokens each takes
    padded alone (its context and its premise columns at their longest) and cut by `plan_sub_batches`
    under `budget`, which also bounds the memory a vectorised pass holds at once."""
    padding, ctx_lens, prem_lens = example_lengths(batch)
    items = [i for i, pad in enumerate(padding) if not pad]
    if not sort_by_length or len(items) <= 1:
        return [items] if items else []
    sizes = [ctx_lens[i] + len(prem_lens[i]) * max(prem_lens[i], default=0) for i in items]
    return [[items[k] for k in sub.rows] for sub in plan_sub_batches(sizes, budget, call_cost, multiple=1)]


def select_items(batch: dict[str, Any], items: list[int]) -> dict[str, Any]:
    """The batch of these items only, in this order, laid out as a collated batch (premises slot-major)."""
    b = len(batch["index"])
    cols = batch["premise_ids"].shape[0] // b
    device = batch["context_ids"].device
    rows = [i + j * b for j in range(cols) for i in items]
    keep, prem = torch.tensor(items, device=device), torch.tensor(rows, device=device)
    out = {"context_ids": batch["context_ids"][keep], "context_mask": batch["context_mask"][keep],
           "premise_ids": batch["premise_ids"][prem], "premise_mask": batch["premise_mask"][prem],
           "label": batch["label"][keep][:, prem], "index": batch["index"][keep],
           "is_padding": torch.zeros(len(items), dtype=torch.bool, device=batch["is_padding"].device)}
    for side, picked in (("context_lengths", items), ("premise_lengths", rows)):
        if side in batch:
            out[side] = [batch[side][r] for r in picked]
    return out
