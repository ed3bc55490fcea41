"""Diagonal Fisher information of the retriever, for EWC: two estimators.

`per_example` (FisherModule, the default) is the diagonal empirical Fisher:
F_i = (1/N) * sum_n (d loss_n / d theta_i)^2 over the N training examples of a repository, each
example scored against its own positive and negatives. It squares *per-example* gradients. Under
DDP the gradient all-reduce would average before squaring, so this pass takes gradients with
`torch.autograd.grad` (DDP's reducer never sees them), accumulates local fp32 sums, and
all-reduces the sums and the true example count once at the end. Padding items (`is_padding`) are
skipped, dropout is off (eval mode), sums are fp32. Two computations of the same sums:

- "loop": per example, its context alone and its premise columns (unpadded) through the encoder and
  one `autograd.grad` to the parameters. Bit-identical however the data is batched or sharded, but
  batch-1 work: on a GPU it is bound by kernel launches (3.9x a bf16 training step per example on an H200).
- "vectorised" (`accumulate_squared_example_grads`): the batch's examples in two forwards, as the
  training step pads them (contexts, then premise columns), loss = the sum of the examples' own
  losses, one `autograd.grad` to the layers' outputs (no weight gradient is formed) and each
  example's parameter gradients rebuilt from activations and output gradients (Linear: sum over its
  tokens of dy x^T; T5LayerNorm, the RMS norm's weight; the embedding rows; the relative attention
  bias table via a per-sequence copy of the position bias), same-shaped layers batched together.
  Equal to the loop up to float tolerance (fp32: ~1e-6 of each tensor's scale; under bf16 autocast the
  two round differently, ~1e-2 per entry on one batch, ~3e-3 over a repository, and the result now
  depends on the batching at that level: 1e-4 between 1 and 2 ranks). It holds the gradients of all
  the layers' outputs at once: peak memory ~1.3x a training step's (measured on the CPU, fp32).

`FisherModule(retriever, method="auto")`, what `leanagent fisher` runs, takes `AUTO_METHOD`, the
loop, on every device. Measured per example against a training step (forward, backward, AdamW), batch
4, 3 negatives: on 2 idle CPU cores the loop is the faster (byt5-small widths, 4 of its 12 layers,
contexts and premises of 150-400 bytes: loop 0.42x a training step in fp32 and 0.60x under bf16
autocast, vectorised 0.70x and 1.11x; tiny: 0.41x against 0.60x), since batching pads every sequence
to the batch's longest and a CPU gains little from larger matrices. On an H200 (byt5-small, all 12
layers, bf16, mathlib-scale data of up to 1024 bytes, `leanagent bench --device cuda`): the loop
1.38x a training step (32 examples); the vectorised pass 1.04x on 8 examples, but it ran out of the
card's 139 GiB on 32 examples and in a real Fisher job at batch 8, length 512, so it is opt-in
(`method="vectorised"`). A retriever with a layer the vectorised path does not know
(`unsupported_modules`) always takes the loop.

`reference` (ReferenceFisherModule) is LeanAgent's `compute_fisher` /
`FisherComputationModule`, step for step: one epoch over the training loader (shuffled,
drop_last, random negatives, sharded by Lightning's DistributedSampler), dropout on; per batch
the gradient of the batch loss, averaged across ranks by DDP, is squared and summed; at the end
the sums are all-reduced (SUM) and divided by len(train dataset) * world_size. Every rank holds
the same DDP-averaged gradient, so that is sum over steps of (batch-mean gradient)^2 / N: a
smaller, different quantity, about 1/(batch size x world size) of the empirical Fisher when
per-example gradients are independent (van de Ven, arXiv:2502.11756; GMvandeVen/continual-learning#11).

Both write safetensors (the reference used pickle, which can execute code on load), keyed by the
retriever's parameter names, with the estimator in the metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save
from torch import nn
from transformers.models.t5.modeling_t5 import T5Attention, T5LayerNorm

from leanagent.atomic import write_bytes_atomic
from leanagent.model.retriever import PremiseRetriever, contrastive_mse

METHODS = ("auto", "loop", "vectorised")
# What `auto` picks, by measurement: on CPU the loop is faster; on an H200 the vectorised pass ran out of
# its 139 GiB at batch 4-8 with 512-1024-byte sequences (per-example weight gradients of every linear layer),
# while the loop took 1.38x a training example. So `auto` is the loop everywhere; "vectorised" is opt-in.
AUTO_METHOD = "loop"


class FisherModule(pl.LightningModule):
    """Runs one epoch over the training examples and accumulates squared per-example gradients.

    `method`: "loop" (one `autograd.grad` per example), "vectorised" (two forwards and one backward per
    batch, per-example gradients rebuilt from activations and output gradients; memory-hungry) or
    "auto" (`AUTO_METHOD`). Both give the same sums up to float tolerance (see the module docstring).
    """

    def __init__(self, retriever: PremiseRetriever, method: str = "auto") -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown Fisher method {method!r}; choose one of {METHODS}")
        self.retriever = retriever
        self.method = method
        self.automatic_optimization = False
        self.names = [n for n, p in retriever.named_parameters() if p.requires_grad]
        self.unsupported = unsupported_modules(retriever)
        if method == "vectorised" and self.unsupported:
            raise ValueError(f"the vectorised Fisher does not cover {self.unsupported[:5]}; use method='loop'")
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.fisher: dict[str, torch.Tensor] = {}
        self.num_examples = 0
        self._hooks: _PerExampleGrads | None = None

    def configure_optimizers(self) -> None:
        return None

    def resolved_method(self, device: torch.device) -> str:
        if self.method != "auto":
            return self.method
        if self.unsupported:
            return "loop"
        return AUTO_METHOD

    def on_train_epoch_start(self) -> None:
        self.sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.retriever.named_parameters()
                     if n in self.names}
        self.count = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Dropout off: the Fisher describes the model as it is used, and must not depend on the rank's RNG.
        self.retriever.eval()
        if self.resolved_method(batch["context_ids"].device) == "vectorised":
            if self._hooks is None:
                self._hooks = _PerExampleGrads(self.retriever, {id(p): n for n, p in self.retriever.named_parameters()
                                                                if n in self.names})
            self.count += accumulate_squared_example_grads(self.retriever, batch, self.sums, self._hooks)
            return
        params = [p for n, p in self.retriever.named_parameters() if n in self.names]
        sums = [self.sums[n] for n in self.names]
        # Every example's lengths in one host read: a read per example would stall a GPU between examples.
        padding, ctx_lens, prem_lens = _example_lengths(batch)
        for i in range(len(padding)):
            if padding[i]:
                continue
            loss = self.example_loss(batch, i, ctx_lens[i], prem_lens[i])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            used = [(total, grad.float()) for total, grad in zip(sums, grads, strict=True) if grad is not None]
            totals, squared = [t for t, _ in used], [g for _, g in used]
            torch._foreach_addcmul_(totals, squared, squared)  # sums += grad^2, one multi-tensor kernel
            self.count += 1

    def example_loss(self, batch: dict[str, Any], i: int, ctx_len: int, prem_len: int) -> torch.Tensor:
        """Example i alone, unpadded (its context's length and its longest premise's, from `_example_lengths`),
        so that its loss is bit-identical however the data is batched or sharded."""
        b = len(batch["index"])
        columns = list(range(i, batch["premise_ids"].shape[0], b))
        context = self.retriever.encode(batch["context_ids"][i : i + 1, :ctx_len],
                                        batch["context_mask"][i : i + 1, :ctx_len])
        premises = self.retriever.encode(batch["premise_ids"][columns, :prem_len],
                                         batch["premise_mask"][columns, :prem_len])
        label = batch["label"][i : i + 1, columns]
        return contrastive_mse(context, premises, label)

    def on_train_epoch_end(self) -> None:
        names = sorted(self.sums)
        flat = torch.cat([self.sums[n].flatten() for n in names])
        count = torch.tensor([float(self.count)], device=flat.device, dtype=torch.float64)
        if _distributed():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        total = int(count.item())
        if total == 0:
            raise RuntimeError("the Fisher pass saw no training example")
        self.fisher = _unflatten(flat / total, names, self.sums)
        self.num_examples = total


# ---- the vectorised per-example gradients -----------------------------------------------------------

def _example_lengths(batch: dict[str, Any]) -> tuple[list[bool], list[int], list[int]]:
    """Per batch item: is it padding, its context's length, and the longest of its premise columns'."""
    b = len(batch["index"])
    prem = batch["premise_mask"].sum(dim=1).view(-1, b).amax(dim=0)  # row i + j * b is item i's column j
    ctx = batch["context_mask"].sum(dim=1)
    padding, ctx_lens, prem_lens = torch.stack([batch["is_padding"].to(ctx.device).long(), ctx, prem]).tolist()
    return [bool(p) for p in padding], ctx_lens, prem_lens


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


class _PerExampleGrads:
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
    # that reduction was 10-30x slower than the products on the CPU.
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

    def start(self, k: int) -> _PerExampleGrads:
        """A new batch of `k` examples."""
        self.k = k
        # (kind, module, parameter names, the call's input (or bucket index), the tensor whose gradient is needed)
        self.records: list[tuple[str, nn.Module, tuple[str | None, ...], torch.Tensor, torch.Tensor]] = []
        return self

    def __enter__(self) -> _PerExampleGrads:
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
                                     sums: dict[str, torch.Tensor], hooks: _PerExampleGrads | None = None) -> int:
    """Adds sum over the batch's non-padding examples of (d loss_e / d theta)^2 to `sums`; returns their count.

    Two forwards, as in the training step (the examples' contexts, then their premise columns, each
    padded to its longest real sequence), the loss the sum of the examples' own losses (each exactly
    `FisherModule.example_loss`), one backward to the activations only (no weight gradient is formed),
    and the per-example parameter gradients rebuilt by `_PerExampleGrads` (an example's contributions
    from the two forwards are added before they are squared). `hooks`: one built for this retriever
    and these sums' parameters, reused across batches.
    """
    if not bool((~batch["is_padding"].bool()).any()):
        return 0
    if hooks is None:
        hooks = _PerExampleGrads(retriever, {id(p): n for n, p in retriever.named_parameters() if n in sums})
    ctx_ids, ctx_mask, prem_ids, prem_mask, label = example_major_batch(batch)
    k, cols = label.shape
    with hooks.start(k):
        context = retriever.encode(ctx_ids, ctx_mask)
        premises = retriever.encode(prem_ids, prem_mask).view(k, cols, -1)
    # contrastive_mse per example: (1 x d) @ (d x cols) (a matmul, bf16 under autocast as in the loop), mean over cols.
    similarity = torch.bmm(context.unsqueeze(1), premises.transpose(1, 2)).squeeze(1)
    loss = F.mse_loss(similarity, label.to(similarity.dtype), reduction="none").mean(dim=1).sum()
    hooks.backward(loss, sums)
    return k


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _unflatten(flat: torch.Tensor, names: list[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name in names:
        numel = like[name].numel()
        out[name] = flat[offset : offset + numel].view_as(like[name]).cpu()
        offset += numel
    return out


NO_BATCH = ("the reference Fisher pass ran no batch (fewer training examples than data.batch_size x world size, "
            "and the training loader drops the last incomplete batch)")


class ReferenceFisherModule(pl.LightningModule):
    """LeanAgent's FisherComputationModule: squared DDP-averaged batch gradients, summed, / (N * world size).

    Fit it on the data module's own `train_dataloader()`; N is `len(trainer.train_dataloader.dataset)`,
    the training dataset (not the examples actually seen: drop_last and the sampler's padding are
    ignored, as in the reference). Keys are the retriever's parameter names, every trainable one
    (a parameter that never gets a gradient keeps 0; the reference would omit it and EWC would refuse).
    """

    def __init__(self, retriever: PremiseRetriever) -> None:
        super().__init__()
        self.retriever = retriever
        self.automatic_optimization = False
        self.names = [n for n, p in retriever.named_parameters() if p.requires_grad]
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.fisher: dict[str, torch.Tensor] = {}
        self.num_examples = 0
        self.num_steps = 0  # DDP-averaged gradients squared (steps of one rank)

    def configure_optimizers(self) -> None:
        return None  # the reference's SGD(lr=0) is never stepped

    def on_train_epoch_start(self) -> None:
        self.sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.retriever.named_parameters()
                     if n in self.names}
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
        names = sorted(self.sums)
        flat = torch.cat([self.sums[n].flatten() for n in names])
        steps = torch.tensor([float(self.steps)], device=flat.device, dtype=torch.float64)
        world_size = 1
        if _distributed():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            dist.all_reduce(steps, op=dist.ReduceOp.SUM)
            world_size = dist.get_world_size()
        if int(steps.item()) == 0:
            raise RuntimeError(NO_BATCH)
        dataset_size = len(self.trainer.train_dataloader.dataset)
        self.fisher = _unflatten(flat / (dataset_size * world_size), names, self.sums)
        self.num_examples = dataset_size
        self.num_steps = int(steps.item()) // world_size

    def on_fit_end(self) -> None:
        # An empty loader ends fit before any epoch hook runs: never hand back an empty Fisher.
        if not self.fisher:
            raise RuntimeError(NO_BATCH)


def save_fisher(path: Path, fisher: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write atomically: a crash never leaves a truncated Fisher that EWC would later trust."""
    write_bytes_atomic(Path(path), save({n: t.contiguous() for n, t in fisher.items()},
                                        metadata={k: json.dumps(v) for k, v in metadata.items()}))


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
