"""Nearest accessible premises: the retrieval step of evaluation, and of anything that queries an index.

One batched matrix product against the whole corpus embedding, then the best accessible premises
per context. LeanAgent instead sorts every premise per context and walks the ranking in Python,
testing membership in a set; it raises ValueError when fewer than k premises are accessible (the
first file of a repository). Here a context simply gets the accessible ones it has.

The selection (`select_top_k`) masks first and sorts only a few: the inaccessible scores become -inf (`_masked`,
the cost of a copy), the `slack * k` best of each row are taken (`topk`) and ordered. A row is decided there unless
its k-th score equals the last candidate's: premises of that score outside the candidates may come first by key,
and a row with fewer than k accessible premises ends in such a tie (at -inf). Those rows, and only they, take the
tied premises of the whole row by key (a `topk` of their ranks). The result is that of ordering each whole masked
row by score and key, and nothing sorts a whole row. (The selection before this took the candidates unmasked and
sorted in full every row they could not decide: at Mathlib's scale, where a context sees a few tenths of the
corpus, most rows, at several times the cost of the product.)

Equal scores are ordered by `tie_key` (smaller first; by default the column; equal keys by column): under bf16
the product rounds scores to 8 bits of mantissa and premises tie often (LeanAgent's ranking leaves their order to
its sort), and a ranking must not depend on where a premise's row happens to be: the same premises, embedded
together with other corpora's (`evaluation.CorpusEmbedding`) or alone, rank the same.

The product itself (`score_matrix`) takes one of the `SCORING` paths. bf16 rows on a CPU without bf16 matmuls (AVX2
only, as on most laptops) make oneDNN emulate the bf16 product: measured 3.6x slower than fp32 at width 1,472 and
7x at 64 (76k premises, an AMD EPYC with AVX2 only). There the rows are upcast to fp32 a chunk at a time, into one
reused buffer of `CHUNK_ELEMENTS` floats (memory stays bounded: no fp32 copy of the whole corpus), and multiplied
in fp32. `exact` says what the caller's scores are:

- not exact (evaluation: the product in the rows' dtype, as under bf16-mixed): the fp32 scores are rounded to
  the rows' dtype, as the bf16 product's output is, so the top k and its ties are the bf16 product's (both
  accumulate in fp32; only a sum within float rounding of a bf16 boundary could round the other way);
- exact (an index, `leanagent retrieve` and `serve`: products of the stored values in fp32, as LeanCopilot takes
  them in float64): bf16 rows on any CPU are upcast in chunks and the scores kept in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from leanagent.model.dtypes import cpu_has_bf16

SLACK = 2  # candidates per premise taken: a tie at the k-th score rarely reaches past 2k under bf16
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


class Selection(NamedTuple):
    """The k best accessible premises per row, best first, and how many rows took the tie path (`select_top_k`)."""

    scores: torch.Tensor  # (rows, k); a row with fewer than k accessible premises ends in -inf
    indices: torch.Tensor  # (rows, k) premise columns
    # Rows whose k-th score tied with the last candidate (among them every row with fewer than k accessible
    # premises), which took the tied premises from the whole row; the others were decided among the candidates.
    # `leanagent bench path` counts both: many tied rows, or a selection slower than the product, is a slow path.
    tied_rows: int


def _ordered(scores: torch.Tensor, keys: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """Positions of each row sorted by score (descending), equal scores by key (ascending), equal keys by `columns`
    (ascending; None: by position)."""
    order = None if columns is None else torch.sort(columns, dim=1).indices
    by_key = torch.sort(keys if order is None else keys.gather(1, order), dim=1, stable=True).indices
    order = by_key if order is None else order.gather(1, by_key)
    return order.gather(1, torch.sort(scores.gather(1, order), dim=1, descending=True, stable=True).indices)


# Each float dtype's integer of the same width: `_masked` works on the floats' bits.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def _masked(scores: torch.Tensor, accessible: torch.Tensor) -> torch.Tensor:
    """`torch.where(accessible, scores, -inf)`, bit for bit, in bitwise passes over the scores' bits: on a CPU
    `where` with a boolean mask is not vectorised (torch 2.13) and took about 5x the time of this, half the product's
    at width 64 (76k premises, one thread)."""
    bits = _BITS.get(scores.dtype)
    if bits is None:
        return torch.where(accessible, scores, float("-inf"))
    neg_inf = int(torch.tensor(float("-inf"), dtype=scores.dtype).view(bits))
    out = scores.view(bits) ^ neg_inf  # ((x ^ c) & all ones) ^ c == x; ((x ^ c) & 0) ^ c == c
    out &= accessible.to(bits).neg_()  # all ones where accessible, zero elsewhere
    out ^= neg_inf
    return out.view(scores.dtype)


def _key_ranks(key: torch.Tensor) -> torch.Tensor:
    """Each premise's place in the order by key, then column: one distinct integer per premise."""
    order = torch.sort(key, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(key), device=key.device)
    return ranks


