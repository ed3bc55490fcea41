"""What every Fisher estimator shares (`registry.py` finds them by name for `lifelong.fisher_estimator`).

An estimator is a LightningModule fitted for one epoch over a repository's training data: it sums squared
gradients of the retriever's trainable parameters into fp32 tensors (`sums`), all-reduces them across ranks
at the end and leaves the diagonal Fisher in `fisher` and the example count it stands for in `num_examples`.
How the gradients are taken, which loader feeds them and what the sums are divided by is each estimator's
own (`per_example.py`, `reference.py`); the bookkeeping around it lives here once, so the two cannot drift.
A new estimator is a subclass with a `name`, listed in `registry.py` and in the config's
`lifelong.fisher_estimator` choices.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.data.dataset import with_lengths
from leanagent.model.retriever import PremiseRetriever


class FisherEstimator(pl.LightningModule):
    """One epoch of squared gradients into fp32 sums, all-reduced at the end (see the module docstring).

    Subclasses implement `training_step` (adding to `sums` and counting what they divide by) and
    `on_train_epoch_end` (calling `reduced_sums`, then setting `fisher` and `num_examples`), and say which
    loader feeds them (`train_loader`) and what their Fisher file records besides (`metadata`).
    """

    name: ClassVar[str]

    def __init__(self, retriever: PremiseRetriever) -> None:
        super().__init__()
        self.retriever = retriever
        self.automatic_optimization = False
        self.names = [n for n, p in retriever.named_parameters() if p.requires_grad]
        self.sums: dict[str, torch.Tensor] = {}
        self.fisher: dict[str, torch.Tensor] = {}
        self.num_examples = 0

    def configure_optimizers(self) -> None:
        return None  # nothing is stepped: the parameters stay as the checkpoint has them

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return with_lengths(batch)  # host-side lengths, read before the batch reaches the device

    def on_train_epoch_start(self) -> None:
        self.sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.retriever.named_parameters()
                     if n in self.names}

    def reduced_sums(self, count: int) -> tuple[torch.Tensor, list[str], int]:
        """The sums of every rank, flattened in name order, the names, and `count` summed over the ranks."""
        names = sorted(self.sums)
        flat = torch.cat([self.sums[n].flatten() for n in names])
        total = torch.tensor([float(count)], device=flat.device, dtype=torch.float64)
        if is_distributed():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return flat, names, int(total.item())

    @classmethod
    def train_loader(cls, datamodule: RetrievalDataModule, world_size: int) -> DataLoader:
        """The loader this estimator is fitted on (Lightning adds the DistributedSampler)."""
        raise NotImplementedError

    def metadata(self) -> dict[str, Any]:
        """What the Fisher file records about this estimate beyond the dataset, checkpoint and world size."""
        return {"num_examples": self.num_examples, "estimator": self.name}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def unflatten(flat: torch.Tensor, names: list[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name in names:
        numel = like[name].numel()
        out[name] = flat[offset : offset + numel].view_as(like[name]).cpu()
        offset += numel
    return out
