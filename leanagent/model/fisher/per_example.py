"""The diagonal empirical Fisher of the retriever, for EWC: `per_example`, the default estimator.

F_i = (1/N) * sum_n (d loss_n / d theta_i)^2 over the N training examples of a repository, each example
scored against its own positive and negatives with the configured loss (`model.loss`, `losses.py`: for
`infonce`, the cross-entropy of its context over its own columns). It squares *per-example* gradients. Under DDP the
gradient all-reduce would average before squaring, so this pass takes gradients with
`torch.autograd.grad` (DDP's reducer never sees them), accumulates local fp32 sums, and all-reduces
the sums and the true example count once at the end. Padding items (`is_padding`) are skipped,
dropout is off (eval mode), sums are fp32. Two computations of the same sums:

- "loop" (here): per example, its context alone and its premise columns (unpadded) through the encoder
  and one `autograd.grad` to the parameters. Bit-identical however the data is batched or sharded.
- "vectorised" (`vectorised.py`): the batch's examples in two forwards, each example's parameter
  gradients rebuilt from layer activations and output gradients. Equal to the loop up to float
  tolerance, but it holds every layer's output gradients at once, and ran out of an H200's memory
  in a real Fisher job; opt-in (README, Performance).

`reference.py` is LeanAgent's own estimator. The Fisher files are written by
`leanagent.checkpoints.ours.save_fisher`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from leanagent.data.datamodule import RetrievalDataModule
from leanagent.ground.names import PER_EXAMPLE
from leanagent.model.fisher.base import FisherEstimator, unflatten
from leanagent.model.fisher.batches import PaddedForRanks, example_lengths
from leanagent.model.fisher.vectorised import PerExampleGrads, accumulate_squared_example_grads, unsupported_modules
from leanagent.model.losses import retrieval_loss
from leanagent.model.retriever import PremiseRetriever

METHODS = ("auto", "loop", "vectorised")
# What `auto` picks per device type, by measurement (README, Performance): the loop is faster on a CPU; on an H200
# the loop took 1.38x a training example and the vectorised pass 1.04x on 8 examples but ran out of its memory on
# 32 (before its sub-batches were bounded by `model.token_budget`), so the loop until `scripts/gpu_run.sh` has
# measured both with sorted sub-batches.
AUTO_METHOD_BY_DEVICE = {"cpu": "loop", "cuda": "loop"}
AUTO_METHOD = "loop"  # any other device


class FisherModule(FisherEstimator):
    """`per_example`: runs one epoch over the training examples and accumulates squared per-example gradients.

    `method`: "loop" (one `autograd.grad` per example), "vectorised" (two forwards and one backward per
    batch, per-example gradients rebuilt from activations and output gradients; memory-hungry) or
    "auto" (`AUTO_METHOD`). Both give the same sums up to float tolerance (see the module docstring).
    """

    name = PER_EXAMPLE

    def __init__(self, retriever: PremiseRetriever, method: str = "auto") -> None:
        super().__init__(retriever)
        if method not in METHODS:
            raise ValueError(f"unknown Fisher method {method!r}; choose one of {METHODS}")
        self.method = method
        self.unsupported = unsupported_modules(retriever)
        if method == "vectorised" and self.unsupported:
            raise ValueError(f"the vectorised Fisher does not cover {self.unsupported[:5]}; use method='loop'")
        self.count = 0
        self._hooks: PerExampleGrads | None = None

    @classmethod
    def train_loader(cls, datamodule: RetrievalDataModule, world_size: int) -> DataLoader:
        """Every training example once, fixed negatives, in order, padded with flagged items to a multiple of
        the world size so that the sampler adds no silent duplicate."""
        padded = PaddedForRanks(datamodule.fisher_dataset(), world_size)
        workers = datamodule.cfg.num_workers
        return DataLoader(padded, batch_size=datamodule.cfg.batch_size, shuffle=False, collate_fn=padded.collate,
                          num_workers=workers, persistent_workers=workers > 0)

    def resolved_method(self, device: torch.device) -> str:
        if self.method != "auto":
            return self.method
        if self.unsupported:
            return "loop"
        return AUTO_METHOD_BY_DEVICE.get(device.type, AUTO_METHOD)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self.count = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Dropout off: the Fisher describes the model as it is used, and must not depend on the rank's RNG.
        self.retriever.eval()
        if self.resolved_method(batch["context_ids"].device) == "vectorised":
            if self._hooks is None:
                self._hooks = PerExampleGrads(self.retriever, {id(p): n for n, p in self.retriever.named_parameters()
                                                                if n in self.names})
            self.count += accumulate_squared_example_grads(self.retriever, batch, self.sums, self._hooks)
            return
        params = [p for n, p in self.retriever.named_parameters() if n in self.names]
        sums = [self.sums[n] for n in self.names]
        padding, ctx_lens, prem_lens = example_lengths(batch)
        for i in range(len(padding)):
            if padding[i]:
                continue
            loss = self.example_loss(batch, i, ctx_lens[i], prem_lens[i])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            used = [(total, grad.float()) for total, grad in zip(sums, grads, strict=True) if grad is not None]
            totals, squared = [t for t, _ in used], [g for _, g in used]
            torch._foreach_addcmul_(totals, squared, squared)  # sums += grad^2, one multi-tensor kernel
            self.count += 1

    def example_loss(self, batch: dict[str, Any], i: int, ctx_len: int, prem_lens: list[int]) -> torch.Tensor:
        """Example i alone (its context unpadded, its premise columns cut to their longest, or with
        `sort_by_length` as sorted sub-batches of their own: `example_lengths` gives the lengths), so that
        its loss is bit-identical however the data is batched or sharded."""
        b = len(batch["index"])
        columns = list(range(i, batch["premise_ids"].shape[0], b))
        prem_len = max(prem_lens)
        context = self.retriever.encode(batch["context_ids"][i : i + 1, :ctx_len],
                                        batch["context_mask"][i : i + 1, :ctx_len], padded=False)
        premises, _ = self.retriever.encode_pool(batch["premise_ids"][columns, :prem_len],
                                                 batch["premise_mask"][columns, :prem_len], prem_lens)
        label = batch["label"][i : i + 1, columns]
        return retrieval_loss(context, premises, label, self.retriever.options)  # the configured loss

    def on_train_epoch_end(self) -> None:
        flat, names, total = self.reduced_sums(self.count)
        if total == 0:
            raise RuntimeError("the Fisher pass saw no training example")
        self.fisher = unflatten(flat / total, names, self.sums)
        self.num_examples = total
