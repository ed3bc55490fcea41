"""The bench's corpus embedding (length-sorted against corpus order, fp32 and bf16) and retrieval (ours against
LeanAgent's search, on the same embeddings)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from leanagent.bench.results import EmbeddingFigures, RetrievalFigures
from leanagent.bench.timing import best_of_rounds, rate, sync
from leanagent.data.corpus import Corpus, FileRecord
from leanagent.data.dataset import tokenize_premises
from leanagent.model.retriever import PremiseRetriever
from leanagent.model.topk import score_matrix, scoring_path, select_top_k, top_k_accessible


def sub_corpus(corpus: Corpus, indices: list[int]) -> Corpus:
    """A corpus of some premises only (one file), for timing the embedding on a sample."""
    return Corpus([FileRecord("bench.lean", [], [dataclasses.replace(corpus.premises[i], path="bench.lean")
                                                 for i in indices])])


def bench_embedding(model: PremiseRetriever, corpus: Corpus, device: torch.device, sample: int,
                    precision_dtype: torch.dtype | None, min_seconds: float) -> EmbeddingFigures:
    """Premises/s of `embed_corpus` (length-sorted, token budget) and of corpus-order batches, same sample.

    Both in fp32, as evaluation embeds the corpus by default (outside autocast, as LeanAgent does); then
    the sorted path again under bf16 autocast, what `model.corpus_autocast: true` runs.
    """
    rng = random.Random(1)
    picked = sorted(rng.sample(range(len(corpus)), min(sample, len(corpus))))
    sub = sub_corpus(corpus, picked)
    max_len, step = model.options.max_seq_len, model.options.eval_batch_size

    def sorted_run(autocast: bool = False) -> int:
        with torch.autocast(device.type, dtype=precision_dtype, enabled=autocast and precision_dtype is not None):
            model.embed_corpus(sub)
        sync(device)
        return len(sub)

    @torch.no_grad()
    def unsorted_run() -> int:
        for i in range(0, len(sub), step):
            ids, mask = tokenize_premises(model.tokenizer, sub, range(i, min(i + step, len(sub))), max_len)
            model.encode(ids.to(device), mask.to(device))
        sync(device)
        return len(sub)

    fast = rate(sorted_run, min_seconds, min_calls=1)
    slow = rate(unsorted_run, min_seconds, min_calls=1)
    autocast = None
    if precision_dtype is not None:
        autocast = rate(lambda: sorted_run(autocast=True), min_seconds, min_calls=1)
    lengths = np.minimum([len(p.text.encode()) + 1 for p in sub.premises], max_len)
    padded = sum(len(lengths[i: i + step]) * lengths[i: i + step].max() for i in range(0, len(lengths), step))
    return EmbeddingFigures(embed_premises_per_s=fast, embed_unsorted_premises_per_s=slow, embed_speedup=fast / slow,
                            embed_autocast_premises_per_s=autocast,
                            embed_autocast_speedup=None if autocast is None else autocast / fast,
                            embed_sample=len(sub), corpus_order_padding_fraction=1 - lengths.sum() / padded)


def bench_retrieval(corpus: Corpus, evals: list, width: int, device: torch.device,
                    precision_dtype: torch.dtype | None, min_seconds: float, k: int = 100, batch: int = 64
                    ) -> RetrievalFigures | None:
    """ms per context of the top-k accessible premises, the accessibility masks included (as evaluation does),
    against LeanAgent's search on the first batch; each part alone (the masks, the product, the selection); and the
    rows each path of the selection took (`leanagent.model.topk.Selection`): a selection that outgrows the product,
    or rows that leave the candidates, show in the table. The five passes take turns (`best_of_rounds`), so that
    their ratios hold on a busy machine. None without evaluation examples."""
    if not evals:
        return None
    g = torch.Generator().manual_seed(0)
    dtype = precision_dtype or torch.float32
    corpus_emb = torch.nn.functional.normalize(torch.randn(len(corpus), width, generator=g), dim=1).to(device, dtype)
    contexts = evals[: 4 * batch]
    ctx_emb = torch.nn.functional.normalize(torch.randn(len(contexts), width, generator=g), dim=1).to(device)
    batches = [(ctx_emb[i: i + batch], contexts[i: i + batch]) for i in range(0, len(contexts), batch)]
    path = scoring_path(corpus_emb)

    def mask(part: list) -> torch.Tensor:
        return torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in part]).to(device)

    masks = [mask(part) for _, part in batches]
    products = [score_matrix(emb, corpus_emb, path) for emb, _ in batches]
    first_emb, first = batches[0]
    passes = {
        "ours": lambda: [top_k_accessible(emb, corpus_emb, mask(part), k) for emb, part in batches],
        "leanagent": lambda: leanagent_style_nearest(corpus, first, first_emb, corpus_emb, k),
        "mask": lambda: [mask(part) for _, part in batches],
        "product": lambda: [score_matrix(emb, corpus_emb, path) for emb, _ in batches],
        "selection": lambda: [select_top_k(scores, m, k) for scores, m in zip(products, masks, strict=True)],
    }
    seconds, last = best_of_rounds(passes, device, min_seconds)
    ms = {name: 1000.0 * t / (len(first) if name == "leanagent" else len(contexts)) for name, t in seconds.items()}
    tied = sum(selection.tied_rows for selection in last["selection"])
    # Scores, not indices: bf16 products tie often, and the two orders of tied premises may differ.
    ours, theirs = last["ours"][0][0], last["leanagent"][0]
    same = all(torch.equal(ours[j][torch.isfinite(ours[j])].float().cpu(), torch.tensor(ref, dtype=torch.float32))
               for j, ref in enumerate(theirs))
    return RetrievalFigures(retrieval_ms_per_context=ms["ours"], retrieval_width=width,
                            retrieval_leanagent_style_ms_per_context=ms["leanagent"],
                            retrieval_speedup=ms["leanagent"] / ms["ours"], retrieval_same_as_leanagent_style=same,
                            retrieval_scoring_path=path, retrieval_mask_ms_per_context=ms["mask"],
                            retrieval_product_ms_per_context=ms["product"],
                            retrieval_selection_ms_per_context=ms["selection"], retrieval_rows=len(contexts),
                            retrieval_rows_candidates=len(contexts) - tied, retrieval_rows_ties=tied)


def leanagent_style_nearest(corpus: Corpus, contexts: list, ctx_emb: torch.Tensor, corpus_emb: torch.Tensor,
                            k: int) -> tuple[list[list[float]], list[list[int]]]:
    """LeanAgent's nearest-premise search (`Corpus.get_nearest_premises`), rewritten here as the baseline.

    One product, a full descending sort of every row turned into Python lists, and per context its
    accessible premises gathered into a fresh set keyed by file path and then full name (LeanAgent's
    `PremiseSet`: the file's premises up to the theorem, then every imported file's, from a per-file
    cache), tested premise by premise down the ranking until k are found.
    """
    premises = corpus.premises
    scores = ctx_emb.to(corpus_emb.dtype) @ corpus_emb.t()
    ranked = scores.argsort(dim=1, descending=True).tolist()
    out_scores: list[list[float]] = []
    out_idx: list[list[int]] = []
    for j, (example, order) in enumerate(zip(contexts, ranked, strict=True)):
        accessible: dict[str, dict[str, int]] = {}
        for i in corpus.in_file_indices(example.file_path, example.theorem_start) + \
                corpus.imported_indices(example.file_path):
            accessible.setdefault(premises[i].path, {})[premises[i].full_name] = i
        found: list[int] = []
        found_scores: list[float] = []
        for i in order:
            names = accessible.get(premises[i].path)
            if names is not None and premises[i].full_name in names:
                found.append(i)
                found_scores.append(scores[j, i].item())
                if len(found) >= k:
                    break
        out_scores.append(found_scores)
        out_idx.append(found)
    return out_scores, out_idx
