"""Nearest accessible premises: the retrieval step of evaluation, and of anything that queries an index.

One batched matrix product against the whole corpus embedding, then the best accessible premises
per context. LeanAgent instead sorts every premise per context and walks the ranking in Python,
testing membership in a set; it raises ValueError when fewer than k premises are accessible (the
first file of a repository). Here a context simply gets the accessible ones it has.

Masking the whole score matrix before the top k costs more than the product itself on a CPU
(a 64 x 180k fill), and a context can usually see a large share of the corpus. So the top
`slack * k` candidates are taken unmasked, the accessible ones among them kept in rank order, and
only a context whose candidates cannot decide (fewer than k accessible among them, or a tie with
the last candidate reaching into its top k) is masked and ranked in full. The result is the same
as masking first.

Equal scores are ordered by `tie_key` (smaller first; by default the column): under bf16 the
product rounds scores to 8 bits of mantissa and premises tie often (LeanAgent's ranking leaves
their order to its sort), and a ranking must not depend on where a premise's row happens to be:
the same premises, embedded together with other corpora's (`evaluation.CorpusEmbedding`) or alone,
rank the same.
"""

from __future__ import annotations

import torch

SLACK = 4


def _ordered(scores: torch.Tensor, keys: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """Positions of each row sorted by score (descending), equal scores by key (ascending); with `first`, rows'
    True entries before their False ones (each group in that order)."""
    order = torch.sort(keys, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(scores.gather(1, order), dim=1, descending=True, stable=True).indices)
    if first is not None:
        order = order.gather(1, torch.sort((~first.gather(1, order)).to(torch.uint8), dim=1, stable=True).indices)
    return order


def top_k_accessible(context_emb: torch.Tensor, corpus_emb: torch.Tensor, accessible: torch.Tensor,
                     k: int, slack: int = SLACK, tie_key: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, premise indices) of the k best accessible premises per context, best first.

    `accessible` is a (contexts x premises) boolean mask. Rows with fewer than k accessible premises
    end in -inf scores. The product runs in the corpus embedding's dtype (bf16 on a GPU, as under
    bf16-mixed autocast, where evaluation runs). `tie_key`: one integer per premise, which orders equal
    scores (default: the premise's index).
    """
    scores = context_emb.to(corpus_emb.dtype) @ corpus_emb.t()
    accessible = accessible.to(scores.device)
    rows, n = scores.shape
    k = min(k, n)
    key = torch.arange(n, device=scores.device) if tie_key is None else tie_key.to(scores.device)
    width = min(n, slack * k)
    cand_scores, cand_idx = scores.topk(width, dim=1)
    ok = accessible.gather(1, cand_idx)
    # Accessible candidates first, each group best first, equal scores by key.
    order = _ordered(cand_scores, key[cand_idx], first=ok)[:, :k]
    top_scores = cand_scores.gather(1, order).masked_fill(~ok.gather(1, order), float("-inf"))
    top_idx = cand_idx.gather(1, order)
    # Undecided among the candidates: too few accessible, or the last candidate ties with the k-th best (premises
    # of that score outside the candidates may come first by key). Rank those rows in full.
    undecided = ok.sum(dim=1) < k
    if width < n:
        undecided |= top_scores[:, -1] == cand_scores[:, -1]
    short = undecided.nonzero().flatten()
    if len(short):
        masked = scores[short].masked_fill(~accessible[short], float("-inf"))
        full = _ordered(masked, key.expand(len(short), n))[:, :k]
        top_scores[short], top_idx[short] = masked.gather(1, full), full
    return top_scores, top_idx
