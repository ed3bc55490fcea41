"""The batch script of one job, `JOB/slurm/job.sbatch`: written for a person to read and resubmit by hand.

It runs one torchrun agent per node through `srun`, with torchrun's c10d rendezvous at the first node of the
allocation on a port derived from the job id; Lightning finds TorchElastic's variables before SLURM's, so the
rank programs run exactly as under the local launcher. Its output goes to `JOB/slurm/slurm-ID.out` with
`--open-mode=append`, so a requeue keeps what came before. Before the time limit (`--signal=B:USR2@lead`) its
trap touches the stop file the ranks read at step boundaries; torchrun never sees USR2 (older torchrun dies of
it). The script is a function of its arguments alone (tests/unit/test_slurm_script.py holds one as a golden file).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import PROGRAMS_ENTRY, STOP_FILE_ENV
from leanagent.launch.slurm.queue import SLURM_DIR
from leanagent.launch.slurm.settings import SlurmConfig

SCRIPT = "job.sbatch"
STOP_FILE = "stop"


def job_name(label: str) -> str:
    """`leanagent-train-PFR` from the label `train PFR`: what squeue shows, in characters any shell takes."""
    return "leanagent-" + (re.sub(r"[^A-Za-z0-9._,+-]+", "-", label).strip("-") or "job")


def sbatch_options(cfg: PipelineConfig, slurm: SlurmConfig, job_dir: Path, name: str) -> list[str]:
    trainer = cfg.trainer
    out = job_dir / SLURM_DIR
    options = [f"--job-name={name}", f"--nodes={slurm.nodes or trainer.num_nodes}", "--ntasks-per-node=1",
               f"--output={out}/slurm-%j.out", "--open-mode=append", "--requeue",
               f"--signal=B:USR2@{slurm.signal_lead_s}"]
    if trainer.accelerator in ("gpu", "cuda"):
        options.append(f"--gpus-per-node={slurm.gpus_per_node or trainer.devices}")
    for flag, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos),
                        ("time", slurm.time), ("cpus-per-task", slurm.cpus_per_task), ("mem", slurm.mem),
                        ("constraint", slurm.constraint)):
        if value is not None:
            options.append(f"--{flag}={value}")
    return options + list(slurm.extra_args)


def render_script(cfg: PipelineConfig, slurm: SlurmConfig, program_args: Sequence[str], job_dir: Path, label: str,
                  entry: Sequence[str] = PROGRAMS_ENTRY, python: str = sys.executable,
                  workdir: Path | None = None) -> str:
    """The batch script: one torchrun agent per node under `srun`, c10d rendezvous at the first node.

    `python` runs the ranks (default: this interpreter, which must be on a filesystem the nodes share) and the
    job starts in `workdir` (default: the current directory).
    """
    job_dir = Path(job_dir).resolve()
    out = job_dir / SLURM_DIR
    lines = ["#!/bin/bash", f"# Written by leanagent for {job_dir}; resubmit by hand with: sbatch {out / SCRIPT}"]
    lines += [f"#SBATCH {option}" for option in sbatch_options(cfg, slurm, job_dir, job_name(label))]
    program = " ".join(shlex.quote(a) for a in (*entry, *program_args))
    devices = slurm.gpus_per_node or cfg.trainer.devices
    lines += [
        "set -u",
        *slurm.setup,
        f"cd {shlex.quote(str(workdir or Path.cwd()))}",
        f"export {STOP_FILE_ENV}={shlex.quote(str(out / STOP_FILE))}",
        # Time limit or preemption ahead (--signal=B:USR2@lead): the ranks checkpoint and stop at their next step.
        f'trap \'echo "slurm: job $SLURM_JOB_ID has {slurm.signal_lead_s} s left: asking the ranks to '
        f'checkpoint and stop"; touch "${STOP_FILE_ENV}"\' USR2',
        # The run_dir must be writable where the ranks run, not only where the flow runs.
        f'srun --ntasks-per-node=1 bash -c {shlex.quote(f"touch {out}/.writable-$(hostname)-$SLURM_NODEID")} '
        f'|| {{ echo "error: {job_dir} is not writable from the compute nodes ($SLURM_JOB_NODELIST); put run_dir '
        f'on a filesystem they share"; exit 2; }}',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "addr=$(scontrol show node \"$head\" | grep -oP 'NodeAddr=\\K\\S+')",
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        f"srun --kill-on-bad-exit=1 {shlex.quote(python)} -m leanagent.launch.torchrun "
        f"--nnodes=\"$SLURM_NNODES\" --nproc-per-node={devices} --rdzv-backend=c10d "
        f"--rdzv-endpoint=\"$addr:$port\" --rdzv-id=\"$SLURM_JOB_ID\" "
        f"--log-dir={shlex.quote(str(job_dir / 'logs'))}/slurm-\"$SLURM_JOB_ID\"-\"${{SLURM_RESTART_COUNT:-0}}\" "
        f"--tee=3 "
        f"{program} &",
        "child=$!",
        # `wait` returns early when the USR2 trap runs: wait again until srun itself has ended.
        'while true; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done',
        f'echo "{{\\"job_id\\": $SLURM_JOB_ID, \\"exit_code\\": $rc}}" '
        f'> {shlex.quote(str(out))}/exit-"$SLURM_JOB_ID".json',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"
