"""Step checkpoints and mid-epoch resume, end to end: real torchrun, 2 gloo ranks, the tiny model.

A job writing `last.ckpt` every 2 optimizer steps is frozen (SIGSTOP) as soon as `last.ckpt` is a
mid-epoch step checkpoint of its second or third epoch, then SIGKILLed whole, as a crash would end it.
Rerun with the same `--out`, it resumes from that step and must train on exactly the batches (examples,
order, negatives) and dropout masks of an uninterrupted run with the same seed: the per-step losses
after the resume step and the final weights are those of the uninterrupted run.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .conftest import REPO_ROOT, leanagent, write_config

pytestmark = pytest.mark.ddp

EPOCHS = 3
EVERY = 2


def _ok(proc: subprocess.CompletedProcess, job: Path) -> dict:
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}"
                                  f"\nstderr:\n{proc.stderr[-4000:]}")
    return json.loads((job / "result.json").read_text())


def _process_tree(root: int) -> list[int]:
    """root and all its descendants (torchrun and the ranks run in sessions of their own, but are children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _read(path: Path) -> dict | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - absent or replaced while opened: look again
        return None


def _run_and_kill_mid_epoch(cfg: Path, dataset: Path, job: Path, steps_per_epoch: int, deadline_s: float = 900
                            ) -> int:
    """Start the job; once last.ckpt is a step checkpoint inside epoch >= 1, freeze every process of the job,
    then SIGKILL them all. Returns the global step of the last.ckpt left behind."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    log = open(job.parent / f"{job.name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "train", "--config", str(cfg), "--dataset",
                             str(dataset), "--out", str(job)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=REPO_ROOT)
    last = job / "checkpoints" / "last.ckpt"
    seen: int | None = None
    killed_at: int | None = None
    killed: list[int] = []
    started = time.monotonic()
    try:
        while killed_at is None:
            if proc.poll() is not None:
                pytest.fail(f"the job ended (exit {proc.returncode}) before a mid-epoch step checkpoint of epoch >= 1 "
                            f"was caught:\n{(job.parent / f'{job.name}.log').read_text()[-4000:]}")
            if time.monotonic() - started > deadline_s:
                pytest.fail("no mid-epoch step checkpoint within the deadline")
            try:
                mtime = last.stat().st_mtime_ns
            except FileNotFoundError:
                time.sleep(0.02)
                continue
            if mtime == seen:
                time.sleep(0.02)
                continue
            seen = mtime
            pids = _process_tree(proc.pid)
            _signal_all(pids, signal.SIGSTOP)  # freeze the whole job while last.ckpt is looked at
            ckpt = _read(last)
            step = ckpt["global_step"] if ckpt else 0
            if step > steps_per_epoch and step % steps_per_epoch:
                killed = _process_tree(proc.pid)
                _signal_all(killed, signal.SIGKILL)  # a crash: no clean-up of any kind
                killed_at = step
            else:
                _signal_all(pids, signal.SIGCONT)
    finally:
        if proc.poll() is None and killed_at is None:
            killed = _process_tree(proc.pid)
            _signal_all(killed, signal.SIGKILL)
        proc.wait(timeout=60)
        log.close()
    # The ranks are not our children: wait until each is gone (or a zombie) before the rerun.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed_at


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] != b"Z"


def _losses(job: Path, version: int) -> dict[int, float]:
    with open(job / "lightning_logs" / f"version_{version}" / "metrics.csv") as f:
        return {int(row["step"]): float(row["loss_train_step"]) for row in csv.DictReader(f)
                if row.get("loss_train_step")}


@pytest.fixture(scope="module")
def runs(ddp_assets, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("step_ckpt")
    cfg = write_config(work / "cfg.yaml", ddp_assets["model"], trainer={"checkpoint_every_n_steps": EVERY},
                       lifelong={"epochs_per_repo": EPOCHS, "ewc_lambda": 0.0})
    dataset = ddp_assets["repo_a"]
    whole = _ok(leanagent("train", "--config", str(cfg), "--dataset", str(dataset), "--out", str(work / "whole"),
                          timeout=900), work / "whole")
    steps_per_epoch = whole["global_step"] // EPOCHS
    job = work / "crashed"
    killed_at = _run_and_kill_mid_epoch(cfg, dataset, job, steps_per_epoch)
    assert not (job / "result.json").exists()
    resumed = _ok(leanagent("train", "--config", str(cfg), "--dataset", str(dataset), "--out", str(job),
                            timeout=900), job)
    return {"work": work, "whole": whole, "resumed": resumed, "job": job, "killed_at": killed_at,
            "steps_per_epoch": steps_per_epoch}


def test_uninterrupted_run_writes_step_checkpoints_beside_the_epoch_ones(runs):
    whole = runs["whole"]
    assert whole["start_global_step"] == 0 and whole["resumed_from"] is None
    assert whole["epoch"] == EPOCHS and runs["steps_per_epoch"] > 2 * EVERY
    names = sorted(p.name for p in (runs["work"] / "whole" / "checkpoints").iterdir())
    epoch_files = [n for n in names if n.startswith("epoch=")]
    # The epoch checkpoints are ModelCheckpoint's, named as ever; the step checkpoints are only last.ckpt.
    assert len(epoch_files) == EPOCHS and all("-Recall@10_val=" in n for n in epoch_files)
    assert names == sorted([*epoch_files, "last.ckpt"])  # no last-v1.ckpt, no temporary file left
    log = (runs["work"] / "whole" / "lightning_logs" / "version_0" / "metrics.csv")
    assert log.is_file()


def test_rerun_resumes_mid_epoch_from_the_step_checkpoint(runs):
    resumed, killed_at, per_epoch = runs["resumed"], runs["killed_at"], runs["steps_per_epoch"]
    assert killed_at > per_epoch and killed_at % per_epoch != 0 and killed_at % EVERY == 0
    assert resumed["resumed_from"] == str(runs["job"] / "checkpoints" / "last.ckpt")
    assert resumed["start_global_step"] == killed_at > 0
    assert resumed["epoch"] == EPOCHS and resumed["global_step"] == runs["whole"]["global_step"]
    # Only the rest of the interrupted epoch was trained: the steps logged after resuming start right after it.
    after = _losses(runs["job"], 1)
    assert min(after) == killed_at and max(after) == runs["whole"]["global_step"] - 1


def test_resumed_run_trains_on_exactly_the_batches_of_an_uninterrupted_run(runs):
    whole = _losses(runs["work"] / "whole", 0)
    before, after = _losses(runs["job"], 0), _losses(runs["job"], 1)
    killed_at = runs["killed_at"]
    # Same seed, same batches before the crash ...
    assert [before[s] for s in sorted(before) if s < killed_at] == [whole[s] for s in sorted(whole) if s < killed_at]
    # ... and after it: the same examples, order, negatives and dropout masks give the same loss at every step.
    assert sorted(after) == [s for s in sorted(whole) if s >= killed_at]
    for step in sorted(after):
        assert after[step] == pytest.approx(whole[step], rel=1e-5, abs=1e-6), step
    a = torch.load(runs["job"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    b = torch.load(runs["work"] / "whole" / "checkpoints" / "last.ckpt", map_location="cpu",
                   weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert runs["resumed"]["metrics"] == pytest.approx(runs["whole"]["metrics"], rel=1e-6)
