"""The retriever's training losses, chosen by `model.loss`: ReProver's `mse` (the default) or `infonce`.

Both score the same matrix: the cosine similarity of every context of the batch with every premise of the
batch (L2-normalised embeddings, so the dot product), against the 0/1 label matrix the collate function
builds, in which row i marks *every* column holding one of context i's positives (its own positive, and any
other context's positive or negative that is also one of context i's positives).

- `mse` (ReProver's, so LeanAgent's): the similarities regressed onto the labels, the mean over the matrix.
- `infonce` (an option; docs/differences.md): a cross-entropy per context over the similarities divided by
  `model.temperature`, with all of the row's marked columns as positives,

      loss_i = -log( sum_{j: label_ij = 1} exp(s_ij / T) / sum_j exp(s_ij / T) ),

  averaged over the contexts. A premise shared by two contexts is a positive of both, never a negative of
  either. LeanHammer's selector takes another multi-positive form: one term per context with only its own
  positive in the numerator and its other positives masked out of the denominator. The two agree when a row
  has one marked column; with more, this one asks that the positives together outrank the negatives, not
  each of them alone (the shared positives are rare: another context's premises are in the batch only as
  its positive or its negatives).

The per-context form (`context_losses`) is what the per-example Fisher estimators square the gradients of,
so EWC's Fisher always describes the loss that is trained (`batch_loss` is the mean of `context_losses` for
`infonce`; for `mse` it is `F.mse_loss` over the matrix, the reference's own reduction, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class LossOptions(Protocol):
    """What a loss reads of the retriever's options (`leanagent.model.options.RetrieverOptions`, which checks
    `loss` against this module's table, so this module names the options by what it reads)."""

    loss: str
    temperature: float

# The options check `model.loss` against `LOSSES`, and the checks before a launch read the options: naming the
# losses must not import torch (seconds of a core, which a refused input never pays), so each loss imports it when it
# is computed, inside a rank that has imported it already.


def contrastive_mse(context_emb: torch.Tensor, premise_emb: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """ReProver's loss: cosine similarities regressed onto the label matrix."""
    import torch.nn.functional as F

    similarity = context_emb @ premise_emb.t()
    return F.mse_loss(similarity, label.to(similarity.dtype))


def info_nce(context_emb: torch.Tensor, premise_emb: torch.Tensor, label: torch.Tensor,
             temperature: float) -> torch.Tensor:
    """The multi-positive InfoNCE of the module docstring, averaged over the contexts."""
    return infonce_rows(context_emb @ premise_emb.t(), label, temperature).mean()


def infonce_rows(similarity: torch.Tensor, label: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each row's -log(sum over its positives of exp(s/T) / sum over all its columns of exp(s/T)).

    In log-sum-exp form (stable at T = 0.05, where s/T spans [-20, 20]); every row has a positive (its own)."""
    import torch

    logits = similarity.to(torch.promote_types(similarity.dtype, torch.float32)) / temperature  # bf16 -> fp32
    positives = logits.masked_fill(label <= 0, float("-inf"))
    return torch.logsumexp(logits, dim=1) - torch.logsumexp(positives, dim=1)


def mse_rows(similarity: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Each row's mean squared error against its labels."""
    import torch.nn.functional as F

    return F.mse_loss(similarity, label, reduction="none").mean(dim=1)


@dataclass(frozen=True)
class Loss:
    """One training loss: the batch's (what the step minimises) and each context's (what a per-example Fisher
    squares the gradients of), both from the batch's embeddings and its 0/1 label matrix."""

    name: str
    batch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossOptions], torch.Tensor]
    rows: Callable[[torch.Tensor, torch.Tensor, LossOptions], torch.Tensor]  # (similarity, label) per context
    summary: str


# `model.loss` names one entry; a new loss is one entry here (the options check names against this table).
LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("mse", lambda c, p, label, o: contrastive_mse(c, p, label), lambda s, label, o: mse_rows(s, label),
         "ReProver's (so LeanAgent's): the similarities regressed onto the labels"),
    Loss("infonce", lambda c, p, label, o: info_nce(c, p, label.to(c.dtype), o.temperature),
         lambda s, label, o: infonce_rows(s, label, o.temperature),
         "a cross-entropy per context over the similarities / model.temperature, every marked column positive"),
)}


def context_losses(similarity: torch.Tensor, label: torch.Tensor, options: LossOptions) -> torch.Tensor:
    """The configured loss of each row (context) of a similarity matrix, unreduced: what a per-example
    Fisher squares the gradients of. `mse`: the row's mean squared error; `infonce`: `infonce_rows`."""
    return LOSSES[options.loss].rows(similarity, label.to(similarity.dtype), options)


def retrieval_loss(context_emb: torch.Tensor, premise_emb: torch.Tensor, label: torch.Tensor,
                   options: LossOptions) -> torch.Tensor:
    """The configured loss of a batch (`model.loss`, `model.temperature`): what the training step minimises."""
    return LOSSES[options.loss].batch(context_emb, premise_emb, label, options)
