"""The T5 encoder stack as the retriever runs it: one attention mask per forward, optionally compiled blocks.

transformers' T5 builds the attention mask in every layer: each of the 12 self-attentions turns the
shared (1, heads, L, L) relative-position bias and the padding into a (batch, heads, L, L) float mask
(`torch.where`, in fp32), which autocast then copies to bf16 for SDPA. The bias and the padding are the
same in all layers, so `encoder_hidden` builds that mask once per forward, in the dtype SDPA runs in,
and hands it to every block as its `position_bias` (the stock blocks then use it as it is). The
weights, their names (`encoder.*` in the retriever's state dict) and the blocks are transformers' own;
only the loop over the blocks is ours, written as `T5Stack.forward` writes it for an encoder (embedding,
dropout, blocks, final norm, dropout: the same dropout draws in the same order).

Outputs are bit-identical to `T5EncoderModel.forward`, and so are the gradients: `SharedMask` gives each
layer its own output (views of one tensor, no copy) and, in backward, adds the layers' gradients in the
order and dtype autograd added them on the stock path (each cast back to the bias's dtype, masked,
summed over the batch, last layer first). `tests/unit/test_encoder.py` checks both, in fp32 and under
bf16 autocast, with dropout on.

`CompiledBlocks` is regional compilation: `torch.compile` of each T5 block rather than of the whole
model, so one compiled graph (per variant: padded or not, training or not) serves all the layers, and
compiling takes one block's time. The batch and sequence dimensions are marked dynamic, so new lengths
do not recompile. If compiling fails, the blocks fall back to eager, saying so in one line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch
from transformers import T5EncoderModel


def sdpa_dtype(model: T5EncoderModel, device: torch.device) -> torch.dtype:
    """The dtype SDPA runs in: autocast's when autocast is on (SDPA is on its lower-precision list, on CPU and
    CUDA alike, so autocast casts the mask too), else the attention projections' own."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model.encoder.block[0].layer[0].SelfAttention.q.weight.dtype


