"""`leanagent bench grad-cache`: what `model.grad_cache` saves and costs, one InfoNCE training step cached and not.

A batch of `batch` contexts, each with its positive and `negatives` negatives (InfoNCE over all of the batch's
premises, as `model.loss: infonce` trains), random bytes at a split's real state lengths (cut at 1,024, as
`data.max_seq_len`). Each variant runs in a process of its own (`python -m leanagent.bench.grad_cache OPTIONS`: the
retriever's real `training_step` and a backward, dropout on, fp32, after one warm-up step), so the peak resident
memory it adds over the model and batch (the high-water mark less the memory before the step) is its own. On a GPU
the activations fill the memory; on a CPU the same figures come out of resident memory.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import ByT5Tokenizer, T5EncoderModel

from leanagent.bench.options import GradCacheOptions
from leanagent.bench.results import Section
from leanagent.data.theorems import load_states
from leanagent.ground.timings import peak_rss_mb, rss_mb
from leanagent.model.options import RetrieverOptions
from leanagent.model.presets import encoder_config
from leanagent.model.retriever import PremiseRetriever

MAX_LEN = 1024


@dataclass
class GradCacheFigures(Section):
    preset: str
    layers: int
    batch: int
    negatives: int
    budget: int
    uncached_step_s: float
    uncached_peak_added_mb: float
    cached_step_s: float
    cached_peak_added_mb: float
    memory_ratio: float
    time_ratio: float


def _lengths(states: Path | None, n: int, seed: int) -> list[int]:
    found = [len(s.encode()) + 1 for s in load_states([states])] if states is not None else [300]
    rng = random.Random(seed)
    return [min(rng.choice(found), MAX_LEN) for _ in range(n)]


def bench_grad_cache(options: GradCacheOptions) -> GradCacheFigures:
    rows = {}
    for cached in (False, True):
        argv = [sys.executable, "-m", "leanagent.bench.grad_cache", options.model_dump_json(), json.dumps(cached)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the {'cached' if cached else 'uncached'} step failed: {done.stderr[-2000:]}")
        rows[cached] = json.loads(done.stdout.strip().splitlines()[-1])
    plain, cached_row = rows[False], rows[True]
    return GradCacheFigures(options.preset, options.layers, options.batch, options.negatives, options.budget,
                            plain["step_s"], plain["peak_added_mb"], cached_row["step_s"],
                            cached_row["peak_added_mb"], cached_row["peak_added_mb"] / plain["peak_added_mb"],
                            cached_row["step_s"] / plain["step_s"])


def grad_cache_table(figures: GradCacheFigures) -> str:
    return "\n".join([
        f"one InfoNCE step, {figures.batch} contexts x {1 + figures.negatives} premises ({figures.preset}, "
        f"{figures.layers} layers, token budget {figures.budget})",
        f"  grad_cache false: step {figures.uncached_step_s:.2f} s, peak memory added "
        f"{figures.uncached_peak_added_mb:.0f} MiB",
        f"  grad_cache  true: step {figures.cached_step_s:.2f} s, peak memory added "
        f"{figures.cached_peak_added_mb:.0f} MiB",
        f"  cached / uncached: memory {figures.memory_ratio:.2f}x, time {figures.time_ratio:.2f}x"])


def _one_step(options: GradCacheOptions, cached: bool) -> dict:
    """The child's measurement: one warm-up step, then the measured one."""
    config = encoder_config(options.preset)
    config.num_layers = options.layers
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:  # the weights are read into memory; the folder goes
        T5EncoderModel(config).save_pretrained(tmp)
        ByT5Tokenizer().save_pretrained(tmp)
        model = PremiseRetriever(RetrieverOptions(name_or_path=tmp, loss="infonce", token_budget=options.budget,
                                                  grad_cache=cached))
    per = 1 + options.negatives

    def pool(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(lens)
        ids = torch.randint(3, 259, (len(lens), width))
        mask = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()
        return ids * mask, mask

    ctx_lens = _lengths(options.states, options.batch, 1)
    prem_lens = _lengths(options.states, options.batch * per, 2)
    (cids, cmask), (pids, pmask) = pool(ctx_lens), pool(prem_lens)
    label = torch.zeros(options.batch, options.batch * per)
    label[torch.arange(options.batch), torch.arange(options.batch) * per] = 1
    batch = {"context_ids": cids, "context_mask": cmask, "context_lengths": ctx_lens, "premise_ids": pids,
             "premise_mask": pmask, "premise_lengths": prem_lens, "label": label, "index": list(range(options.batch))}
    model.log = lambda *a, **k: None  # no Trainer to log to

    def step() -> float:
        start = time.perf_counter()
        model.training_step(batch, 0).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up: the allocator's first pools, then the peak counts the step alone
    before = rss_mb()
    seconds = step()
    return {"grad_cache": cached, "step_s": seconds, "peak_added_mb": peak_rss_mb() - before}


if __name__ == "__main__":  # one variant, in a process of its own (`bench_grad_cache`)
    print(json.dumps(_one_step(GradCacheOptions.model_validate_json(sys.argv[1]), json.loads(sys.argv[2]))))
