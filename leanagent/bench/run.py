"""`run_bench`: every section of the bench, in one process, in the order a lifelong run meets them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from leanagent.bench.cpu import BF16_FLAGS, this_cpu
from leanagent.bench.cuda import bench_fixed_length
from leanagent.bench.data import bench_batches, bench_corpus, bench_data
from leanagent.bench.fisher import bench_train_vs_fisher
from leanagent.bench.launch import bench_launch
from leanagent.bench.options import BenchOptions
from leanagent.bench.perf import peak_bf16_tflops
from leanagent.bench.results import BenchResult, RunInfo
from leanagent.bench.retrieval import bench_embedding, bench_retrieval
from leanagent.bench.train_step import bench_train_step, keep_layers
from leanagent.data.theorems import load_states
from leanagent.model.options import RetrieverOptions
from leanagent.model.presets import write_random_encoder
from leanagent.model.retriever import PremiseRetriever

PRECISION = torch.bfloat16  # the seed's bf16-mixed


def run_bench(options: BenchOptions) -> BenchResult:
    """Every figure, in one process. With `options.states`, LeanDojo split files whose proof states replace the
    training contexts (their real lengths; the premises stay the dataset's). The training rows (step, Fisher,
    and the fixed-length rows on CUDA) use the model cut to `options.layers`."""
    device = torch.device(options.device)
    cpu = this_cpu()
    result = BenchResult(RunInfo(dataset=str(options.dataset), device=options.device, torch=torch.__version__,
                                 threads=torch.get_num_threads(), cpu=cpu.name, cpu_flags=cpu.describe(BF16_FLAGS)))
    run = result.run
    corpus, result.corpus = bench_corpus(options.dataset)
    result.data, train, evals = bench_data(options.dataset, corpus, options.split, options.min_seconds)
    state_texts = load_states(list(options.states)) if options.states else None
    if state_texts:
        run.states, run.num_states = [str(p) for p in options.states], len(state_texts)
    peak = None
    if device.type == "cuda":
        run.cuda_device = torch.cuda.get_device_name(device)
        peak = run.peak_bf16_tflops = peak_bf16_tflops(run.cuda_device)
    with tempfile.TemporaryDirectory(prefix="leanagent-bench-") as tmp:
        tmp_path = Path(tmp)
        if options.model is None:
            model_path = str(write_random_encoder(tmp_path / "model", options.shape))
            run.model = f"random {options.shape}"
        else:
            model_path = run.model = options.model
        model = PremiseRetriever(RetrieverOptions(name_or_path=model_path)).to(device)
        run.params = sum(p.numel() for p in model.parameters())
        model.eval()
        if options.wants("embedding"):
            result.embedding = bench_embedding(model, corpus, device, options.sample, PRECISION,
                                               options.min_seconds)
        if options.wants("retrieval"):
            result.retrieval = bench_retrieval(corpus, evals, model.encoder.config.d_model, device, PRECISION,
                                               options.min_seconds)
        if options.wants("train_step") or options.wants("fisher") or options.wants("cuda"):
            run.train_model = f"{run.model}, {keep_layers(model, options.layers)}"
            run.train_step_max_len = options.max_len
        if options.wants("train_step"):
            batches = bench_batches(corpus, train, model.tokenizer, options.batches, options.max_len, state_texts)
            result.train_step = bench_train_step(model, batches, device, PRECISION, options.min_seconds,
                                                 compiled=options.compile, work=tmp_path, peak_tflops=peak)
        if options.wants("fisher"):
            result.fisher = bench_train_vs_fisher(model, corpus, train, device, PRECISION, options.fisher_examples,
                                                  options.methods, max_len=options.max_len, states=state_texts,
                                                  min_seconds=options.min_seconds)
        if device.type == "cuda" and options.wants("cuda"):
            result.cuda_training = bench_fixed_length(model, device, PRECISION, peak_tflops=peak)
            if options.compile:
                result.cuda_training += bench_fixed_length(model, device, PRECISION, batch_sizes=(16,),
                                                           peak_tflops=peak, compiled=True)
        if options.launch and options.wants("launch"):
            result.launch = bench_launch(tmp_path / "launch")
    return result
