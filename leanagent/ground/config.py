"""Typed configuration for every LeanAgent job.

The defaults are the reference implementation's settings: the seed's trainer (4 GPUs, bf16-mixed,
a one-year DDP timeout, gradient clipping 1.0, 4-step accumulation) and the hyper-parameters of
LeanAgent's `leanagent.py` (lr 1e-3, warmup 1000, batch 4, 1024-byte training sequences, the corpus
embedded at the model's 512, seed 3407, EWC off), so that results compare with the paper. A CPU run
is an override in YAML, never a different code path. Unknown keys are refused so that a typo
cannot silently fall back to a default.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from leanagent.ground.names import DEFAULT_SPLIT, PER_EXAMPLE, SPLITS, FisherEstimatorName

ONE_YEAR_SECONDS = 7 * 24 * 60 * 60 * 52
DEFAULT_MODEL = "kaiyuy/leandojo-lean4-retriever-byt5-small"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    name_or_path: str = Field(DEFAULT_MODEL, description="HF hub id or local directory of a T5 encoder")
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(1000, ge=0)
    max_seq_len: int = Field(512, gt=0, description="token budget of premises when the corpus is embedded")
    num_retrieved: int = Field(100, gt=0, description="premises retrieved per context at evaluation")
    corpus_autocast: bool = Field(
        False, description="embed the corpus for evaluation under the trainer's autocast (bf16 matmuls under "
                           "bf16-mixed): several times faster on a GPU, embeddings differ by bf16 rounding. "
                           "False: in fp32 outside autocast, as LeanAgent does")
    embed_premises: Literal["needed", "all"] = Field(
        "needed", description="which premises validation and evaluation embed. needed: only those some context "
                              "of the job may use (a premise no context may use is never ranked), each distinct "
                              "premise (same path, name and code) once per job, however many of the job's "
                              "datasets carry it: the same metrics. all: every premise of each dataset's corpus, "
                              "once per dataset, as LeanAgent re-embeds them")
    sort_by_length: bool = Field(
        True, description="encode a step's contexts, and its premises, as length-sorted sub-batches each padded to "
                          "its own longest (training, both Fisher estimators, evaluation's contexts): the same loss "
                          "and embeddings to float rounding, far fewer tokens processed on real lengths (faster "
                          "steps), but training's dropout draws its masks for other shapes (another dropout stream) "
                          "and bf16 rounds embeddings differently. False: each pool padded to its longest, "
                          "as LeanAgent, whose padded batches it keeps bit for bit")
    token_budget: int = Field(
        16384, gt=0, description="most tokens (sequences x padded width) one sub-batch's encoder call may take")
    loss: str = Field(
        "mse", description="a loss of leanagent/model/losses.py's table. mse: ReProver's (so LeanAgent's) cosine "
                           "similarities regressed onto the label matrix; "
                           "infonce: a cross-entropy per context over the similarities / temperature, every column "
                           "marked positive counting as positive, averaged over contexts (leanagent/model/losses.py)")
    temperature: float = Field(0.05, gt=0, description="the similarities are divided by this under loss: infonce")
    grad_cache: bool = Field(
        False, description="gradient caching (GradCache): encode the batch without gradients, take the loss's "
                           "gradient at the embeddings, then encode each sub-batch again (its dropout replayed) and "
                           "backpropagate it alone: the same gradient with one encoder call's activations in "
                           "memory, for a large data.batch_size under loss: infonce; each sub-batch is encoded "
                           "twice (leanagent/model/grad_cache.py)")
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile each T5 block (regional, dynamic lengths): auto = under CUDA only; "
                            "a failed compile falls back to eager with one line")


class DataConfig(_Section):
    split: str = Field(DEFAULT_SPLIT, description=f"split folder inside each dataset: {' or '.join(SPLITS)}")
    batch_size: int = Field(4, gt=0)
    eval_batch_size: int = Field(64, gt=0)
    num_negatives: int = Field(3, ge=0)
    num_in_file_negatives: int = Field(1, ge=0)
    negatives: Literal["random", "mined"] = Field(
        "random", description="random: LeanAgent's, drawn uniformly from the accessible premises; mined: from the "
                              "top data.mined_pool of the current model's ranking of them (refreshed at each "
                              "validation, random before the first), positives excluded; the in-file count "
                              "rule is the same either way")
    mined_pool: int = Field(50, gt=0, description="how deep in the model's ranking mined negatives are drawn")
    max_seq_len: int = Field(1024, gt=0, description="token budget of contexts and of training premises")
    num_workers: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _in_file_within_total(self) -> DataConfig:
        if self.num_in_file_negatives > self.num_negatives:
            raise ValueError(
                f"data.num_in_file_negatives ({self.num_in_file_negatives}) exceeds "
                f"data.num_negatives ({self.num_negatives})"
            )
        return self


# Lightning's `Trainer(precision=...)` values (lightning_fabric's `_PRECISION_INPUT`, each as a string: a YAML number
# such as `32` is read as "32"), and `auto`: LeanAgent's bf16-mixed on a GPU, and on a CPU the CPU's own precision
# (bf16-mixed where it has bf16 matmuls, 32-true elsewhere: `leanagent.model.dtypes.resolve_precision`, which the
# ranks apply; a run keeps the one it started with, `leanagent.run.fingerprint`). Written out here, as this floor
# loads no Lightning; tests/unit/test_config_and_trainer.py checks it against Lightning's own list.
Precision = Literal["auto", "bf16-mixed", "32-true", "16-mixed", "bf16-true", "16-true", "64-true",
                    "transformer-engine", "transformer-engine-float16", "bf16", "32", "16", "64"]


class TrainerConfig(_Section):
    accelerator: Literal["gpu", "cpu", "cuda", "auto"] = "gpu"
    devices: int = Field(4, gt=0, description="processes per node (GPUs per node)")
    num_nodes: int = Field(1, gt=0)
    node_rank: int = Field(0, ge=0, description="this node's rank when num_nodes > 1")
    rdzv_endpoint: str | None = Field(None, description="host:port of node 0 when num_nodes > 1")
    precision: Precision = Field(
        "bf16-mixed", description="Lightning's precision (LeanAgent's bf16-mixed), or auto: bf16-mixed on a GPU; on "
                                  "a CPU bf16-mixed where it has bf16 matmuls (AVX-512 BF16, AMX), else 32-true. A "
                                  "run keeps the precision it started with")
    gradient_clip_val: float = 1.0
    accumulate_grad_batches: int = Field(4, gt=0)
    ddp_timeout_seconds: int = Field(ONE_YEAR_SECONDS, gt=0)
    log_every_n_steps: int = Field(1, gt=0)
    num_sanity_val_steps: int = Field(0, ge=0)
    early_stopping_patience: int = Field(5, ge=0)
    save_top_k: int = Field(-1, ge=-1)
    seed: int = 3407
    checkpoint_every_n_steps: int | None = Field(
        None, gt=0, description="also write the job's last.ckpt every N optimizer steps, mid-epoch (atomic)")
    checkpoint_every_minutes: float | None = Field(
        None, gt=0, description="also write the job's last.ckpt every this many minutes, mid-epoch (atomic)")

    @field_validator("precision", mode="before")
    @classmethod
    def _number_as_text(cls, value: Any) -> Any:
        """`precision: 32` in YAML is a number; Lightning takes it as "32" too."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _node_rank_within_nodes(self) -> TrainerConfig:
        if self.node_rank >= self.num_nodes:
            raise ValueError(f"trainer.node_rank ({self.node_rank}) must be < trainer.num_nodes ({self.num_nodes})")
        return self

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


