"""`leanagent bench`: how fast each stage of the data and model path runs, measured in one process.

A benchmark, not a test: it prints a table and writes JSON, and its numbers are meant to be
compared as ratios within one run (these machines are noisy). Each figure isolates one piece of
what a lifelong run spends its time on:

- corpus load (time and resident memory), premise tokenization;
- training examples: negative sampling + collate, batch 4, 3 negatives, 1024 bytes, one process;
- corpus embedding with the given model, sorted into token-budget batches and, for comparison,
  in corpus order (the straightforward way), in fp32 as evaluation does; sorted again under bf16
  autocast (`model.corpus_autocast`);
- retrieval: the top 100 accessible premises per context, batched, at the model's width, in bf16
  as under bf16-mixed; and LeanAgent's search (a full sort walked in Python) on the same embeddings,
  for the ratio and to check that both find the same scores;
- the real training step (`PremiseRetriever.training_step`, backward, clipping, AdamW) on the dataset's
  batches, optionally with the proof states of LeanDojo split files as contexts (`--states`: their real
  lengths), four ways: padded, length-sorted sub-batches, + one attention mask per forward, + compiled
  blocks; examples/s, real tokens/s, token efficiency, MFU on CUDA (`leanagent.perf`), compile time
  cold and warm, and the sorted loss against the padded one;
- that step against the Fisher pass, per example, on the same examples (loop; vectorised on CUDA);
- the launch overhead of a real job, from its start to its first training step (on the demo);
- with `--device cuda`: the same training step on fixed-length batches (L = 512 and 1024, batch 4 to 16),
  with tokens/s and model FLOP utilisation.

On a CPU the training rows use the model's first 2 layers (`--train-layers`): every layer of byt5-small's
width has the same matmuls and attention shapes, so fewer layers keep each step's balance (the share of
matmuls against attention's and dropout's elementwise work) at a sixth of the time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanagent.config import DataConfig, PipelineConfig, dump_config
from leanagent.data.corpus import Corpus, FileRecord
from leanagent.data.dataset import (
    TrainDataset,
    build_eval_examples,
    build_train_examples,
    tokenize_premises,
    with_lengths,
)
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import format_context, load_split
from leanagent.jobs import run_job
from leanagent.launch.progress_view import MODE_ENV
from leanagent.model.fisher import FisherModule
from leanagent.model.lr_schedule import build_optimizer_and_schedule
from leanagent.model.presets import write_random_encoder
from leanagent.model.retriever import PremiseRetriever, TokenCount
from leanagent.model.topk import top_k_accessible
from leanagent.perf import mfu, peak_bf16_tflops, training_flops


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rate(fn: Callable[[], int], min_seconds: float, min_calls: int = 3) -> float:
    """Items per second of `fn` (which returns how many items it did), after one warm-up call."""
    fn()
    done, calls, start = 0, 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        done += fn()
        calls += 1
    return done / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_corpus(dataset: Path) -> tuple[Any, dict[str, float]]:

    before = _rss_mb()
    start = time.perf_counter()
    corpus = Corpus.from_jsonl(dataset / "corpus.jsonl")
    seconds = time.perf_counter() - start
    return corpus, {"corpus_load_s": seconds, "corpus_rss_mb": _rss_mb() - before,
                    "num_premises": len(corpus), "num_files": len(corpus.paths)}


def bench_data(dataset: Path, corpus, split: str, min_seconds: float) -> tuple[dict, list, list]:
    from transformers import ByT5Tokenizer


    tokenizer = ByT5Tokenizer()
    cfg = DataConfig()  # LeanAgent's: batch 4, 3 negatives (1 in-file), 1024 bytes
    train = build_train_examples(corpus, load_split(dataset / split / "train.json"))
    evals: list = []
    for name in ("test", "val"):
        path = dataset / split / f"{name}.json"
        if path.is_file():
            evals += build_eval_examples(corpus, load_split(path))
    ds = TrainDataset(corpus, train, tokenizer, cfg.num_negatives, cfg.num_in_file_negatives, cfg.max_seq_len,
                      cfg.max_seq_len, seed=0)
    rng = random.Random(0)

    def one_batch() -> int:
        items = [ds[rng.randrange(len(ds))] for _ in range(cfg.batch_size)]
        ds.collate(items)
        return cfg.batch_size

    sample = rng.sample(range(len(corpus)), min(len(corpus), 4096))

    def tokenize() -> int:
        for i in range(0, len(sample), 64):
            tokenize_premises(tokenizer, corpus, sample[i: i + 64], cfg.max_seq_len)
        return len(sample)

    figures = {"num_train_examples": len(train), "train_examples_per_s": _rate(one_batch, min_seconds),
               "tokenize_premises_per_s": _rate(tokenize, min_seconds, min_calls=1)}
    return figures, train, evals


def _sub_corpus(corpus, indices: list[int]):
    """A corpus of some premises only (one file), for timing the embedding on a sample."""

    return Corpus([FileRecord("bench.lean", [], [dataclasses.replace(corpus.premises[i], path="bench.lean")
                                                 for i in indices])])


def bench_embedding(model, corpus, device: torch.device, sample: int, precision_dtype: torch.dtype | None,
                    min_seconds: float) -> dict[str, float]:
    """Premises/s of `embed_corpus` (length-sorted, token budget) and of corpus-order batches, same sample.

    Both in fp32, as evaluation embeds the corpus by default (outside autocast, as LeanAgent does); then
    the sorted path again under bf16 autocast, what `model.corpus_autocast: true` runs.
    """

    rng = random.Random(1)
    picked = sorted(rng.sample(range(len(corpus)), min(sample, len(corpus))))
    sub = _sub_corpus(corpus, picked)
    max_len, step = model.hparams["max_seq_len"], model.hparams["eval_batch_size"]

    def sorted_run(autocast: bool = False) -> int:
        with torch.autocast(device.type, dtype=precision_dtype, enabled=autocast and precision_dtype is not None):
            model.embed_corpus(sub)
        _sync(device)
        return len(sub)

    @torch.no_grad()
    def unsorted_run() -> int:
        for i in range(0, len(sub), step):
            ids, mask = tokenize_premises(model.tokenizer, sub, range(i, min(i + step, len(sub))), max_len)
            model.encode(ids.to(device), mask.to(device))
        _sync(device)
        return len(sub)

    fast = _rate(sorted_run, min_seconds, min_calls=1)
    slow = _rate(unsorted_run, min_seconds, min_calls=1)
    figures = {"embed_premises_per_s": fast, "embed_unsorted_premises_per_s": slow, "embed_speedup": fast / slow}
    if precision_dtype is not None:
        figures["embed_autocast_premises_per_s"] = _rate(lambda: sorted_run(autocast=True), min_seconds, min_calls=1)
        figures["embed_autocast_speedup"] = figures["embed_autocast_premises_per_s"] / fast
    lengths = np.minimum([len(p.text.encode()) + 1 for p in sub.premises], max_len)
    padded = sum(len(lengths[i: i + step]) * lengths[i: i + step].max() for i in range(0, len(lengths), step))
    return {**figures, "embed_sample": len(sub), "corpus_order_padding_fraction": 1 - lengths.sum() / padded}


def bench_retrieval(corpus, evals: list, width: int, device: torch.device, precision_dtype: torch.dtype | None,
                    min_seconds: float, k: int = 100, batch: int = 64) -> dict[str, float]:
    """ms per context of the top-k accessible premises, the accessibility masks included (as evaluation does)."""

    if not evals:
        return {}
    g = torch.Generator().manual_seed(0)
    dtype = precision_dtype or torch.float32
    corpus_emb = torch.nn.functional.normalize(torch.randn(len(corpus), width, generator=g), dim=1).to(device, dtype)
    contexts = evals[: 4 * batch]
    ctx_emb = torch.nn.functional.normalize(torch.randn(len(contexts), width, generator=g), dim=1).to(device)

    def run() -> int:
        for i in range(0, len(contexts), batch):
            part = contexts[i: i + batch]
            mask = torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in part])
            top_k_accessible(ctx_emb[i: i + len(part)], corpus_emb, mask.to(device), k)
        _sync(device)
        return len(contexts)

    figures = {"retrieval_ms_per_context": 1000.0 / _rate(run, min_seconds), "retrieval_width": width}
    # LeanAgent's search on the first batch, same embeddings and dtype: its time, and whether it finds the same.
    part = contexts[:batch]
    start = time.perf_counter()
    ref_scores, _ = leanagent_style_nearest(corpus, part, ctx_emb[: len(part)], corpus_emb, k)
    figures["retrieval_leanagent_style_ms_per_context"] = 1000.0 * (time.perf_counter() - start) / len(part)
    figures["retrieval_speedup"] = (figures["retrieval_leanagent_style_ms_per_context"]
                                    / figures["retrieval_ms_per_context"])
    mask = torch.stack([corpus.accessible_mask(e.file_path, e.theorem_start) for e in part])
    scores, _ = top_k_accessible(ctx_emb[: len(part)], corpus_emb, mask.to(device), k)
    # Scores, not indices: bf16 products tie often, and the two orders of tied premises may differ.
    figures["retrieval_same_as_leanagent_style"] = all(
        torch.equal(scores[j][torch.isfinite(scores[j])].float().cpu(), torch.tensor(ref, dtype=torch.float32))
        for j, ref in enumerate(ref_scores))
    return figures


def leanagent_style_nearest(corpus, contexts: list, ctx_emb: torch.Tensor, corpus_emb: torch.Tensor,
                            k: int) -> tuple[list[list[float]], list[list[int]]]:
    """LeanAgent's nearest-premise search (`Corpus.get_nearest_premises`), rewritten here as the baseline.

    One product, a full descending sort of every row turned into Python lists, and per context its
    accessible premises gathered into a fresh set keyed by file path and then full name (LeanAgent's
    `PremiseSet`: the file's premises up to the theorem, then every imported file's, from a per-file
    cache), tested premise by premise down the ranking until k are found.
    """
    premises = corpus.premises
    scores = ctx_emb.to(corpus_emb.dtype) @ corpus_emb.t()
    ranked = scores.argsort(dim=1, descending=True).tolist()
    out_scores: list[list[float]] = []
    out_idx: list[list[int]] = []
    for j, (example, order) in enumerate(zip(contexts, ranked, strict=True)):
        accessible: dict[str, dict[str, int]] = {}
        for i in corpus.in_file_indices(example.file_path, example.theorem_start) + \
                corpus.imported_indices(example.file_path):
            accessible.setdefault(premises[i].path, {})[premises[i].full_name] = i
        found: list[int] = []
        found_scores: list[float] = []
        for i in order:
            names = accessible.get(premises[i].path)
            if names is not None and premises[i].full_name in names:
                found.append(i)
                found_scores.append(scores[j, i].item())
                if len(found) >= k:
                    break
        out_scores.append(found_scores)
        out_idx.append(found)
    return out_scores, out_idx


def load_states(files: list[Path]) -> list[str]:
    """The contexts of every tactic in LeanDojo split files, formatted as training formats them: real lengths."""
    return [format_context(tactic) for path in files for theorem in load_split(Path(path))
            for tactic in theorem.tactics]


def bench_batches(corpus, train: list, tokenizer, batches: int, max_len: int, states: list[str] | None = None,
                  seed: int = 2) -> list[dict[str, Any]]:
    """Training batches as the data module builds them (LeanAgent's batch 4, 3 negatives, one in-file; fixed
    negatives), cut at `max_len` bytes, host-side lengths added. With `states`, each example's context is
    replaced by one of those proof states (a seeded order): the batches then have the contexts' real lengths
    while the premises come from the dataset's corpus."""
    cfg = DataConfig()
    if states:
        order = list(states)
        random.Random(seed).shuffle(order)
        train = [dataclasses.replace(e, context=order[k % len(order)]) for k, e in enumerate(train)]
    ds = TrainDataset(corpus, train, tokenizer, cfg.num_negatives, cfg.num_in_file_negatives, max_len, max_len,
                      seed=0, deterministic=True)
    size = cfg.batch_size
    picked = random.Random(seed).sample(range(len(ds)), min(batches * size, len(ds) - len(ds) % size))
    return [with_lengths(ds.collate([ds[i] for i in picked[j: j + size]])) for j in range(0, len(picked), size)]


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


