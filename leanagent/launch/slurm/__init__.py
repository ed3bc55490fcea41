"""The SLURM launcher (`launcher: slurm`): each job is one SLURM job, submitted and watched with SLURM's own tools.

One launcher, in a package because it is big: its settings (`settings.py`, the config's `slurm:` section),
SLURM's queue (`queue.py`: states, the run's job records), the batch script (`script.py`), one job submitted and
watched (`job.py`), and here the plugin that ties them to the registry: the checks before anything is submitted,
and what `leanagent status` and `leanagent cancel` say of a run_dir.

Before anything is submitted: the cross-check with the trainer (`slurm.nodes` and `slurm.gpus_per_node` equal
`trainer.num_nodes` and `trainer.devices`, when given), then SLURM's commands on PATH and the partition, which
must exist and offer the nodes (and GPUs per node, from its Gres) a job asks for (`sinfo`). This machine's own
GPUs are not looked at: the flow runs on a login node or a Prefect worker, which has none.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from leanagent.ground.config import PipelineConfig
from leanagent.launch.base import JobStatus, LauncherPlugin
from leanagent.launch.slurm.job import SlurmLauncher
from leanagent.launch.slurm.queue import run_jobs, slurm_command
from leanagent.launch.slurm.settings import NAME, SlurmConfig, shape_problems, slurm_settings

TOOLS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


class SlurmPlugin(LauncherPlugin):
    """`launcher: slurm`, with its `slurm:` section."""

    name = NAME
    section = SlurmConfig

    def launcher(self, cfg: PipelineConfig) -> SlurmLauncher:
        return SlurmLauncher(cfg, slurm_settings(cfg))

    def check_config(self, cfg: PipelineConfig) -> list[str]:
        return shape_problems(cfg, slurm_settings(cfg))

    def preflight(self, cfg: PipelineConfig, visible_gpus: Callable[[], int]) -> list[str]:
        return check_cluster(cfg, slurm_settings(cfg))

    def status(self, run_dir: Path) -> list[JobStatus]:
        return [JobStatus(job_dir, str(job_id), "forgotten by SLURM" if state is None else state.describe(),
                          state is not None and not state.final)
                for job_dir, job_id, state in run_jobs(run_dir)]

    def cancel(self, run_dir: Path) -> list[JobStatus]:
        """scancel every job of the run still in the queue (a SIGKILLed flow could not)."""
        queued = [job for job in self.status(run_dir) if job.queued]
        if queued:
            slurm_command("scancel", "--full", *(job.job_id for job in queued))
        return queued


PLUGIN = SlurmPlugin()


def check_cluster(cfg: PipelineConfig, slurm: SlurmConfig) -> list[str]:
    """sbatch is there, the partition exists and offers the nodes (and GPUs per node) a job asks for."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return [f"launcher: slurm needs SLURM's commands, but {', '.join(missing)} is not on PATH; run the flow on "
                f"a login node of the cluster, or set launcher: local"]
    trainer = cfg.trainer
    args = ["sinfo", "-h", "-o", "%P|%D|%G|%a"]
    if slurm.partition:
        args[1:1] = ["-p", slurm.partition]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return ["launcher: slurm: sinfo did not answer within 60 s; is the controller up?"]
    if done.returncode != 0:
        reason = (done.stderr.strip() or f"exit {done.returncode}").splitlines()[-1]
        return [f"launcher: slurm: sinfo failed ({reason}); is SLURM_CONF right and the controller up?"]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.count("|") == 3]
    if slurm.partition and not rows:
        known = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60).stdout.split()
        return [f"slurm.partition: {slurm.partition!r} is not a partition of this cluster (it has "
                f"{', '.join(sorted({p.rstrip('*') for p in known})) or 'none'})"]
    nodes = slurm.nodes or trainer.num_nodes
    offered = sum(int(count) for _, count, _, _ in rows if count.isdigit())
    where = f"partition {slurm.partition}" if slurm.partition else "the cluster's partitions"
    problems = []
    if offered and nodes > offered:
        problems.append(f"slurm.nodes / trainer.num_nodes: {nodes} node(s) per job, but {where} has {offered}")
    if trainer.accelerator in ("gpu", "cuda"):
        gpus = max((gres_gpus(gres) for _, _, gres, _ in rows), default=0)
        per_node = slurm.gpus_per_node or trainer.devices
        if gpus < per_node:
            problems.append(f"slurm.gpus_per_node / trainer.devices: {per_node} GPU(s) per node, but the nodes of "
                            f"{where} offer {gpus} (Gres {sorted({r[2] for r in rows})}); set trainer.accelerator: cpu "
                            f"for a CPU partition")
    return problems


def gres_gpus(gres: str) -> int:
    """GPUs per node from sinfo's Gres column (`gpu:4`, `gpu:a100:4(S:0-1)`, `(null)`)."""
    total = 0
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total
