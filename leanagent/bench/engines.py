"""`leanagent bench engines`: the query side per engine and dtype (`--engine`, `--dtype`), on one index.

What a laptop user chooses between: per proof state, the encoder pass a query waits for, and what each engine costs
in agreement with torch fp32, the reference. Measured on one index (an INDEX, a run's newest stage, or one built
here from `--dataset` by a model: a random one of `--preset`'s shape by default), each engine a `PremiseIndex` of
its own over the same stored rows:

- **latency**: `encode_state` of the timed states (`--states`: real proof states, evenly spread over their
  lengths), the engines taking turns per state in a rotating order, `repeats` rounds; per engine the median over
  states of each state's median, and the median over states of torch fp32's time on that state over its own
  (the speed-up: a ratio in one run, as the machine's load moves both);
- **premises/s**: `encode_premises` of `premises` of the index's premises, the engines taking turns;
- **agreement**: on every test state of the datasets (the index's, or `--dataset`), ranked as `leanagent retrieve
  --file --line` ranks them (the premises the state may use), the top-10 overlap with torch fp32, Recall@10 and
  its difference from torch fp32's; and the lowest cosine of a timed state's embedding with torch fp32's.

The CPU's name and the flags that decide these figures (AVX2, AVX-512, VNNI, BF16, AMX) are recorded beside them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leanagent.bench.cpu import this_cpu
from leanagent.bench.options import EnginesOptions
from leanagent.bench.results import Section
from leanagent.data.corpus import Corpus
from leanagent.data.dataset import build_eval_examples
from leanagent.data.theorems import load_split, load_states
from leanagent.ground.names import CORPUS_FILE, TEST_PART, part_file
from leanagent.index.build import build_index
from leanagent.index.query import PremiseIndex
from leanagent.index.read import read_meta
from leanagent.model.metrics import aggregate, score_context
from leanagent.model.presets import write_random_encoder
from leanagent.serve import resolve_source

REFERENCE = "torch:fp32"
# The flags (Linux's names) that decide these figures: the vector and matrix instructions each engine may use.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass
class EngineRow(Section):
    engine: str  # engine:dtype, as resolved
    state_s: float  # median over the timed states of each state's median pass
    speedup: float  # median over states of torch fp32's pass over this one's
    premises_per_s: float
    overlap: float  # top-10 overlap with torch fp32, mean over the test states
    recall10: float  # Recall@10 (percent) on the test states
    recall10_change: float  # minus torch fp32's
    cosine_min: float  # the lowest cosine of a timed state's embedding with torch fp32's


@dataclass
class EnginesFigures(Section):
    model: str
    index: str
    cpu: str
    flags: str
    threads: int
    timed_states: int
    test_states: int
    rows: list[EngineRow] = field(default_factory=list)

    def flat(self) -> dict:
        out = {k: v for k, v in super().flat().items() if k != "rows"}
        for row in self.rows:
            key = row.engine.replace(":", "_")
            out.update({f"{key}_{name}": value for name, value in row.flat().items() if name != "engine"})
        return out


def pick_states(files: tuple[Path, ...], count: int) -> list[str]:
    """`count` distinct states of the split files, evenly spread over their lengths (shortest to longest)."""
    found = sorted(set(load_states(list(files))), key=lambda s: (len(s.encode()), s))
    if len(found) <= count:
        return found
    return [found[round(i * (len(found) - 1) / (count - 1))] for i in range(count)] if count > 1 else found[:1]


def bench_engines(options: EnginesOptions) -> EnginesFigures:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="leanagent-bench-engines-") as tmp:
        folder, model, datasets = _source(options, Path(tmp))
        specs = list(dict.fromkeys([REFERENCE, *options.engines]))
        indexes = {}
        for spec in specs:
            engine, dtype = spec.split(":")
            index = PremiseIndex.load(folder, engine=engine, dtype=dtype)
            indexes[f"{index.engine}:{index.dtype}"] = index
        timed = pick_states(options.states, options.max_states) if options.states else []
        examples = [(corpus, e) for corpus, split in datasets for e in split]
        if not timed:
            timed = pick_states_of(examples, options.max_states)
        if not timed:
            raise ValueError(f"{folder}: no test states in its datasets to time or rank; give --states")
        cpu = this_cpu()
        figures = EnginesFigures(model, str(folder), cpu.name, cpu.describe(CPU_FLAGS), torch.get_num_threads(),
                                 len(timed), len(examples))
        seconds, cosines = _latency(indexes, timed, options.repeats)
        rates = _premise_rates(indexes, options.premises, options.repeats)
        agreement = _agreement(indexes, examples)
        reference = seconds[REFERENCE]
        for spec in indexes:
            per_state = [statistics.median(times) for times in seconds[spec]]
            ratios = [statistics.median(ref) / statistics.median(own)
                      for ref, own in zip(reference, seconds[spec], strict=True)]
            overlap, recall = agreement[spec]
            figures.rows.append(EngineRow(spec, statistics.median(per_state), statistics.median(ratios), rates[spec],
                                          overlap, recall, recall - agreement[REFERENCE][1], cosines[spec]))
    return figures


def _source(options: EnginesOptions, tmp: Path) -> tuple[Path, str, list[tuple[Corpus, list]]]:
    """The index measured, its model, and the test examples of its datasets (each with its corpus)."""
    if options.index is not None:
        folder, _ = resolve_source(options.index)
        meta = read_meta(folder)
        datasets = [Path(d) for d in meta.get("datasets") or [meta.get("dataset")] if d]
        model = str(meta.get("checkpoint") or meta.get("model"))
    else:
        model = options.model or str(write_random_encoder(tmp / "model", options.preset))
        datasets = list(options.dataset)
        folder = tmp / "index"
        build_index(model, datasets[0], folder, engine="torch", dtype="fp32")
        datasets = datasets[:1]
        if options.model is None:
            model = f"random {options.preset}"
    loaded = []
    for dataset in datasets:
        split = dataset / options.split / part_file(TEST_PART)
        if split.is_file():
            corpus = Corpus.from_jsonl(dataset / CORPUS_FILE)
            loaded.append((corpus, [e for e in build_eval_examples(corpus, load_split(split)) if e.all_pos_premises]))
    return folder, model, loaded


def pick_states_of(examples: list, count: int) -> list[str]:
    found = sorted({e.context for _, e in examples}, key=lambda s: (len(s.encode()), s))
    step = max(1, len(found) // max(1, count))
    return found[::step][:count]


def _latency(indexes: dict[str, PremiseIndex], states: list[str], repeats: int
             ) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
    """Per engine, per state, the seconds of each pass: every engine once per state per round, in an order that
    rotates with the state and the round, after one warm-up pass each. And per engine the lowest cosine of a
    state's embedding with torch fp32's."""
    specs = list(indexes)
    for spec in specs:
        indexes[spec].encode_state(states[0] if states else "⊢ True")
    out = {spec: [[] for _ in states] for spec in specs}
    rows: dict[str, list[torch.Tensor]] = {spec: [torch.empty(0)] * len(states) for spec in specs}
    for r in range(repeats):
        for i, state in enumerate(states):
            shift = (i + r) % len(specs)
            for spec in specs[shift:] + specs[:shift]:
                start = time.perf_counter()
                rows[spec][i] = indexes[spec].encode_state(state)
                out[spec][i].append(time.perf_counter() - start)
    cosine = {spec: min((float(torch.nn.functional.cosine_similarity(a, b)[0])
                         for a, b in zip(rows[spec], rows[REFERENCE], strict=True)), default=1.0) for spec in specs}
    return out, cosine


def _premise_rates(indexes: dict[str, PremiseIndex], count: int, repeats: int) -> dict[str, float]:
    """Premises per second of `encode_premises` on `count` of the index's premises spread over their lengths."""
    any_index = next(iter(indexes.values()))
    texts = sorted((p["text"] for p in any_index.premises), key=len)
    texts = [texts[round(i * (len(texts) - 1) / max(1, count - 1))] for i in range(min(count, len(texts)))]
    best = {spec: float("inf") for spec in indexes}
    specs = list(indexes)
    for r in range(max(1, repeats)):
        shift = r % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            start = time.perf_counter()
            indexes[spec].encode_premises(texts)
            best[spec] = min(best[spec], time.perf_counter() - start)
    return {spec: len(texts) / seconds for spec, seconds in best.items()}


