"""`leanagent bench precision`: the training step and the Fisher pass in each trainer precision on the CPU at hand.

Why: `trainer.precision: auto` picks bf16-mixed or 32-true by the CPU (`leanagent.model.dtypes.cpu_has_bf16`); this
is the measurement behind that choice, and the one to run on a new kind of CPU. Each pass is the real one: the
retriever's `training_step` under the precision's autocast, backward, clipping and AdamW (`TrainStep`), and the
per-example Fisher pass LeanAgent's EWC runs after each repository (`FisherModule`, its CPU method). Every pass
of every precision runs the same batches, and the passes take turns (`best_of_rounds`), so their ratio holds on a
busy machine. The table names the CPU, its flags that bear on bf16, torch's view of them, and what `auto` takes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leanagent.bench.cpu import BF16_FLAGS, this_cpu
from leanagent.bench.data import bench_batches
from leanagent.bench.options import PrecisionOptions
from leanagent.bench.results import Section
from leanagent.bench.timing import best_of_rounds
from leanagent.bench.train_step import TrainStep, keep_layers
from leanagent.data.corpus import Corpus
from leanagent.data.dataset import build_train_examples
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import load_split
from leanagent.ground.names import AUTO, BYT5_SMALL, CORPUS_FILE, DEFAULT_SPLIT, TRAIN_PART, part_file
from leanagent.model.dtypes import LIGHTNING_AUTOCAST, cpu_has_bf16, resolve_precision
from leanagent.model.fisher import FisherModule
from leanagent.model.options import RetrieverOptions
from leanagent.model.presets import write_random_encoder
from leanagent.model.progress_bars import no_progress_bars
from leanagent.model.retriever import PremiseRetriever


@dataclass
class PrecisionRow(Section):
    preset: str
    precision: str
    train_s_per_example: float
    fisher_s_per_example: float


@dataclass
class PrecisionFigures(Section):
    cpu: str
    flags: list[str]  # those of BF16_FLAGS the CPU has
    torch_capability: str  # the vector ISA torch's own kernels use (ATEN_CPU_CAPABILITY)
    cpu_has_bf16: bool
    auto: str  # what trainer.precision: auto takes on this CPU
    threads: int
    examples: int
    rows: list[PrecisionRow] = field(default_factory=list)

    def flat(self) -> dict:
        out = {k: v for k, v in super().flat().items() if k != "rows"}
        for row in self.rows:
            out[f"{row.preset}_{row.precision}_train_s_per_example"] = row.train_s_per_example
            out[f"{row.preset}_{row.precision}_fisher_s_per_example"] = row.fisher_s_per_example
        return out


def bench_precision(options: PrecisionOptions) -> PrecisionFigures:
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        return _measure(options)
    finally:
        torch.set_num_threads(threads)


def _measure(options: PrecisionOptions) -> PrecisionFigures:
    cpu = this_cpu()
    figures = PrecisionFigures(cpu=cpu.name, flags=cpu.having(BF16_FLAGS),
                               torch_capability=torch.backends.cpu.get_cpu_capability(),
                               cpu_has_bf16=cpu_has_bf16(), auto=resolve_precision(AUTO, "cpu"),
                               threads=torch.get_num_threads(), examples=0)
    with tempfile.TemporaryDirectory(prefix="leanagent-bench-") as tmp:
        dataset = options.dataset or write_demo_repos(Path(tmp) / "data", 1, theorems_per_repo=90, scale=3)[0]
        corpus = Corpus.from_jsonl(dataset / CORPUS_FILE)
        train = build_train_examples(corpus, load_split(dataset / DEFAULT_SPLIT / part_file(TRAIN_PART)))
        for preset in options.presets:
            torch.manual_seed(0)
            folder = write_random_encoder(Path(tmp) / preset, preset)
            with no_progress_bars():
                model = PremiseRetriever(RetrieverOptions(name_or_path=str(folder)))
            keep_layers(model, options.layers if preset == BYT5_SMALL else None)
            batches = bench_batches(corpus, train, model.tokenizer, options.batches, options.max_len)
            figures.examples = sum(len(b["index"]) for b in batches)
            seconds = _take_turns(model, batches, options)
            figures.rows += [PrecisionRow(preset, p, seconds[("train", p)] / figures.examples,
                                          seconds[("fisher", p)] / figures.examples) for p in options.precisions]
    return figures


def _take_turns(model: PremiseRetriever, batches: list[dict], options: PrecisionOptions
                ) -> dict[tuple[str, str], float]:
    """Seconds of each (pass, precision) over the batches, the fastest of the rounds in which they take turns."""
    device = torch.device("cpu")
    fisher = FisherModule(model, method="auto")
    passes: dict[tuple[str, str], Callable[[], None]] = {}
    for precision in options.precisions:
        step = TrainStep(model, device, LIGHTNING_AUTOCAST[precision])

        def train_pass(step: TrainStep = step) -> None:
            model.train()
            for b in batches:
                step(b)

        def fisher_pass(step: TrainStep = step) -> None:
            fisher.on_train_epoch_start()
            for b in batches:
                with step.autocast():
                    fisher.training_step({**b, "is_padding": torch.zeros(len(b["index"]), dtype=torch.bool)}, 0)

        passes[("train", precision)], passes[("fisher", precision)] = train_pass, fisher_pass
    for run in passes.values():
        run()  # warm-up
    seconds, _ = best_of_rounds(passes, device, options.min_seconds, options.rounds)
    return seconds


def precision_table(figures: PrecisionFigures) -> str:
    flags = " ".join(figures.flags) or "none of " + " ".join(BF16_FLAGS)
    lines = [f"the training step and the Fisher pass per trainer precision, seconds per example ({figures.examples} "
             f"examples, batches of 4, {figures.threads} threads; the passes took turns)",
             f"  CPU: {figures.cpu}; flags: {flags}; torch's kernels: {figures.torch_capability}; bf16 matmuls "
             f"(cpu_has_bf16): {'yes' if figures.cpu_has_bf16 else 'no'}; trainer.precision auto -> {figures.auto}",
             f"  {'model':<12} {'precision':<11} {'train s/ex':>11} {'Fisher s/ex':>12} {'train x':>8} {'Fisher x':>9}"]
    base = {r.preset: r for r in figures.rows if r.precision == "32-true"}
    for r in figures.rows:
        ref = base.get(r.preset)
        ratio = (f"{r.train_s_per_example / ref.train_s_per_example:>8.2f} "
                 f"{r.fisher_s_per_example / ref.fisher_s_per_example:>9.2f}") if ref else f"{'-':>8} {'-':>9}"
        lines.append(f"  {r.preset:<12} {r.precision:<11} {r.train_s_per_example:>11.4f} "
                     f"{r.fisher_s_per_example:>12.4f} {ratio}")
    lines.append("  x: seconds over 32-true's on the same batches (above 1: slower than fp32)")
    return "\n".join(lines)
