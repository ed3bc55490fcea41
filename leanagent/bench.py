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
- a training step and the Fisher pass, per example, on the same examples;
- the launch overhead of a real job, from its start to its first training step (on the demo);
- with `--device cuda`: training throughput of a byt5-small-shaped encoder in bf16 at L = 512
  and 1024, with tokens/s and model FLOP utilisation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leanagent.config import DataConfig, PipelineConfig, dump_config
from leanagent.data.corpus import Corpus, FileRecord
from leanagent.data.dataset import TrainDataset, build_eval_examples, build_train_examples, tokenize_premises
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import load_split
from leanagent.jobs import run_job
from leanagent.launch.progress_view import MODE_ENV
from leanagent.model.fisher import FisherModule
from leanagent.model.lr_schedule import build_optimizer_and_schedule
from leanagent.model.presets import encoder_config, write_random_encoder
from leanagent.model.retriever import PremiseRetriever, contrastive_mse
from leanagent.model.topk import top_k_accessible

H200_BF16_PEAK_TFLOPS = 989.0
# Forward FLOPs of one byt5-small encoder sequence of L tokens: 2 x (weights touched per token) x L plus the
# attention products (QK^T and AV over 12 layers x 6 heads x 64 dims, twice, x2 FLOPs per MAC): 434.1M L + 18,432 L^2.
BYT5_SMALL_FLOPS_PER_TOKEN = 434.1e6
BYT5_SMALL_FLOPS_PER_TOKEN_SQ = 18_432


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


