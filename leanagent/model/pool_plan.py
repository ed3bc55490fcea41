"""How a pool of sequences (a batch's contexts, or its premises) is cut into encoder calls, and put back in order.

Why its own module: `PremiseRetriever.encode_pool` encodes the pieces in one autograd graph, and gradient caching
(`grad_cache.py`) encodes the same pieces twice, first without gradients and then with them, one at a time. Both
must cut the pool the same way and call the encoder in the same order, or their dropout draws would differ.

- Sorted (`model.sort_by_length`): the pool sorted by length and cut into token-budget runs (`plan_sub_batches`),
  each padded to its own longest (a multiple of 8).
- Padded: the pool as the collate function padded it, in one piece; or, with `rows_within_budget` (gradient
  caching's padded pools), consecutive rows at the pool's width, as many per piece as the token budget holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leanagent.model.sub_batches import plan_sub_batches


@dataclass
class TokenCount:
    """Real tokens (the attention masks' ones) and tokens processed (padding included) by the encoder."""

    real: int = 0
    processed: int = 0

    def __iadd__(self, other: TokenCount) -> TokenCount:
        self.real += other.real
        self.processed += other.processed
        return self

    def __add__(self, other: TokenCount) -> TokenCount:
        return TokenCount(self.real + other.real, self.processed + other.processed)

    @property
    def efficiency(self) -> float:
        return self.real / self.processed if self.processed else 1.0


@dataclass(frozen=True)
class Piece:
    """One encoder call: its rows' ids and mask, and whether any of them is padded (so the mask must be read)."""

    ids: torch.Tensor
    mask: torch.Tensor
    padded: bool


@dataclass(frozen=True)
class PoolPlan:
    """The pieces, in the order they are encoded; `order`: the pool row of each row of their concatenation (None:
    the pool's own order); `tokens`: the pool's real and processed tokens."""

    pieces: tuple[Piece, ...]
    order: tuple[int, ...] | None
    tokens: TokenCount

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pieces' embeddings, in the pool's order."""
        if self.order is None:
            return parts[0] if len(parts) == 1 else torch.cat(list(parts))
        inverse = torch.empty(len(self.order), dtype=torch.long)
        inverse[torch.tensor(self.order, dtype=torch.long)] = torch.arange(len(self.order))
        return torch.cat(list(parts))[inverse.to(parts[0].device, non_blocking=True)]

    def split(self, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A gradient of the pool's embeddings (in the pool's order), cut as the pieces are."""
        if self.order is not None:
            grad = grad.index_select(0, torch.tensor(self.order, dtype=torch.long, device=grad.device))
        return grad.split([len(piece.ids) for piece in self.pieces])


def plan_pool(input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Sequence[int] | None, sort: bool,
              budget: int, call_cost: int, rows_within_budget: bool = False) -> PoolPlan:
    """The plan of the module docstring. `lengths`: the sequences' real lengths, when known on the host (the collate
    functions give them), else read from the mask."""
    n, width = input_ids.shape
    if lengths is None:
        lengths = attention_mask.sum(dim=1).tolist()
    lengths = [int(x) for x in lengths]
    real = sum(lengths)
    if not sort or n == 0:
        step = max(1, budget // max(width, 1)) if rows_within_budget else max(n, 1)
        pieces = tuple(Piece(input_ids[lo:lo + step], attention_mask[lo:lo + step],
                             any(x < width for x in lengths[lo:lo + step])) for lo in range(0, n, step))
        return PoolPlan(pieces or (Piece(input_ids, attention_mask, False),), None, TokenCount(real, n * width))
    runs = plan_sub_batches(lengths, budget, call_cost)
    order = tuple(row for run in runs for row in run.rows)
    perm = torch.tensor(order, dtype=torch.long).to(input_ids.device, non_blocking=True)
    ids, mask = input_ids.index_select(0, perm), attention_mask.index_select(0, perm)
    widest = runs[-1].width
    if widest > width:  # the longest rounded up to a multiple of 8: pad the sorted copies a little more
        ids, mask = F.pad(ids, (0, widest - width)), F.pad(mask, (0, widest - width))
    pieces, lo = [], 0
    for run in runs:
        hi = lo + len(run.rows)
        pieces.append(Piece(ids[lo:hi, : run.width], mask[lo:hi, : run.width],
                            any(lengths[row] < run.width for row in run.rows)))
        lo = hi
    return PoolPlan(tuple(pieces), order, TokenCount(real, sum(run.tokens for run in runs)))
