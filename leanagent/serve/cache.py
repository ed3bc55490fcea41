"""The server's cache of new-premise embeddings: a client sends the same unindexed premises with every request.

Bounded in bytes, not entries: a text is kept by its digest (16 bytes), never whole (a declaration may be 100 kB),
and what an entry costs is counted as its row plus a fixed overhead, so that any texts, however long, hold at most
`capacity_bytes` between them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

ENTRY_OVERHEAD = 200  # bytes of a key, a tensor object and the dict's slot, beside the row's own


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class EmbeddingCache:
    """New-premise embeddings by serialized text, least recently used dropped beyond `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def _size(row: torch.Tensor) -> int:
        return row.numel() * row.element_size() + ENTRY_OVERHEAD

    def lookup(self, texts: Sequence[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
        found, missing = {}, []
        for text in dict.fromkeys(texts):
            key = _key(text)
            row = self._rows.get(key)
            if row is None:
                missing.append(text)
            else:
                self._rows.move_to_end(key)
                found[text] = row
        self.hits += len(found)
        self.misses += len(missing)
        return found, missing

    def store(self, texts: Sequence[str], rows: torch.Tensor) -> None:
        for text, row in zip(texts, rows, strict=True):
            key = _key(text)
            row = row.clone()  # not a view: a view would keep its whole batch's storage alive
            if key in self._rows:
                self.bytes -= self._size(self._rows.pop(key))
            if self._size(row) > self.capacity:
                continue
            self._rows[key] = row
            self.bytes += self._size(row)
        while self.bytes > self.capacity and self._rows:
            _, dropped = self._rows.popitem(last=False)
            self.bytes -= self._size(dropped)