class SharedMask(torch.autograd.Function):
    """bias (1, H, L, L) and padding (B, 1, 1, L) -> `n` views of one (B, H, L, L) additive mask in `dtype`.

    Without padding the mask is the bias itself, (1, H, L, L), as transformers passes it. The backward adds
    the `n` layers' gradients as autograd added them when each layer built its own mask (see the module
    docstring): cast to the bias's dtype, masked (`where`'s backward), summed over the batch (`sum_to`'s),
    accumulated from the last layer to the first.
    """

    @staticmethod
    def forward(ctx, bias: torch.Tensor, keep: torch.Tensor | None, dtype: torch.dtype, n: int):
        ctx.keep = keep
        ctx.bias_dtype = bias.dtype
        if keep is None:
            mask = bias.contiguous().to(dtype)
        else:
            mask = torch.where(keep, bias, torch.finfo(dtype).min).contiguous().to(dtype)
        return tuple(mask.view(mask.shape) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = None
        for grad in reversed(grads):
            if grad is None:
                continue
            grad = grad.to(ctx.bias_dtype)
            if ctx.keep is not None:
                grad = torch.where(ctx.keep, grad, 0)
                if grad.shape[0] != 1:
                    grad = grad.sum(dim=(0,), keepdim=True)
            total = grad if total is None else total + grad
        return total, None, None, None


def encoder_hidden(model: T5EncoderModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   padded: bool | None = None, blocks: Sequence[Callable] | None = None) -> torch.Tensor:
    """`model(input_ids, attention_mask).last_hidden_state`, with the attention mask built once.

    `padded`: whether any row has padding, when the caller knows it from host-side lengths (else it is
    read from the mask: one device sync). `blocks`: callables to run in place of `model.encoder.block`
    (the compiled ones), same order.
    """
    stack = model.encoder
    hidden = stack.dropout(stack.embed_tokens(input_ids))
    length = input_ids.shape[1]
    attention = stack.block[0].layer[0].SelfAttention
    bias = attention.compute_bias(length, length, device=hidden.device)
    if padded is None:
        padded = not bool(attention_mask.bool().all())
    keep = attention_mask.bool()[:, None, None, :] if padded else None
    layers = blocks if blocks is not None else stack.block
    masks = SharedMask.apply(bias, keep, sdpa_dtype(model, hidden.device), len(layers))
    for block, mask in zip(layers, masks, strict=True):
        hidden = block(hidden, None, mask)[0]
    return stack.dropout(stack.final_layer_norm(hidden))


def _dynamic(block: Callable) -> Callable:
    """A compiled block whose batch and sequence dims are symbols from its first call, so that sub-batches of
    new sizes and lengths reuse its graph instead of recompiling (a size-1 dim stays specialised)."""

    def call(hidden: torch.Tensor, attention_mask: None, mask: torch.Tensor):
        for dim in (0, 1):
            torch._dynamo.maybe_mark_dynamic(hidden, dim)
        for dim in (0, 2, 3):
            torch._dynamo.maybe_mark_dynamic(mask, dim)
        return block(hidden, attention_mask, mask)

    return call


class CompiledBlocks:
    """`torch.compile` of each of an encoder's blocks (regional compilation), with eager as the fallback.

    The first forward compiles (`warm_up` runs one, and a backward, on a small batch, so that a compiler
    error shows before training depends on it; `compile_s` is how long that took). A failure, then or
    later at a new shape, switches every block back to eager for the rest of the process, printing one
    line; the forward that failed is rerun eagerly. The compiled wrappers live outside the module tree:
    the state dict and the parameters are the encoder's own.
    """

    def __init__(self, model: T5EncoderModel, backend: str | Callable = "inductor") -> None:
        self.model = model
        self.compiled = [_dynamic(torch.compile(block, backend=backend)) for block in model.encoder.block]
        self.failed: str | None = None
        self.compile_s: float | None = None
        self.warmed: set[tuple[bool, bool]] = set()  # (grad enabled, training) variants compiled by `warm_up`

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, padded: bool | None = None
               ) -> torch.Tensor:
        if self.failed is None:
            try:
                return encoder_hidden(self.model, input_ids, attention_mask, padded, blocks=self.compiled)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # a compiler error: the eager blocks compute the same
                self.fail(exc)
        return encoder_hidden(self.model, input_ids, attention_mask, padded)

    def warm_up(self, device: torch.device, backward: bool) -> None:
        """Compile now, on 2 sequences of 16 tokens (one padded), forward and, with `backward`, backward: once
        per (backward, training mode), the variants a forward compiles anew. `compile_s`: the first one's time.

        The RNG is restored afterwards (dropout draws), and no parameter's `.grad` is touched."""
        variant = (backward, self.model.training)
        if self.failed is not None or variant in self.warmed:
            return
        self.warmed.add(variant)
        start = time.perf_counter()
        ids = torch.full((2, 16), 5, dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                out = encoder_hidden(self.model, ids, mask, True, blocks=self.compiled)
                if backward and out.requires_grad:
                    weight = self.model.encoder.block[0].layer[0].SelfAttention.q.weight
                    torch.autograd.grad(out.float().sum(), [weight])
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            self.fail(exc)
            return
        if self.compile_s is None:
            self.compile_s = time.perf_counter() - start

    def fail(self, exc: BaseException) -> None:
        root = exc  # torch wraps the compiler's own error (BackendCompilerFailed, InductorError): name the cause
        while root.__cause__ is not None:
            root = root.__cause__
        root = getattr(root, "inner_exception", None) or root
        first_line = (str(root).strip().splitlines() or [""])[0]
        where = f"{type(exc).__name__}, " if root is not exc else ""
        self.failed = f"{where}{type(root).__name__}: {first_line}"[:300]
        print(f"torch.compile of the encoder blocks failed, running them eagerly: {self.failed}", file=sys.stderr,
              flush=True)
