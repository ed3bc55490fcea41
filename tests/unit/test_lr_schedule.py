"""The learning rate follows LeanAgent's schedule: transformers' cosine with warmup, the reference's horizon."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from transformers import ByT5Tokenizer

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.config import DataConfig
from leanagent.model.lr_schedule import build_optimizer_and_schedule, reference_horizon
from leanagent.model.options import RetrieverOptions
from leanagent.model.retriever import PremiseRetriever


def expected_lr(lr: float, warmup: int, horizon: int, step: int) -> float:
    """get_cosine_schedule_with_warmup, written out: linear warmup from 0, then half a cosine to 0 at `horizon`."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, horizon - warmup)
    return lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def test_horizon_is_the_references():
    # max_epochs * len(unsharded loader, drop_last) // accumulate_grad_batches
    assert reference_horizon(max_epochs=3, unsharded_batches=1234 // 4, accumulate_grad_batches=4) == 3 * 308 // 4
    assert reference_horizon(2, 0, 4) == 0


@pytest.mark.parametrize("step", [0, 1, 500, 999, 1000, 1001, 5000, 9999, 10000, 12000])
def test_lr_at_chosen_steps(step):
    opt = build_optimizer_and_schedule([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, warmup_steps=1000,
                                       horizon=10000)
    scheduler = opt["lr_scheduler"]["scheduler"]
    assert opt["lr_scheduler"]["interval"] == "step"
    assert scheduler.lr_lambdas[0](step) * 1e-3 == pytest.approx(expected_lr(1e-3, 1000, 10000, step), abs=1e-12)


def test_a_fit_uses_the_reference_horizon(tmp_path, unit_repo, tiny_model):
    """A real Trainer: the horizon counts cumulative max_epochs and the unsharded, drop_last loader."""
    repo, model_dir = unit_repo, tiny_model
    torch.manual_seed(0)
    model = PremiseRetriever(RetrieverOptions(name_or_path=str(model_dir), lr=1e-3, warmup_steps=3, max_seq_len=64))
    data = RetrievalDataModule(repo, ByT5Tokenizer(), DataConfig(batch_size=4, num_workers=0, max_seq_len=64),
                               premise_max_len=64, seed=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    n = len(data.train_examples)
    horizon = 2 * (n // 4) // 2
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    for step in (0, 2, 3, horizon // 2, horizon):
        assert scheduler.lr_lambdas[0](step) * 1e-3 == pytest.approx(expected_lr(1e-3, 3, horizon, step), abs=1e-12)
    # drop_last: n // 4 batches an epoch; Lightning also steps on an epoch's last, partial accumulation
    assert trainer.global_step == 2 * math.ceil((n // 4) / 2)
    assert scheduler.get_last_lr()[0] == pytest.approx(expected_lr(1e-3, 3, horizon, trainer.global_step), abs=1e-12)


def test_fused_adamw_only_when_nothing_clips():
    # Lightning's mixed-precision plugin refuses to clip for an optimizer that unscales its own gradients
    # (fused AdamW): with the seed's clip of 1.0 a fused optimizer crashed the first step on an H200.
    from leanagent.model.lr_schedule import use_fused_adamw

    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert not use_fused_adamw(cpu, None)  # not on a GPU
    assert not use_fused_adamw([], None)


def test_lightning_refuses_to_clip_for_a_fused_optimizer():
    """What `use_fused_adamw` avoids, checked on CPU (fused AdamW runs there too): if a Lightning release lifts
    the restriction this fails, and fusing under clipping can come back."""

    class Module(pl.LightningModule):
        def __init__(self, fused: bool):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.fused = fused

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused or None)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    kwargs = dict(accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=1.0, max_steps=2,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        pl.Trainer(**kwargs).fit(Module(fused=True), data)
    pl.Trainer(**kwargs).fit(Module(fused=False), data)
