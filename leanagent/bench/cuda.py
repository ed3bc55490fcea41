"""With `--device cuda`: the real training step on fixed-length batches (L = 512 and 1024, batch 4 to 16), the
worst case of LeanAgent's 1024-byte budget, with tokens/s, model FLOP utilisation and peak memory."""

from __future__ import annotations

import time
from typing import Any

import torch

from leanagent.bench.perf import mfu, training_flops
from leanagent.bench.results import FixedLengthRow
from leanagent.bench.timing import sync, to_device
from leanagent.bench.train_step import TrainStep, set_levers
from leanagent.data.dataset import with_lengths
from leanagent.model.retriever import PremiseRetriever


def fixed_length_batch(batch_size: int, length: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """A collated training batch of random bytes, every sequence `length` tokens: a context and 4 premises
    (1 positive, 3 negatives) per example, slot-major as `TrainDataset.collate` lays them out."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, 259, (batch_size, length), generator=g)
    prem = torch.randint(3, 259, (4 * batch_size, length), generator=g)
    label = torch.zeros(batch_size, 4 * batch_size)
    label[torch.arange(batch_size), torch.arange(batch_size)] = 1.0
    batch = {"context_ids": ctx, "context_mask": torch.ones_like(ctx), "premise_ids": prem,
             "premise_mask": torch.ones_like(prem), "label": label, "index": torch.arange(batch_size)}
    return to_device(with_lengths(batch), device)


def bench_fixed_length(model: PremiseRetriever, device: torch.device, precision_dtype: torch.dtype | None,
                       batch_sizes: tuple[int, ...] = (4, 8, 16), lengths: tuple[int, ...] = (512, 1024),
                       steps: int = 10, peak_tflops: float | None = None, compiled: bool = False
                       ) -> list[FixedLengthRow]:
    """The real training step (`TrainStep`) on batches whose sequences all have length L, the worst case of
    LeanAgent's 1024-byte budget: examples/s, tokens/s, MFU (`leanagent.bench.perf`) and peak memory per (L, batch).
    `compiled`: with the compiled blocks (`model.compile: true`)."""
    set_levers(model, True, True, compiled)
    model.drop_compiled()
    model.train()
    step = TrainStep(model, device, precision_dtype)
    rows: list[FixedLengthRow] = []
    for length in lengths:
        for b in batch_sizes:
            batch = fixed_length_batch(b, length, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                for _ in range(3):
                    step(batch)
                sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    step(batch)
                sync(device)
            except torch.OutOfMemoryError as e:
                rows.append(FixedLengthRow(length, b, compiled, error="out of memory: " + str(e).split(".")[0]))
                step.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            per_s = b * steps / (time.perf_counter() - start)
            flops = training_flops(model.encoder.config, [length] * (5 * b)) / b
            rows.append(FixedLengthRow(length, b, compiled, examples_per_s=per_s, tokens_per_s=per_s * 5 * length,
                                       tflops=per_s * flops / 1e12, mfu=mfu(per_s * flops, peak_tflops),
                                       peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30
                                       if device.type == "cuda" else None))
    set_levers(model, True, True, False)
    model.drop_compiled()
    return rows