def select_top_k(scores: torch.Tensor, accessible: torch.Tensor, k: int, slack: int = SLACK,
                 tie_key: torch.Tensor | None = None) -> Selection:
    """The k best accessible premises of each row of `scores` (contexts x premises), best first, equal scores by
    `tie_key` then column (module docstring). `accessible`: a boolean mask of the same shape."""
    accessible = accessible.to(scores.device)
    rows, n = scores.shape
    k = min(k, n)
    if k == 0:
        return Selection(scores[:, :0], torch.zeros(rows, 0, dtype=torch.long, device=scores.device), 0)
    key = torch.arange(n, device=scores.device) if tie_key is None else tie_key.to(scores.device)
    masked = _masked(scores, accessible)
    width = min(n, slack * k)
    cand_scores, cand_idx = masked.topk(width, dim=1)
    # With the default key (the column) the key orders equal keys too; a given key may repeat (evaluation's -1 for
    # premises of other corpora, never accessible), and then the column does.
    order = _ordered(cand_scores, key[cand_idx], None if tie_key is None else cand_idx)[:, :k]
    top_scores, top_idx = cand_scores.gather(1, order), cand_idx.gather(1, order)
    if width == n:
        return Selection(top_scores, top_idx, 0)
    tied = (top_scores[:, -1] == cand_scores[:, -1]).nonzero().flatten()
    if len(tied):
        # Every premise scoring above the k-th is among the candidates, in order; the rest of the k are the
        # premises of the k-th score with the smallest (key, column), from the whole row.
        row = masked[tied]
        last = top_scores[tied, -1:]
        above = (top_scores[tied] > last).sum(dim=1, keepdim=True)
        ranks = key if tie_key is None else _key_ranks(key)
        by_key = torch.where(row == last, ranks, n).topk(k, dim=1, largest=False).indices
        place = torch.arange(k, device=scores.device)[None]
        picked = torch.where(place < above, top_idx[tied], by_key.gather(1, (place - above).clamp(min=0)))
        top_scores[tied], top_idx[tied] = row.gather(1, picked), picked
    return Selection(top_scores, top_idx, len(tied))


def top_k_accessible(context_emb: torch.Tensor, corpus_emb: torch.Tensor, accessible: torch.Tensor,
                     k: int, slack: int = SLACK, tie_key: torch.Tensor | None = None, exact: bool = False,
                     path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, premise indices) of the k best accessible premises per context, best first.

    `accessible` is a (contexts x premises) boolean mask. Rows with fewer than k accessible premises
    end in -inf scores. The product runs in the corpus embedding's dtype (bf16 on a GPU, as under
    bf16-mixed autocast, where evaluation runs). `tie_key`: one integer per premise, which orders equal
    scores (default: the premise's index). `exact` and `path`: how the product runs (`score_matrix`; default path:
    `scoring_path`'s). The selection: `select_top_k`.
    """
    scores = score_matrix(context_emb, corpus_emb, path or scoring_path(corpus_emb, exact), exact)
    selection = select_top_k(scores, accessible, k, slack, tie_key)
    return selection.scores, selection.indices
