"""The server's cache of new-premise embeddings: a client sends the same unindexed premises with every request.

Bounded in bytes as they are, not as estimated: a text is kept by its digest (16 bytes), never whole (a declaration
may be 100 kB), and the rows live in a few preallocated blocks (`CHUNKS` of them at most), not one tensor each. A
tensor per row costs several times the row's own bytes (its object, its storage, the allocator's rounding), so a
budget counted in rows held several times its size (figures: docs/measurements.md). Here `bytes` is the blocks' own
size plus `ENTRY_OVERHEAD` per entry (its digest, its slot number, the ordered dict's node), and stays within
`capacity_bytes`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

ENTRY_OVERHEAD = 200  # bytes of one entry's digest, slot number and dict node, rounded up from tracemalloc's count
CHUNKS = 16  # the rows' blocks: allocated one at a time as the cache fills, so an idle cache costs nothing


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class EmbeddingCache:
    """New-premise embeddings by serialized text, least recently used dropped beyond `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # digest -> row, least recently used first
        self._blocks: list[torch.Tensor] = []
        self._block_rows = 0
        self._rows = 0  # rows the blocks may hold at most, within the capacity
        self._free: list[int] = []
        self._next = 0  # the first row never used
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def bytes(self) -> int:
        """What the cache holds: its blocks' storage and its entries' bookkeeping."""
        return sum(b.untyped_storage().nbytes() for b in self._blocks) + len(self._slots) * ENTRY_OVERHEAD

    def _row(self, slot: int) -> torch.Tensor:
        return self._blocks[slot // self._block_rows][slot % self._block_rows]

    def lookup(self, texts: Sequence[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The cached rows (copies: a slot may be given to another text before the caller is done) and the texts
        not cached."""
        found, missing = {}, []
        for text in dict.fromkeys(texts):
            key = _key(text)
            slot = self._slots.get(key)
            if slot is None:
                missing.append(text)
            else:
                self._slots.move_to_end(key)
                found[text] = self._row(slot).clone()
        self.hits += len(found)
        self.misses += len(missing)
        return found, missing

    def _shape(self, rows: torch.Tensor) -> bool:
        """Size the blocks for this row width on the first store; whether any row fits at all."""
        if self._blocks or self._rows:
            return self._rows > 0
        row_bytes = rows.shape[1] * rows.element_size()
        self._rows = self.capacity // (row_bytes + ENTRY_OVERHEAD)
        self._block_rows = max(1, -(-self._rows // CHUNKS))
        # Whole blocks only: the last one must fit the capacity too.
        while self._rows and (-(-self._rows // self._block_rows)) * self._block_rows * row_bytes \
                + self._rows * ENTRY_OVERHEAD > self.capacity:
            self._rows -= 1
        return self._rows > 0

    def _take_slot(self, rows: torch.Tensor) -> int:
        if self._free:
            return self._free.pop()
        if self._next < self._rows:
            if self._next == len(self._blocks) * self._block_rows:
                self._blocks.append(torch.empty(self._block_rows, rows.shape[1], dtype=rows.dtype,
                                                device=rows.device))
            self._next += 1
            return self._next - 1
        _, slot = self._slots.popitem(last=False)  # full: the least recently used goes
        return slot

    def store(self, texts: Sequence[str], rows: torch.Tensor) -> None:
        if not len(texts) or not self._shape(rows):
            return
        if self._blocks and (rows.shape[1] != self._blocks[0].shape[1] or rows.dtype != self._blocks[0].dtype):
            return  # not this cache's rows (one server embeds at one width and dtype)
        for text, row in zip(texts, rows, strict=True):
            key = _key(text)
            slot = self._slots.pop(key, None)
            if slot is None:
                slot = self._take_slot(rows)
            self._row(slot).copy_(row)
            self._slots[key] = slot
