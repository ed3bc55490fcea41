"""What one `leanagent bench` run measures: its options, validated, with the device-dependent defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from leanagent.bench.attacks import ATTACKS
from leanagent.ground.config import DataConfig
from leanagent.ground.names import (
    BYT5_SMALL,
    DEFAULT_SPLIT,
    FP32,
    PRESET_NAMES,
    TINY,
    TORCH_DTYPES,
    DtypeChoice,
    Preset,
    Split,
    TorchDtypeChoice,
)
from leanagent.model.engines import ENGINES

FisherMethod = Literal["loop", "vectorised"]
# The parts of `leanagent bench path` after the corpus and data figures (which every part needs), in run order.
PathPart = Literal["embedding", "retrieval", "train_step", "fisher", "cuda", "launch"]


class BenchOptions(BaseModel):
    """The bench's settings; None means the default for the device (the properties below resolve them).

    On a CPU the training rows use the model's first 2 layers: every layer of byt5-small's width has the same
    matmuls and attention shapes, so fewer layers keep each step's balance at a fraction of its time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Path = Field(description="a LeanDojo dataset (corpus.jsonl and SPLIT/{train,val,test}.json)")
    model: str | None = Field(None, description="the encoder to measure: an HF model folder or hub id (default: a "
                                                "random encoder of --preset's shape)")
    preset: Preset | None = Field(None, description="the shape of the random encoder "
                                                                            "measured without --model (default tiny)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the model runs")
    split: str = Field(DEFAULT_SPLIT, description="the split folder the examples come from")
    min_seconds: float = Field(3.0, ge=0, description="time each rate for at least this long")
    embed_sample: PositiveInt | None = Field(None, description="premises embedded (default: 512 on cpu, 4096 on "
                                                               "cuda)")
    fisher_examples: PositiveInt = Field(8, description="examples the Fisher rows run")
    fisher_methods: tuple[FisherMethod, ...] | None = Field(None, description="the per-example Fisher passes to "
                                                                            "time (default: loop on cpu, both on "
                                                                            "cuda)")
    launch: bool = Field(True, description="measure a real job's launch overhead")
    compile: bool = Field(True, description="run the compiled training row (and time the compile)")
    train_max_len: PositiveInt | None = Field(None, description="bytes the training step and Fisher pass cut "
                                                                "sequences at (default: LeanAgent's 1024)")
    train_layers: PositiveInt | None = Field(None, description="layers of the model the training rows keep "
                                                               "(default: 2 on cpu, byt5-small's width with each "
                                                               "layer's work as in the full model; all on cuda)")
    train_batches: PositiveInt | None = Field(None, description="batches of 4 the training rows run (default: 4 on "
                                                                "cpu, 16 on cuda)")
    parts: tuple[PathPart, ...] | None = Field(None, description="only these parts, after the corpus and data "
                                                                 "figures (default: all; cuda runs on cuda only, "
                                                                 "launch unless --no-launch)")
    states: tuple[Path, ...] = Field((), description="LeanDojo split files whose proof states are the training "
                                                     "rows' contexts (their real lengths; premises stay the "
                                                     "dataset's), e.g. a real benchmark's random/val.json")

    def wants(self, part: str) -> bool:
        return self.parts is None or part in self.parts

    @property
    def shape(self) -> str:
        """The random encoder's preset (without `model`)."""
        return self.preset or TINY

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def sample(self) -> int:
        return self.embed_sample or (4096 if self.on_cuda else 512)

    @property
    def layers(self) -> int | None:
        """Layers the training rows keep; None: all."""
        return self.train_layers if self.train_layers is not None else (None if self.on_cuda else 2)

    @property
    def batches(self) -> int:
        return self.train_batches or (16 if self.on_cuda else 4)

    @property
    def max_len(self) -> int:
        return self.train_max_len or DataConfig().max_seq_len

    @property
    def methods(self) -> tuple[FisherMethod, ...]:
        return self.fisher_methods or (("loop", "vectorised") if self.on_cuda else ("loop",))


