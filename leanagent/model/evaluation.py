"""Retrieval evaluation: embed the premises, rank each context's accessible ones, score the ranking.

Validation (every epoch of a training job) and test (the evaluation jobs) share it, as in ReProver, whose
retriever re-embeds its whole corpus at the start of each. At LeanAgent's scale that corpus is mostly Mathlib,
re-embedded with the same weights for every repository evaluated; so here:

- **Only what can be ranked** (`model.embed_premises: needed`): an evaluation embeds the premises accessible to
  at least one of its contexts (`RetrievalDataModule.premise_table`). A premise no context may use is never
  ranked, so the metrics are the same.
- **Once per model:** an evaluation job over several datasets embeds the union of what they need, each distinct
  premise once (`PremiseTable`), before its first test (`RetrievalEvaluation.share`); each dataset's contexts
  are then ranked against its own corpus's premises only, its accessibility masks mapped onto the union's rows
  (`CorpusEmbedding.top_k`).
- **The stage index for free:** a job that also writes a premise index keeps that table's embedding
  (`RetrievalEvaluation.keep`): its rows come from what the tests embedded (the shared union, or under `all` each
  test's whole corpus), and only premises no test embedded are embedded once more (`kept_embedding`).

A premise's embedding does not depend on its batch mates (padding is masked), so in fp32 each dataset's metrics
equal those of the dataset evaluated alone; `model.embed_premises: all` embeds every premise of each dataset's
corpus, once per dataset, as LeanAgent does.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from leanagent.data.dataset import tokenize_premises
from leanagent.data.premise_table import PremiseTable
from leanagent.model.metrics import ContextScore, aggregate, score_context
from leanagent.model.topk import scoring_path, top_k_accessible


def premise_token_lengths(source, max_len: int) -> np.ndarray:
    """ByT5 tokens of each premise (its UTF-8 bytes and `</s>`), capped at `max_len`."""
    encoded = source.premise_utf8(range(len(source)))  # cached per corpus: tokenization reuses these bytes
    return np.minimum(np.fromiter((len(b) + 1 for b in encoded), dtype=np.int64, count=len(encoded)), max_len)


def corpus_embedding_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    """The dtype to keep the corpus embedding in: the one retrieval's product runs in.

    Under bf16 precision the validation step runs in autocast, which rounds both operands of the product
    to bf16 on every batch (LeanAgent's too): storing them rounded once gives the same scores, half the
    memory and no per-batch cast of the whole corpus (on a CPU that cast cost as much as the product).
    Without a trainer (building an index), a GPU keeps bf16 and a CPU fp32.
    """
    if precision is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if str(precision).startswith("bf16") else torch.float32


def length_order(source, max_len: int) -> np.ndarray:
    """Premise indices by token length (stable): neighbours in this order pad little against each other."""
    return np.argsort(premise_token_lengths(source, max_len), kind="stable")


def token_budget_batches(lengths: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """[lo, hi) runs of a length-sorted sequence whose padded size (count x longest) stays within `budget`."""
    batches, lo, longest = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        longest = max(longest, length)
        if i > lo and (i + 1 - lo) * longest > budget:
            batches.append((lo, i))
            lo, longest = i, length
    if lo < len(lengths):
        batches.append((lo, len(lengths)))
    return batches


@torch.no_grad()
def embed_premises(model, source, batch_tokens: int | None = None, rows: Sequence[int] | None = None
                   ) -> torch.Tensor:
    """The embedding of every premise of `source` (a `Corpus` or a `PremiseTable`), in its order, on every rank.

    Premises are ordered by length and dealt round-robin to the ranks, so each rank gets a similar share of long
    ones; each rank encodes its share in token-budget batches of similar lengths, so little compute goes to
    padding (taken in corpus order, about a quarter of the tokens of a real corpus are padding). The shards are
    then gathered and put back in order. Padding is masked, so the embeddings are those of unsorted batches up
    to float tolerance. They are stored in the dtype retrieval multiplies them in (`corpus_embedding_dtype`).
    `batch_tokens`: the padded-token budget of one batch (default: `options.embed_batch_tokens`). `rows`: only
    these indices of `source` (the result has one row per index, in that order).
    """
    clock = model.clock
    with clock.part("embed"):
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        max_len = model.options.max_seq_len
        picked = np.arange(len(source), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        n = len(picked)
        lengths = premise_token_lengths(source, max_len)[picked]
        order = np.argsort(lengths, kind="stable")
        shards = [order[r::world] for r in range(world)]
        mine = shards[rank]
        dim = model.encoder.config.d_model
        trainer = model._trainer
        dtype = corpus_embedding_dtype(trainer.precision if trainer is not None else None, model.device)
        shard = torch.zeros(-(-n // world), dim, device=model.device, dtype=dtype)
        for lo, hi in token_budget_batches(lengths[mine], batch_tokens or model.options.embed_batch_tokens):
            ids, mask = tokenize_premises(model.tokenizer, source, picked[mine[lo:hi]], max_len)
            padded = not bool(mask.all())  # read on the host, before the copy: no device sync
            shard[lo:hi] = model.encode(ids.to(model.device, non_blocking=True),
                                        mask.to(model.device, non_blocking=True), padded=padded).to(dtype)
            if model.progress_hook is not None:
                model.progress_hook("embed-corpus")
        clock.premises_embedded += n  # this rank's shard and the others': the job's count, summed over ranks
        full = torch.empty(n, dim, device=model.device, dtype=dtype)
        if world == 1:
            full[torch.from_numpy(mine).to(model.device)] = shard[: len(mine)]
            return full
        gathered = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(gathered, shard)
        for part, idx in zip(gathered, shards, strict=True):
            full[torch.from_numpy(idx).to(model.device)] = part[: len(idx)]
        return full


@dataclass
class CorpusEmbedding:
    """The embedded rows of a premise table, seen from one of its corpora (`corpus`): ranks that corpus's contexts
    in the corpus's own premise indices, against its own premises only."""

    emb: torch.Tensor  # (rows of the table, width)
    table: PremiseTable
    corpus: int = 0
    _to_corpus: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of_corpus(cls, emb: torch.Tensor, corpus) -> CorpusEmbedding:
        """A whole corpus's embedding in corpus order (`embed_premises(model, corpus)`)."""
        return cls(emb, PremiseTable([corpus]))

    def to_corpus(self) -> torch.Tensor:
        """Per row, its index in this corpus (-1: a premise of another corpus, or not embedded for this one)."""
        if self._to_corpus is None or self._to_corpus.device != self.emb.device:
            self._to_corpus = torch.from_numpy(self.table.corpus_index(self.corpus).copy()).to(self.emb.device)
        return self._to_corpus

    def top_k(self, context_emb: torch.Tensor, accessible: torch.Tensor, k: int, path: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, corpus indices) of the k best accessible premises per context, best first (`top_k_accessible`);
        `accessible` is a (contexts x this corpus's premises) mask. Rows with fewer than k end in -inf scores.
        `path`: how the product runs (default `scoring_path`'s: on a CPU without bf16 matmuls, bf16 rows are
        multiplied in fp32 a chunk at a time, with the bf16 product's top k)."""
        to_corpus = self.to_corpus()
        held = to_corpus >= 0
        allowed = accessible.to(self.emb.device)[:, to_corpus.clamp(min=0)] & held
        # Equal scores in corpus order, wherever the rows are: the ranking of one corpus embedded alone.
        scores, rows = top_k_accessible(context_emb, self.emb, allowed, k, tie_key=to_corpus, path=path)
        return scores, to_corpus[rows]


class RetrievalEvaluation:
    """One model's validation or test in progress: the premise embedding, the scores so far, the metrics.

    The retriever's Lightning hooks call `start`, `step` and `finish`. A job that evaluates several datasets
    `share`s one table of their union first: the first evaluation that starts embeds it, the others rank from it.
    A table to `keep` (a premise index's, written when the job is done) is kept until `release`: a table both
    shared and kept is embedded once; otherwise (LeanAgent's `all`, each test embedding its own corpus) its rows
    are copied from the tests' embeddings as they run, and `kept_embedding` embeds only the rows no test did.
    """

    def __init__(self) -> None:
        self.embedding: CorpusEmbedding | None = None
        self._scores: list[ContextScore] = []
        self._shared: tuple[PremiseTable, int] | None = None
        self._kept: PremiseTable | None = None
        self._kept_rows: torch.Tensor | None = None  # the kept table's rows copied from the tests' embeddings
        self._kept_filled: np.ndarray | None = None
        self._embedded: dict[int, tuple[PremiseTable, torch.Tensor]] = {}

    def share(self, table: PremiseTable, corpus: int) -> None:
        """Rank the next evaluation against `table`'s embedding, as its corpus number `corpus`; embed the table at
        the first start that needs it, once (the same table again keeps its embedding)."""
        self._shared = (table, corpus)

    def keep(self, table: PremiseTable) -> None:
        """Keep `table`'s embedding for `kept_embedding`, embedding each of its rows once with what is ranked."""
        self._kept = table
        self._kept_rows, self._kept_filled = None, np.zeros(len(table), dtype=bool)

    def kept_embedding(self, model) -> torch.Tensor:
        """The kept table's embedding, once the evaluations have run: the rows no evaluation embedded are embedded
        now. Every rank calls it (embedding is collective)."""
        table = self._kept
        if table is None:
            raise RuntimeError("no table is kept")
        whole = self.embedding_of(table)
        if whole is not None:
            return whole
        assert self._kept_filled is not None
        missing = np.flatnonzero(~self._kept_filled)
        if len(missing):
            training = model.training
            model.eval()  # outside the test loop: no dropout, as the tests' embeddings had none
            try:
                with torch.inference_mode():  # as the test loop's (the rows copied so far are inference tensors)
                    part = self._embed(model, table, missing)
            finally:
                model.train(training)
            with torch.inference_mode():
                if self._kept_rows is None:
                    self._kept_rows = torch.zeros(len(table), part.shape[1], dtype=part.dtype, device=part.device)
                rows = torch.from_numpy(missing).to(self._kept_rows.device)
                self._kept_rows[rows] = part.to(self._kept_rows.dtype)
            self._kept_filled[missing] = True
        if self._kept_rows is None:  # a table of no rows
            return torch.zeros(0, model.encoder.config.d_model, device=model.device)
        return self._kept_rows

    def _fill_kept(self, corpus, table: PremiseTable, emb: torch.Tensor) -> None:
        """Copy into the kept table the rows of `emb` (the embedding of `table`, over `corpus` alone) that hold its
        premises (the same path, name and code, whichever corpus the kept table has them from) and are not there
        yet."""
        filled = self._kept_filled
        assert self._kept is not None and filled is not None
        to_kept, to_emb = self._kept.match(corpus), table.row_of(0)
        chosen = np.flatnonzero((to_kept >= 0) & (to_emb >= 0))
        chosen = chosen[~filled[to_kept[chosen]]]
        if not len(chosen):
            return
        if self._kept_rows is None:
            self._kept_rows = torch.zeros(len(self._kept), emb.shape[1], dtype=emb.dtype, device=emb.device)
        dst = torch.from_numpy(to_kept[chosen]).to(emb.device)
        self._kept_rows[dst] = emb[torch.from_numpy(to_emb[chosen]).to(emb.device)]
        filled[to_kept[chosen]] = True

    def embedding_of(self, table: PremiseTable) -> torch.Tensor | None:
        """The embedding of a shared or kept table, once a start has computed it."""
        found = self._embedded.get(id(table))
        return found[1] if found is not None and found[0] is table else None

    def release(self) -> None:
        """Forget the shared and kept tables and their embeddings (the memory goes back)."""
        self._shared, self._kept, self.embedding = None, None, None
        self._kept_rows, self._kept_filled = None, None
        self._embedded.clear()

    def _embedding(self, model, table: PremiseTable) -> torch.Tensor:
        emb = self.embedding_of(table)
        if emb is None:
            emb = self._embed(model, table)
            self._embedded[id(table)] = (table, emb)
        return emb

    def start(self, model, datamodule, split: str) -> None:
        model.clock.start("rank")
        model.clock.premises_in_corpora += len(datamodule.corpus)  # what embedding its whole corpus would embed
        self._scores = []
        if self._shared is not None:
            table, corpus = self._shared
            self.embedding = CorpusEmbedding(self._embedding(model, table), table, corpus)
            return
        with model.clock.part("data"):
            table = datamodule.premise_table(split, needed_only=model.options.embed_premises == "needed")
        emb = self._embed(model, table)
        self.embedding = CorpusEmbedding(emb, table)
        if self._kept is not None and len(table.corpora) == 1:
            self._fill_kept(datamodule.corpus, table, emb)

    @staticmethod
    def _embed(model, table: PremiseTable, rows: Sequence[int] | None = None) -> torch.Tensor:
        # Epoch-start hooks run outside Lightning's autocast, so by default the premises are embedded in fp32, as
        # LeanAgent's `reindex_corpus` (in `on_validation_start`) does; `corpus_autocast` opts into the trainer's
        # own autocast (the validation step's).
        autocast = model.trainer.precision_plugin.forward_context() if model.options.corpus_autocast \
            else nullcontext()
        with autocast:
            return model.embed_corpus(table, rows=rows)

    def step(self, model, batch: dict[str, Any]) -> None:
        assert self.embedding is not None
        context_emb, _ = model.encode_pool(batch["context_ids"], batch["context_mask"], batch.get("context_lengths"))
        path = scoring_path(self.embedding.emb)
        model.clock.scoring.add(path)  # result.json says which product ran (`leanagent.model.topk.SCORING`)
        top_scores, top_idx = self.embedding.top_k(context_emb, batch["accessible_mask"], model.options.num_retrieved,
                                                   path)
        for row, index in enumerate(batch["index"].tolist()):
            # Fewer accessible premises than k is normal (first file of a repo): keep only real hits.
            retrieved = top_idx[row][torch.isfinite(top_scores[row])].tolist()
            self._scores.append(score_context(index, retrieved, batch["pos_premises"][row]))

    def finish(self, model, suffix: str) -> dict[str, float]:
        scores = self._scores
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[list[ContextScore]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(parts, scores)
            scores = [s for part in parts for s in part]
        metrics = aggregate(scores)
        model.log(f"Recall@1{suffix}", metrics["Recall@1"], sync_dist=True)
        model.log(f"Recall@10{suffix}", metrics["Recall@10"], sync_dist=True)
        model.log("MRR", metrics["MRR"], sync_dist=True)
        self.embedding = None
        self._scores = []
        model.clock.stop("rank")
        return metrics
