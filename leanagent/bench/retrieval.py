"""The bench's corpus embedding (length-sorted against corpus order, fp32 and bf16) and retrieval (ours against
LeanAgent's search, on the same embeddings)."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import torch

from leanagent.bench.results import EmbeddingFigures, RetrievalFigures
from leanagent.bench.timing import rate, sync
from leanagent.data.corpus import Corpus, FileRecord
from leanagent.data.dataset import tokenize_premises
from leanagent.model.retriever import PremiseRetriever
from leanagent.model.topk import top_k_accessible


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
    """ms per context of the top-k accessible premises, the accessibility masks included (as evaluation does);
    None without evaluation examples."""
    if not evals:
        return None
    g = torch.Generator().manual_seed(0)
    dtype = precision_dtype or torch.float32
    corpus_emb = torch.nn.functional.normalize(torch.randn(len(corpus), width, generator=g), dim=1).to(device, dtype)
    contexts = evals[: 4 * batch]
    ctx_emb = torch.nn.functional.normalize(torch.randn(len(contexts), width, generator=g), dim=1).to(device)

    def run() -> int:
        for i in range(0, len(contexts), batch):
            part = contexts[i: i + batch]
            mask = torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in part])
            top_k_accessible(ctx_emb[i: i + len(part)], corpus_emb, mask.to(device), k)
        sync(device)
        return len(contexts)

    ours = 1000.0 / rate(run, min_seconds)
    # LeanAgent's search on the first batch, same embeddings and dtype: its time, and whether it finds the same.
    part = contexts[:batch]
    start = time.perf_counter()
    ref_scores, _ = leanagent_style_nearest(corpus, part, ctx_emb[: len(part)], corpus_emb, k)
    theirs = 1000.0 * (time.perf_counter() - start) / len(part)
    mask = torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in part])
    scores, _ = top_k_accessible(ctx_emb[: len(part)], corpus_emb, mask.to(device), k)
    # Scores, not indices: bf16 products tie often, and the two orders of tied premises may differ.
    same = all(torch.equal(scores[j][torch.isfinite(scores[j])].float().cpu(), torch.tensor(ref, dtype=torch.float32))
               for j, ref in enumerate(ref_scores))
    return RetrievalFigures(retrieval_ms_per_context=ours, retrieval_width=width,
                            retrieval_leanagent_style_ms_per_context=theirs, retrieval_speedup=theirs / ours,
                            retrieval_same_as_leanagent_style=same)


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
