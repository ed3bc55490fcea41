"""The bench's figures, one typed section per measurement, and the flat JSON `--json` writes.

Each section is a dataclass whose field names are the JSON keys (the flat names the README and
`scripts/gpu_run.sh` readers know); a figure that was not measured is None and left out of the JSON.
The training step's rows and the Fisher pass's passes are named parts of their section (`rows`,
`passes`), flattened as `train_step_<row>_...` and `<pass>_...`; `cuda_training` stays a list of rows.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Section:
    def flat(self) -> dict[str, Any]:
        """The measured figures under their JSON keys (None: not measured, left out)."""
        return {f.name: value for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None}

    def failures(self) -> list[str]:
        """What failed a bar of this section (a section with bars says; `leanagent bench` then exits 1)."""
        return []


@dataclass
class RunInfo(Section):
    """What was measured, where: the dataset, device, model and the training rows' model and lengths."""

    dataset: str
    device: str
    torch: str
    threads: int
    cpu: str = ""
    cpu_flags: str = ""  # those of `leanagent.bench.cpu.BF16_FLAGS` the CPU has
    model: str = ""
    params: int = 0
    train_model: str = ""
    train_step_max_len: int = 0
    states: list[str] | None = None
    num_states: int | None = None
    cuda_device: str | None = None
    peak_bf16_tflops: float | None = None  # on CUDA, None for a GPU the peak table does not know

    def flat(self) -> dict[str, Any]:
        out = super().flat()
        if self.cuda_device is not None:
            out["peak_bf16_tflops"] = self.peak_bf16_tflops  # written as null when unknown
        return out


@dataclass
class CorpusFigures(Section):
    corpus_load_s: float
    corpus_rss_mb: float
    num_premises: int
    num_files: int


@dataclass
class DataFigures(Section):
    num_train_examples: int
    train_examples_per_s: float
    tokenize_premises_per_s: float


@dataclass
class EmbeddingFigures(Section):
    embed_premises_per_s: float
    embed_unsorted_premises_per_s: float
    embed_speedup: float
    embed_sample: int
    corpus_order_padding_fraction: float
    embed_autocast_premises_per_s: float | None = None
    embed_autocast_speedup: float | None = None


@dataclass
class RetrievalFigures(Section):
    retrieval_ms_per_context: float
    retrieval_width: int
    retrieval_leanagent_style_ms_per_context: float
    retrieval_speedup: float
    retrieval_same_as_leanagent_style: bool
    # The parts alone, and the rows each path of the selection took (`leanagent.model.topk.Selection`).
    retrieval_scoring_path: str | None = None
    retrieval_mask_ms_per_context: float | None = None
    retrieval_product_ms_per_context: float | None = None
    retrieval_selection_ms_per_context: float | None = None
    retrieval_rows: int | None = None
    retrieval_rows_candidates: int | None = None
    retrieval_rows_ties: int | None = None


@dataclass
class TrainStepRow:
    """One way of running the training step (`padded`, `sorted`, `sorted_one_mask`, `compiled`)."""

    examples_per_s: float | None = None
    tokens_per_s: float | None = None
    token_efficiency: float | None = None
    mfu: float | None = None
    speedup: float | None = None  # over the padded row
    error: str | None = None  # out of memory: the other rows still stand

    def flat(self, name: str) -> dict[str, Any]:
        keys = {"examples_per_s": f"train_step_{name}_examples_per_s",
                "tokens_per_s": f"train_step_{name}_tokens_per_s", "token_efficiency": f"train_token_efficiency_{name}",
                "mfu": f"train_step_{name}_mfu", "speedup": f"train_step_{name}_speedup",
                "error": f"train_step_{name}_error"}
        return {keys[f.name]: value for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None}


@dataclass
class TrainStepFigures(Section):
    train_step_batches: int
    train_step_examples: int
    train_step_layers: int
    train_step_real_tokens_per_example: float
    train_step_loss_rel_diff: float
    train_step_rounds_best_of: int = 0
    compile_s: float | None = None
    compile_warm_s: float | None = None
    compile_error: str | None = None
    rows: dict[str, TrainStepRow] = field(default_factory=dict)

    def flat(self) -> dict[str, Any]:
        out = {k: v for k, v in super().flat().items() if k != "rows"}
        for name, row in self.rows.items():
            out.update(row.flat(name))
        return out


@dataclass
class PassFigures:
    """One pass of the training-vs-Fisher rows (`train`, `fisher`, `fisher_vectorised`)."""

    s_per_example: float | None = None
    over_train: float | None = None  # a Fisher pass's time per example over the training step's
    peak_memory_gb: float | None = None
    error: str | None = None

    def flat(self, name: str) -> dict[str, Any]:
        return {f"{name}_{f.name}": value for f in dataclasses.fields(self)
                if (value := getattr(self, f.name)) is not None}


@dataclass
class FisherFigures(Section):
    train_max_len: int
    fisher_auto: str
    passes: dict[str, PassFigures] = field(default_factory=dict)

    def flat(self) -> dict[str, Any]:
        out = {"train_max_len": self.train_max_len, "fisher_auto": self.fisher_auto}
        for name, figures in self.passes.items():
            out.update(figures.flat(name))
        return out


@dataclass
class FixedLengthRow:
    """The training step on batches whose sequences all have `length` tokens (CUDA only)."""

    length: int
    batch_size: int
    compiled: bool
    examples_per_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None
    error: str | None = None

    def flat(self) -> dict[str, Any]:
        head = {"length": self.length, "batch_size": self.batch_size, "compiled": self.compiled}
        if self.error is not None:
            return {**head, "error": self.error}
        return {**head, "examples_per_s": self.examples_per_s, "tokens_per_s": self.tokens_per_s,
                "tflops": self.tflops, "mfu": self.mfu, "peak_memory_gb": self.peak_memory_gb}


@dataclass
class LaunchFigures(Section):
    launch_overhead_s: float
    launch_total_s: float


@dataclass
class BenchResult:
    """Every section of one `leanagent bench` run; `flat()` is the JSON it writes."""

    run: RunInfo
    corpus: CorpusFigures | None = None
    data: DataFigures | None = None
    embedding: EmbeddingFigures | None = None
    retrieval: RetrievalFigures | None = None  # None: the dataset has no val/test theorems
    train_step: TrainStepFigures | None = None
    fisher: FisherFigures | None = None
    cuda_training: list[FixedLengthRow] | None = None  # CUDA only
    launch: LaunchFigures | None = None  # None: --no-launch

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for section in (self.run, self.corpus, self.data, self.embedding, self.retrieval, self.train_step,
                        self.fisher, self.launch):
            if section is not None:
                out.update(section.flat())
        if self.cuda_training is not None:
            out["cuda_training"] = [row.flat() for row in self.cuda_training]
        return out


def write_json(result: BenchResult, path: Path) -> None:
    Path(path).write_text(json.dumps(result.flat(), indent=2, sort_keys=True, default=str))
