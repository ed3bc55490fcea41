"""Nearest accessible premises: the retrieval step of evaluation, and of anything that queries an index.

One batched matrix product against the whole corpus embedding, then the premises a context may
not use are masked out before the top k is taken. LeanAgent instead sorts every premise per
context and walks the ranking in Python, testing membership in a set; it raises ValueError when
fewer than k premises are accessible (the first file of a repository). Here a context simply
gets the accessible ones it has (the -inf scores are dropped by the caller).
"""

from __future__ import annotations

import torch


def top_k_accessible(context_emb: torch.Tensor, corpus_emb: torch.Tensor, accessible: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, premise indices) of the k best accessible premises per context, best first.

    `accessible` is a (contexts x premises) boolean mask. Rows with fewer than k accessible premises
    end in -inf scores. The product runs in the corpus embedding's dtype (bf16 on a GPU, as under
    bf16-mixed autocast, where evaluation runs).
    """
    scores = context_emb.to(corpus_emb.dtype) @ corpus_emb.t()
    scores = scores.masked_fill_(~accessible.to(scores.device), float("-inf"))
    return scores.topk(min(k, scores.shape[1]), dim=1)
