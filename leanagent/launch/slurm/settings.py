"""The `slurm:` section of a config: how each job is submitted under `launcher: slurm`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from leanagent.ground.config import PipelineConfig
from leanagent.launch.base import section_settings

NAME = "slurm"  # `launcher: slurm`, and the key of this section


class SlurmConfig(BaseModel):
    """How each job is submitted under `launcher: slurm`: one SLURM job per train, Fisher or evaluate job."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    partition: str | None = Field(None, description="sbatch --partition (None: the cluster's default)")
    account: str | None = Field(None, description="sbatch --account")
    qos: str | None = Field(None, description="sbatch --qos")
    time: str | None = Field(None, description="sbatch --time, e.g. 1-00:00:00 (a job at its limit is resumed)")
    nodes: int | None = Field(None, gt=0, description="nodes per job (default trainer.num_nodes, which it must equal)")
    gpus_per_node: int | None = Field(
        None, gt=0, description="ranks (GPUs) per node (default trainer.devices, which it must equal)")
    cpus_per_task: int | None = Field(None, gt=0, description="sbatch --cpus-per-task (one task per node: torchrun)")
    mem: str | None = Field(None, description="sbatch --mem, e.g. 64G")
    constraint: str | None = Field(None, description="sbatch --constraint")
    extra_args: list[str] = Field(default_factory=list, description="more sbatch arguments, e.g. [--exclusive]")
    setup: list[str] = Field(default_factory=list,
                             description="shell lines run in the job before the ranks start (module load ..., "
                                         "source .venv/bin/activate)")
    signal_lead_s: int = Field(120, ge=0, description="seconds before the time limit at which the ranks are asked "
                                                      "to checkpoint and stop (sbatch --signal=B:USR2@...)")
    max_requeues: int = Field(3, ge=0, description="resubmissions of a job that was stopped for its time limit, "
                                                   "preempted or lost a node")
    poll_s: float = Field(5.0, gt=0, description="seconds between looks at the queue")


def slurm_settings(cfg: PipelineConfig) -> SlurmConfig:
    """The config's `slurm:` section, validated (absent: every default)."""
    return section_settings(cfg, NAME, SlurmConfig)


def shape_problems(cfg: PipelineConfig, slurm: SlurmConfig) -> list[str]:
    """`slurm.nodes` and `slurm.gpus_per_node`, when given, agree with the trainer's ranks."""
    trainer = cfg.trainer
    problems = []
    for key, mine, theirs, their_key in (("slurm.nodes", slurm.nodes, trainer.num_nodes, "trainer.num_nodes"),
                                         ("slurm.gpus_per_node", slurm.gpus_per_node, trainer.devices,
                                          "trainer.devices")):
        if mine is not None and mine != theirs:
            problems.append(f"{key} is {mine} but {their_key} is {theirs}: the ranks are trainer.devices x "
                            f"trainer.num_nodes, so set both alike")
    return problems
