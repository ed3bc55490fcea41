"""SLURM's batch script rendered without a cluster, as submitit tests its own: a fixed config, the exact file.

The golden file, tests/fixtures/slurm/job.sbatch, is what a user reads and resubmits by hand: a change to it is
a change of what every SLURM job runs, so it is reviewed as such (regenerate it only on purpose).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import JobRequest
from leanagent.launch.slurm.queue import JobState
from leanagent.launch.slurm.script import job_name, render_script
from leanagent.launch.slurm.settings import slurm_settings

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "job.sbatch"
RUN = Path("/shared/runs/leanagent")

CONFIG = {
    "launcher": "slurm",
    "trainer": {"devices": 4, "num_nodes": 2},  # the seed's GPUs per node, on two nodes
    "slurm": {"partition": "gpu", "account": "lean-proj", "time": "2-00:00:00", "cpus_per_task": 32, "mem": "256G",
              "extra_args": ["--exclusive"], "signal_lead_s": 300,
              "setup": ["module load cuda/12.4", 'source "$HOME/leanagent/.venv/bin/activate"']},
}


def render(config: dict) -> str:
    cfg = PipelineConfig.model_validate(config)
    job = RUN / "jobs" / "01-PFR" / "train"
    argv = JobRequest(program="train", config=cfg, datasets=(Path("/shared/data/pfr"),), out=job,
                      checkpoint=RUN / "jobs" / "00-mathlib4" / "train" / "last.ckpt").to_argv(RUN / "config.yaml")
    return render_script(cfg, slurm_settings(cfg), argv, job, "train PFR", python="/shared/leanagent/.venv/bin/python",
                         workdir=Path("/shared/leanagent"))


def test_the_job_script_of_a_fixed_config_is_the_golden_file():
    script = render(CONFIG)
    assert script == GOLDEN.read_text()
    # It is a script bash can read, and it names the job after the repository's configured name.
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "#SBATCH --job-name=leanagent-train-PFR\n" in script


def test_a_cpu_job_asks_for_no_gpus_and_leaves_out_what_is_not_set():
    script = render({"launcher": "slurm", "trainer": {"accelerator": "cpu", "devices": 1, "num_nodes": 2}})
    options = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert options == ["#SBATCH --job-name=leanagent-train-PFR", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                       f"#SBATCH --output={RUN}/jobs/01-PFR/train/slurm/slurm-%j.out", "#SBATCH --open-mode=append",
                       "#SBATCH --requeue", "#SBATCH --signal=B:USR2@120"]


def test_job_names_keep_to_characters_any_shell_takes():
    assert job_name("train PFR") == "leanagent-train-PFR"
    assert job_name("evaluate repo_0,repo_1") == "leanagent-evaluate-repo_0,repo_1"
    assert job_name("train Mathlib (4)") == "leanagent-train-Mathlib-4"
    assert job_name("") == "leanagent-job"


def test_a_pending_reason_is_shown_as_slurm_gives_it_or_left_out():
    assert JobState("PENDING", "Resources").describe() == "PENDING (Resources)"
    assert JobState("PENDING", "BeginTime").describe() == "PENDING (BeginTime)"
    for none in ("None", "", "(null)"):  # what squeue and scontrol print for a job with no reason
        state = JobState("PENDING", none)
        assert state.reason == "" and state.describe() == "PENDING"
