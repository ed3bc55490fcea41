"""Batched retrieval of accessible premises equals the plain definition: rank all, keep the accessible, take k;
and the selection ranks as the one it replaced (kept here, `reference_select`), ties and all."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanagent.model.evaluation import corpus_embedding_dtype
from leanagent.model.topk import _masked, select_top_k, top_k_accessible

PROPERTY = settings(max_examples=400, deadline=None, derandomize=True)


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


def _reference_ordered(scores: torch.Tensor, keys: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    order = torch.sort(keys, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(scores.gather(1, order), dim=1, descending=True, stable=True).indices)
    if first is not None:
        order = order.gather(1, torch.sort((~first.gather(1, order)).to(torch.uint8), dim=1, stable=True).indices)
    return order


def reference_select(scores: torch.Tensor, accessible: torch.Tensor, k: int, slack: int = 4,
                     tie_key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection `top_k_accessible` made before it masked first, as it was: the `slack * k` best candidates
    unmasked, and every row they could not decide (fewer than k accessible among them, or a tie with the last
    candidate) masked and sorted in full by score, then key."""
    rows, n = scores.shape
    k = min(k, n)
    key = torch.arange(n, device=scores.device) if tie_key is None else tie_key.to(scores.device)
    width = min(n, slack * k)
    cand_scores, cand_idx = scores.topk(width, dim=1)
    ok = accessible.gather(1, cand_idx)
    order = _reference_ordered(cand_scores, key[cand_idx], first=ok)[:, :k]
    top_scores = cand_scores.gather(1, order).masked_fill(~ok.gather(1, order), float("-inf"))
    top_idx = cand_idx.gather(1, order)
    undecided = ok.sum(dim=1) < k
    if width < n:
        undecided |= top_scores[:, -1] == cand_scores[:, -1]
    short = undecided.nonzero().flatten()
    if len(short):
        masked = scores[short].masked_fill(~accessible[short], float("-inf"))
        full = _reference_ordered(masked, key.expand(len(short), n))[:, :k]
        top_scores[short], top_idx[short] = masked.gather(1, full), full
    return top_scores, top_idx


@st.composite
def selections(draw):
    """Scores with many ties (a few levels, rounded to bf16), masks from none to all accessible, k up to n and past
    it, and keys as callers give them: none, distinct, or evaluation's (-1 for premises of other corpora, which are
    never accessible)."""
    rows, n = draw(st.integers(1, 6)), draw(st.integers(1, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    levels = draw(st.sampled_from([1, 2, 3, 8, 64, 4096]))
    scores = (torch.randint(0, levels, (rows, n), generator=g) / levels + torch.randn(rows, n, generator=g) * 1e-3
              * draw(st.sampled_from([0, 1]))).to(torch.bfloat16)
    share = draw(st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0]))
    accessible = torch.rand(rows, n, generator=g) < share
    keys = draw(st.sampled_from(["none", "distinct", "evaluation"]))
    tie_key = None
    if keys == "distinct":
        tie_key = torch.randperm(n, generator=g) * 3 - n
    elif keys == "evaluation":
        held = torch.rand(n, generator=g) < 0.7
        tie_key = torch.where(held, torch.randperm(n, generator=g), -1)
        accessible &= held
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]))
    return scores.to(dtype), accessible, draw(st.integers(1, n + 2)), draw(st.integers(1, 4)), tie_key


@PROPERTY
@given(selections())
def test_the_selection_ranks_as_the_full_sort_it_replaced(case):
    scores, accessible, k, slack, tie_key = case
    got = select_top_k(scores, accessible, k, slack, tie_key)
    want = reference_select(scores, accessible, k, slack, tie_key)
    assert torch.equal(got.scores, want[0]) and torch.equal(got.indices, want[1])


def test_a_tie_past_the_candidates_is_taken_by_key_from_the_whole_row():
    """The k-th score shared by premises the candidates left out: the smallest keys win, wherever they are."""
    scores = torch.zeros(2, 40)
    scores[:, 5] = 1.0  # one premise above the tie
    key = torch.arange(40).flip(0)  # the last columns have the smallest keys
    accessible = torch.ones(2, 40, dtype=torch.bool)
    accessible[1, 30:] = False
    got = select_top_k(scores, accessible, 4, slack=2, tie_key=key)
    assert got.tied_rows == 2
    assert got.indices.tolist() == [[5, 39, 38, 37], [5, 29, 28, 27]]
    want = reference_select(scores, accessible, 4, 2, key)
    assert torch.equal(got.scores, want[0]) and torch.equal(got.indices, want[1])


def test_a_row_with_fewer_than_k_accessible_ends_as_the_full_sort_ends_it():
    scores = torch.rand(3, 50, generator=torch.Generator().manual_seed(3))
    accessible = torch.zeros(3, 50, dtype=torch.bool)
    accessible[0, [7, 20]] = True
    accessible[2] = True
    got = select_top_k(scores, accessible, 5, slack=2)
    assert got.tied_rows == 2  # rows 0 and 1 (none accessible), the -inf tie taken by key
    assert got.indices[0, 2:].tolist() == [0, 1, 2] and torch.isinf(got.scores[:2, 2:]).all()
    want = reference_select(scores, accessible, 5, 2)
    assert torch.equal(got.scores, want[0]) and torch.equal(got.indices, want[1])


def test_the_mask_on_the_floats_bits_is_where_bit_for_bit():
    special = torch.tensor([0.0, -0.0, 1.5, -2.25, float("inf"), float("-inf"), float("nan"), 1e-40, -3e38])
    accessible = torch.tensor([True, False] * 9).reshape(2, 9)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        scores = torch.stack([special, special.flip(0)]).to(dtype)
        got, want = _masked(scores, accessible), torch.where(accessible, scores, float("-inf"))
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