def _agreement(indexes: dict[str, PremiseIndex], examples: list) -> dict[str, tuple[float, float]]:
    """Per engine: mean top-10 overlap with torch fp32 and Recall@10 (percent)."""
    tops: dict[str, list[list[int]]] = {spec: [] for spec in indexes}
    scores: dict[str, list] = {spec: [] for spec in indexes}
    rows_of: dict[int, dict] = {}
    for corpus, example in examples:
        row_of = rows_of.setdefault(id(corpus), {(p.path, p.full_name): i for i, p in enumerate(corpus.premises)})
        for spec, index in indexes.items():
            hits = index.retrieve(example.context, k=10, file=example.file_path, line=example.theorem_start[0],
                                  column=example.theorem_start[1])
            retrieved = [row_of.get((h.path, h.full_name), -1) for h in hits]
            tops[spec].append(retrieved)
            scores[spec].append(score_context(example.index, retrieved, example.all_pos_premises))
    out = {}
    for spec in indexes:
        overlaps = [len(set(a) & set(b)) / max(1, len(b)) for a, b in zip(tops[spec], tops[REFERENCE], strict=True)]
        recall = aggregate(scores[spec])["Recall@10"] if scores[spec] else float("nan")
        out[spec] = (statistics.fmean(overlaps) if overlaps else float("nan"), recall)
    return out


def engines_table(figures: EnginesFigures) -> str:
    lines = [f"query engines on {figures.model} ({figures.index}); {figures.timed_states} timed states, "
             f"{figures.test_states} test states; {figures.threads} threads; CPU {figures.cpu} [{figures.flags}]",
             f"  {'engine':<18} {'s/state':>8} {'vs fp32':>8} {'prem/s':>8} {'top-10 overlap':>15} {'R@10':>7} "
             f"{'ΔR@10':>7} {'min cos':>10}"]
    lines += [f"  {row.engine:<18} {row.state_s:>8.3f} {row.speedup:>7.2f}x {row.premises_per_s:>8.1f} "
              f"{row.overlap:>15.3f} {row.recall10:>7.2f} {row.recall10_change:>+7.2f} {row.cosine_min:>10.6f}"
              for row in figures.rows]
    return "\n".join(lines)