# The training step's levers, as the rows of the bench: (name, sort_by_length, one mask, compiled).
TRAIN_STEP_ROWS = (("padded", False, False, False), ("sorted", True, False, False),
                   ("sorted_one_mask", True, True, False), ("compiled", True, True, True))


def _set_levers(model: PremiseRetriever, sort: bool, one_mask: bool, compiled: bool) -> None:
    model.hparams["sort_by_length"] = sort
    model.one_mask = one_mask
    model.hparams["compile"] = compiled


class TrainStep:
    """The real training step, as Lightning runs it: the retriever's `training_step` (its forward through
    `batch_loss`, the loss, EWC when armed) under the precision's autocast, backward, the seed's gradient
    clipping (1.0) and the optimizer training builds (`build_optimizer_and_schedule`)."""

    def __init__(self, model: PremiseRetriever, device: torch.device, precision_dtype: torch.dtype | None) -> None:
        self.model, self.device, self.dtype = model, device, precision_dtype
        self.optimizer = build_optimizer_and_schedule(model.parameters(), 1e-5, 10, 1000,
                                                      gradient_clip_val=1.0)["optimizer"]

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)

    def __call__(self, batch: dict[str, Any], index: int = 0) -> TokenCount:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer here to log to
            with self.autocast():
                loss = self.model.training_step(batch, index)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.model.last_tokens


