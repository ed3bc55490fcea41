"""Nearest accessible premises: the retrieval step of evaluation, and of anything that queries an index.

One batched matrix product against the whole corpus embedding, then the best accessible premises
per context. LeanAgent instead sorts every premise per context and walks the ranking in Python,
testing membership in a set; it raises ValueError when fewer than k premises are accessible (the
first file of a repository). Here a context simply gets the accessible ones it has.

Masking the whole score matrix before the top k costs more than the product itself on a CPU
(a 64 x 180k fill), and a context can usually see a large share of the corpus. So the top
`slack * k` candidates are taken unmasked, the accessible ones among them kept in rank order, and
only a context with fewer than k accessible candidates (rare) is masked and ranked in full. The
result is the same as masking first.
"""

from __future__ import annotations

import torch

SLACK = 4


def top_k_accessible(context_emb: torch.Tensor, corpus_emb: torch.Tensor, accessible: torch.Tensor,
                     k: int, slack: int = SLACK) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, premise indices) of the k best accessible premises per context, best first.

    `accessible` is a (contexts x premises) boolean mask. Rows with fewer than k accessible premises
    end in -inf scores. The product runs in the corpus embedding's dtype (bf16 on a GPU, as under
    bf16-mixed autocast, where evaluation runs).
    """
    scores = context_emb.to(corpus_emb.dtype) @ corpus_emb.t()
    accessible = accessible.to(scores.device)
    rows, n = scores.shape
    k = min(k, n)
    cand_scores, cand_idx = scores.topk(min(n, slack * k), dim=1)
    ok = accessible.gather(1, cand_idx)
    # Accessible candidates first, each group kept in rank order (a stable sort on "not accessible").
    order = torch.sort((~ok).to(torch.uint8), dim=1, stable=True).indices[:, :k]
    top_scores = cand_scores.gather(1, order).masked_fill(~ok.gather(1, order), float("-inf"))
    top_idx = cand_idx.gather(1, order)
    short = (ok.sum(dim=1) < k).nonzero().flatten()
    if len(short):  # too few accessible among the candidates: rank those rows in full
        masked = scores[short].masked_fill(~accessible[short], float("-inf"))
        top_scores[short], top_idx[short] = masked.topk(k, dim=1)
    return top_scores, top_idx
