"""A resumed training job trains exactly as an uninterrupted one, bit for bit, wherever the interruption falls.

Real `leanagent train` (CLI, launcher, torchrun, 2 gloo ranks, the tiny model, 3 epochs, a step checkpoint every
2 optimizer steps). Each case interrupts one job at an exact point (`tests/ddp_scripts/faults/sitecustomize.py`:
rank 0 signals the `leanagent train` process from inside a Trainer hook, then waits there), reruns it with the
same `--out`, and compares with one uninterrupted job: the checkpoint it resumed from, then every loss logged
after that step, every epoch checkpoint's weights and the final metrics, with `==`, not a tolerance.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import REPO_ROOT, fault_env, leanagent

pytestmark = pytest.mark.ddp

EPOCHS = 3
EVERY = 2


def _ok(proc: subprocess.CompletedProcess, job: Path) -> dict:
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}"
                                  f"\nstderr:\n{proc.stderr[-4000:]}")
    return json.loads((job / "result.json").read_text())


def _interrupted(cfg: Path, dataset: Path, job: Path, fault: str) -> subprocess.CompletedProcess:
    """`leanagent train` with the fault in its ranks, in a session of its own (a group SIGINT reaches only it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(fault_env(fault))
    return subprocess.run([sys.executable, "-m", "leanagent.cli", "train", "--config", str(cfg), "--dataset",
                           str(dataset), "--out", str(job)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=REPO_ROOT, start_new_session=True)


def _losses(job: Path) -> dict[int, float]:
    """The training loss at each step that the job's last attempt logged (an interrupted attempt's log may lack
    its last rows, which CSVLogger had not flushed yet)."""
    last = max((job / "lightning_logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    with open(last) as f:
        return {int(row["step"]): float(row["loss_train_step"]) for row in csv.DictReader(f)
                if row.get("loss_train_step")}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _epoch_files(job: Path) -> dict[str, Path]:
    return {p.name.split("-Recall")[0]: p for p in (job / "checkpoints").glob("epoch=*.ckpt")}


@pytest.fixture(scope="module")
def setup(ddp_assets, tmp_path_factory, write_cpu_config) -> dict:
    work = tmp_path_factory.mktemp("resume")
    lifelong = {"epochs_per_repo": EPOCHS, "ewc_lambda": 0.0}
    cfg = write_cpu_config(work / "cfg.yaml", encoder=ddp_assets["model"], trainer={"checkpoint_every_n_steps": EVERY},
                           lifelong=lifelong)
    plain = write_cpu_config(work / "plain.yaml", encoder=ddp_assets["model"], lifelong=lifelong)
    dataset = ddp_assets["repo_a"]
    whole = _ok(leanagent("train", "--config", str(cfg), "--dataset", str(dataset), "--out", str(work / "whole"),
                          timeout=900), work / "whole")
    return {"work": work, "cfg": cfg, "plain": plain, "dataset": dataset, "whole": whole,
            "per_epoch": whole["global_step"] // EPOCHS}


def test_an_uninterrupted_job_writes_step_checkpoints_beside_the_epoch_ones(setup):
    whole = setup["whole"]
    assert whole["start_global_step"] == 0 and whole["resumed_from"] is None
    assert whole["epoch"] == EPOCHS and setup["per_epoch"] > 3 * EVERY and setup["per_epoch"] % EVERY == 0
    names = sorted(p.name for p in (setup["work"] / "whole" / "checkpoints").iterdir())
    epoch_files = [n for n in names if n.startswith("epoch=")]
    # The epoch checkpoints are ModelCheckpoint's, named as ever; the step checkpoints are only last.ckpt.
    assert len(epoch_files) == EPOCHS and all("-Recall@10_val=" in n for n in epoch_files)
    assert names == sorted([*epoch_files, "last.ckpt"])  # no last-v1.ckpt, no temporary file left


# case: (where and how it is interrupted, config, the step the rerun resumes at), `E` standing for one epoch's steps
CASES = {
    "mid-epoch step checkpoint, SIGINT": ("step:E+4:SIGINT", "cfg", "E+4"),
    "mid-epoch step checkpoint, SIGKILL": ("step:E+4:SIGKILL", "cfg", "E+4"),
    "between epochs, SIGKILL": ("epoch_start:2:SIGKILL", "cfg", "2*E"),
    "between epochs without step checkpoints, SIGINT": ("epoch_start:2:SIGINT", "plain", "2*E"),
    "during validation, SIGINT": ("validation:1:SIGINT", "cfg", "2*E-2"),
    "during the epoch checkpoint's save, SIGKILL": ("save:1:SIGKILL", "cfg", "2*E-2"),
    "during the epoch checkpoint's save without step checkpoints, SIGINT": ("save:1:SIGINT", "plain", "E"),
}


def _steps(expression: str, per_epoch: int) -> int:
    return int(eval(expression, {}, {"E": per_epoch}))  # noqa: S307 - the literals above


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_job_trains_exactly_as_an_uninterrupted_one(setup, case):
    fault, config, resume_at = CASES[case]
    per_epoch, whole_dir = setup["per_epoch"], setup["work"] / "whole"
    where, at, how = fault.split(":")
    fault = f"{where}:{_steps(at, per_epoch)}:{how}"
    expected_step = _steps(resume_at, per_epoch)
    job = setup["work"] / case.replace(" ", "-").replace(",", "").replace("'", "")
    cfg = setup[config]

    stopped = _interrupted(cfg, setup["dataset"], job, fault)
    signum = signal.SIGKILL if fault.endswith("SIGKILL") else signal.SIGINT
    assert stopped.returncode == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signal.SIGINT), \
        stopped.stderr[-3000:]
    assert not (job / "result.json").exists()

    resumed = _ok(leanagent("train", "--config", str(cfg), "--dataset", str(setup["dataset"]), "--out", str(job),
                            timeout=900), job)
    # Resumed from where the interruption left the newest whole checkpoint, and only from there.
    assert resumed["start_global_step"] == expected_step
    assert (resumed["resumed_from"] is None) == (expected_step == 0)
    assert resumed["global_step"] == setup["whole"]["global_step"] and resumed["epoch"] == EPOCHS
    # The same batches, negatives and dropout masks: the same loss at every step, to the last bit ...
    whole, losses = _losses(whole_dir), _losses(job)
    assert losses == {step: loss for step, loss in whole.items() if step >= expected_step}
    # ... and so the same weights at every epoch's end, and the same validation metrics.
    assert _epoch_files(job).keys() == _epoch_files(whole_dir).keys()
    for name, path in _epoch_files(whole_dir).items():
        mine, theirs = _weights(_epoch_files(job)[name]), _weights(path)
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), name
    assert resumed["history"] == setup["whole"]["history"]
    assert resumed["metrics"] == setup["whole"]["metrics"]
    # No temporary checkpoint file is left behind by the interrupted save.
    assert not [p.name for p in (job / "checkpoints").iterdir() if p.name.startswith(".")]
