"""LeanAgent's Fisher estimator (`reference`): its `compute_fisher` / `FisherComputationModule`, step for step.

One epoch over the training loader (shuffled, drop_last, random negatives, sharded by Lightning's
DistributedSampler), dropout on; per batch the gradient of the batch loss, averaged across ranks by DDP,
is squared and summed; at the end the sums are all-reduced (SUM) and divided by len(train dataset) *
world_size. Every rank holds the same DDP-averaged gradient, so that is sum over steps of (batch-mean
gradient)^2 / N: a smaller, different quantity than the empirical Fisher, about 1/(batch size x world
size) of it when per-example gradients are independent (van de Ven, arXiv:2502.11756;
GMvandeVen/continual-learning#11), so an `ewc_lambda` tuned for one does not carry over to the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.names import REFERENCE
from leanagent.model.fisher.base import FisherEstimator, is_distributed, unflatten
from leanagent.model.retriever import PremiseRetriever

NO_BATCH = ("the reference Fisher pass ran no batch (fewer training examples than data.batch_size x world size, "
            "and the training loader drops the last incomplete batch)")


class ReferenceFisherModule(FisherEstimator):
    """`reference`, LeanAgent's FisherComputationModule: squared DDP-averaged batch gradients, summed, / (N x world
    size).

    Fit it on the data module's own `train_dataloader()`; N is `len(trainer.train_dataloader.dataset)`,
    the training dataset (not the examples actually seen: drop_last and the sampler's padding are
    ignored, as in the reference). Keys are the retriever's parameter names, every trainable one
    (a parameter that never gets a gradient keeps 0; the reference would omit it and EWC would refuse).
    """

    name = REFERENCE

    def __init__(self, retriever: PremiseRetriever) -> None:
        super().__init__(retriever)  # the reference's SGD(lr=0) is never stepped: no optimizer either
        self.steps = 0
        self.num_steps = 0  # DDP-averaged gradients squared (steps of one rank)

    @classmethod
    def train_loader(cls, datamodule: RetrievalDataModule, world_size: int) -> DataLoader:
        """The very loader training uses (shuffle, drop_last, random negatives), as in the reference."""
        return datamodule.train_dataloader()

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "steps": self.num_steps}

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self.steps = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        # Train mode, as the reference's trainer.fit leaves it: dropout is on.
        self.retriever.train()
        self.retriever.zero_grad(set_to_none=True)
        loss = self.retriever.batch_loss(batch)  # the retriever's loss, without any EWC term
        # Through Lightning so that DDP all-reduces (averages) the gradient across ranks, as in the reference.
        self.manual_backward(loss)
        for name, param in self.retriever.named_parameters():
            if name in self.sums and param.grad is not None:
                self.sums[name] += param.grad.detach().float() ** 2
        self.retriever.zero_grad(set_to_none=True)
        self.steps += 1
        return loss.detach()

    def on_train_epoch_end(self) -> None:
        flat, names, steps = self.reduced_sums(self.steps)
        world_size = dist.get_world_size() if is_distributed() else 1
        if steps == 0:
            raise RuntimeError(NO_BATCH)
        dataset_size = len(self.trainer.train_dataloader.dataset)
        self.fisher = unflatten(flat / (dataset_size * world_size), names, self.sums)
        self.num_examples = dataset_size
        self.num_steps = steps // world_size

    def on_fit_end(self) -> None:
        # An empty loader ends fit before any epoch hook runs: never hand back an empty Fisher.
        if not self.fisher:
            raise RuntimeError(NO_BATCH)
