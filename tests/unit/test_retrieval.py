"""Batched retrieval of accessible premises equals the plain definition: rank all, keep the accessible, take k."""

from __future__ import annotations

import torch

from leanagent.model.evaluation import corpus_embedding_dtype
from leanagent.model.topk import top_k_accessible


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


def test_a_corpus_kept_in_bf16_scores_as_bf16_autocast_does_with_fp32():
    """Evaluation under bf16-mixed keeps the corpus in bf16: the same scores as autocast casting fp32 per batch."""
    g = torch.Generator().manual_seed(1)
    corpus = torch.nn.functional.normalize(torch.randn(3000, 96, generator=g), dim=1)
    context = torch.nn.functional.normalize(torch.randn(16, 96, generator=g), dim=1)
    accessible = torch.rand(16, 3000, generator=g) < 0.4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast_per_batch = top_k_accessible(context, corpus, accessible, k=20)
        stored = top_k_accessible(context, corpus.to(corpus_embedding_dtype("bf16-mixed", torch.device("cpu"))),
                                  accessible, k=20)
    assert cast_per_batch[0].dtype == torch.bfloat16
    assert torch.equal(cast_per_batch[0], stored[0]) and torch.equal(cast_per_batch[1], stored[1])
    without_autocast = top_k_accessible(context, corpus, accessible, k=20)
    assert not torch.equal(without_autocast[0].to(torch.bfloat16), stored[0])  # bf16 products do differ from fp32
    assert corpus_embedding_dtype("32-true", torch.device("cuda")) == torch.float32
    assert corpus_embedding_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert corpus_embedding_dtype(None, torch.device("cpu")) == torch.float32


def test_the_benchmarks_leanagent_style_search_finds_what_top_k_accessible_finds(tmp_path):
    """`leanagent bench` times LeanAgent's search as its baseline: it must find the same premises."""
    from leanagent.bench.retrieval import leanagent_style_nearest
    from leanagent.data.corpus import Corpus
    from leanagent.data.dataset import build_eval_examples
    from leanagent.data.synthetic import write_demo_repos
    from leanagent.data.theorems import load_split

    repo = write_demo_repos(tmp_path, 1, seed=2)[0]
    corpus = Corpus.from_jsonl(repo / "corpus.jsonl")
    examples = build_eval_examples(corpus, load_split(repo / "random" / "val.json"))[:20]
    g = torch.Generator().manual_seed(2)
    corpus_emb = torch.nn.functional.normalize(torch.randn(len(corpus), 32, generator=g), dim=1)
    ctx_emb = torch.nn.functional.normalize(torch.randn(len(examples), 32, generator=g), dim=1)
    mask = torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in examples])
    assert 0 < int(mask.sum(dim=1).min()) < len(corpus)  # each context sees some premises, not all
    scores, idx = top_k_accessible(ctx_emb, corpus_emb, mask, k=10)
    ref_scores, ref_idx = leanagent_style_nearest(corpus, examples, ctx_emb, corpus_emb, 10)
    for row, (s, i, rs, ri) in enumerate(zip(scores, idx, ref_scores, ref_idx, strict=True)):
        kept = torch.isfinite(s)
        assert i[kept].tolist() == ri, row
        assert torch.allclose(s[kept], torch.tensor(rs)), row