def bench_train_vs_fisher(model, corpus, train: list, device: torch.device, precision_dtype: torch.dtype | None,
                          examples: int, fisher_method: str = "auto", max_len: int | None = None) -> dict[str, float]:
    """Seconds per example of a training step (forward, backward, AdamW) and of the per-example Fisher pass.

    Sequences are cut at `max_len` bytes (default: LeanAgent's 1024).
    """

    cfg = DataConfig()
    max_len = max_len or cfg.max_seq_len
    ds = TrainDataset(corpus, train, model.tokenizer, cfg.num_negatives, cfg.num_in_file_negatives,
                      max_len, max_len, seed=0, deterministic=True)
    picked = random.Random(2).sample(range(len(ds)), min(examples, len(ds)))
    batches = [ds.collate([ds[i] for i in picked[j: j + cfg.batch_size]]) for j in range(0, len(picked),
                                                                                      cfg.batch_size)]
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    autocast = torch.autocast(device.type, dtype=precision_dtype, enabled=precision_dtype is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def train_pass() -> None:
        for b in batches:
            with autocast:
                loss = model.batch_loss(b)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    fisher = FisherModule(model, method=fisher_method)

    def fisher_pass() -> None:
        fisher.on_train_epoch_start()
        for b in batches:
            with autocast:
                fisher.training_step({**b, "is_padding": torch.zeros(len(b["index"]), dtype=torch.bool)}, 0)

    figures: dict[str, Any] = {"train_max_len": max_len}
    for name, fn in (("train", train_pass), ("fisher", fisher_pass)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            fn()  # warm-up
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
        except torch.OutOfMemoryError as e:  # a figure of its own: the other rows still stand
            figures[f"{name}_error"] = "out of memory: " + str(e).split(".")[0]
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        figures[f"{name}_s_per_example"] = (time.perf_counter() - start) / len(picked)
        if device.type == "cuda":
            figures[f"{name}_peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if "train_s_per_example" in figures and "fisher_s_per_example" in figures:
        figures["fisher_over_train"] = figures["fisher_s_per_example"] / figures["train_s_per_example"]
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


def bench_cuda_training(batch_sizes: tuple[int, ...] = (4, 8, 16), lengths: tuple[int, ...] = (512, 1024),
                        steps: int = 10, peak_tflops: float = H200_BF16_PEAK_TFLOPS, device: str = "cuda",
                        preset: str = "byt5-small", compile_model: bool = False) -> list[dict[str, Any]]:
    """Training steps of a byt5-small-shaped retriever in bf16 on random bytes: examples/s, tokens/s, MFU.

    Each example is a context and 4 premises (1 positive, 3 negatives), all of length L, as the
    worst case of LeanAgent's 1024-byte budget; FLOPs per example = 3 x 5 x (434.1M L + 18,432 L^2).
    All premise slots go through one forward call, as in training. `compile_model` times the same
    step with `torch.compile` on the encoder (not what training uses yet: a measure of the head room).
    `device="cpu", preset="tiny"` only checks this function; its MFU means nothing.
    """
    from transformers import T5EncoderModel


    dev = torch.device(device)
    torch.manual_seed(0)
    config = encoder_config(preset)
    config._attn_implementation = "sdpa"
    encoder = T5EncoderModel(config).to(dev).train()
    # As training builds it: the seed clips gradients, so the foreach (not fused) AdamW update.
    opt = build_optimizer_and_schedule(encoder.parameters(), 1e-4, 10, 1000, gradient_clip_val=1.0)["optimizer"]
    forward = torch.compile(encoder) if compile_model else encoder

    def encode(ids: torch.Tensor) -> torch.Tensor:
        hidden = forward(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        return torch.nn.functional.normalize(hidden.float().mean(dim=1), dim=1)

    rows: list[dict[str, Any]] = []
    for length in lengths:
        for b in batch_sizes:
            ctx = torch.randint(3, 259, (b, length), device=dev)
            prem = torch.randint(3, 259, (4 * b, length), device=dev)
            label = torch.zeros(b, 4 * b, device=dev)
            label[torch.arange(b), torch.arange(b)] = 1.0

            def step(ctx: torch.Tensor = ctx, prem: torch.Tensor = prem, label: torch.Tensor = label) -> None:
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = contrastive_mse(encode(ctx), encode(prem), label)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            try:
                for _ in range(3):
                    step()
                _sync(dev)
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                _sync(dev)
            except torch.OutOfMemoryError as e:
                rows.append({"length": length, "batch_size": b, "compiled": compile_model,
                             "error": "out of memory: " + str(e).split(".")[0]})
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            per_s = b * steps / (time.perf_counter() - start)
            flops = 3 * 5 * (BYT5_SMALL_FLOPS_PER_TOKEN * length + BYT5_SMALL_FLOPS_PER_TOKEN_SQ * length ** 2)
            rows.append({"length": length, "batch_size": b, "compiled": compile_model, "examples_per_s": per_s,
                         "tokens_per_s": per_s * 5 * length, "tflops": per_s * flops / 1e12,
                         "mfu": per_s * flops / 1e12 / peak_tflops,
                         "peak_memory_gb": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda"
                         else None})
    return rows


def run_bench(dataset: Path, model_path: str | None, preset: str | None, device_name: str, split: str = "random",
              min_seconds: float = 3.0, embed_sample: int | None = None, fisher_examples: int = 8,
              launch: bool = True, compile_model: bool = False, train_max_len: int | None = None) -> dict[str, Any]:

    device = torch.device(device_name)
    results: dict[str, Any] = {"dataset": str(dataset), "device": device_name,
                               "torch": torch.__version__, "threads": torch.get_num_threads()}
    corpus, figures = bench_corpus(dataset)
    results.update(figures)
    figures, train, evals = bench_data(dataset, corpus, split, min_seconds)
    results.update(figures)
    precision = torch.bfloat16  # the seed's bf16-mixed
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
        # On a CPU a byt5-small batch of 4 at 1024 bytes needs ~45 GB of activations (as on an H200): cut shorter.
        train_max_len = train_max_len or (DataConfig().max_seq_len if device.type == "cuda" else 256)
        results.update(bench_train_vs_fisher(model, corpus, train, device, precision, fisher_examples,
                                             max_len=train_max_len))
        if launch:
            results.update(bench_launch(tmp_path / "launch"))
    if device.type == "cuda":
        results["cuda_device"] = torch.cuda.get_device_name(device)
        results["cuda_training"] = bench_cuda_training()
        if compile_model:
            results["cuda_training"] += bench_cuda_training(compile_model=True)
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
    ("train_s_per_example", "training step (s/example)"), ("fisher_s_per_example", "Fisher pass (s/example)"),
    ("fisher_over_train", "Fisher / training per example"),
    ("train_max_len", "training and Fisher sequences cut at (bytes)"),
    ("train_peak_memory_gb", "training step, peak GPU memory (GiB)"),
    ("fisher_peak_memory_gb", "Fisher pass, peak GPU memory (GiB)"),
    ("launch_overhead_s", "job start to first step (s)"),
]


def format_table(results: dict[str, Any]) -> str:
    lines = [f"leanagent bench: {results['dataset']} ({results.get('num_premises')} premises, "
             f"{results.get('num_files')} files), model {results.get('model')}, device {results['device']}"]
    for key, label in LABELS:
        if isinstance(results.get(key), bool):
            lines.append(f"  {label:<46} {'yes' if results[key] else 'NO':>12}")
        elif key in results:
            lines.append(f"  {label:<46} {results[key]:>12.4g}")
    for key in ("train_error", "fisher_error"):
        if key in results:
            lines.append(f"  {key.replace('_', ' ')}: {results[key]}")
    for row in results.get("cuda_training", []):
        compiled = " compiled" if row.get("compiled") else ""
        head = f"  cuda training{compiled} L={row['length']:<5} batch {row['batch_size']:<3}"
        if "error" in row:
            lines.append(f"{head} {row['error']}")
            continue
        lines.append(f"{head} {row['examples_per_s']:>9.1f} ex/s {row['tokens_per_s']:>12.0f} tok/s  "
                     f"MFU {100 * row['mfu']:.1f}%")
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: Path) -> None:
    Path(path).write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
