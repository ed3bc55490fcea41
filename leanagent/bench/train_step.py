"""The bench's training step: the retriever's real `training_step` four ways (padded, length-sorted sub-batches,
+ one attention mask per forward, + compiled blocks), the loss of the sorted path against the padded one, the
compile times, and the model cut to a few layers for a CPU."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from leanagent.bench.perf import mfu, training_flops
from leanagent.bench.results import TrainStepFigures, TrainStepRow
from leanagent.bench.timing import best_of_rounds, sync, to_device
from leanagent.model.lr_schedule import build_optimizer_and_schedule
from leanagent.model.pool_plan import TokenCount
from leanagent.model.retriever import PremiseRetriever

# The training step's levers, as the rows of the bench: (name, sort_by_length, one mask, compiled).
TRAIN_STEP_ROWS = (("padded", False, False, False), ("sorted", True, False, False),
                   ("sorted_one_mask", True, True, False), ("compiled", True, True, True))


def set_levers(model: PremiseRetriever, sort: bool, one_mask: bool, compiled: bool) -> None:
    """One row's levers on the same weights: `model.sort_by_length` and `model.compile` through the retriever's
    options, the one mask per forward through its attribute."""
    model.reconfigure(sort_by_length=sort, compile=compiled)
    model.one_mask = one_mask


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


def loss_rel_diff(model: PremiseRetriever, batches: list[dict[str, Any]]) -> float:
    """Largest relative difference, over the batches, of the sorted + one-mask loss against the padded one:
    fp32, dropout off (eval mode), the same weights: what sorting changes, float rounding only."""
    was_training = model.training
    model.eval()
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            set_levers(model, False, False, False)
            padded = model.batch_loss(batch).item()
            set_levers(model, True, True, False)
            worst = max(worst, abs(model.batch_loss(batch).item() - padded) / max(abs(padded), 1e-30))
    model.train(was_training)
    return worst


def compile_blocks(model: PremiseRetriever, step: TrainStep, cache_dir: Path, figures: TrainStepFigures) -> None:
    """Compile the encoder blocks twice: with an empty inductor cache (cold), then again after dropping every
    in-memory compiled artefact, with the on-disk cache the first one filled (warm). Seconds of each, into
    `figures` (or why compiling failed)."""
    # Inductor's private modules, loaded only when a compiled row is measured (seconds of import otherwise).
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch._inductor.utils import clear_caches

    with temporary_cache_dir(str(cache_dir)):
        for key in ("compile_s", "compile_warm_s"):
            torch._dynamo.reset()
            clear_caches()
            model.drop_compiled()
            with step.autocast():
                blocks = model.compiled_blocks()
            if blocks is None:
                figures.compile_error = model.compile_status().get("compile_failed", "compile not enabled")
                return
            setattr(figures, key, blocks.compile_s)


def bench_train_step(model: PremiseRetriever, batches: list[dict[str, Any]], device: torch.device,
                     precision_dtype: torch.dtype | None, min_seconds: float, compiled: bool = True,
                     work: Path | None = None, peak_tflops: float | None = None, rounds: int = 2
                     ) -> TrainStepFigures:
    """The training step on the dataset's batches, padded / sorted / sorted + one mask / + compiled.

    Per row: examples/s, real tokens/s, token efficiency (real over processed tokens) and, given a peak,
    MFU on real tokens (`leanagent.bench.perf`). The loss of the sorted path against the padded one comes first,
    on the same weights (`_loss_rel_diff`). Each row runs the batches once to warm up (the compiled row
    compiles first, cold and warm, then at the batches' shapes), then the rows take turns
    (`_best_of_rounds`: each row's time is its fastest pass over the batches).
    """
    batches = [to_device(b, device) for b in batches]
    config = model.encoder.config
    real_lengths = [n for b in batches for n in b["context_lengths"] + b["premise_lengths"]]
    flops = training_flops(config, real_lengths)
    examples = sum(len(b["index"]) for b in batches)
    figures = TrainStepFigures(train_step_batches=len(batches), train_step_examples=examples,
                               train_step_layers=config.num_layers,
                               train_step_real_tokens_per_example=sum(real_lengths) / examples,
                               train_step_loss_rel_diff=loss_rel_diff(model, batches))
    model.train()
    step = TrainStep(model, device, precision_dtype)

    def row_pass(levers: tuple[bool, bool, bool]) -> Callable[[], TokenCount]:
        def run() -> TokenCount:
            set_levers(model, *levers)
            tokens = TokenCount()
            for b in batches:
                tokens += step(b)
            return tokens
        return run

    passes: dict[str, Callable[[], TokenCount]] = {}
    for name, *levers in TRAIN_STEP_ROWS:
        if levers[2] and not compiled:
            continue
        set_levers(model, *levers)
        if levers[2]:
            compile_blocks(model, step, Path(work or tempfile.mkdtemp()) / "inductor-cache", figures)
            if figures.compile_error is not None:
                continue
        try:
            row_pass(tuple(levers))()  # warm-up (and, compiled, the batches' shapes)
            sync(device)
        except torch.OutOfMemoryError as e:
            figures.rows[name] = TrainStepRow(error="out of memory: " + str(e).split(".")[0])
            step.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        passes[name] = row_pass(tuple(levers))
    seconds, tokens = best_of_rounds(passes, device, min_seconds, rounds)
    figures.train_step_rounds_best_of = rounds
    for name in passes:
        figures.rows[name] = TrainStepRow(examples_per_s=examples / seconds[name],
                                          tokens_per_s=tokens[name].real / seconds[name],
                                          token_efficiency=tokens[name].efficiency,
                                          mfu=mfu(flops / seconds[name], peak_tflops) if peak_tflops else None)
    set_levers(model, True, True, False)
    model.drop_compiled()
    padded = figures.rows.get("padded")
    for name in ("sorted", "sorted_one_mask", "compiled"):
        row = figures.rows.get(name)
        if row is not None and row.examples_per_s is not None and padded is not None \
                and padded.examples_per_s is not None:
            row.speedup = row.examples_per_s / padded.examples_per_s
    return figures


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
