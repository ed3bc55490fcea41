"""Diagonal Fisher information of the retriever, for EWC: two estimators.

`per_example` (FisherModule, the default) is the diagonal empirical Fisher:
F_i = (1/N) * sum_n (d loss_n / d theta_i)^2 over the N training examples of a repository, each
example scored against its own positive and negatives. It squares *per-example* gradients. Under
DDP the gradient all-reduce would average before squaring, so this pass takes gradients with
`torch.autograd.grad` (DDP's reducer never sees them), accumulates local fp32 sums, and
all-reduces the sums and the true example count once at the end.

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

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.models.t5.modeling_t5 import T5Attention, T5LayerNorm

from leanagent.model.retriever import PremiseRetriever, contrastive_mse

METHODS = ("auto", "loop", "vectorised")
# What `auto` picks on a CPU, by measurement (see the module docstring); on CUDA it always picks "vectorised".
CPU_METHOD = "loop"


class FisherModule(pl.LightningModule):
    """Runs one epoch over the training examples and accumulates squared per-example gradients.

    `method`: "loop" (one `autograd.grad` per example), "vectorised" (one forward and one backward per
    batch, per-example gradients rebuilt from activations and output gradients) or "auto" (vectorised
    on CUDA, `CPU_METHOD` elsewhere; the loop where the retriever has a layer the vectorised path does
    not know). Both give the same sums up to float tolerance.
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

    def configure_optimizers(self) -> None:
        return None

    def resolved_method(self, device: torch.device) -> str:
        if self.method != "auto":
            return self.method
        if self.unsupported:
            return "loop"
        return "vectorised" if device.type == "cuda" else CPU_METHOD

    def on_train_epoch_start(self) -> None:
        self.sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.retriever.named_parameters()
                     if n in self.names}
        self.count = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Dropout off: the Fisher describes the model as it is used, and must not depend on the rank's RNG.
        self.retriever.eval()
        if self.resolved_method(batch["context_ids"].device) == "vectorised":
            self.count += accumulate_squared_example_grads(self.retriever, batch, self.sums)
            return
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
        if _distributed():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        total = int(count.item())
        if total == 0:
            raise RuntimeError("the Fisher pass saw no training example")
        self.fisher = _unflatten(flat / total, names, self.sums)
        self.num_examples = total


