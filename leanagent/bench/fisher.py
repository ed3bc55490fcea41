"""The bench's training step against the Fisher pass, per example, on the same examples, by Fisher method."""

from __future__ import annotations

from collections.abc import Callable

import torch

from leanagent.bench.data import bench_batches
from leanagent.bench.results import FisherFigures, PassFigures
from leanagent.bench.timing import best_of_rounds, sync, to_device
from leanagent.bench.train_step import TrainStep
from leanagent.data.corpus import Corpus
from leanagent.ground.config import DataConfig
from leanagent.model.fisher import FisherModule
from leanagent.model.retriever import PremiseRetriever


def bench_train_vs_fisher(model: PremiseRetriever, corpus: Corpus, train: list, device: torch.device,
                          precision_dtype: torch.dtype | None, examples: int,
                          fisher_methods: tuple[str, ...] = ("loop", "vectorised"), max_len: int | None = None,
                          states: list[str] | None = None, min_seconds: float = 0.0, rounds: int = 2
                          ) -> FisherFigures:
    """Seconds per example of the training step (`TrainStep`) and of the per-example Fisher pass, by method.

    The same batches for all (sequences cut at `max_len` bytes, default LeanAgent's 1024), with the
    retriever's settings (sorted sub-batches, one mask); each pass warmed up once, then the passes take
    turns (`_best_of_rounds`). `fisher_auto` names the method `auto` takes here.
    """
    max_len = max_len or DataConfig().max_seq_len
    batches = [to_device(b, device) for b in bench_batches(corpus, train, model.tokenizer, -(-examples // 4), max_len,
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

    figures = FisherFigures(train_max_len=max_len, fisher_auto=FisherModule(model).resolved_method(device))
    candidates = [("train", train_pass)] + [(f"fisher_{m}" if m != "loop" else "fisher", fisher_pass(m))
                                            for m in fisher_methods]
    passes: dict[str, Callable[[], None]] = {}
    for name, fn in candidates:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            fn()  # warm-up
            sync(device)
        except torch.OutOfMemoryError as e:  # a figure of its own: the other rows still stand
            figures.passes[name] = PassFigures(error="out of memory: " + str(e).split(".")[0])
            step.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        figures.passes[name] = PassFigures(peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30
                                           if device.type == "cuda" else None)
        passes[name] = fn
    seconds, _ = best_of_rounds(passes, device, min_seconds, rounds)
    model.train()
    for name in passes:
        figures.passes[name].s_per_example = seconds[name] / n
    train_s = figures.passes.get("train", PassFigures()).s_per_example
    for name in ("fisher", "fisher_vectorised"):
        fisher = figures.passes.get(name)
        if train_s is not None and fisher is not None and fisher.s_per_example is not None:
            fisher.over_train = fisher.s_per_example / train_s
    return figures
