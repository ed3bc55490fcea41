"""The diagonal empirical Fisher information of the retriever, for EWC.

F_i = (1/N) * sum_n (d loss_n / d theta_i)^2 over the N training examples of a repository, each
example scored against its own positive and negatives. It must be the square of *per-example*
gradients: the square of a batch-mean gradient is a smaller, different quantity. Under DDP the
gradient all-reduce would average before squaring, so this pass takes gradients with
`torch.autograd.grad` (DDP's reducer never sees them), accumulates local fp32 sums, and
all-reduces the sums and the true example count once at the end. The reference stored the
result with pickle; we write safetensors, which cannot execute code on load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from leanagent.model.retriever import PremiseRetriever, contrastive_mse


class FisherModule(pl.LightningModule):
    """Runs one epoch over the training examples and accumulates squared per-example gradients."""

    def __init__(self, retriever: PremiseRetriever) -> None:
        super().__init__()
        self.retriever = retriever
        self.automatic_optimization = False
        self.names = [n for n, p in retriever.named_parameters() if p.requires_grad]
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.fisher: dict[str, torch.Tensor] = {}
        self.num_examples = 0

    def configure_optimizers(self) -> None:
        return None

    def on_train_epoch_start(self) -> None:
        self.sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.retriever.named_parameters()
                     if n in self.names}
        self.count = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Dropout off: the Fisher describes the model as it is used, and must not depend on the rank's RNG.
        self.retriever.eval()
        params = [p for n, p in self.retriever.named_parameters() if n in self.names]
        for i in range(len(batch["index"])):
            if bool(batch["is_padding"][i]):
                continue
            loss = self.example_loss(batch, i)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for name, grad in zip(self.names, grads, strict=True):
                if grad is not None:
                    self.sums[name] += grad.float() ** 2
            self.count += 1

    def example_loss(self, batch: dict[str, Any], i: int) -> torch.Tensor:
        """Example i alone, unpadded, so that its loss is bit-identical however the data is batched or sharded."""
        b = len(batch["index"])
        columns = list(range(i, batch["premise_ids"].shape[0], b))
        ctx_len = int(batch["context_mask"][i].sum())
        context = self.retriever.encode(batch["context_ids"][i : i + 1, :ctx_len],
                                        batch["context_mask"][i : i + 1, :ctx_len])
        prem_len = int(batch["premise_mask"][columns].sum(dim=1).max())
        premises = self.retriever.encode(batch["premise_ids"][columns, :prem_len],
                                         batch["premise_mask"][columns, :prem_len])
        label = batch["label"][i : i + 1, columns]
        return contrastive_mse(context, premises, label)

    def on_train_epoch_end(self) -> None:
        names = sorted(self.sums)
        flat = torch.cat([self.sums[n].flatten() for n in names])
        count = torch.tensor([float(self.count)], device=flat.device, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        total = int(count.item())
        if total == 0:
            raise RuntimeError("the Fisher pass saw no training example")
        flat = flat / total
        fisher: dict[str, torch.Tensor] = {}
        offset = 0
        for name in names:
            numel = self.sums[name].numel()
            fisher[name] = flat[offset : offset + numel].view_as(self.sums[name]).cpu()
            offset += numel
        self.fisher = fisher
        self.num_examples = total


def save_fisher(path: Path, fisher: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write atomically: a crash never leaves a truncated Fisher that EWC would later trust."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({n: t.contiguous() for n, t in fisher.items()}, str(tmp),
              metadata={k: json.dumps(v) for k, v in metadata.items()})
    tmp.replace(path)


def load_fisher(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Fisher file")
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        raw_meta = f.metadata() or {}
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    bad = [n for n, t in tensors.items() if not torch.isfinite(t).all() or (t < 0).any()]
    if bad:
        raise ValueError(f"{path}: Fisher entries are negative or not finite: {bad[:5]}")
    return tensors, {k: json.loads(v) for k, v in raw_meta.items()}
