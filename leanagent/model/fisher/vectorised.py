"""The vectorised per-example gradients: every example's parameter gradient of one batch, from one backward.

The batch's examples go through the encoder in two forwards, as the training step pads them (contexts,
then premise columns), the loss is the sum of the examples' own losses, and one `autograd.grad` goes
to the layers' outputs (no weight gradient is formed); each example's parameter gradients are then
rebuilt from activations and output gradients (Linear: sum over its tokens of dy x^T; T5LayerNorm, the
RMS norm's weight; the embedding rows; the relative attention bias table via a per-sequence copy of the
position bias), same-shaped layers batched together. Equal to the loop (`per_example.py`) up to float
tolerance: fp32 ~1e-6 of each tensor's scale; under bf16 autocast the two round differently (~1e-2 per
entry on one batch, ~3e-3 over a repository). It holds the gradients of all the layers' outputs at once.
A retriever with a layer this does not know (`unsupported_modules`) always takes the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.models.t5.modeling_t5 import T5Attention, T5LayerNorm

from leanagent.model.fisher.batches import example_groups, select_items
from leanagent.model.losses import context_losses
from leanagent.model.retriever import PremiseRetriever
from leanagent.model.sub_batches import call_cost_for


def _relative_bias_attentions(model: nn.Module) -> list[T5Attention]:
    return [m for m in model.modules() if isinstance(m, T5Attention) and m.has_relative_attention_bias]


def unsupported_modules(model: nn.Module) -> list[str]:
    """Modules holding a trainable parameter whose per-example gradient the vectorised path cannot rebuild."""
    bias_tables = {id(m.relative_attention_bias) for m in _relative_bias_attentions(model)}
    bad = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if id(module) in bias_tables:
            ok = type(module).forward is nn.Embedding.forward
        elif isinstance(module, nn.Linear):
            ok = type(module).forward is nn.Linear.forward
        elif isinstance(module, nn.Embedding):
            ok = (type(module).forward is nn.Embedding.forward and module.max_norm is None
                  and not module.scale_grad_by_freq and not module.sparse)
        elif isinstance(module, T5LayerNorm):
            ok = type(module).forward is T5LayerNorm.forward
        else:
            ok = False
        if not ok:
            bad.append(f"{name or '<root>'} ({type(module).__name__})")
    return bad


def example_major_batch(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """The non-padding examples' contexts (k, Lc), premises (k x columns, Lp), example-major, labels (k, columns).

    Premise row e * columns + j is example e's column j (batch row i + j * batch size, i its batch item).
    Each side is cut to its longest real sequence (tokenizers pad on the right), as the training step pads.
    """
    b = len(batch["index"])
    keep = torch.nonzero(~batch["is_padding"].bool()).flatten().to(batch["context_ids"].device)
    cols = batch["premise_ids"].shape[0] // b
    prem_rows = (keep.unsqueeze(1) + b * torch.arange(cols, device=keep.device)).flatten()
    ctx_mask, prem_mask = batch["context_mask"][keep], batch["premise_mask"][prem_rows]
    ctx_len, prem_len = torch.stack([ctx_mask.sum(dim=1).max(), prem_mask.sum(dim=1).max()]).tolist()
    label = batch["label"][keep.unsqueeze(1), prem_rows.view(len(keep), cols)]
    return (batch["context_ids"][keep, :ctx_len], ctx_mask[:, :ctx_len],
            batch["premise_ids"][prem_rows, :prem_len], prem_mask[:, :prem_len], label)


class PerExampleGrads:
    """Rebuilds each example's gradient from activations and output gradients, for a whole batch at once.

    Every forward holds `k` examples' sequences, example-major (example e's are consecutive, as many for
    each example); the loss is the sum of the examples' own losses, so the gradient of the loss at the
    tokens of e's sequences is the gradient of e's own loss there (and 0 at padding, which attention
    masks out and pooling ignores). A parameter's gradient for example e is then a sum over e's tokens:
    Linear W: sum_t dy_t x_t^T (bias: sum_t dy_t); T5LayerNorm (RMS norm, weight only): sum_t dy_t * x_t/rms(x_t);
    Embedding: dy_t added to the row of token t; the relative attention bias (one table shared by all
    layers): the gradient of each sequence's own copy of the (heads, L, L) position bias, summed by bucket.
    A parameter used by several calls (here: the context and the premise forward) has its per-example
    gradients summed over the calls before they are squared.

    Forward hooks only record each call's input and output; one `autograd.grad` then returns the
    gradients of all the outputs (the weights' own gradients are never formed), and parameters of one
    kind and shape (the 12 layers' wi_0 and wi_1, ...) are done together: one batched matmul per
    forward, one reduction, one multi-tensor add. Few, large kernels: a bf16 GPU step at batch 4 is
    otherwise bound by kernel launches and Python, not by arithmetic.
    """

    # Devices where sum_e g_e^2 is one reduction over the examples rather than k in-place products:
    # on a CPU that reduction was many times slower than the products (docs/measurements.md).
    reduce_on: tuple[str, ...] = ("cuda",)
    # At most about this many per-example gradient entries at a time: a group's parameters are cut to fit.
    chunk_entries: int = 2**28

    def __init__(self, model: nn.Module, names: dict[int, str]) -> None:
        """Built once per model: `names` maps id(parameter) to its name, for the trainable parameters only."""
        self.names = names
        self.bias_attentions = [m for m in _relative_bias_attentions(model)
                                if id(m.relative_attention_bias.weight) in names]
        tables = {id(m.relative_attention_bias) for m in _relative_bias_attentions(model)}
        # (module, kind, names of its trainable parameters): only modules with one are hooked.
        self.hooked: list[tuple[nn.Module, str, tuple[str | None, ...]]] = []
        for module in model.modules():
            if id(module) in tables:
                continue
            if isinstance(module, nn.Linear):
                bias = names.get(id(module.bias)) if module.bias is not None else None
                kind, own = "linear", (names.get(id(module.weight)), bias)
            elif isinstance(module, nn.Embedding):
                kind, own = "embedding", (names.get(id(module.weight)),)
            elif isinstance(module, T5LayerNorm):
                kind, own = "norm", (names.get(id(module.weight)),)
            else:
                continue
            if any(n is not None for n in own):
                self.hooked.append((module, kind, own))
        self.handles: list[Any] = []
        self.start(0)

    def start(self, k: int) -> PerExampleGrads:
        """A new batch of `k` examples."""
        self.k = k
        # (kind, module, parameter names, the call's input (or bucket index), the tensor whose gradient is needed)
        self.records: list[tuple[str, nn.Module, tuple[str | None, ...], torch.Tensor, torch.Tensor]] = []
        return self

    def __enter__(self) -> PerExampleGrads:
        for module in self.bias_attentions:
            self.handles.append(module.register_forward_pre_hook(self._bias_pre_hook, with_kwargs=True))
        for module, kind, own in self.hooked:
            self.handles.append(module.register_forward_hook(self._recorder(kind, own)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- forward: record the calls
    def _recorder(self, kind: str, own: tuple[str | None, ...]) -> Callable:
        def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if output.requires_grad:
                self.records.append((kind, module, own, args[0], output))

        return record

    def _bias_pre_hook(self, module: T5Attention, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        if len(args) > 1 or any(kwargs.get(a) is not None for a in ("position_bias", "key_value_states", "cache")):
            # Not the self-attention of an encoder computing its own bias: its table's gradient would be missed.
            raise RuntimeError("the vectorised Fisher cannot follow this attention call; use method='loop'")
        seqs, length = hidden.shape[0], hidden.shape[1]
        shared = module.compute_bias(length, length, device=hidden.device)  # (1, heads, L, L)
        # One copy per sequence, so that its gradient is per sequence; the module and the later layers use it.
        per_seq = shared.expand(seqs, -1, -1, -1).clone()
        position = torch.arange(length, dtype=torch.long, device=hidden.device)
        bucket = module._relative_position_bucket(
            position[None, :] - position[:, None], bidirectional=not module.is_decoder,
            num_buckets=module.relative_attention_num_buckets, max_distance=module.relative_attention_max_distance)
        name = self.names[id(module.relative_attention_bias.weight)]
        self.records.append(("bias", module, (name,), bucket, per_seq))
        return args, {**kwargs, "position_bias": per_seq}

    # -- backward to the recorded outputs, then the per-example gradients, squared into `sums`
    def backward(self, loss: torch.Tensor, sums: dict[str, torch.Tensor]) -> None:
        records, self.records = self.records, []
        if not records:
            return
        grads = torch.autograd.grad(loss, [r[-1] for r in records], allow_unused=True)
        # A parameter's calls, [(input, output gradient)], in call order; calls that did not reach the loss dropped.
        calls: dict[tuple[str, nn.Module, tuple], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for (kind, module, names, aux, _), grad in zip(records, grads, strict=True):
            if grad is not None:
                calls.setdefault((kind, module, names), []).append((aux, grad))
        del records, grads
        groups: dict[tuple, list[tuple[tuple, nn.Module, list]]] = {}
        for (kind, module, names), done in calls.items():
            if kind == "embedding":
                self._embedding(module, names[0], done, sums)
            elif kind == "bias":
                self._relative_bias(module, names[0], done, sums)
            else:  # done together: same kind, parameter shape, norm epsilon, and the same shapes call by call
                key = (kind, module.weight.shape, module.weight.dtype, getattr(module, "variance_epsilon", None),
                       tuple((x.shape, x.dtype, g.shape, g.dtype) for x, g in done))
                groups.setdefault(key, []).append((names, module, done))
        del calls
        for (kind, shape, *_), members in groups.items():
            # A member's temporaries: its per-example gradients and its share of the stacked inputs and gradients.
            each = self.k * shape.numel() + sum(x.numel() + g.numel() for x, g in members[0][2])
            size = max(1, self.chunk_entries // each)
            for i in range(0, len(members), size):
                (self._linears if kind == "linear" else self._norms)(members[i : i + size], sums)

    def _linears(self, members: list[tuple[tuple, nn.Module, list]], sums: dict[str, torch.Tensor]) -> None:
        k, m = self.k, len(members)
        with_weight, with_bias = members[0][0][0] is not None, members[0][0][1] is not None
        weight = bias = None
        for call in range(len(members[0][2])):
            dy = torch.stack([done[call][1].reshape(k, -1, done[call][1].shape[-1]) for _, _, done in members])
            dy = dy.view(m * k, -1, dy.shape[-1])  # (m k, tokens of one example in this call, out)
            if with_weight:
                # The input in the dtype the layer ran in (autocast's bf16), as the loop's weight gradient is;
                # one cast for the layers that read the same input (q, k and v; wi_0 and wi_1).
                cast: dict[int, torch.Tensor] = {}
                for _, _, done in members:
                    x = done[call][0]
                    if id(x) not in cast:
                        cast[id(x)] = x.reshape(k, -1, x.shape[-1]).to(dy.dtype)
                x = torch.stack([cast[id(done[call][0])] for _, _, done in members])
                del cast
                x = x.view(m * k, -1, x.shape[-1])
                dyt = dy.transpose(1, 2)
                weight = torch.bmm(dyt, x) if weight is None else weight.baddbmm_(dyt, x)
            if with_bias:
                part = dy.float().sum(dim=1)
                bias = part if bias is None else bias + part
        if with_weight:
            self._square([names[0] for names, _, _ in members], weight.view(m, k, *weight.shape[1:]), sums)
        if with_bias:
            self._square([names[1] for names, _, _ in members], bias.view(m, k, -1), sums)

    def _norms(self, members: list[tuple[tuple, nn.Module, list]], sums: dict[str, torch.Tensor]) -> None:
        k, m = self.k, len(members)
        module = members[0][1]
        total = None
        for call in range(len(members[0][2])):
            x = torch.stack([done[call][0] for _, _, done in members])
            dy = torch.stack([done[call][1] for _, _, done in members])
            # T5LayerNorm.forward: weight * (x * rsqrt(mean(x^2) + eps)), the mean taken in fp32.
            norm = torch.linalg.vector_norm(x, ord=2, dim=-1, dtype=torch.float32)
            scale = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(module.variance_epsilon))  # (m, rows, T)
            if module.weight.dtype in (torch.float16, torch.bfloat16):  # the module rounds x / rms(x) first
                normed = (x * scale.unsqueeze(-1)).to(module.weight.dtype)
                part = (dy.float() * normed.float()).view(m, k, -1, dy.shape[-1]).sum(dim=2)
            else:  # sum_t scale_t (dy_t * x_t) per example, without forming x / rms(x)
                product = (dy * x).view(m * k, -1, dy.shape[-1]).float()
                part = torch.bmm(scale.reshape(m * k, 1, -1), product).view(m, k, -1)
            total = part if total is None else total + part
        self._square([names[0] for names, _, _ in members], total, sums)

    def _embedding(self, module: nn.Embedding, name: str, done: list, sums: dict[str, torch.Tensor]) -> None:
        vocab, dim = module.weight.shape
        grad = torch.zeros(self.k, vocab, dim, device=module.weight.device, dtype=torch.float32)
        for ids, dy in done:
            example = torch.arange(self.k, device=ids.device).repeat_interleave(ids.numel() // self.k)
            grad.view(self.k * vocab, dim).index_add_(0, example * vocab + ids.reshape(-1), dy.reshape(-1, dim).float())
        if module.padding_idx is not None:
            grad[:, module.padding_idx] = 0
        self._square([name], grad.unsqueeze(0), sums)

    def _relative_bias(self, module: T5Attention, name: str, done: list, sums: dict[str, torch.Tensor]) -> None:
        buckets, heads = module.relative_attention_bias.weight.shape
        grad = torch.zeros(self.k, heads, buckets, device=module.relative_attention_bias.weight.device,
                           dtype=torch.float32)
        for bucket, dp in done:
            per_example = dp.float().reshape(self.k, -1, heads, bucket.numel()).sum(dim=1)  # (k, heads, L*L)
            grad.scatter_add_(2, bucket.reshape(1, 1, -1).expand(self.k, heads, -1), per_example)
        self._square([name], grad.transpose(1, 2).unsqueeze(0), sums)  # (1, k, buckets, heads), as the table

    def _square(self, names: list[str], per_example: torch.Tensor, sums: dict[str, torch.Tensor]) -> None:
        """sums[names[i]] += sum_e per_example[i, e]^2, each square taken in fp32 (exact for bf16)."""
        totals = [sums[n] for n in names]
        if per_example.device.type in self.reduce_on:
            norm = torch.linalg.vector_norm(per_example, ord=2, dim=1, dtype=torch.float32)
            rows = list(norm.unbind(0))
            torch._foreach_addcmul_(totals, rows, rows)
        else:
            for e in range(per_example.shape[1]):
                rows = list(per_example[:, e].unbind(0))
                torch._foreach_addcmul_(totals, rows, rows)


def accumulate_squared_example_grads(retriever: PremiseRetriever, batch: dict[str, Any],
                                     sums: dict[str, torch.Tensor], hooks: PerExampleGrads | None = None) -> int:
    """Adds sum over the batch's non-padding examples of (d loss_e / d theta)^2 to `sums`; returns their count.

    The examples go in groups (`example_groups`: all of them, or with `sort_by_length` length-sorted groups
    under `model.token_budget`, which bounds what one pass holds), each group in two forwards as the
    training step pads them (its contexts, then its premise columns, each cut to its longest real
    sequence), the loss the sum of the examples' own losses (each exactly `FisherModule.example_loss`),
    one backward to the activations only (no weight gradient is formed), and the per-example parameter
    gradients rebuilt by `PerExampleGrads` (an example's contributions from the two forwards are added
    before they are squared). On transformers' own forward (`stock_forward`): the hooks follow each layer's
    call. `hooks`: one built for this retriever and these sums' parameters, reused across batches.
    """
    if hooks is None:
        hooks = PerExampleGrads(retriever, {id(p): n for n, p in retriever.named_parameters() if n in sums})
    count = 0
    with retriever.stock_forward():
        for items in fisher_groups(retriever, batch):
            count += _accumulate_group(retriever, select_items(batch, items), sums, hooks)
    return count


def fisher_groups(retriever: PremiseRetriever, batch: dict[str, Any]) -> list[list[int]]:
    """The groups of the batch's items the vectorised pass takes together, as the retriever's options say
    (`model.sort_by_length`, `model.token_budget`): the training step's setting, not one of its own."""
    options = retriever.options
    return example_groups(batch, options.token_budget, call_cost_for(batch["context_ids"].device.type),
                          options.sort_by_length)


def _accumulate_group(retriever: PremiseRetriever, batch: dict[str, Any], sums: dict[str, torch.Tensor],
                      hooks: PerExampleGrads) -> int:
    ctx_ids, ctx_mask, prem_ids, prem_mask, label = example_major_batch(batch)
    k, cols = label.shape
    with hooks.start(k):
        context = retriever.encode(ctx_ids, ctx_mask)
        premises = retriever.encode(prem_ids, prem_mask).view(k, cols, -1)
    # The configured loss per example: (1 x d) @ (d x cols) (a matmul, bf16 under autocast as in the loop), then
    # each row's own loss (`context_losses`: for mse the mean over its columns), summed over the examples.
    similarity = torch.bmm(context.unsqueeze(1), premises.transpose(1, 2)).squeeze(1)
    loss = context_losses(similarity, label, retriever.options).sum()
    hooks.backward(loss, sums)
    return k
