"""`model.grad_cache`: the chunked gradient equals the unchunked one, dropout on, in float64 (one process; the DDP
case is tests/ddp/test_grad_cache.py)."""

from __future__ import annotations

import itertools
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

BUDGET = 512  # tokens per encoder call: a batch of 8 contexts and 32 premises is cut into several pieces


def retriever(model_dir: Path, dropout: bool = True, **options) -> PremiseRetriever:
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(model_dir), max_seq_len=512, token_budget=BUDGET,
                                              **options)).double()
    if not dropout:
        for module in model.modules():  # nn.Dropout modules and the attention's own rate (SDPA's)
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            elif isinstance(module, T5Attention):
                module.dropout = 0.0
    return model


def datamodule(repo: Path, model: PremiseRetriever) -> RetrievalDataModule:
    return RetrievalDataModule(repo, model.tokenizer, DataConfig(batch_size=8, num_workers=0, max_seq_len=512),
                               premise_max_len=512, seed=1)


def step(model: PremiseRetriever, batch: dict, cached: bool) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """One step's loss value, the weights' gradients and the RNG state after it, from the same RNG state."""
    torch.manual_seed(11)
    model.zero_grad(set_to_none=True)
    loss = model.cached_batch_loss(batch) if cached else model.batch_loss(batch)
    (loss + model.ewc_penalty()).backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, torch.get_rng_state()


def pieces(model: PremiseRetriever, batch: dict) -> int:
    return sum(len(model.plan_pool(batch[f"{pool}_ids"], batch[f"{pool}_mask"], batch[f"{pool}_lengths"],
                                   rows_within_budget=True).pieces) for pool in ("context", "premise"))


@pytest.mark.parametrize("loss, sort, dropout", [("mse", True, True), ("infonce", True, True),
                                                 ("infonce", False, False)])
def test_the_cached_gradient_is_the_unchunked_one(unit_repo, tiny_model, loss: str, sort: bool,
                                                  dropout: bool) -> None:
    """Sorted pools: the uncached step's own pieces, dropout replayed, so the same masks; padded pools: runs of rows
    within the budget, whose dropout differs from one padded call's, so compared with dropout off. EWC is armed."""
    model = retriever(tiny_model, dropout, loss=loss, sort_by_length=sort)
    model.set_ewc({n: torch.rand_like(p) for n, p in model.named_parameters()}, 0.1,
                  anchor={n: p.detach() + 0.01 for n, p in model.named_parameters()})
    model.on_fit_start()
    batches = [with_lengths(b) for b in itertools.islice(iter(datamodule(unit_repo, model).train_dataloader()), 2)]
    for b in batches:
        b["label"] = b["label"].double()
        assert pieces(model, b) >= 4  # cut, or the test would compare one call with itself
        plain_loss, plain_grads, plain_rng = step(model, b, cached=False)
        cached_loss, cached_grads, cached_rng = step(model, b, cached=True)
        assert cached_loss == plain_loss
        assert torch.equal(cached_rng, plain_rng)  # the rest of training draws what it would have
        for name, grad in plain_grads.items():
            assert (cached_grads[name] - grad).norm() <= 1e-9 * grad.norm(), name


def test_two_passes_draw_different_dropout_unless_replayed(unit_repo, tiny_model) -> None:
    """Why the replay is needed (so the equality above is not vacuous): a piece encoded twice draws other masks."""
    model = retriever(tiny_model, loss="infonce")
    b = with_lengths(next(iter(datamodule(unit_repo, model).train_dataloader())))
    piece = model.plan_pool(b["context_ids"], b["context_mask"], b["context_lengths"]).pieces[0]
    with torch.no_grad():
        first, again = model.encode_piece(piece), model.encode_piece(piece)
    assert not torch.equal(first, again)


def test_a_real_trainer_with_accumulation_ends_at_the_uncached_weights(unit_repo, tiny_model) -> None:
    """Lightning divides the loss by accumulate_grad_batches and zeroes gradients after the training step: two
    optimizer steps of two micro-batches each (AdamW, clipping, dropout on) end at the uncached run's weights."""
    final = {}
    for cached in (False, True):
        model = retriever(tiny_model, loss="infonce", grad_cache=cached)
        pl.seed_everything(5, verbose=False)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, precision="64-true", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             gradient_clip_val=1.0, accumulate_grad_batches=2, limit_val_batches=0)
        trainer.fit(model, train_dataloaders=datamodule(unit_repo, model).train_dataloader())
        final[cached] = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = {n: p.detach() for n, p in retriever(tiny_model).named_parameters()}
    for name, w in final[False].items():
        moved = (w - start[name]).norm()
        assert (final[True][name] - w).norm() <= 1e-9 * max(moved, 1e-30), name
    assert any((w - start[n]).norm() > 0 for n, w in final[False].items())
