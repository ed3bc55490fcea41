"""Batched retrieval of accessible premises equals the plain definition: rank all, keep the accessible, take k."""

from __future__ import annotations

import torch

from leanagent.model.retrieval import top_k_accessible


def plain_top_k(context: torch.Tensor, corpus: torch.Tensor, accessible: torch.Tensor, k: int) -> list[list[int]]:
    out = []
    for c, ok in zip(context, accessible, strict=True):
        ranked = sorted(range(len(corpus)), key=lambda i: -float(c @ corpus[i]))
        out.append([i for i in ranked if ok[i]][:k])
    return out


def test_top_k_accessible_matches_the_plain_definition():
    g = torch.Generator().manual_seed(0)
    corpus = torch.nn.functional.normalize(torch.randn(300, 16, generator=g, dtype=torch.float64), dim=1)
    context = torch.nn.functional.normalize(torch.randn(12, 16, generator=g, dtype=torch.float64), dim=1)
    accessible = torch.rand(12, 300, generator=g) < 0.3
    accessible[0] = False
    accessible[0, :5] = True  # fewer accessible premises than k: no error, only those five
    scores, idx = top_k_accessible(context, corpus, accessible, k=10)
    got = [[int(i) for i, s in zip(row_i, row_s, strict=True) if torch.isfinite(s)] for row_i, row_s in zip(idx, scores,
                                                                                                          strict=True)]
    assert got == plain_top_k(context, corpus, accessible, 10)
    assert len(got[0]) == 5
    assert torch.all(scores[:, :-1] >= scores[:, 1:])  # best first