class CurriculumOptions(BaseModel):
    """What `leanagent bench curriculum` runs: the repositories, their shared dependency, the trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repos: PositiveInt = Field(4, description="repositories in the curriculum")
    dependency_files: PositiveInt = Field(500, description="files of the shared dependency")
    dependency_premises: PositiveInt = Field(20000, description="premises of the shared dependency")
    theorems: PositiveInt = Field(60, description="theorems of each repository")
    epochs: PositiveInt = Field(1, description="lifelong.epochs_per_repo (LeanAgent's 1)")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="where the jobs run")
    devices: PositiveInt = Field(2, description="ranks per job (on a GPU: GPUs)")
    preset: Preset = Field(TINY, description="the random encoder's shape")
    launcher: str = Field("local", description="what starts each job's ranks (the config's `launcher`)")
    work: Path | None = Field(None, description="keep the data, model and both runs here (default: a temporary "
                                                "folder, removed at the end)")


class SweepOptions(BaseModel):
    """What `leanagent bench sweep` runs: the repositories, the setups' trainer, and how many setups at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repos: PositiveInt = Field(3, description="repositories each setup learns")
    theorems: PositiveInt = Field(60, description="theorems of each repository")
    epochs: PositiveInt = Field(1, description="lifelong.epochs_per_repo (LeanAgent's 1)")
    max_parallel: PositiveInt = Field(2, description="setups the sweep runs at once")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="where the jobs run")
    devices: PositiveInt = Field(2, description="ranks per job (on a GPU: GPUs)")
    preset: Preset = Field(TINY, description="the random encoder's shape")
    work: Path | None = Field(None, description="keep the data, model, the sweep and the runs alone here (default: a "
                                                "temporary folder, removed at the end)")


class ProjectionOptions(BaseModel):
    """LeanAgent's curriculum at its scale. Defaults: its 14 repositories, one epoch each, on 4 GPUs, a Mathlib-sized
    shared dependency; the rates are the bench's on one H200 (byt5-small, bf16)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repos: PositiveInt = Field(14, description="repositories in the curriculum")
    epochs_per_repo: PositiveInt = Field(1, description="lifelong.epochs_per_repo")
    dependency_premises: PositiveInt = Field(100_000, description="premises of the shared dependency (Mathlib's "
                                                                  "order of magnitude)")
    own_premises: int = Field(2_000, ge=0, description="premises of each repository's own files")
    needed_share: float = Field(1.0, gt=0, le=1, description="the share of the premises an evaluation's contexts "
                                                             "can rank (1: all; the bench measures it)")
    train_examples: PositiveInt = Field(3_000, description="training examples of each repository")
    gpus: PositiveInt = Field(4, description="ranks of each job")
    embed_per_s: float = Field(1_252.0, gt=0, description="premises embedded per second per GPU")
    step_s_per_example: float = Field(0.058, gt=0, description="seconds of a training step per example per GPU")


class SwapOptions(BaseModel):
    """What `leanagent bench swap` measures: a server following a run through one swap of Mathlib-sized stages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    premises: PositiveInt = Field(76_000, description="premises of the corpus both stages index (Mathlib-sized)")
    files: PositiveInt = Field(2_000, description="files of that corpus")
    preset: Preset = Field(TINY, description="the random encoder's shape")
    embed: Literal["model", "random"] = Field(
        "model", description="model: the indexes embedded by the model; random: random unit rows of its width, "
                             "served with --force (a byt5-small index at its true size, without a day of CPU)")
    work: Path | None = Field(None, description="keep the data, indexes and run here (default: a temporary folder)")


class DtypesOptions(BaseModel):
    """What `leanagent bench dtypes` measures: the served encoder's pass per `--dtype`, at byt5-small's full shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    states: Path | None = Field(None, description="a LeanDojo split file: its median-length proof state and a "
                                                  "1,024-byte one are encoded (default: generated states)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the encoder runs")
    dtypes: tuple[TorchDtypeChoice, ...] = Field(
        TORCH_DTYPES, description="the dtypes measured, in this order (int8: CPU only)")
    repeats: PositiveInt = Field(3, description="passes per state, after a warm-up; the median is kept")
    premises: PositiveInt = Field(64, description="premises of the corpus embedding rate")
    preset: Preset = Field(BYT5_SMALL, description="the random encoder's shape")


class GradCacheOptions(BaseModel):
    """What `leanagent bench grad-cache` measures: one InfoNCE training step's peak memory and time, with
    `model.grad_cache` and without, each in a process of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: Preset = Field(TINY, description="the random encoder's shape")
    layers: PositiveInt = Field(2, description="layers of the encoder kept")
    batch: PositiveInt = Field(32, description="contexts of the step")
    negatives: int = Field(3, ge=0, description="negatives per context")
    budget: PositiveInt = Field(16384, description="model.token_budget: tokens per encoder call")
    states: Path | None = Field(None, description="a LeanDojo split file whose proof states' lengths the contexts "
                                                  "and premises take (default: 300 bytes each)")