# ---- the vectorised per-example gradients -----------------------------------------------------------

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
    """Forward hooks that rebuild each example's gradient from activations and output gradients.

    Every forward holds `k` examples' sequences, example-major (example e's are consecutive, as many for
    each example); the loss is the sum of the examples' own losses, so the gradient of the loss at the
    tokens of e's sequences is the gradient of e's own loss there (and 0 at padding, which attention
    masks out and pooling ignores).
    A parameter's gradient for example e is then a sum over e's tokens alone:
    Linear W: sum_t dy_t x_t^T (bias: sum_t dy_t); T5LayerNorm (RMS norm, weight only): sum_t dy_t * x_t/rms(x_t);
    Embedding: dy_t added to the row of token t; the relative attention bias (one table shared by all
    layers): the gradient of each sequence's own copy of the (heads, L, L) position bias, summed by bucket.
    """

    def __init__(self, model: nn.Module, names: dict[int, str], sums: dict[str, torch.Tensor], k: int) -> None:
        self.model = model
        self.names = names  # id(parameter) -> name, trainable parameters only
        self.sums = sums
        self.k = k
        self.handles: list[Any] = []
        self.expected: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.partial: dict[str, torch.Tensor] = {}
        self.inputs: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self.casts: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.uses: dict[int, int] = {}  # id(linear input) -> Linear calls that read it

    def __enter__(self) -> _PerExampleGrads:
        attentions = _relative_bias_attentions(self.model)
        tables = {id(m.relative_attention_bias) for m in attentions}
        for module in attentions:
            if id(module.relative_attention_bias.weight) in self.names:
                self.handles.append(module.register_forward_pre_hook(self._bias_pre_hook, with_kwargs=True))
        for module in self.model.modules():
            if id(module) in tables:
                continue
            if isinstance(module, nn.Linear):
                self.handles.append(module.register_forward_hook(self._linear_hook))
            elif isinstance(module, nn.Embedding):
                self.handles.append(module.register_forward_hook(self._embedding_hook))
            elif isinstance(module, T5LayerNorm):
                self.handles.append(module.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- bookkeeping. A parameter used by several calls (here: the context and the premise forward) gets its
    # per-example gradients summed over the calls before they are squared.
    def _expect(self, param: torch.Tensor | None) -> str | None:
        name = self.names.get(id(param)) if param is not None else None
        if name is not None:
            self.expected[name] = self.expected.get(name, 0) + 1
        return name

    def _contribute(self, name: str, update: Callable[[torch.Tensor | None], torch.Tensor]) -> None:
        """`update(per-example gradients of the earlier calls, or None)` returns them with this call's added."""
        partial = update(self.partial.pop(name, None))
        self.received[name] = self.received.get(name, 0) + 1
        if self.received[name] < self.expected[name]:
            self.partial[name] = partial
        else:
            self._square_into(name, partial)

    def _square_into(self, name: str, per_example: torch.Tensor) -> None:
        # sum_e g_e^2 in fp32, reading the (k, *shape) per-example gradients once.
        norm = torch.linalg.vector_norm(per_example, ord=2, dim=0, dtype=torch.float32)
        self.sums[name].addcmul_(norm, norm)

    def flush(self) -> None:
        """Calls whose output did not reach the loss never report: square what the others gave."""
        for name, per_example in self.partial.items():
            self._square_into(name, per_example)
        self.partial.clear()
        self.casts.clear()
        self.uses.clear()

    def _cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x in the dtype its Linear layers ran in (autocast's bf16 copy), made once for all the layers reading x."""
        if x.dtype == dtype:
            return x
        key = (id(x), dtype)
        cast = self.casts.get(key)
        if cast is None:
            cast = self.casts[key] = x.to(dtype)
        self.uses[id(x)] -= 1
        if self.uses[id(x)] <= 0:
            self.casts.pop(key, None)
        return cast

    # -- hooks
    def _linear_hook(self, module: nn.Linear, args: tuple, output: torch.Tensor) -> None:
        weight, bias = self._expect(module.weight), self._expect(module.bias)
        if (weight is None and bias is None) or not output.requires_grad:
            return
        x = args[0]
        if weight is not None:
            self.uses[id(x)] = self.uses.get(id(x), 0) + 1

        def on_grad(dy: torch.Tensor) -> None:
            dy = dy.reshape(self.k, -1, dy.shape[-1])
            if weight is not None:
                # In the dtype the layer ran in (bf16 under autocast), as the loop's weight gradient is.
                dyt = dy.transpose(1, 2)
                xs = self._cast(x, dy.dtype).reshape(self.k, -1, x.shape[-1])

                def add_outer(partial: torch.Tensor | None) -> torch.Tensor:
                    if partial is None:
                        return torch.bmm(dyt, xs)
                    if partial.dtype == dyt.dtype:
                        return partial.baddbmm_(dyt, xs)
                    return partial.float() + torch.bmm(dyt, xs).float()

                self._contribute(weight, add_outer)
            if bias is not None:
                self._contribute(bias, _plus(dy.float().sum(dim=1)))

        output.register_hook(on_grad)

    def _norm_hook(self, module: T5LayerNorm, args: tuple, output: torch.Tensor) -> None:
        weight = self._expect(module.weight)
        if weight is None or not output.requires_grad:
            return
        x = args[0]

        def on_grad(dy: torch.Tensor) -> None:
            # T5LayerNorm.forward's own arithmetic, so the normalised input is the one it multiplied.
            variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            normed = x * torch.rsqrt(variance + module.variance_epsilon)
            if module.weight.dtype in (torch.float16, torch.bfloat16):
                normed = normed.to(module.weight.dtype)
            per_example = (dy.float() * normed.float()).reshape(self.k, -1, dy.shape[-1]).sum(dim=1)
            self._contribute(weight, _plus(per_example))

        output.register_hook(on_grad)

    def _embedding_hook(self, module: nn.Embedding, args: tuple, output: torch.Tensor) -> None:
        weight = self._expect(module.weight)
        if weight is None or not output.requires_grad:
            return
        ids = args[0]

        def on_grad(dy: torch.Tensor) -> None:
            vocab, dim = module.weight.shape
            example = torch.arange(self.k, device=ids.device).repeat_interleave(ids.numel() // self.k)
            rows = example * vocab + ids.reshape(-1)

            def add_rows(partial: torch.Tensor | None) -> torch.Tensor:
                if partial is None:
                    partial = torch.zeros(self.k, vocab, dim, device=dy.device, dtype=torch.float32)
                partial.view(self.k * vocab, dim).index_add_(0, rows, dy.reshape(-1, dim).float())
                if module.padding_idx is not None:
                    partial[:, module.padding_idx] = 0
                return partial

            self._contribute(weight, add_rows)

        # Asked for from autograd.grad, not hooked: the gradient it returns for the output is the complete one.
        self.inputs.append((output, on_grad))

    def _bias_pre_hook(self, module: T5Attention, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if kwargs.get("position_bias") is not None or kwargs.get("key_value_states") is not None:
            return None
        if kwargs.get("cache") is not None:
            raise RuntimeError("the vectorised Fisher runs the encoder without a cache")
        weight = self._expect(module.relative_attention_bias.weight)
        seqs, length = hidden.shape[0], hidden.shape[1]
        shared = module.compute_bias(length, length, device=hidden.device)  # (1, heads, L, L)
        # One copy per sequence, so that its gradient is per sequence; the module and the later layers use it.
        per_seq = shared.expand(seqs, -1, -1, -1).clone()
        position = torch.arange(length, dtype=torch.long, device=hidden.device)
        bucket = module._relative_position_bucket(
            position[None, :] - position[:, None], bidirectional=not module.is_decoder,
            num_buckets=module.relative_attention_num_buckets, max_distance=module.relative_attention_max_distance)

        def on_grad(dp: torch.Tensor) -> None:
            heads, buckets = dp.shape[1], module.relative_attention_num_buckets
            per_example = dp.float().reshape(self.k, -1, heads, length * length).sum(dim=1)  # (k, heads, L*L)

            def add_buckets(partial: torch.Tensor | None) -> torch.Tensor:
                # Kept as (k, buckets, heads), the table's layout, over a (k, heads, buckets) tensor.
                if partial is None:
                    partial = torch.zeros(self.k, heads, buckets, device=dp.device, dtype=torch.float32).transpose(1, 2)
                partial.transpose(1, 2).scatter_add_(2, bucket.reshape(1, 1, -1).expand(self.k, heads, -1),
                                                     per_example)
                return partial

            self._contribute(weight, add_buckets)

        self.inputs.append((per_seq, on_grad))
        return args, {**kwargs, "position_bias": per_seq}


def _plus(per_example: torch.Tensor) -> Callable[[torch.Tensor | None], torch.Tensor]:
    return lambda partial: per_example if partial is None else partial + per_example


def accumulate_squared_example_grads(retriever: PremiseRetriever, batch: dict[str, Any],
                                     sums: dict[str, torch.Tensor]) -> int:
    """Adds sum over the batch's non-padding examples of (d loss_e / d theta)^2 to `sums`; returns their count.

    Two forwards, as in the training step (the examples' contexts, then their premise columns, each
    padded to its longest real sequence), the loss the sum of the examples' own losses (each exactly
    `FisherModule.example_loss`), one backward to the activations only (no weight gradient is formed),
    and the per-example parameter gradients rebuilt by `_PerExampleGrads` (an example's contributions
    from the two forwards are added before they are squared).
    """
    if not bool((~batch["is_padding"].bool()).any()):
        return 0
    ctx_ids, ctx_mask, prem_ids, prem_mask, label = example_major_batch(batch)
    k, cols = label.shape
    names = {id(p): n for n, p in retriever.named_parameters() if n in sums}
    with _PerExampleGrads(retriever, names, sums, k) as hooks:
        context = retriever.encode(ctx_ids, ctx_mask)
        premises = retriever.encode(prem_ids, prem_mask).view(k, cols, -1)
    # contrastive_mse per example: (1 x d) @ (d x cols) (a matmul, bf16 under autocast as in the loop), mean over cols.
    similarity = torch.bmm(context.unsqueeze(1), premises.transpose(1, 2)).squeeze(1)
    loss = F.mse_loss(similarity, label.to(similarity.dtype), reduction="none").mean(dim=1).sum()
    grads = torch.autograd.grad(loss, [t for t, _ in hooks.inputs], allow_unused=True)
    for (_, on_grad), grad in zip(hooks.inputs, grads, strict=True):
        if grad is not None:
            on_grad(grad)
    hooks.flush()
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
