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

from pydantic import ValidationError

from leanagent.config import format_validation_error

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2  # argparse's own

VERBOSE_HELP = ("show every line of the ranks, known third-party warnings included (LEANAGENT_VERBOSE=1 does the "
                "same for the flow and deployments); the job's logs under JOB/logs/ always have them")


class CommandError(Exception):
    """A command's refusal (or its job's failure): the one line `main` prints as `error: ...`, exit 1."""


def option_error(exc: ValidationError) -> CommandError:
    """Options validated by a pydantic model whose fields are the command's flags: named as the flags are."""
    return CommandError("--" + format_validation_error(exc).replace("_", "-").replace("; ", "; --"))


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
    """`--dtype`, one meaning for `index`, `retrieve` and `serve` (`leanagent.model.dtypes`)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "int8"],
                   help="the encoder's precision (default auto: bf16 on a GPU or mps, and on a CPU with bf16 "
                        "matmuls, where it agreed with fp32; fp32 on other CPUs; int8: dynamic quantization, CPU "
                        "only); an index serves at any dtype")


def add_model_check_arguments(p: argparse.ArgumentParser) -> None:
    """`retrieve` and `serve`: the index refuses a model other than the one its corpus was embedded with."""
    p.add_argument("--model", help="encode states with this checkpoint or HF folder instead of the one index.json "
                                   "names (e.g. both moved); it must hold the same weights")
    p.add_argument("--force", action="store_true",
                   help="use the index even when its model changed since it was built (stale embeddings), warning")
