"""Gradient caching (`model.grad_cache`): a batch's exact gradient with one encoder call's activations in memory.

Why: InfoNCE gains from many in-batch negatives (LeanHammer trains at batch 256), but a training step holds every
encoder call's activations until its backward, so the batch a GPU fits is small. The loss depends on the weights
only through the embeddings, so (GradCache, Gao et al. 2021) its gradient is the sum over the encoder calls of
(dL/d its embeddings) . (d its embeddings / d weights):

1. every piece of both pools (`pool_plan.py`: the very pieces the uncached step encodes, in its order) is encoded
   without gradients; the loss and its gradient with respect to the embeddings come from those;
2. each piece is encoded again with gradients, its dropout replayed (the RNG restored to its state before the
   first pass), and its gradient taken at once, so only that piece's activations are alive. The pieces but the last
   go into a buffer with `torch.autograd.grad`, which leaves `.grad` and DDP's hooks alone; the last piece's
   surrogate `(embeddings * their gradient).sum()` and the buffer's `(weight * buffer).sum()` go into the loss the
   training step returns, whose value is the loss itself.

Lightning then backpropagates it as any loss: divided by `accumulate_grad_batches`, scaled by a grad scaler,
after its `zero_grad`, and under DDP each weight's gradient is ready once, in that backward, so the reducer
all-reduces it as usual (gradients accumulated by hand inside the step would be zeroed by Lightning, which zeroes
after the training step, and under DDP would be marked ready once per piece). After the replays the RNG is where
the first pass left it, as after an uncached step. With `sort_by_length` (the default) the pieces and their dropout
masks are the uncached step's, so the gradient is the same to float summation order
(`tests/unit/test_grad_cache.py`, in float64 with dropout on); with padded pools the pieces are runs of rows within
the token budget, whose dropout masks have other shapes than one padded call's. The cost: each piece is encoded
twice and its gradient taken alone (1.7x the step time, 0.5x its peak memory in `leanagent bench grad-cache`'s
run, docs/training.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from leanagent.model.pool_plan import Piece, PoolPlan


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generators dropout draws from on `device`: the CPU's, and the CUDA device's own."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def grad_cached_loss(encode: Callable[[Piece], torch.Tensor], plans: Sequence[PoolPlan],
                     loss_of: Callable[..., torch.Tensor], weights: Sequence[torch.Tensor],
                     device: torch.device) -> torch.Tensor:
    """The loss `loss_of(*pool embeddings)`, whose backward gives the uncached loss's gradient (module docstring).

    `encode`: one piece's embeddings; `plans`: the pools' plans, in the order the uncached step encodes them;
    `weights`: the trained parameters."""
    states, pools = [], []
    with torch.no_grad():
        for plan in plans:
            parts = []
            for piece in plan.pieces:
                states.append(rng_state(device))
                parts.append(encode(piece))
            pools.append(plan.assemble(parts).requires_grad_())
    after = rng_state(device)
    loss = loss_of(*pools)
    pieces = [(piece, grad) for plan, pool_grad in zip(plans, torch.autograd.grad(loss, pools), strict=True)
              for piece, grad in zip(plan.pieces, plan.split(pool_grad), strict=True)]
    buffer: list[torch.Tensor | None] = [None] * len(weights)
    try:
        for (piece, grad), state in zip(pieces[:-1], states[:-1], strict=True):
            set_rng_state(state, device)
            grads = torch.autograd.grad(encode(piece), weights, grad_outputs=grad, allow_unused=True)
            buffer = [b if g is None else g if b is None else b.add_(g) for b, g in zip(buffer, grads, strict=True)]
        (piece, grad), state = pieces[-1], states[-1]
        set_rng_state(state, device)
        surrogate = (encode(piece) * grad).sum()
    finally:
        set_rng_state(after, device)
    carried = [(w * b).sum() for w, b in zip(weights, buffer, strict=True) if b is not None]
    if carried:
        surrogate = surrogate + torch.stack(carried).sum()
    return loss.detach() + (surrogate - surrogate.detach())
