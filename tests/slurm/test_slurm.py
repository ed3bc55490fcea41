"""`launcher: slurm` on a real SLURM cluster (two nodes on this machine): the same jobs, submitted and watched.

Each job runs one torchrun agent per node (1 gloo rank each, so 2 ranks as the local launcher's 2); the
tests look at what a user sees: results, the job script, the queue (`squeue`), and the processes left.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from leanagent.ground.config import load_config
from leanagent.launch.base import LaunchError
from leanagent.launch.slurm import SlurmLauncher
from tests.conftest import write_cpu_config_file
from tests.ddp.conftest import fault_env
from tests.slurm.cluster import Cluster
from tests.waiting import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.ddp]  # its jobs are real torchrun jobs

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "tests" / "ddp_scripts"
STARTUP_S = 300.0  # sbatch, two torchrun agents and their rendezvous, two Python ranks, on a busy 2-core machine


def write_config(path: Path, model: Path, launcher: str = "slurm", **sections) -> Path:
    """The tests' CPU config, 2 nodes of 1 rank under SLURM (1 node of 2 under `local`), 2 epochs, no EWC."""
    nodes, devices = (2, 1) if launcher == "slurm" else (1, 2)
    defaults = {"trainer": {"devices": devices, "num_nodes": nodes},
                "lifelong": {"epochs_per_repo": 2, "ewc_lambda": 0.0}, "slurm": {"partition": "debug", "poll_s": 0.5}}
    for section, values in sections.items():
        defaults[section] = {**defaults.get(section, {}), **values} if isinstance(values, dict) else values
    return write_cpu_config_file(path, encoder=model, launcher=launcher, **defaults)


def leanagent(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    # One thread per rank everywhere, as torchrun gives 2 local ranks: CPU matmuls sum in another order with
    # another thread count, and the test compares weights bit for bit.
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)


def ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def losses(job: Path) -> dict[int, float]:
    last = max((job / "lightning_logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    with open(last) as f:
        return {int(r["step"]): float(r["loss_train_step"]) for r in csv.DictReader(f) if r.get("loss_train_step")}


def job_ids(job: Path) -> list[int]:
    return json.loads((job / "slurm" / "job.json").read_text())["job_ids"]


# ---- refusals before anything is submitted ------------------------------------------------------------

def test_a_partition_that_does_not_exist_is_refused_in_one_line_before_anything_is_submitted(
        cluster: Cluster, ddp_assets, tmp_path):
    cfg = write_config(tmp_path / "cfg.yaml", ddp_assets["model"], slurm={"partition": "gpu-large"})
    out = tmp_path / "job"
    run = leanagent("train", "--config", str(cfg), "--dataset", str(ddp_assets["repo_a"]), "--out", str(out))
    assert run.returncode == 1
    assert run.stderr.strip() == ("error: slurm.partition: 'gpu-large' is not a partition of this cluster "
                                  "(it has debug)"), run.stderr
    assert not out.exists() and not cluster.jobs()


# ---- the same job, the same result ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_job(ddp_assets, tmp_path_factory) -> dict:
    """The reference: the same training job under the local launcher, 2 ranks on this machine."""
    work = tmp_path_factory.mktemp("local")
    cfg = write_config(work / "cfg.yaml", ddp_assets["model"], launcher="local",
                       trainer={"checkpoint_every_n_steps": 2})
    started = time.time()
    result = ok(leanagent("train", "--config", str(cfg), "--dataset", str(ddp_assets["repo_a"]),
                          "--out", str(work / "job")))
    return {"result": result, "job": work / "job", "started": started}


def test_a_two_node_job_gives_the_local_jobs_weights_bit_for_bit(cluster, ddp_assets, local_job, tmp_path):
    cfg = write_config(tmp_path / "cfg.yaml", ddp_assets["model"], trainer={"checkpoint_every_n_steps": 2})
    out = tmp_path / "job"
    started = time.monotonic()
    run = leanagent("train", "--config", str(cfg), "--dataset", str(ddp_assets["repo_a"]), "--out", str(out))
    result = ok(run)
    took = time.monotonic() - started
    assert result["world_size"] == 2 and result["global_step"] == local_job["result"]["global_step"]
    mine, theirs = weights(result["checkpoint"]), weights(local_job["result"]["checkpoint"])
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert losses(out) == losses(local_job["job"])
    # The script a user can read and resubmit, its one submission on record, and nothing left in the queue.
    script = (out / "slurm" / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR2@120",
                 "--rdzv-backend=c10d", "srun --kill-on-bad-exit=1"):
        assert line in script, line
    assert len(job_ids(out)) == 1 and not cluster.jobs()
    # Submit to first step, against the local launcher's own start to first step.
    submitted = json.loads((out / "slurm" / "job.json").read_text())["submitted_at"][0]
    overhead = result["first_train_batch_time"] - submitted
    local = local_job["result"]["first_train_batch_time"] - local_job["started"]
    print(f"\n[slurm] 2-node job: {took:.1f} s in all; submit to first step {overhead:.1f} s, against "
          f"{local:.1f} s from `leanagent train` to the first step under the local launcher")
    assert re.search(r"\[launcher\] slurm: submitted job \d+", run.stdout)


def test_a_failing_rank_is_named_with_its_lines(cluster, ddp_assets, tmp_path):
    cfg = load_config(write_config(tmp_path / "cfg.yaml", ddp_assets["model"]))
    launcher = SlurmLauncher(cfg, entry=[str(SCRIPTS / "fail_probe.py"), "fail", str(tmp_path / "job")])
    with pytest.raises(LaunchError) as info:
        launcher.supervise([], tmp_path / "job", on_line=lambda line: None, timeout_s=STARTUP_S)
    message = str(info.value)
    assert info.value.failing_rank == 1, message
    assert "last lines of rank 1" in message and "RuntimeError: boom on rank 1" in message, message
    assert "about to fail: the data on this rank is bad" in message
    assert not cluster.jobs()


# ---- requeue, time limits, lost nodes ---------------------------------------------------------------------

def held_at(step: int, mark: Path, release: Path | None = None) -> dict[str, str]:
    """The environment that holds a job's rank 0 after optimizer step `step` (tests/ddp_scripts/faults, HOLD), until
    `release` exists or, without one, until the job's stop file does; `mark` appears when the hold begins."""
    return fault_env(f"step:{step}:HOLD", mark, release)


def start_train(cfg: Path, dataset: Path, out: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`leanagent train` in the background, its output in a file the test can read as it grows."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")},
           **(env or {})}
    env["OMP_NUM_THREADS"] = "1"
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "leanagent.cli", "train", "--config", str(cfg), "--dataset",
                                 str(dataset), "--out", str(out)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT)


