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

The product itself (`score_matrix`) takes one of the `SCORING` paths. bf16 rows on a CPU without bf16 matmuls (AVX2
only, as on most laptops) make oneDNN emulate the bf16 product, several times slower than fp32 (docs/differences.md
gives the figures). There the rows are upcast to fp32 a chunk at a time, into one
reused buffer of `CHUNK_ELEMENTS` floats (memory stays bounded: no fp32 copy of the whole corpus), and multiplied
in fp32. `exact` says what the caller's scores are:

- not exact (evaluation: the product in the rows' dtype, as under bf16-mixed): the fp32 scores are rounded to
  the rows' dtype, as the bf16 product's output is, so the top k and its ties are the bf16 product's (both
  accumulate in fp32; only a sum within float rounding of a bf16 boundary could round the other way);
- exact (an index, `leanagent retrieve` and `serve`: products of the stored values in fp32, as LeanCopilot takes
  them in float64): bf16 rows on any CPU are upcast in chunks and the scores kept in fp32.
"""

from __future__ import annotations

import torch

from leanagent.model.dtypes import cpu_has_bf16

SLACK = 4
NATIVE, FP32_CHUNKS = "native", "fp32-chunks"
SCORING = {NATIVE: "the product in the rows' dtype",
           FP32_CHUNKS: "bf16 rows upcast to fp32 in chunks, multiplied in fp32"}
CHUNK_ELEMENTS = 8 * 2**20  # the upcast buffer: 32 MiB of fp32 (5,698 rows of byt5-small's 1,472)


def scoring_path(rows: torch.Tensor, exact: bool = False, bf16_matmuls: bool | None = None) -> str:
    """The `SCORING` path a product with `rows` takes (module docstring). `bf16_matmuls`: whether the CPU has
    them (default: asked of torch, `cpu_has_bf16`); given by a test to take the other branch."""
    if rows.dtype != torch.bfloat16 or rows.device.type != "cpu":
        return NATIVE
    if exact:
        return FP32_CHUNKS
    return NATIVE if (cpu_has_bf16() if bf16_matmuls is None else bf16_matmuls) else FP32_CHUNKS


def score_matrix(context_emb: torch.Tensor, rows: torch.Tensor, path: str = NATIVE, exact: bool = False
                 ) -> torch.Tensor:
    """`context_emb @ rows.T` by `path`. Not `exact`: the contexts rounded to the rows' dtype (as the product in
    that dtype takes them) and the result in the rows' dtype. `exact` on the fp32 path: the contexts as they are and
    the result in fp32."""
    if path not in SCORING:
        raise ValueError(f"scoring path {path!r}: one of {', '.join(SCORING)}")
    if path == NATIVE:
        return context_emb.to(rows.dtype) @ rows.t()
    context = context_emb.float() if exact else context_emb.to(rows.dtype).float()
    n, width = rows.shape
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    buffer = torch.empty(min(step, n), width, dtype=torch.float32, device=rows.device)
    # Scores transposed (a row per premise), so that each chunk's product is written in place, contiguous: two
    # operations a chunk (the upcast, the product), each a parallel region a loaded CPU must gather its threads for.
    flipped = torch.empty(n, context.shape[0], dtype=torch.float32, device=rows.device)
    with torch.autocast(rows.device.type, enabled=False):  # in evaluation's autocast: fp32 here, as said
        for lo in range(0, n, step):
            part = buffer[: min(step, n - lo)]
            part.copy_(rows[lo: lo + step])
            torch.mm(part, context.t(), out=flipped[lo: lo + len(part)])
    return flipped.t().contiguous() if exact else flipped.t().to(rows.dtype).contiguous()


def _ordered(scores: torch.Tensor, keys: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """Positions of each row sorted by score (descending), equal scores by key (ascending); with `first`, rows'
    True entries before their False ones (each group in that order)."""
    order = torch.sort(keys, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(scores.gather(1, order), dim=1, descending=True, stable=True).indices)
    if first is not None:
        order = order.gather(1, torch.sort((~first.gather(1, order)).to(torch.uint8), dim=1, stable=True).indices)
    return order


def top_k_accessible(context_emb: torch.Tensor, corpus_emb: torch.Tensor, accessible: torch.Tensor,
                     k: int, slack: int = SLACK, tie_key: torch.Tensor | None = None, exact: bool = False,
                     path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, premise indices) of the k best accessible premises per context, best first.

    `accessible` is a (contexts x premises) boolean mask. Rows with fewer than k accessible premises
    end in -inf scores. The product runs in the corpus embedding's dtype (bf16 on a GPU, as under
    bf16-mixed autocast, where evaluation runs). `tie_key`: one integer per premise, which orders equal
    scores (default: the premise's index). `exact` and `path`: how the product runs (`score_matrix`; default path:
    `scoring_path`'s).
    """
    scores = score_matrix(context_emb, corpus_emb, path or scoring_path(corpus_emb, exact), exact)
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
