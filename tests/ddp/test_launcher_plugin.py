"""Adding a launcher is one file: a launcher from a package of its own, found through the `leanagent.launchers`
entry point group, runs a real job (torchrun, 2 gloo ranks) with no other module touched.

The package is written into a temporary folder with its distribution metadata, as `pip install` would leave
it, and put on the commands' PYTHONPATH: the registry finds it by its entry point, validates its own config
section (an unknown key named with the nearest), runs `leanagent evaluate` through its launcher, and asks it
for `leanagent status`. Without it on the path the same config is refused, naming the launchers there are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

pytestmark = pytest.mark.ddp

PLUGIN_SOURCE = '''
"""torchrun on this machine, under another name, with a section of its own (`here: {tag: ...}`)."""
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from leanagent.launch.base import JobStatus, LauncherPlugin
from leanagent.launch.local import LocalLauncher


class HereConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = "untagged"


class HereLauncher(LocalLauncher):
    def __init__(self, trainer, tag):
        super().__init__(trainer)
        self.tag = tag

    def start(self, program_args, job_dir, log_dir, label):
        (Path(job_dir) / "here.json").write_text(json.dumps({"tag": self.tag, "label": label}))
        return super().start(program_args, job_dir, log_dir, label)


class HerePlugin(LauncherPlugin):
    name = "here"
    section = HereConfig

    def launcher(self, cfg):
        return HereLauncher(cfg.trainer, self.settings(cfg).tag)

    def check_config(self, cfg):
        return [] if cfg.trainer.num_nodes == 1 else ["launcher: here runs one node"]

    def status(self, run_dir):
        return [JobStatus(p.parent, p.parent.name, "RAN " + json.loads(p.read_text())["tag"], False)
                for p in sorted(Path(run_dir).glob("jobs/**/here.json"))]


PLUGIN = HerePlugin()
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the package `here_launcher` and its metadata, as an installed distribution."""
    root = tmp_path_factory.mktemp("site")
    (root / "here_launcher.py").write_text(PLUGIN_SOURCE)
    info = root / "here_launcher-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: here-launcher\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[leanagent.launchers]\nhere = here_launcher:PLUGIN\n")
    return root


def leanagent(*args: str, site: Path | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=REPO_ROOT)


def test_a_launcher_from_its_own_package_runs_a_real_job_and_answers_status(site, ddp_assets, tmp_path,
                                                                           write_cpu_config):
    cfg = write_cpu_config(tmp_path / "cfg.yaml", encoder=ddp_assets["model"], launcher="here",
                           here={"tag": "from-a-plugin"})
    run_dir = tmp_path / "run"
    out = run_dir / "jobs" / "00-repo_a" / "eval"
    done = leanagent("evaluate", "--config", str(cfg), "--dataset", str(ddp_assets["repo_a"]), "--out", str(out),
                     site=site)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["world_size"] == 2 and result["metrics"]["num_contexts"] > 0  # torchrun's 2 ranks ran it
    # Its launcher started the job, with its own section's value and the job's label.
    label = f"evaluate {ddp_assets['repo_a'].name}"
    assert json.loads((out / "here.json").read_text()) == {"tag": "from-a-plugin", "label": label}
    status = leanagent("status", str(run_dir), site=site)
    assert status.returncode == 0, status.stderr
    assert status.stdout.split() == ["eval", "RAN", "from-a-plugin", "00-repo_a/eval", "(here)"], status.stdout


def test_its_section_and_its_name_are_checked_like_the_built_in_ones(site, ddp_assets, tmp_path, write_cpu_config):
    typo = write_cpu_config(tmp_path / "typo.yaml", encoder=ddp_assets["model"], launcher="here", here={"tga": "x"})
    out = tmp_path / "job"
    refused = leanagent("evaluate", "--config", str(typo), "--dataset", str(ddp_assets["repo_a"]), "--out", str(out),
                        site=site)
    assert refused.returncode == 1 and not out.exists()
    assert refused.stderr == f"error: {typo}: here.tga: unknown key (did you mean 'tag'?)\n", refused.stderr
    near = write_cpu_config(tmp_path / "near.yaml", encoder=ddp_assets["model"], launcher="hre")
    refused = leanagent("evaluate", "--config", str(near), "--dataset", str(ddp_assets["repo_a"]), "--out", str(out),
                        site=site)
    assert refused.stderr == (f"error: {near}: launcher: 'hre' is not a known launcher (did you mean 'here'?); "
                              f"known: here, local, slurm, warm\n"), refused.stderr
    # Not installed: the same config names the launchers there are.
    good = write_cpu_config(tmp_path / "good.yaml", encoder=ddp_assets["model"], launcher="here")
    refused = leanagent("evaluate", "--config", str(good), "--dataset", str(ddp_assets["repo_a"]), "--out", str(out),
                        site=None)
    assert refused.returncode == 1 and not out.exists()
    assert refused.stderr == f"error: {good}: launcher: 'here' is not a known launcher; known: local, slurm, warm\n"
