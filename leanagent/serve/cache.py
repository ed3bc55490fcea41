"""The server's cache of new-premise embeddings: a client sends the same unindexed premises with every request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class EmbeddingCache:
    """New-premise embeddings by serialized text, least recently used dropped beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, texts: Sequence[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
        found, missing = {}, []
        for text in dict.fromkeys(texts):
            row = self._rows.get(text)
            if row is None:
                missing.append(text)
            else:
                self._rows.move_to_end(text)
                found[text] = row
        self.hits += len(found)
        self.misses += len(missing)
        return found, missing

    def store(self, texts: Sequence[str], rows: torch.Tensor) -> None:
        if not self.capacity:
            return
        for text, row in zip(texts, rows, strict=True):
            self._rows[text] = row
            self._rows.move_to_end(text)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)
