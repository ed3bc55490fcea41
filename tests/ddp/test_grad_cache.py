"""`model.grad_cache` on 2 gloo ranks under a real Lightning DDP Trainer: the same weights as the uncached step.

Under DDP the reducer all-reduces each weight's gradient when it is ready in a backward; the cached step must make
each one ready exactly once per micro-batch (tests/unit/test_grad_cache.py covers one process)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.ddp

PROBE = textwrap.dedent('''
    """Under torchrun: two fits of the same model and data (float64, dropout on, accumulation 2), uncached then
    cached; each rank saves both runs' final weights."""
    import sys
    from pathlib import Path

    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist

    from leanagent.ground.config import DataConfig, TrainerConfig
    from leanagent.data.datamodule import RetrievalDataModule
    from leanagent.model.options import RetrieverOptions
    from leanagent.model.retriever import PremiseRetriever
    from leanagent.train.trainer import ddp_strategy, init_process_group

    model_dir, repo, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cfg = TrainerConfig(accelerator="cpu", devices=2, precision="64-true")
    init_process_group(cfg)
    rank = dist.get_rank()
    for cached in (False, True):
        torch.manual_seed(0)
        model = PremiseRetriever(RetrieverOptions(name_or_path=model_dir, max_seq_len=256, token_budget=256,
                                                  loss="infonce", grad_cache=cached)).double()
        if rank == 0 and not cached:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / "w_init.pt")
        dm = RetrievalDataModule(repo, model.tokenizer, DataConfig(batch_size=6, num_workers=0, max_seq_len=256),
                                 premise_max_len=256, seed=1)
        pl.seed_everything(5, verbose=False)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_strategy(cfg), max_steps=2,
                             precision="64-true", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                             accumulate_grad_batches=2, limit_val_batches=0)
        trainer.fit(model, train_dataloaders=dm.train_dataloader())
        torch.save({n: p.detach() for n, p in model.named_parameters()}, out / f"w{int(cached)}_{rank}.pt")
    dist.destroy_process_group()
''')


def test_cached_ddp_training_ends_at_the_uncached_weights(ddp_assets, tmp_path: Path, run_probe) -> None:
    run_probe(PROBE, tmp_path, str(ddp_assets["model"]), str(ddp_assets["repo_a"]), str(tmp_path))
    weights = {(c, r): torch.load(tmp_path / f"w{c}_{r}.pt", weights_only=True) for c in (0, 1) for r in (0, 1)}
    start = torch.load(tmp_path / "w_init.pt", weights_only=True)
    for name, plain in weights[0, 0].items():
        assert torch.equal(weights[0, 1][name], plain) and torch.equal(weights[1, 1][name], weights[1, 0][name])
        assert (weights[1, 0][name] - plain).norm() <= 1e-9 * (plain - start[name]).norm(), name
    assert all((w - start[n]).norm() > 0 for n, w in weights[0, 0].items())  # every weight trained