def finished(proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> dict:
    proc.wait(timeout=timeout_s)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return json.loads(text[text.index("{\n"):])


def checkpoint_step(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    except Exception:  # noqa: BLE001 - absent, or being replaced while read: look again
        return -1


def state_of(cluster: Cluster, job_id: int) -> str:
    return cluster.run("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()


def test_a_requeued_job_resumes_from_its_step_checkpoint_and_trains_as_if_never_stopped(
        cluster, ddp_assets, local_job, tmp_path):
    cfg = write_config(tmp_path / "cfg.yaml", ddp_assets["model"], trainer={"checkpoint_every_n_steps": 2})
    out, log = tmp_path / "job", tmp_path / "train.log"
    per_epoch = local_job["result"]["global_step"] // local_job["result"]["epoch"]
    proc = start_train(cfg, ddp_assets["repo_a"], out, log)
    wait_for(lambda: checkpoint_step(out / "checkpoints" / "last.ckpt") > per_epoch, STARTUP_S,
             "a step checkpoint in epoch 1")
    [job_id] = job_ids(out)
    cluster.run("scontrol", "requeue", str(job_id))
    # SLURM holds a requeued job back (BeginTime, the credential lifetime) because the nodes revoked the job's
    # credential: a restart whose new credential is dated the same second as that revocation (SLURM compares whole
    # seconds) is killed at once ("Job credential revoked"). The revocation comes before the job is pending again,
    # so once the clock is past that second, the job may start at once.
    wait_for(lambda: state_of(cluster, job_id) == "PENDING", 60, "the requeued job pending")
    pending_at = int(time.time())
    wait_for(lambda: int(time.time()) > pending_at, 5, "the second after the requeue")
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    result = finished(proc, log)
    assert job_ids(out) == [job_id]  # SLURM requeued the same job: nothing was submitted again
    resumed_at = result["start_global_step"]
    assert per_epoch < resumed_at < local_job["result"]["global_step"] and resumed_at % 2 == 0
    assert result["resumed_from"] == str(out / "checkpoints" / "last.ckpt")
    reference = losses(local_job["job"])
    assert losses(out) == {step: loss for step, loss in reference.items() if step >= resumed_at}
    mine, theirs = weights(result["checkpoint"]), weights(local_job["result"]["checkpoint"])
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    text = log.read_text()
    assert "pending" in text and "(None)" not in text  # SLURM's reason as it gives it, or none at all
    assert not cluster.jobs()


def test_a_stop_signal_before_the_time_limit_checkpoints_resubmits_and_finishes(cluster, ddp_assets, local_job,
                                                                               tmp_path):
    """What SLURM sends `signal_lead_s` before the time limit (USR2 to the batch shell), sent now by the test:
    the ranks checkpoint at their next step and stop, the job is submitted again and finishes the training."""
    cfg = write_config(tmp_path / "cfg.yaml", ddp_assets["model"], trainer={"checkpoint_every_n_steps": 2})
    out, log = tmp_path / "job", tmp_path / "train.log"
    proc = start_train(cfg, ddp_assets["repo_a"], out, log)
    wait_for(lambda: checkpoint_step(out / "checkpoints" / "last.ckpt") >= 4, STARTUP_S, "training under way")
    [first] = job_ids(out)
    cluster.run("scancel", "--signal=USR2", "--batch", str(first))
    result = finished(proc, log)
    second = job_ids(out)[1:]
    assert len(second) == 1, job_ids(out)
    text = log.read_text()
    assert f"slurm: job {first}: its ranks stopped to be resumed; submitting it again" in text, text[-3000:]
    assert "asking the ranks to checkpoint and stop" in text and "stopping to be resumed" in text
    assert result["start_global_step"] >= 4 and result["global_step"] == local_job["result"]["global_step"]
    mine, theirs = weights(result["checkpoint"]), weights(local_job["result"]["checkpoint"])
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not cluster.jobs()


def test_a_real_time_limit_with_a_signal_lead_is_survived(cluster, ddp_assets, tmp_path):
    """SLURM's own signal before a time limit: the job is held after its 4th step (spending no CPU while SLURM's
    clock runs, and there however slow the machine), the test shortens its limit (`scontrol update TimeLimit`) to
    a minute or two from now, within `signal_lead_s`; SLURM signals the job at its next look (about every 30 s),
    which creates the stop file and so ends the hold; the ranks stop at their next step, the job is submitted
    again (with the script's full limit) and finishes."""
    cfg = write_config(tmp_path / "cfg.yaml", ddp_assets["model"], lifelong={"epochs_per_repo": 3},
                       slurm={"time": "00:10:00", "signal_lead_s": 120})
    out, log, held = tmp_path / "job", tmp_path / "train.log", tmp_path / "held"
    proc = start_train(cfg, ddp_assets["repo_a"], out, log, env=held_at(4, held))
    wait_for(held.exists, STARTUP_S, "training held at step 4", proc, lambda: log.read_text()[-4000:])
    [first] = job_ids(out)
    elapsed = cluster.run("squeue", "-h", "-j", str(first), "-o", "%M").stdout.strip()  # [[D-]H:]M:SS
    seconds = sum(int(x) * 60**k for k, x in enumerate(reversed(elapsed.replace("-", ":").split(":"))))
    minutes = -(-(seconds + 50) // 60)  # SLURM keeps limits in whole minutes: 50 to 110 s from now, < the lead
    cluster.run("scontrol", "update", f"JobId={first}", f"TimeLimit={minutes}")
    result = finished(proc, log, timeout_s=1800)
    text = log.read_text()
    assert f"slurm: job {first} has 120 s left: asking the ranks to checkpoint and stop" in text, text[-3000:]
    assert f"slurm: job {first}: its ranks stopped to be resumed; submitting it again" in text
    assert result["epoch"] == 3 and len(job_ids(out)) == 2 and result["start_global_step"] >= 4, job_ids(out)
    assert not cluster.jobs()


def test_a_node_set_down_is_reported_and_the_job_runs_again(cluster, ddp_assets, tmp_path):
    cfg = write_config(tmp_path / "cfg.yaml", ddp_assets["model"], lifelong={"epochs_per_repo": 3},
                       trainer={"checkpoint_every_n_steps": 2})
    out, log = tmp_path / "job", tmp_path / "train.log"
    proc = start_train(cfg, ddp_assets["repo_a"], out, log)
    try:
        wait_for(lambda: checkpoint_step(out / "checkpoints" / "last.ckpt") >= 4, STARTUP_S, "training under way")
        cluster.run("scontrol", "update", "nodename=n2", "state=down", "reason=leanagent-test")
        wait_for(lambda: re.search(r"Node failure on n2|ended NODE_FAIL", log.read_text()) is not None, 120,
                 "the lost node reported")
    finally:
        # Back in service (ReturnToService=2 may have done it already; then this is refused, and harmless).
        cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
    # SLURM requeues the job itself and starts it again after its credential lifetime (cluster.py: cred_expire=20,
    # instead of 120 s), a delay that keeps the first run's late step messages from reaching the second.
    wait_for(lambda: len(re.findall(r"slurm: job \d+ running", log.read_text())) >= 2, 180, "the job running again")
    result = finished(proc, log)
    assert result["epoch"] == 3 and result["start_global_step"] >= 4
    assert not cluster.jobs()


def test_status_and_cancel_ask_the_queue_for_the_runs_jobs(cluster, tmp_path):
    """A stage's job held in the queue: `leanagent status` shows it with SLURM's reason, `leanagent cancel` ends it,
    and status then shows what it became. No torchrun: the job is a held `sleep`, recorded as the launcher does."""
    run_dir = tmp_path / "run"
    folder = run_dir / "jobs" / "00-repo" / "train" / "slurm"
    folder.mkdir(parents=True)
    (folder / "job.sbatch").write_text("#!/bin/bash\nsleep 600\n")
    submitted = cluster.run("sbatch", "--parsable", "--hold", "--partition=debug", f"--output={folder}/slurm-%j.out",
                            str(folder / "job.sbatch"))
    job_id = int(submitted.stdout.strip().split(";")[0])
    (folder / "job.json").write_text(json.dumps({"job_ids": [job_id], "submitted_at": [time.time()],
                                                 "resubmissions": 0}))
    status = leanagent("status", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert status.stdout.split() == [str(job_id), "PENDING", "(JobHeldUser)", "00-repo/train", "(slurm)"]
    cancel = leanagent("cancel", str(run_dir))
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout == f"cancelled {job_id} (slurm, was PENDING (JobHeldUser)): 00-repo/train\n"
    wait_for(lambda: not cluster.jobs(), 60, "the cancelled job out of the queue")
    after = leanagent("status", str(run_dir))
    assert after.stdout.split()[:2] == [str(job_id), "CANCELLED"], after.stdout
    assert leanagent("cancel", str(run_dir)).stdout == f"{run_dir}: nothing queued, nothing cancelled\n"


def test_the_end_of_a_job_slurm_has_forgotten_comes_from_its_own_exit_record(cluster, tmp_path):
    """After MinJobAge squeue and scontrol no longer know a job, and this cluster keeps no accounting (sacct):
    the exit record the job script writes is then the answer. A job id the cluster never had stands in."""
    from leanagent.launch.slurm.queue import query_state

    forgotten = 987654
    assert query_state(forgotten, tmp_path) is None  # nothing knows it: the launcher reports it ended without trace
    (tmp_path / f"exit-{forgotten}.json").write_text(json.dumps({"job_id": forgotten, "exit_code": 0}))
    assert query_state(forgotten, tmp_path).state == "COMPLETED"
    (tmp_path / f"exit-{forgotten}.json").write_text(json.dumps({"job_id": forgotten, "exit_code": 3}))
    state = query_state(forgotten, tmp_path)
    assert (state.state, state.exit_code) == ("FAILED", 3)
