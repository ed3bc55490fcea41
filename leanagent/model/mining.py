"""Mined negatives (`data.negatives: mined`): each training context's hardest premises by the current model.

ANCE-style mining: a context's negatives come from the top `data.mined_pool` premises the model itself ranks
highest among those the context may use, its positives left out. The ranking is refreshed at every validation
from the premise embedding validation computes anyway (`PremiseRetriever.corpus_embedding`, which then holds the
premises the training contexts may use too: `RetrievalDataModule.retrieval_positions`), so no premise is
embedded an extra time; what mining adds is one no-grad pass over the training *contexts* (each distinct one
once) and a top-k against that embedding. Before the first validation there is no table and the negatives
are LeanAgent's random ones.

Under DDP the distinct contexts are dealt to the ranks round-robin and the rows all-gathered, so every rank
holds the one same table (and each context is encoded once). The table is plain integers (premise indices,
-1 past a short row), saved by the data module in every checkpoint, so a resumed epoch draws what an
uninterrupted one did (`RetrievalDataModule.state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from leanagent.data.corpus import Corpus
from leanagent.data.dataset import TrainExample, tokenize_texts
from leanagent.model.evaluation import CorpusEmbedding


def _distinct_contexts(examples: Sequence[TrainExample]) -> tuple[list[TrainExample], list[int]]:
    """One example per distinct (context, file, theorem start) and, per example, the row of its context.

    A tactic with several positives is several examples of one context: mined once, its positives all left out."""
    rows: dict[tuple, int] = {}
    firsts: list[TrainExample] = []
    positives: list[set[int]] = []
    of_example = []
    for ex in examples:
        key = (ex.context, ex.file_path, tuple(ex.theorem_start))
        if key not in rows:
            rows[key] = len(firsts)
            firsts.append(ex)
            positives.append(set())
        positives[rows[key]].update(ex.all_pos_premises)
        positives[rows[key]].add(ex.pos_premise)
        of_example.append(rows[key])
    return [_with_positives(ex, pos) for ex, pos in zip(firsts, positives, strict=True)], of_example


def _with_positives(ex: TrainExample, positives: set[int]) -> TrainExample:
    return TrainExample(index=ex.index, context=ex.context, file_path=ex.file_path, theorem_start=ex.theorem_start,
                        pos_premise=ex.pos_premise, all_pos_premises=sorted(positives))


@torch.no_grad()
def mine_table(model, embedding: CorpusEmbedding, corpus: Corpus, examples: Sequence[TrainExample], pool: int,
               context_max_len: int, batch_size: int, progress: Callable[[str], None] | None = None) -> torch.Tensor:
    """(len(examples), pool) int32 on the CPU: row e is example e's top `pool` accessible non-positive premises by
    `model` against `embedding` (of `corpus`'s premises), best first, -1 where it has fewer. The same on every rank
    (see the module docstring). `progress`: called after each batch (the heartbeat a watchdog reads)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    distinct, of_example = _distinct_contexts(examples)

    def owned_by(r: int) -> list[int]:
        """Rank r's contexts, longest first (in batches: little padding, the largest batch's memory known at once);
        the order its rows are gathered in."""
        return sorted(range(r, len(distinct), world), key=lambda i: -len(distinct[i].context))

    mine = owned_by(rank)
    shard_len = -(-len(distinct) // world)
    shard = torch.full((shard_len, pool), -1, dtype=torch.int64, device=embedding.emb.device)
    for lo in range(0, len(mine), batch_size):
        picked = mine[lo : lo + batch_size]
        shard[lo : lo + len(picked)] = _mine_batch(model, embedding, corpus, [distinct[i] for i in picked], pool,
                                                   context_max_len)
        if progress is not None:
            progress("mine-negatives")
    if world > 1:
        gathered = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(gathered, shard)
    else:
        gathered = [shard]
    table = torch.full((len(distinct), pool), -1, dtype=torch.int64)
    for r, part in enumerate(gathered):
        owned = owned_by(r)
        if owned:
            table[torch.tensor(owned)] = part[: len(owned)].cpu()
    return table[torch.tensor(of_example, dtype=torch.long)].to(torch.int32)


def _mine_batch(model, embedding: CorpusEmbedding, corpus: Corpus, batch: list[TrainExample], pool: int,
                context_max_len: int) -> torch.Tensor:
    device = embedding.emb.device
    ids, mask = tokenize_texts(model.tokenizer, [ex.context for ex in batch], context_max_len)
    context_emb, _ = model.encode_pool(ids.to(device), mask.to(device), mask.sum(dim=1).tolist())
    cache: dict[tuple, torch.Tensor] = {}
    rows = []
    for ex in batch:
        key = (ex.file_path, tuple(ex.theorem_start))
        if key not in cache:
            cache[key] = corpus.accessible_mask(ex.file_path, ex.theorem_start)
        allowed = cache[key].clone()
        allowed[torch.tensor(ex.all_pos_premises, dtype=torch.long)] = False
        rows.append(allowed)
    scores, idx = embedding.top_k(context_emb, torch.stack(rows), pool)
    idx = idx.masked_fill(~torch.isfinite(scores), -1)
    if idx.shape[1] < pool:  # a corpus smaller than the pool
        idx = torch.cat([idx, idx.new_full((len(batch), pool - idx.shape[1]), -1)], dim=1)
    return idx
