"""Adding a rank program is its `ProgramSpec` plus its function: a program registered from outside the package runs
a real job (`run_job`, torchrun, 2 gloo ranks), gets its `leanagent` command with the job flags it takes, and writes
its result.json like the others, read back as its own result model, with no module of the package touched.

Its spec and result model (`count_program`) are added to `PROGRAMS` in this process and, through a `sitecustomize`
on PYTHONPATH, in every process the job starts (torchrun and the ranks), as a line in `leanagent/ground/job.py`
would for all of them; its function (`count_rank`) goes into `leanagent.train.programs.RUNNERS` in the ranks (the
processes torchrun gives a LOCAL_RANK), as a line there would. It counts the training theorems of the dataset, each
rank its share, summed by an all-reduce.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from leanagent.data.theorems import load_split
from leanagent.ground.config import load_config
from leanagent.ground.job import PROGRAMS, JobRequest
from leanagent.ground.names import TRAIN_PART, part_file
from leanagent.preflight.run_job import run_job
from tests.conftest import TORCHRUN

from .conftest import REPO_ROOT

pytestmark = pytest.mark.ddp

PROGRAM = """
from typing import Literal

from leanagent.ground.job import PROGRAMS, ProgramSpec
from leanagent.ground.results import JobResult


class CountResult(JobResult):
    program: Literal["count"]
    training_theorems: int


PROGRAMS["count"] = ProgramSpec("count", "count a repository's training theorems over the ranks", CountResult)
"""

RANK = """
import torch
import torch.distributed as dist

from count_program import CountResult
from leanagent.data.theorems import load_split
from leanagent.ground.names import TRAIN_PART, part_file
from leanagent.train.programs import RUNNERS


def count_job(job, clock):
    theorems = load_split(job.datasets[0] / job.config.data.split / part_file(TRAIN_PART))
    mine = torch.tensor([len(theorems[dist.get_rank()::dist.get_world_size()])])
    dist.all_reduce(mine)
    return CountResult(program="count", training_theorems=int(mine.item()), world_size=dist.get_world_size())


RUNNERS["count"] = count_job
"""

REGISTER = """
import os

import count_program

if "LOCAL_RANK" in os.environ:  # a rank: its function too (torch is imported there anyway)
    import count_rank
"""


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "count_program.py").write_text(PROGRAM)
    (site / "count_rank.py").write_text(RANK)
    (site / "sitecustomize.py").write_text(REGISTER)
    monkeypatch.setitem(PROGRAMS, "count", None)  # undone after the test: the registration below lasts as long
    runpy.run_path(str(site / "count_program.py"))  # registers its spec here, as the sitecustomize does in the job
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return site


def test_a_registered_program_runs_a_real_job_and_has_its_command(registered: Path, ddp_assets, tmp_path: Path,
                                                                  write_cpu_config) -> None:
    config = write_cpu_config(tmp_path / "cfg.yaml", encoder=ddp_assets["model"], launcher=TORCHRUN)
    job = JobRequest(program="count", config=load_config(config), datasets=(ddp_assets["repo_a"],),
                     out=tmp_path / "job")
    result = run_job(job)
    expected = len(load_split(ddp_assets["repo_a"] / "random" / part_file(TRAIN_PART)))
    assert type(result).__name__ == "CountResult"  # read back as its own model
    assert (result.program, result.training_theorems, result.world_size) == ("count", expected, 2)
    assert json.loads((tmp_path / "job" / "result.json").read_text())["training_theorems"] == expected
    assert result.timings and result.peak_rss_mb  # the account every program's result carries
    shown = subprocess.run([sys.executable, "-m", "leanagent.cli", "count", "--help"], capture_output=True, text=True,
                           timeout=120, cwd=REPO_ROOT)
    assert shown.returncode == 0, shown.stderr
    assert "--dataset" in shown.stdout and "--out" in shown.stdout and "--timeout" in shown.stdout
    assert "--fisher" not in shown.stdout and "--index" not in shown.stdout  # what it does not take, it is not offered
