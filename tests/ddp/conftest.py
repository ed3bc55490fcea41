"""Shared fixtures of the DDP tests: one synthetic dataset pair, one tiny encoder, CPU configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "tests" / "ddp_scripts"


def write_config(path: Path, model: Path, devices: int = 2, **overrides) -> Path:
    cfg = {
        "model": {"name_or_path": str(model), "lr": 1e-3, "warmup_steps": 5, "max_seq_len": 256},
        "data": {"batch_size": 4, "eval_batch_size": 16, "max_seq_len": 256, "num_workers": 0},
        "trainer": {"accelerator": "cpu", "devices": devices, "precision": "bf16-mixed",
                    "accumulate_grad_batches": 1},
        "lifelong": {"epochs_per_repo": 1, "ewc_lambda": 0.1},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values  # a top-level value, e.g. launcher="slurm"
    path.write_text(yaml.safe_dump(cfg))
    return path


def leanagent(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed console script's code path, in a subprocess as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)
