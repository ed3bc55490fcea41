"""What every command shares: the one way to refuse (`CommandError`), the exit codes, and shared arguments.

The exit codes, the same for every command:

- 0: done.
- 1 (`EXIT_REFUSED`): the command refused its input (a file, a folder, a config, a dataset, an argument's value)
  or its job failed. A handler raises `CommandError`; `main` prints it once, as `error: ...`, without a traceback.
  Input is checked before any accelerator time is spent.
- 2 (`EXIT_USAGE`): argparse could not parse the command line (an unknown option, a missing or ill-typed one).
- 128 + N: ended by signal N (130 Ctrl-C, 143 SIGTERM), every job it started ended first.

Handlers import what they need when they run (torch, Prefect, FastAPI take seconds to import), so that
`leanagent --help` and a refused argument answer at once; no import here or in a handler dodges a cycle.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from leanagent.ground.atomic import out_file_problem, out_folder_problem
from leanagent.ground.config import format_validation_error
from leanagent.ground.names import AUTO, DTYPE_CHOICES, ENGINE_CHOICES, INDEX_FILE
from leanagent.model.engines import ENGINES
from leanagent.run.manifest import MANIFEST_NAME, ManifestUnreadableError, read_manifest

EXIT_REFUSED = 1
EXIT_USAGE = 2  # argparse's own

VERBOSE_HELP = ("show every line of the ranks, known third-party warnings included (LEANAGENT_VERBOSE=1 does the "
                "same for the flow and deployments); the job's logs under JOB/logs/ always have them")


class CommandError(Exception):
    """A command's refusal (or its job's failure): the one line `main` prints as `error: ...`, exit 1."""


def option_error(exc: ValidationError) -> CommandError:
    """Options validated by a pydantic model whose fields are the command's flags: named as the flags are."""
    return CommandError("--" + format_validation_error(exc).replace("_", "-").replace("; ", "; --"))


def check_out_file(flag: str, path: str | Path | None) -> None:
    """`--json OUT` and the like, refused in one line before the work whose figures the file is to hold: a folder
    there, or a folder for it that cannot be made or written."""
    problem = None if path is None else out_file_problem(Path(path))
    if problem is not None:
        raise CommandError(f"{flag} {problem}")


def check_out_folder(flag: str, folder: str | Path | None, new_or_empty: bool = False) -> None:
    """`--work DIR` and the like: `out_folder_problem`'s line, naming the flag, before any work."""
    problem = None if folder is None else out_folder_problem(Path(folder), new_or_empty)
    if problem is not None:
        raise CommandError(f"{flag} {problem}")


def check_run_or_index(source: Path) -> None:
    """SOURCE of `serve` and `retrieve`: a run's folder (its manifest.json, read through its schema now) or an
    index's (its index.json), said in one line before the model's stack is imported: a missing run was reported as
    an index folder 48 s later (torch imported first), and a 2 GB manifest was read after it."""
    what = f"SOURCE is a run's folder (RUN_DIR, with its {MANIFEST_NAME}) or an INDEX folder (with its {INDEX_FILE})"
    if not source.exists():
        raise CommandError(f"{source}: no such run or index: nothing is there; {what}")
    if not source.is_dir():
        raise CommandError(f"{source}: a file, not a run or an index; {what}")
    if (source / MANIFEST_NAME).exists():  # a manifest cut short, of the wrong shape or too large: one line
        try:
            read_manifest(source / MANIFEST_NAME)
        except ManifestUnreadableError as exc:
            raise CommandError(str(exc)) from None
    elif not (source / INDEX_FILE).exists():
        raise CommandError(f"{source}: not a run that has started (no {MANIFEST_NAME}) nor an index (no "
                           f"{INDEX_FILE}); {what}")


def check_device(device: str) -> None:
    """`--device cuda` (or `mps`) on a machine where torch sees none: refused before any model is loaded."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CommandError("--device cuda: torch sees no CUDA device")
    if device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise CommandError("--device mps: torch sees no Apple GPU (mps)")


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """`--engine` and `--dtype`, one meaning for `index`, `retrieve` and `serve` (`leanagent.model.engines`)."""
    p.add_argument("--engine", default=AUTO, choices=ENGINE_CHOICES,
                   help="what runs the encoder: " + "; ".join(f"{e.name}: {e.help}" for e in ENGINES.values())
                        + " (default auto: ct2 fp32 on a CPU where CTranslate2 is installed, the fastest that "
                          "agrees with torch fp32 exactly; else torch)")
    p.add_argument("--dtype", default=AUTO, choices=DTYPE_CHOICES,
                   help="the encoder's precision: " + "; ".join(f"{e.name} runs {', '.join(e.dtypes)}"
                                                                for e in ENGINES.values())
                        + " (default auto: ct2's fp32; torch's bf16 on a GPU or mps and on a CPU with bf16 matmuls, "
                          "fp32 on other CPUs; int8 and int8_float32 only when asked: they cost recall, see "
                          "docs/serving.md); an index serves at any engine and dtype")


def add_model_check_arguments(p: argparse.ArgumentParser) -> None:
    """`retrieve` and `serve`: the index refuses a model other than the one its corpus was embedded with."""
    p.add_argument("--model", help="encode states with this checkpoint or HF folder instead of the one index.json "
                                   "names (e.g. both moved); it must hold the same weights")
    p.add_argument("--force", action="store_true",
                   help="use the index even when its model changed since it was built (stale embeddings), warning")


# ---- flags generated from a pydantic model: one definition of an option, its type, default and help ----------

def _unwrap(annotation: Any) -> Any:
    """`X` from `X | None` (and from `Optional[X]`)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _choices(annotation: Any) -> list[str] | None:
    return [str(v) for v in typing.get_args(annotation)] if typing.get_origin(annotation) is Literal else None


def add_model_options(p: argparse.ArgumentParser, model: type[BaseModel], skip: Iterable[str] = (),
                      positional: Iterable[str] = ()) -> None:
    """One flag per field of `model`: `--field-name` (a `positional` field: an argument of that name), its help the
    field's description and default, a bool field `--name`/`--no-name`, a tuple field one or more values (each may
    be comma-separated). Values are left unparsed here: the model validates them (`model_from_args`), so a bad value
    is refused as every refusal is, in one line naming the flag."""
    positional = set(positional)
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        annotation = _unwrap(field.annotation)
        required = field.is_required()
        default = None if required else field.get_default(call_default_factory=True)
        help_text = field.description or ""
        if default is not None and default != () and name not in positional:
            help_text += f" (default: {default})" if help_text else f"default: {default}"
        if name in positional:
            p.add_argument(name, help=help_text)
            continue
        flag = "--" + name.replace("_", "-")
        if annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        item = annotation
        many = typing.get_origin(annotation) in (tuple, list)
        if many:
            item = typing.get_args(annotation)[0]
        choices = _choices(item)
        metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
        p.add_argument(flag, dest=name, nargs="+" if many else None, metavar=metavar, default=None,
                       required=required, help=help_text)


def model_from_args(model: type[BaseModel], args: argparse.Namespace, **given: Any) -> Any:
    """The `model` the flags of `add_model_options` give (a flag left out: the field's default), with `given`;
    a value the model refuses is a `CommandError` naming the flag."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, list):
            value = tuple(part for item in value for part in str(item).split(",") if part)
            inner = typing.get_args(_unwrap(field.annotation))
            if inner and inner[0] is Path:
                value = tuple(Path(v) for v in value)
        values[name] = value
    try:
        return model(**{**values, **given})
    except ValidationError as exc:
        raise option_error(exc) from None