class LifelongConfig(_Section):
    epochs_per_repo: int = Field(1, gt=0)
    curriculum: bool = True
    ewc_lambda: float = Field(0.0, ge=0, description="0: LeanAgent's main setup; 0.1: its EWC setup")
    fisher_estimator: FisherEstimatorName = Field(
        PER_EXAMPLE,
        description="per_example: mean of squared per-example gradients; reference: LeanAgent's compute_fisher "
                    "(squared DDP-averaged batch gradients, summed over steps, divided by the dataset size)")
    keep_checkpoints: Literal["all", "best_and_last"] = Field(
        "all", description="all: the seed's save_top_k=-1; best_and_last: once a repository's stages are done, "
                           "delete its other epoch checkpoints")
    checkpoint: Literal["latest", "best"] = Field(
        "latest", description="which checkpoint of a repository the next one starts from and is evaluated: "
                              "the newest (LeanAgent) or the best by Recall@10_val")
    dataset_strategy: Literal["single", "merge_all", "replay"] = Field(
        "single", description="single: repository i trains (and computes its Fisher) on itself, LeanAgent's main "
                              "setup; merge_all: on the merge of repositories 0..i in curriculum order (LeanAgent's "
                              "merge rules, written once under run_dir/merged); replay: on that merge with only "
                              "replay_fraction of each earlier repository's training theorems (not in LeanAgent). "
                              "Each is evaluated on its own test split whatever the strategy")
    replay_fraction: float | None = Field(
        None, description="with dataset_strategy: replay, the share in (0, 1] of each earlier repository's "
                          "training theorems that stage i trains on again, drawn once per stage from the seed, the "
                          "stage and the repositories' content (1: merge_all's dataset; 0 would be single)")
    start_checkpoint: Path | None = Field(
        None, description="the first repository's training starts from this checkpoint (and the untrained "
                          "baseline is scored with it): one of ours, or a LeanAgent/ReProver retriever .ckpt, "
                          "a file or a zero_to_fp32-consolidated DeepSpeed folder; its epochs count towards "
                          "max_epochs. None: start from model.name_or_path")

    @field_validator("replay_fraction")
    @classmethod
    def _a_share(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:  # NaN included
            raise ValueError(f"{value} is outside (0, 1]: the share of each earlier repository's training theorems "
                             f"replayed (0 is dataset_strategy: single, 1 is merge_all)")
        return value

    @model_validator(mode="after")
    def _fraction_with_replay(self) -> LifelongConfig:
        """A fraction without replay, or replay without a fraction, is a half-made choice: refused, not guessed."""
        if self.dataset_strategy == "replay" and self.replay_fraction is None:
            raise ValueError("lifelong.dataset_strategy: replay needs lifelong.replay_fraction, a share in (0, 1] "
                             "of each earlier repository's training theorems")
        if self.dataset_strategy != "replay" and self.replay_fraction is not None:
            raise ValueError(f"lifelong.replay_fraction ({self.replay_fraction:g}) is set but "
                             f"lifelong.dataset_strategy is {self.dataset_strategy}: set dataset_strategy: replay, or "
                             f"leave replay_fraction out")
        return self


class RepoConfig(_Section):
    path: Path = Field(description="LeanDojo Benchmark 4 dataset folder: corpus.jsonl and split folders")
    name: str | None = Field(None, description="display name; defaults to the folder name")

    @property
    def display_name(self) -> str:
        return self.name or self.path.name


class PipelineConfig(_Section):
    """A whole config file. Its top-level keys are these fields, plus the sections of launchers.

    A launcher's settings are the top-level section named like it (`NAME:` for `launcher: NAME`). This ground
    layer knows no launcher: it keeps each such section as written (a mapping; `dump_config` writes it back, so
    the ranks get it too) and leaves it to the launcher registry (leanagent/launch/registry.py), which validates
    `launcher` and every section with its launcher's own pydantic model, and refuses any other top-level key
    with the nearest known one, wherever a config is loaded for a run or a job. A top-level key that is no field
    and holds no mapping is no launcher's section: refused here already, with the nearest known key.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    __pydantic_extra__: dict[str, dict[str, Any] | None] = Field(init=False)  # launchers' sections, as written

    launcher: str = Field(
        "local", description="how each job's ranks are started: the name of a launcher (a module of "
                             "leanagent/launch/, or an installed package's `leanagent.launchers` entry point); "
                             "its settings are the top-level section of that name")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    trainer: TrainerConfig = TrainerConfig()
    lifelong: LifelongConfig = LifelongConfig()
    run_dir: Path = Path("runs/leanagent")
    repos: list[RepoConfig] = []
    repos_dir: Path | None = Field(
        None, description="a folder whose every immediate subfolder holding a LeanDojo dataset is one more "
                          "repository, named by its folder, taken after those of `repos`; a run picks up the "
                          "folders added since the last one. Folders whose name starts with '.' are not read "
                          "(copy a dataset in under a dot-name, then rename it), and one that does not validate "
                          "is skipped for this run")

    def section(self, key: str) -> dict[str, Any] | None:
        """The top-level section `key` this layer does not interpret (a launcher's), as written; None if absent."""
        return (self.model_extra or {}).get(key)


# Keys added after runs and checkpoints were written without them, where the old behaviour is not today's default:
# the value that reproduces a manifest or checkpoint lacking the key (before `model.sort_by_length` existed, every
# pool was padded). Any other absent key reads as its default.
ABSENT_MEANS: dict[str, Any] = {"model.sort_by_length": False}


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and the key."""


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Read a YAML file into a validated config; relative paths inside it resolve against the file.

    `overrides`: `KEY=VALUE` settings (`model.lr=2e-4`, `lifelong.ewc_lambda=0.1`) applied over the file before
    validation, each VALUE read as YAML (a number, `true`, a list), so they are checked exactly as the file's keys
    are, an unknown one refused with the nearest known key."""
    path = Path(path)
    return config_from_data(read_config_data(path), config_source(path, overrides), path.parent, overrides)


def read_config_data(path: str | Path) -> dict[str, Any]:
    """A config file's YAML mapping, not yet validated; ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise ConfigError(f"{path}: no such config file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def config_from_data(raw: dict[str, Any], source: str, base: Path, overrides: Sequence[str] = ()) -> PipelineConfig:
    """A config from its YAML mapping (left as it is) with `overrides` applied, validated, relative paths resolved
    against `base`; ConfigError starting with `source` (what names the config: its file, a sweep's setup)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        _override(raw, item)
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc, PipelineConfig)}") from exc
    return resolve_paths(config, base)


def config_source(path: str | Path, overrides: Sequence[str] = ()) -> str:
    """What a refusal of a loaded config names: `run.yaml`, or `run.yaml with --set model.lr=0.1` when settings were
    given on the command line (the key at fault may be theirs, not the file's)."""
    return f"{path} with --set {' '.join(overrides)}" if overrides else str(path)


def _override(raw: dict[str, Any], item: str) -> None:
    """One `--set KEY=VALUE` into the raw mapping (sections made where the file has none)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--set {item}: expected KEY=VALUE, a dotted key such as model.lr=2e-4")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item}: the value is not valid YAML ({exc})") from None
    if isinstance(value, str):
        value = _number(value)
    node = raw
    for n, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: {'.'.join(parts[: n + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _number(text: str) -> Any:
    """YAML 1.1 reads `2e-4` (no dot) as a string: a value that is a number in Python's syntax is one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def resolve_paths(config: PipelineConfig, base: Path) -> PipelineConfig:
    """Make run_dir, repository paths and a local model path absolute relative to `base`."""
    base = base.resolve()
    update: dict = {"run_dir": _absolute(config.run_dir, base)}
    update["repos"] = [r.model_copy(update={"path": _absolute(r.path, base)}) for r in config.repos]
    if config.repos_dir is not None:
        update["repos_dir"] = _absolute(config.repos_dir, base)
    if config.lifelong.start_checkpoint is not None:
        start = _absolute(config.lifelong.start_checkpoint, base)
        update["lifelong"] = config.lifelong.model_copy(update={"start_checkpoint": start})
    local_model = base / config.model.name_or_path
    if not Path(config.model.name_or_path).is_absolute() and local_model.exists():
        update["model"] = config.model.model_copy(update={"name_or_path": str(local_model.resolve())})
    return config.model_copy(update=update)


def _absolute(p: Path, base: Path) -> Path:
    p = Path(p).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def format_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """`key: problem; ...`; with the validated `model`, an unknown key names the nearest known one, and a value
    outside an enumerated setting's choices (a Literal: trainer.precision, trainer.accelerator, lifelong.checkpoint,
    ...) names the value, the nearest choice and every choice, once per key (not once per branch of a union)."""
    parts = []
    named: set[str] = set()
    for err in exc.errors():
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")  # our validators' own words
        choices = _choices_at(model, err["loc"]) if model is not None and err["type"] != "missing" else None
        if model is not None and (err["type"] == "extra_forbidden" or _not_a_section(model, err)):
            known = _known_keys(model, err["loc"][:-1])
            close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            message = "unknown key" + (f" (did you mean {close[0]!r}?)" if close else
                                        f"; known here: {', '.join(known)}" if known else "")
        elif choices is not None:
            depth, values = choices
            key = ".".join(str(x) for x in err["loc"][:depth])
            if key in named:
                continue  # another branch of the same union: the key is named once
            message = not_a_choice(err.get("input"), values)
        named.add(key)
        parts.append(f"{key}: {message}")
    return "; ".join(parts)


def not_a_choice(value: Any, choices: Sequence[Any]) -> str:
    """`'bf16-mix' is not a valid value (did you mean 'bf16-mixed'?); one of: auto, bf16-mixed, ...`."""
    shown = [_yaml_text(c) for c in choices]
    likeness = {c: difflib.SequenceMatcher(None, str(value).lower(), c.lower()).ratio() for c in shown}
    nearest = max(shown, key=likeness.__getitem__)
    given = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    hint = f" (did you mean {nearest!r}?)" if likeness[nearest] > 0 else ""
    return f"{given} is not a valid value{hint}; one of: {', '.join(shown)}"


def _yaml_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _choices_at(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[int, list[Any]] | None:
    """(how many parts of `loc` name the setting, its choices) when `loc` is in an enumerated setting of `model`."""
    node: Any = model
    for depth, part in enumerate(loc):
        if isinstance(part, int):
            continue
        if not (isinstance(node, type) and issubclass(node, BaseModel)) or part not in node.model_fields:
            return None
        annotation = node.model_fields[part].annotation
        values = _enumerated(annotation)
        if values:
            return depth + 1, values
        node = _section_type(annotation)
    return None


def _enumerated(annotation: Any) -> list[Any]:
    """The values a Literal (or a union of Literals and bool, e.g. `Literal["auto"] | bool`) admits; [] for any
    other annotation."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if annotation is bool:
        return [True, False]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if all(a is bool or typing.get_origin(a) is Literal for a in args):
            values = [v for a in args for v in _enumerated(a)]
            return values if any(typing.get_origin(a) is Literal for a in args) else []
    return []


def _not_a_section(model: type[BaseModel], err: Any) -> bool:
    """A top-level key that is no field and whose value is no mapping: no launcher's section, so an unknown key."""
    loc = err["loc"]
    return len(loc) == 1 and loc[0] not in model.model_fields and err["type"] == "dict_type"


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) section at `loc` of `model`: list indices step into the item type."""
    node: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return []
        node = _section_type(field.annotation)
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _section_type(annotation: Any) -> Any:
    """`ModelConfig` from `ModelConfig`, `list[RepoConfig]` or `RepoConfig | None`; else the annotation itself."""
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation


def dump_config(config: PipelineConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
