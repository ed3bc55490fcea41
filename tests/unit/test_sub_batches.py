"""Length-sorted sub-batches: the plan, and that sorting changes nothing but float rounding.

Sorted sub-batches must compute the padded path's loss, gradients and evaluation: here in float64
(to 1e-10 relative) through the retriever and a real Lightning Trainer, dropout off (with dropout on,
masks are drawn for other shapes, which is the one thing sorting changes).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from transformers.models.t5.modeling_t5 import T5Attention

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.data.dataset import with_lengths
from leanagent.ground.config import DataConfig
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever
from leanagent.model.sub_batches import padded_width, plan_sub_batches


def cost(runs, call_cost: int) -> int:
    return sum(r.tokens + call_cost for r in runs)


def brute_force(lengths: list[int], budget: int, call_cost: int) -> int:
    """The cheapest cut of the sorted lengths into contiguous runs, by trying every cut."""
    s = sorted(lengths)
    best = None
    for cuts in itertools.product([False, True], repeat=len(s) - 1):
        runs, start = [], 0
        for i, cut in enumerate([*cuts, True]):
            if cut:
                runs.append(s[start: i + 1])
                start = i + 1
        if any(len(r) > 1 and len(r) * padded_width(r[-1]) > budget for r in runs):
            continue
        total = sum(len(r) * padded_width(r[-1]) + call_cost for r in runs)
        best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_covers_the_pool_within_budget_at_least_cost(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 40), rng.randint(100, 1024)]) for _ in range(rng.randint(1, 9))]
    budget, call_cost = rng.choice([512, 2048, 16384]), rng.choice([0, 64, 512])
    runs = plan_sub_batches(lengths, budget, call_cost)
    rows = [r for run in runs for r in run.rows]
    assert sorted(rows) == list(range(len(lengths)))  # every sequence once
    assert [lengths[r] for r in rows] == sorted(lengths)  # shortest first
    for run in runs:
        assert run.width % 8 == 0 and run.width >= max(lengths[r] for r in run.rows)
        assert run.width - max(lengths[r] for r in run.rows) < 8
        assert len(run.rows) == 1 or run.tokens <= budget
    assert cost(runs, call_cost) == brute_force(lengths, budget, call_cost)


def test_a_cost_per_call_keeps_similar_lengths_together() -> None:
    assert [r.rows for r in plan_sub_batches([300, 10, 12, 305], 16384, 64)] == [(1, 2), (0, 3)]
    assert len(plan_sub_batches([300, 10, 12, 305], 16384, 10**6)) == 1  # calls too dear to cut at all
    # 100 tokens pad to 104, and 4 x 104 > 400: the budget cuts the 8 into runs of at most 3.
    assert sorted(len(r.rows) for r in plan_sub_batches([100] * 8, 400, 1)) == [2, 3, 3]


# ---- the retriever ------------------------------------------------------------------------------

def loader_batches(repo: Path, model: PremiseRetriever, n: int) -> list[dict]:
    dm = RetrievalDataModule(repo, model.tokenizer, DataConfig(batch_size=8, num_workers=0, max_seq_len=512),
                             premise_max_len=512, seed=1)
    loader = dm.train_dataloader()
    return [with_lengths(b) for b in itertools.islice(iter(loader), n)]


def double_retriever(model_dir: Path, sort: bool) -> PremiseRetriever:
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(model_dir), max_seq_len=512,
                                              sort_by_length=sort)).double()
    for module in model.modules():  # dropout off: nn.Dropout modules and the attention's own rate (SDPA's)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        elif isinstance(module, T5Attention):
            module.dropout = 0.0
    return model


def test_sorted_loss_and_gradients_equal_the_padded_path_in_float64(unit_repo, tiny_model) -> None:
    model = double_retriever(tiny_model, sort=True)
    batches = loader_batches(unit_repo, model, 3)
    results = {}
    for sort in (False, True):
        model.reconfigure(sort_by_length=sort)
        losses, grads, tokens = [], [], []
        for b in batches:
            model.zero_grad(set_to_none=True)
            loss = model.batch_loss({**b, "label": b["label"].double()})
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            tokens.append(model.last_tokens)
        results[sort] = (losses, grads, tokens)
    padded_loss, padded_grads, padded_tokens = results[False]
    sorted_loss, sorted_grads, sorted_tokens = results[True]
    for p, s in zip(padded_loss, sorted_loss, strict=True):
        assert s == pytest.approx(p, rel=1e-10)
    for pg, sg in zip(padded_grads, sorted_grads, strict=True):
        for name, grad in pg.items():
            assert (sg[name] - grad).norm() <= 1e-10 * grad.norm(), name
    # The same real tokens, fewer processed: the pools were cut (the test would pass vacuously otherwise).
    for p, s in zip(padded_tokens, sorted_tokens, strict=True):
        assert s.real == p.real and s.processed < p.processed


def test_training_with_a_real_trainer_ends_at_the_padded_weights(unit_repo, tiny_model) -> None:
    """Three optimizer steps under Lightning in float64 (AdamW, clipping): sorted and padded end at the same
    weights, and the job's token efficiency is logged and counted by epoch."""
    final = {}
    for sort in (False, True):
        model = double_retriever(tiny_model, sort)
        dm = RetrievalDataModule(unit_repo, model.tokenizer, DataConfig(batch_size=8, num_workers=0, max_seq_len=512),
                                 premise_max_len=512, seed=1)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, precision="64-true", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             gradient_clip_val=1.0, limit_val_batches=0)
        trainer.fit(model, train_dataloaders=dm.train_dataloader())
        final[sort] = ({n: p.detach().clone() for n, p in model.named_parameters()},
                       model.token_count_since(0), trainer.callback_metrics["train_token_efficiency"].item())
    (padded_w, padded_tokens, padded_logged), (sorted_w, sorted_tokens, sorted_logged) = final[False], final[True]
    for name, w in padded_w.items():
        assert (sorted_w[name] - w).norm() <= 1e-10 * w.norm(), name
    assert sorted_tokens.real == padded_tokens.real > 0
    assert padded_tokens.efficiency < sorted_tokens.efficiency <= 1.0
    assert padded_logged == pytest.approx(padded_tokens.efficiency, rel=0.2)  # the mean of the steps' ratios
    assert sorted_logged > padded_logged


def test_evaluation_scores_are_unchanged_to_the_printed_digit(unit_repo, tiny_model) -> None:
    """Recall@1, Recall@10 (percent, 2 decimals) and MRR (3 decimals), contexts encoded padded or sorted."""
    printed = {}
    for sort in (False, True):
        torch.manual_seed(0)
        model = PremiseRetriever(RetrieverOptions(name_or_path=str(tiny_model), max_seq_len=256, eval_batch_size=32,
                                                  sort_by_length=sort))
        dm = RetrievalDataModule(unit_repo, model.tokenizer, DataConfig(eval_batch_size=32, num_workers=0,
                                                                        max_seq_len=512), premise_max_len=512, seed=1)
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.test(model, datamodule=dm, verbose=False)
        m = model.eval_metrics
        printed[sort] = (f"{m['Recall@1']:.2f}", f"{m['Recall@10']:.2f}", f"{m['MRR']:.3f}", m["num_contexts"])
    assert printed[True] == printed[False]