def _loss_rel_diff(model: PremiseRetriever, batches: list[dict[str, Any]]) -> float:
    """Largest relative difference, over the batches, of the sorted + one-mask loss against the padded one:
    fp32, dropout off (eval mode), the same weights: what sorting changes, float rounding only."""
    was_training = model.training
    model.eval()
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            _set_levers(model, False, False, False)
            padded = model.batch_loss(batch).item()
            _set_levers(model, True, True, False)
            worst = max(worst, abs(model.batch_loss(batch).item() - padded) / max(abs(padded), 1e-30))
    model.train(was_training)
    return worst


def _compile_blocks(model: PremiseRetriever, step: TrainStep, cache_dir: Path) -> dict[str, float | str]:
    """Compile the encoder blocks twice: with an empty inductor cache (cold), then again after dropping every
    in-memory compiled artefact, with the on-disk cache the first one filled (warm). Seconds of each."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch._inductor.utils import clear_caches

    figures: dict[str, float | str] = {}
    with temporary_cache_dir(str(cache_dir)):
        for key in ("compile_s", "compile_warm_s"):
            torch._dynamo.reset()
            clear_caches()
            model.drop_compiled()
            with step.autocast():
                blocks = model.compiled_blocks()
            if blocks is None:
                figures["compile_error"] = model.compile_status().get("compile_failed", "compile not enabled")
                return figures
            figures[key] = blocks.compile_s
    return figures


def _best_of_rounds(passes: dict[str, Callable[[], Any]], device: torch.device, min_seconds: float,
                    rounds: int = 2) -> tuple[dict[str, float], dict[str, Any]]:
    """Seconds of each pass, the best of at least `rounds` rounds in which the passes take turns, and what each
    pass returned last. These machines are shared: interleaving gives every pass the same neighbours, and other
    work only ever slows a pass down, so its fastest round is the closest to its own cost."""
    best = {name: float("inf") for name in passes}
    last: dict[str, Any] = {}
    done, start = 0, time.perf_counter()
    while done < rounds or time.perf_counter() - start < min_seconds * len(passes):
        for name, run in passes.items():
            t0 = time.perf_counter()
            last[name] = run()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
        done += 1
    return best, last


def bench_train_step(model: PremiseRetriever, batches: list[dict[str, Any]], device: torch.device,
                     precision_dtype: torch.dtype | None, min_seconds: float, compiled: bool = True,
                     work: Path | None = None, peak_tflops: float | None = None, rounds: int = 2) -> dict[str, Any]:
    """The training step on the dataset's batches, padded / sorted / sorted + one mask / + compiled.

    Per row: examples/s, real tokens/s, token efficiency (real over processed tokens) and, given a peak,
    MFU on real tokens (`leanagent.perf`). The loss of the sorted path against the padded one comes first,
    on the same weights (`_loss_rel_diff`). Each row runs the batches once to warm up (the compiled row
    compiles first, cold and warm, then at the batches' shapes), then the rows take turns
    (`_best_of_rounds`: each row's time is its fastest pass over the batches).
    """
    batches = [_to(b, device) for b in batches]
    config = model.encoder.config
    real_lengths = [n for b in batches for n in b["context_lengths"] + b["premise_lengths"]]
    flops = training_flops(config, real_lengths)
    examples = sum(len(b["index"]) for b in batches)
    figures: dict[str, Any] = {"train_step_batches": len(batches), "train_step_examples": examples,
                               "train_step_layers": config.num_layers,
                               "train_step_real_tokens_per_example": sum(real_lengths) / examples,
                               "train_step_loss_rel_diff": _loss_rel_diff(model, batches)}
    model.train()
    step = TrainStep(model, device, precision_dtype)

    def row_pass(levers: tuple[bool, bool, bool]) -> Callable[[], TokenCount]:
        def run() -> TokenCount:
            _set_levers(model, *levers)
            tokens = TokenCount()
            for b in batches:
                tokens += step(b)
            return tokens
        return run

    passes: dict[str, Callable[[], TokenCount]] = {}
    for name, *levers in TRAIN_STEP_ROWS:
        if levers[2] and not compiled:
            continue
        _set_levers(model, *levers)
        if levers[2]:
            figures.update(_compile_blocks(model, step, Path(work or tempfile.mkdtemp()) / "inductor-cache"))
            if "compile_error" in figures:
                continue
        try:
            row_pass(tuple(levers))()  # warm-up (and, compiled, the batches' shapes)
            _sync(device)
        except torch.OutOfMemoryError as e:
            figures[f"train_step_{name}_error"] = "out of memory: " + str(e).split(".")[0]
            step.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        passes[name] = row_pass(tuple(levers))
    seconds, tokens = _best_of_rounds(passes, device, min_seconds, rounds)
    figures["train_step_rounds_best_of"] = rounds
    for name in passes:
        figures[f"train_step_{name}_examples_per_s"] = examples / seconds[name]
        figures[f"train_step_{name}_tokens_per_s"] = tokens[name].real / seconds[name]
        figures[f"train_token_efficiency_{name}"] = tokens[name].efficiency
        if peak_tflops:
            figures[f"train_step_{name}_mfu"] = mfu(flops / seconds[name], peak_tflops)
    _set_levers(model, True, True, False)
    model.drop_compiled()
    for name in ("sorted", "sorted_one_mask", "compiled"):
        if f"train_step_{name}_examples_per_s" in figures and "train_step_padded_examples_per_s" in figures:
            figures[f"train_step_{name}_speedup"] = (figures[f"train_step_{name}_examples_per_s"]
                                                     / figures["train_step_padded_examples_per_s"])
    return figures


def bench_train_vs_fisher(model, corpus, train: list, device: torch.device, precision_dtype: torch.dtype | None,
                          examples: int, fisher_methods: tuple[str, ...] = ("loop", "vectorised"),
                          max_len: int | None = None, states: list[str] | None = None,
                          min_seconds: float = 0.0, rounds: int = 2) -> dict[str, float]:
    """Seconds per example of the training step (`TrainStep`) and of the per-example Fisher pass, by method.

    The same batches for all (sequences cut at `max_len` bytes, default LeanAgent's 1024), with the
    retriever's settings (sorted sub-batches, one mask); each pass warmed up once, then the passes take
    turns (`_best_of_rounds`). `fisher_auto` names the method `auto` takes here.
    """
    max_len = max_len or DataConfig().max_seq_len
    batches = [_to(b, device) for b in bench_batches(corpus, train, model.tokenizer, -(-examples // 4), max_len,
                                                     states)]
    n = sum(len(b["index"]) for b in batches)
    model.train()
    step = TrainStep(model, device, precision_dtype)

    def train_pass() -> None:
        model.train()
        for b in batches:
            step(b)

    def fisher_pass(method: str) -> Callable[[], None]:
        fisher = FisherModule(model, method=method)

        def run() -> None:
            fisher.on_train_epoch_start()
            for b in batches:
                with step.autocast():
                    fisher.training_step({**b, "is_padding": torch.zeros(len(b["index"]), dtype=torch.bool)}, 0)
        return run

    figures: dict[str, Any] = {"train_max_len": max_len,
                               "fisher_auto": FisherModule(model).resolved_method(device)}
    candidates = [("train", train_pass)] + [(f"fisher_{m}" if m != "loop" else "fisher", fisher_pass(m))
                                            for m in fisher_methods]
    passes: dict[str, Callable[[], None]] = {}
    for name, fn in candidates:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            fn()  # warm-up
            _sync(device)
        except torch.OutOfMemoryError as e:  # a figure of its own: the other rows still stand
            figures[f"{name}_error"] = "out of memory: " + str(e).split(".")[0]
            step.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        if device.type == "cuda":
            figures[f"{name}_peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        passes[name] = fn
    seconds, _ = _best_of_rounds(passes, device, min_seconds, rounds)
    model.train()
    for name in passes:
        figures[f"{name}_s_per_example"] = seconds[name] / n
    for name in ("fisher", "fisher_vectorised"):
        if "train_s_per_example" in figures and f"{name}_s_per_example" in figures:
            figures[f"{name}_over_train"] = figures[f"{name}_s_per_example"] / figures["train_s_per_example"]
    return figures


def bench_launch(workdir: Path) -> dict[str, float]:
    """From the start of a real `train` job (torchrun, 1 CPU rank) to its first training batch, on the demo."""

    repo = write_demo_repos(workdir / "data", 1, seed=0)[0]
    model = write_random_encoder(workdir / "model", "tiny")
    cfg = PipelineConfig.model_validate({
        "model": {"name_or_path": str(model), "max_seq_len": 128, "warmup_steps": 1},
        "data": {"num_workers": 0, "max_seq_len": 128},
        "trainer": {"accelerator": "cpu", "devices": 1, "accumulate_grad_batches": 1},
    })
    cfg_path = workdir / "cfg.yaml"
    dump_config(cfg, cfg_path)

    before = os.environ.get(MODE_ENV)
    os.environ[MODE_ENV] = "off"  # a measurement, not a job to watch: no bar over the bench's table
    start = time.time()
    try:
        result = run_job(cfg, cfg_path, "train", repo, workdir / "job", on_line=lambda line: None)
    finally:
        if before is None:
            os.environ.pop(MODE_ENV, None)
        else:
            os.environ[MODE_ENV] = before
    return {"launch_overhead_s": result["first_train_batch_time"] - start,
            "launch_total_s": time.time() - start}


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
    return _to(with_lengths(batch), device)


def bench_fixed_length(model: PremiseRetriever, device: torch.device, precision_dtype: torch.dtype | None,
                       batch_sizes: tuple[int, ...] = (4, 8, 16), lengths: tuple[int, ...] = (512, 1024),
                       steps: int = 10, peak_tflops: float | None = None, compiled: bool = False
                       ) -> list[dict[str, Any]]:
    """The real training step (`TrainStep`) on batches whose sequences all have length L, the worst case of
    LeanAgent's 1024-byte budget: examples/s, tokens/s, MFU (`leanagent.perf`) and peak memory per (L, batch).
    `compiled`: with the compiled blocks (`model.compile: true`)."""
    _set_levers(model, True, True, compiled)
    model.drop_compiled()
    model.train()
    step = TrainStep(model, device, precision_dtype)
    rows: list[dict[str, Any]] = []
    for length in lengths:
        for b in batch_sizes:
            batch = fixed_length_batch(b, length, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                for _ in range(3):
                    step(batch)
                _sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    step(batch)
                _sync(device)
            except torch.OutOfMemoryError as e:
                rows.append({"length": length, "batch_size": b, "compiled": compiled,
                             "error": "out of memory: " + str(e).split(".")[0]})
                step.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            per_s = b * steps / (time.perf_counter() - start)
            flops = training_flops(model.encoder.config, [length] * (5 * b)) / b
            rows.append({"length": length, "batch_size": b, "compiled": compiled, "examples_per_s": per_s,
                         "tokens_per_s": per_s * 5 * length, "tflops": per_s * flops / 1e12,
                         "mfu": mfu(per_s * flops, peak_tflops),
                         "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else None})
    _set_levers(model, True, True, False)
    model.drop_compiled()
    return rows


def keep_layers(model: PremiseRetriever, layers: int | None) -> str:
    """Keep the encoder's first `layers` blocks (all when None or more): every layer of one width does the same
    work, so fewer layers keep a step's balance in a fraction of its time. Says what was kept."""
    blocks = model.encoder.encoder.block
    total = len(blocks)
    if layers is None or layers >= total:
        return f"{total} layers"
    model.encoder.encoder.block = torch.nn.ModuleList(list(blocks)[:layers])
    model.encoder.config.num_layers = layers
    return f"first {layers} of {total} layers"


def run_bench(dataset: Path, model_path: str | None, preset: str | None, device_name: str, split: str = "random",
              min_seconds: float = 3.0, embed_sample: int | None = None, fisher_examples: int = 8,
              launch: bool = True, compile_model: bool = True, train_max_len: int | None = None,
              states: list[Path] | None = None, train_layers: int | None = None, train_batches: int | None = None,
              fisher_methods: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every figure, in one process. `states`: LeanDojo split files whose proof states replace the training
    contexts (their real lengths; the premises stay the dataset's). The training rows (step, Fisher, and the
    fixed-length rows on CUDA) use the model cut to `train_layers` (default: 2 on a CPU, all on CUDA)."""
    device = torch.device(device_name)
    results: dict[str, Any] = {"dataset": str(dataset), "device": device_name,
                               "torch": torch.__version__, "threads": torch.get_num_threads()}
    corpus, figures = bench_corpus(dataset)
    results.update(figures)
    figures, train, evals = bench_data(dataset, corpus, split, min_seconds)
    results.update(figures)
    state_texts = load_states(states) if states else None
    if state_texts:
        results["states"] = [str(p) for p in states]
        results["num_states"] = len(state_texts)
    precision = torch.bfloat16  # the seed's bf16-mixed
    peak = None
    if device.type == "cuda":
        results["cuda_device"] = torch.cuda.get_device_name(device)
        peak = peak_bf16_tflops(results["cuda_device"])
        results["peak_bf16_tflops"] = peak
    with tempfile.TemporaryDirectory(prefix="leanagent-bench-") as tmp:
        tmp_path = Path(tmp)
        if model_path is None:
            model_path = str(write_random_encoder(tmp_path / "model", preset or "tiny"))
            results["model"] = f"random {preset or 'tiny'}"
        else:
            results["model"] = model_path
        model = PremiseRetriever(model_path).to(device)
        results["params"] = sum(p.numel() for p in model.parameters())
        model.eval()
        sample = embed_sample or (4096 if device.type == "cuda" else 512)
        results.update(bench_embedding(model, corpus, device, sample, precision, min_seconds))
        results.update(bench_retrieval(corpus, evals, model.encoder.config.d_model, device, precision, min_seconds))
        layers = train_layers if train_layers is not None else (None if device.type == "cuda" else 2)
        results["train_model"] = f"{results['model']}, {keep_layers(model, layers)}"
        max_len = train_max_len or DataConfig().max_seq_len
        results["train_step_max_len"] = max_len
        batches = bench_batches(corpus, train, model.tokenizer, train_batches or (16 if device.type == "cuda" else 4),
                                max_len, state_texts)
        results.update(bench_train_step(model, batches, device, precision, min_seconds, compiled=compile_model,
                                        work=tmp_path, peak_tflops=peak))
        methods = fisher_methods or (("loop", "vectorised") if device.type == "cuda" else ("loop",))
        results.update(bench_train_vs_fisher(model, corpus, train, device, precision, fisher_examples, methods,
                                             max_len=max_len, states=state_texts, min_seconds=min_seconds))
        if device.type == "cuda":
            results["cuda_training"] = bench_fixed_length(model, device, precision, peak_tflops=peak)
            if compile_model:
                results["cuda_training"] += bench_fixed_length(model, device, precision, batch_sizes=(16,),
                                                               peak_tflops=peak, compiled=True)
        if launch:
            results.update(bench_launch(tmp_path / "launch"))
    return results


LABELS = [
    ("corpus_load_s", "corpus load (s)"), ("corpus_rss_mb", "corpus resident memory (MB)"),
    ("train_examples_per_s", "negatives + collate (examples/s)"), ("tokenize_premises_per_s", "tokenize (premises/s)"),
    ("embed_premises_per_s", "embed corpus, sorted (premises/s)"),
    ("embed_unsorted_premises_per_s", "embed corpus, corpus order (premises/s)"),
    ("embed_speedup", "embedding speed-up from sorting"),
    ("embed_autocast_premises_per_s", "embed corpus, sorted, bf16 autocast (premises/s)"),
    ("embed_autocast_speedup", "embedding speed-up from bf16 autocast"),
    ("retrieval_ms_per_context", "retrieval, top 100 accessible (ms/context)"),
    ("retrieval_leanagent_style_ms_per_context", "retrieval, LeanAgent's search (ms/context)"),
    ("retrieval_speedup", "retrieval speed-up over LeanAgent's search"),
    ("retrieval_same_as_leanagent_style", "retrieval scores equal LeanAgent's search"),
    ("train_s_per_example", "training step (s/example)"), ("fisher_s_per_example", "Fisher pass, loop (s/example)"),
    ("fisher_over_train", "Fisher loop / training per example"),
    ("fisher_vectorised_s_per_example", "Fisher pass, vectorised (s/example)"),
    ("fisher_vectorised_over_train", "Fisher vectorised / training per example"),
    ("train_max_len", "training and Fisher sequences cut at (bytes)"),
    ("train_peak_memory_gb", "training step, peak GPU memory (GiB)"),
    ("fisher_peak_memory_gb", "Fisher pass, peak GPU memory (GiB)"),
    ("launch_overhead_s", "job start to first step (s)"),
]
STEP_LABELS = {"padded": "padded", "sorted": "sorted", "sorted_one_mask": "sorted + one mask",
               "compiled": "sorted + one mask + compiled"}


def format_table(results: dict[str, Any]) -> str:
    lines = [f"leanagent bench: {results['dataset']} ({results.get('num_premises')} premises, "
             f"{results.get('num_files')} files), model {results.get('model')}, device {results['device']}"]
    for key, label in LABELS:
        if isinstance(results.get(key), bool):
            lines.append(f"  {label:<46} {'yes' if results[key] else 'NO':>12}")
        elif isinstance(results.get(key), (int, float)):
            lines.append(f"  {label:<46} {results[key]:>12.4g}")
    if "fisher_auto" in results:
        lines.append(f"  {'Fisher method auto takes here':<46} {results['fisher_auto']:>12}")
    for key in ("train_error", "fisher_error", "fisher_vectorised_error"):
        if key in results:
            lines.append(f"  {key.replace('_', ' ')}: {results[key]}")
    if "train_step_examples" in results:
        contexts = (f"contexts: {results['num_states']} proof states of {', '.join(results['states'])}"
                    if results.get("states") else "contexts: the dataset's")
        lines.append(f"  training step, {results['train_step_examples']} examples in batches of 4 cut at "
                     f"{results['train_step_max_len']} bytes ({contexts}; premises: the dataset's corpus), "
                     f"{results['train_step_real_tokens_per_example']:.0f} real tokens per example;")
        lines.append(f"  model {results['train_model']}, bf16 autocast; loss sorted vs padded (fp32, dropout off): "
                     f"{results['train_step_loss_rel_diff']:.2e} relative; rows in turns, each its best of "
                     f"{results.get('train_step_rounds_best_of')} rounds")
        if "compile_s" in results:
            lines.append(f"  compile (regional, each T5 block): {results['compile_s']:.1f} s cold, "
                         f"{results.get('compile_warm_s', float('nan')):.1f} s with the inductor cache warm")
        if "compile_error" in results:
            lines.append(f"  compile failed: {results['compile_error']}")
        lines.append(f"    {'':<30} {'examples/s':>11} {'real tok/s':>11} {'token eff.':>10} {'speed-up':>9}"
                     + (f" {'MFU':>6}" if results.get("peak_bf16_tflops") else ""))
        for name, label in STEP_LABELS.items():
            rate = results.get(f"train_step_{name}_examples_per_s")
            if rate is None:
                if f"train_step_{name}_error" in results:
                    lines.append(f"    {label:<30} {results[f'train_step_{name}_error']}")
                continue
            speedup = results.get(f"train_step_{name}_speedup", 1.0)
            row = (f"    {label:<30} {rate:>11.3g} {results[f'train_step_{name}_tokens_per_s']:>11.4g} "
                   f"{results[f'train_token_efficiency_{name}']:>10.3f} {speedup:>8.2f}x")
            if results.get(f"train_step_{name}_mfu") is not None:
                row += f" {100 * results[f'train_step_{name}_mfu']:>5.1f}%"
            lines.append(row)
    for row in results.get("cuda_training", []):
        compiled = " compiled" if row.get("compiled") else ""
        head = f"  cuda training{compiled} L={row['length']:<5} batch {row['batch_size']:<3}"
        if "error" in row:
            lines.append(f"{head} {row['error']}")
            continue
        mfu_text = f"MFU {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "MFU -"
        lines.append(f"{head} {row['examples_per_s']:>9.1f} ex/s {row['tokens_per_s']:>12.0f} tok/s  {mfu_text}")
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
