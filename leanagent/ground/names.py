"""The names a user types or a dataset carries, each defined once: every Literal, CLI `choices` and Prefect form
field that lists them is derived from here.

They live on the ground floor because both ends of the house need them: the config (ground) and the Fisher registry
(model) both name the estimators, `leanagent validate` (data) and `leanagent run`'s digests (run) both name a
dataset's files, the CLI (which imports no torch to build its parser) and `leanagent.model.presets` both name the
presets. A table kept on a higher floor (the presets' shapes, the estimators' classes) is checked against its names
here when it is imported, so the two cannot drift apart.

Rank programs are the one table whose names are not here: `leanagent.ground.job.PROGRAMS` is their home (adding a
program is adding its spec there and its function to `leanagent.train.programs.RUNNERS`), and every list of
programs is read from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

# ---- LeanDojo Benchmark 4: a dataset folder -----------------------------------------------------------------
# DATASET/corpus.jsonl (every premise its theorems can see), then one folder per split (how LeanDojo divided the
# theorems: at random, or so that test theorems use premises no training theorem uses), each with three parts.

CORPUS_FILE = "corpus.jsonl"
Split = Literal["random", "novel_premises"]
SPLITS: tuple[str, ...] = get_args(Split)
DEFAULT_SPLIT: str = SPLITS[0]  # LeanAgent's
Part = Literal["train", "val", "test"]
PARTS: tuple[str, ...] = get_args(Part)
TRAIN_PART, VAL_PART, TEST_PART = PARTS


def part_file(part: str) -> str:
    """`train.json`: the file of one part inside a split folder."""
    return f"{part}.json"


PART_FILES: tuple[str, ...] = tuple(part_file(part) for part in PARTS)  # train.json, val.json, test.json

# A premise index (`leanagent index`, a run's stage): the file that makes a folder one (`leanagent.index.files` has
# the rest), named here so that a command can tell an index from a run before it imports torch; and its served name
# lists, which a sweep tells apart (an index extends the previous stage's) in the flow's process, without torch.
INDEX_FILE = "index.json"
NAMES_FILE = "names.json"


# ---- the encoder ------------------------------------------------------------------------------------------------

# Random ByT5-architecture encoders (`leanagent init-model --preset`, the bench sections): their shapes are
# `leanagent.model.presets.PRESETS`, keyed by these names.
Preset = Literal["tiny", "byt5-small"]
PRESET_NAMES: tuple[str, ...] = get_args(Preset)
TINY, BYT5_SMALL = PRESET_NAMES

# What runs a query side's encoder (`--engine`: `leanagent.model.engines.ENGINES`, keyed by these names), and the
# precision it runs at (`--dtype`): torch runs fp32, bf16 and int8 (`leanagent.model.dtypes`), CTranslate2 fp32,
# int8 and int8_float32 (int8 weights, float32 elsewhere). `auto` picks one of each per device.
Engine = Literal["torch", "ct2"]
ENGINE_NAMES: tuple[str, ...] = get_args(Engine)
TORCH, CT2 = ENGINE_NAMES
TorchDtype = Literal["fp32", "bf16", "int8"]
TORCH_DTYPES: tuple[str, ...] = get_args(TorchDtype)
FP32, BF16, INT8 = TORCH_DTYPES
Dtype = Literal[TorchDtype, "int8_float32"]
DTYPES: tuple[str, ...] = get_args(Dtype)
INT8_FLOAT32 = DTYPES[-1]
DtypeChoice = Literal["auto", Dtype]
DTYPE_CHOICES: tuple[str, ...] = get_args(DtypeChoice)
AUTO = DTYPE_CHOICES[0]
TorchDtypeChoice = Literal["auto", TorchDtype]
TORCH_DTYPE_CHOICES: tuple[str, ...] = get_args(TorchDtypeChoice)
EngineChoice = Literal["auto", Engine]
ENGINE_CHOICES: tuple[str, ...] = get_args(EngineChoice)

# `lifelong.fisher_estimator`: the estimators of `leanagent.model.fisher.registry`, by name.
FisherEstimatorName = Literal["per_example", "reference"]
FISHER_ESTIMATORS: tuple[str, ...] = get_args(FisherEstimatorName)
PER_EXAMPLE, REFERENCE = FISHER_ESTIMATORS


def check_table(what: str, names: Iterable[str], table: Iterable[str]) -> None:
    """A table keyed by names defined here holds exactly those names (raised at its import: a name added on one
    side only is a programming error, found by the first test that imports the table)."""
    names, keys = set(names), set(table)
    if names != keys:
        raise RuntimeError(f"{what}: the table has {sorted(keys)}, leanagent.ground.names lists {sorted(names)}; "
                           f"add or remove the name on both sides")