class BatchingOptions(BaseModel):
    """What `leanagent bench batching` measures: `PremiseServer.retrieve` in process (no HTTP), batched against one
    request at a time, and the two parts of a batched pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: Path = Field(description="an INDEX folder (`leanagent index`)")
    dataset: Path = Field(description="the dataset whose test split's proof states are sent")
    threads: PositiveInt = Field(32, description="concurrent requests")
    rounds: PositiveInt = Field(3, description="rounds in which the two servers take turns")
    dtype: DtypeChoice = Field(FP32, description="the index's dtype on load")


ServeBody = Literal["new client", "old client"]


class ServeOptions(BaseModel):
    """What `leanagent bench serve` measures: real `leanagent serve` processes, batched and not, at 1, 8 and 32
    concurrent clients."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    work: Path = Field(description="a folder for the data, model and indexes (reused when present)")
    preset: Preset = Field(TINY, description="the random encoder's shape")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the servers run")
    mathlib: bool = Field(True, description="also a Mathlib-sized index (76,000 premises), beside the demo's")
    modes: tuple[Literal["batched", "unbatched"], ...] = Field(("batched", "unbatched"),
                                                               description="the servers measured, in this order")
    bodies: tuple[ServeBody, ...] = Field(("new client", "old client"),
                                          description="the request bodies measured (new client: imported modules "
                                                      "and new premises; old client: every position listed)")
    serve_args: str = Field("", description="more `leanagent serve` options, e.g. '--dtype bf16'")
    server_cpus: tuple[int, ...] = Field((), description="Linux: run the server on these CPUs and the clients on "
                                                         "the others (default: both share every CPU)")


AttackName = Literal[tuple(a.name for a in ATTACKS)]  # type: ignore[valid-type]


class AbuseOptions(BaseModel):
    """What `leanagent bench abuse` replays: every attack of `leanagent.bench.attacks`, or those named."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: Literal["full", "small"] = Field("full", description="full: each attack at the size that once hurt the "
                                                               "server; small: every count shrunk (a quick check)")
    attacks: tuple[AttackName, ...] = Field((), description="only these attacks (default: all)")
    work: Path | None = Field(None, description="keep the index, the run and the logs here (default: a temporary "
                                                "folder)")


class PrecisionOptions(BaseModel):
    """What `leanagent bench precision` measures: the training step and the Fisher pass in each trainer precision, on
    the CPU at hand, the precisions taking turns on the same batches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Path | None = Field(None, description="a LeanDojo dataset whose training examples are the batches "
                                                   "(default: a synthetic one, as `leanagent demo-data` writes)")
    presets: tuple[Preset, ...] = Field(
        PRESET_NAMES, description="the random encoders' shapes, each measured (tiny: the demo's)")
    layers: PositiveInt = Field(2, description="layers of byt5-small kept: each layer of its width does the same "
                                               "work, so 2 keep a step's balance at a sixth of its time")
    precisions: tuple[Literal["32-true", "bf16-mixed"], ...] = Field(("32-true", "bf16-mixed"),
                                                                       description="the precisions measured")
    batches: PositiveInt = Field(4, description="batches of 4 examples each pass runs")
    max_len: PositiveInt = Field(1024, description="bytes sequences are cut at (LeanAgent's 1024)")
    rounds: PositiveInt = Field(3, description="rounds in which the passes take turns; each keeps its fastest")
    min_seconds: float = Field(0.0, ge=0, description="take turns for at least this long per pass")
    threads: PositiveInt = Field(1, description="torch's threads: 1 is what each rank of a 2-rank CPU job runs "
                                                "(torchrun's OMP_NUM_THREADS), and holds still on a busy machine")


# engine:dtype, every pair `leanagent.model.engines.ENGINES` runs.
EngineDtype = Literal[tuple(f"{e.name}:{d}" for e in ENGINES.values() for d in e.dtypes)]  # type: ignore[valid-type]


class EnginesOptions(BaseModel):
    """What `leanagent bench engines` measures: the query side per engine and dtype on one index, against torch
    fp32 (always measured, first)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: Path | None = Field(None, description="an INDEX folder, or a lifelong RUN_DIR (its newest stage): its "
                                                 "model is measured, on its datasets' test states")
    dataset: tuple[Path, ...] = Field((), description="without --index: a LeanDojo dataset whose corpus is indexed "
                                                      "here (torch fp32) and whose test states are ranked")
    model: str | None = Field(None, description="without --index: the model indexed (an HF folder, checkpoint or "
                                                "cached hub id; default: a random encoder of --preset's shape)")
    preset: Preset = Field(BYT5_SMALL, description="the random encoder's shape")
    states: tuple[Path, ...] = Field((), description="LeanDojo split files whose proof states are timed (default: "
                                                     "the test states)")
    max_states: PositiveInt = Field(10, description="states timed, evenly spread over their lengths")
    engines: tuple[EngineDtype, ...] = Field(("torch:fp32", "torch:bf16", "ct2:fp32", "ct2:int8", "ct2:int8_float32"),
                                             description="the engines and dtypes measured, in this order")
    repeats: PositiveInt = Field(3, description="rounds in which the engines take turns on every state")
    premises: PositiveInt = Field(64, description="premises of the embedding rate")
    split: Split = Field(DEFAULT_SPLIT, description="the split folder whose test.json is ranked")
