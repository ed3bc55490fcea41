"""Known third-party noise, dropped from what the launcher shows; `--verbose` shows everything.

Where: the launcher, not the ranks. torchrun's `--tee` writes each rank's log file under
`JOB/logs/` from the rank's own stdout/stderr, so whatever a rank suppressed itself would be
missing there too; dropping lines only on the way to the terminal (and to Prefect's logs) keeps
those files complete by construction. The one exception is torchrun's OMP_NUM_THREADS banner:
it is printed by the agent, not a rank (so no rank file ever had it), and the only way to silence
it is to set the variable, to the value torchrun would set anyway.

Each pattern names one message, never a whole category or module: an unexpected warning still shows.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

VERBOSE_ENV = "LEANAGENT_VERBOSE"

# One regex per known message, matched against a rank line without its `[rank N] ` prefix.
NOISE = (
    re.compile(r"Tip: For seamless cloud logging and experiment tracking, try installing \[?litlogger"),
    re.compile(r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    re.compile(r"Precision bf16-mixed is not supported by the model summary"),
    re.compile(r"'set_vital' is deprecated"),
    re.compile(r"Using `DistributedSampler` with the dataloaders\. During `trainer\.test\(\)`"),
    # transformers' bar while it loads a model's weights (twice per rank and job, at 0% and 100%)
    re.compile(r"^Loading weights: +\d+%\|"),
    # the Fisher pass has no optimizer by design
    re.compile(r"`LightningModule\.configure_optimizers` returned `None`, this fit will run with no optimizer"),
    # loss_train is logged per rank, without an all-reduce per step (LeanAgent syncs it; README, Differences)
    re.compile(r"It is recommended to use `self\.log\('loss_train', \.\.\., sync_dist=True\)`"),
    # Lightning's start-of-job lines, the same in every job: seeding, precision, devices
    re.compile(r"^\[rank: \d+\] Seed set to -?\d+$"),
    re.compile(r"^Using bfloat16 Automatic Mixed Precision \(AMP\)$"),
    re.compile(r"^(GPU|TPU|HPU) available: (True|False)"),
    re.compile(r"^LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES: \["),
    # its model summary: the table (box-drawing rows) and the counts under it
    re.compile(r"^[┏┃┡│└]"),
    re.compile(r"^(Trainable params|Non-trainable params|Total params|Total estimated model params size \(MB\)|"
               r"Modules in train mode|Modules in eval mode|Total FLOPs): "),
    re.compile(r"^`Trainer\.fit` stopped: `max_epochs=\d+` reached\.$"),
    # where fit restores from: in the job's result.json (`resumed_from`) and the manifest
    re.compile(r"^Restoring states from the checkpoint path at "),
    re.compile(r"^Restored all states from the checkpoint at "),
    # a job folder's ModelCheckpoint resuming from another job's checkpoint (the next repository, by design)
    re.compile(r"The dirpath has changed from .* to .*, therefore `best_model_score`"),
    # on a machine with SLURM's tools: our jobs run under torchrun, also inside SLURM jobs (README)
    re.compile(r"The `srun` command is available on your system but is not used"),
)
# The indented source line Python's default warning format prints under a warning.
SOURCE_LINE = re.compile(r"^\s+\S")


def verbose(env: MutableMapping[str, str] | None = None) -> bool:
    """`LEANAGENT_VERBOSE=1` (set by `--verbose`, or by hand for the flow and deployments)."""
    value = (os.environ if env is None else env).get(VERBOSE_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def quiet_environment(env: MutableMapping[str, str], nproc_per_node: int) -> None:
    """torchrun's OMP banner is printed only when it sets OMP_NUM_THREADS itself (to 1, with more than one
    process per node): set it first, to the same value, so that nothing else changes."""
    if not verbose(env) and nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")


class NoiseFilter:
    """Decides, line by line and per rank, whether the launcher shows a line.

    A dropped Python warning takes its indented source line (the next line of the same rank) with it.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._after_noise: set[int] = set()

    def keep(self, rank: int, text: str) -> bool:
        if not self.enabled:
            return True
        if rank in self._after_noise:
            self._after_noise.discard(rank)
            if SOURCE_LINE.match(text):
                return False
        if not text.strip():  # blank rank lines (transformers prints one before each weights bar)
            return False
        if any(p.search(text) for p in NOISE):
            self._after_noise.add(rank)
            return False
        return True
