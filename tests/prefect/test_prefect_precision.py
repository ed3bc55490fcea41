"""A run continues in the precision it started with, on any machine: a run recorded in bf16-mixed by a leanagent
from before `trainer.precision: auto` existed, continued with a config that now says `auto` on a CPU without bf16
matmuls, goes on in bf16-mixed; it is neither refused nor switched to fp32.

The session's three-repository run (`lifelong_run3`) is copied and its manifest made an old one (its config says
bf16-mixed, its results name no precision); a fourth repository is then added with `auto` under
ONEDNN_MAX_CPU_ISA=AVX2, oneDNN's own variable, which makes this CPU one without bf16 matmuls for the detection
and for the kernels. Only the fourth repository's jobs run (4 jobs); they must all say bf16-mixed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leanagent.flows.lifelong import lifelong_retrieval
from tests.conftest import FinishedRun, read_json

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]


def _as_recorded_before_auto(manifest: Path) -> None:
    data = json.loads(manifest.read_text())
    data["config"]["trainer"]["precision"] = "bf16-mixed"
    for repo in data["repos"].values():
        for stage in repo["stages"].values():
            stage.get("result", {}).pop("precision", None)
    manifest.write_text(json.dumps(data))


def test_a_run_recorded_in_bf16_continues_in_bf16_on_a_cpu_without_it(lifelong_run3: FinishedRun, demo_assets,
                                                                         ddp_assets, write_cpu_config,
                                                                         tmp_path: Path) -> None:
    run_dir = shutil.copytree(lifelong_run3.run_dir, tmp_path / "run")
    _as_recorded_before_auto(run_dir / "manifest.json")
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, [*demo_assets.repos[:3], ddp_assets["repo_a"]])
    raw = yaml.safe_load(config.read_text())
    assert raw["trainer"]["precision"] == "auto"
    raw["repos"][3]["name"] = "fourth"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    before = {p for p in (run_dir / "jobs").rglob("result.json")}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the ranks' CPU has no bf16 matmuls: auto alone would be 32-true
        env.setenv("OMP_NUM_THREADS", "1")
        state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message
    new = {str(p.parent.relative_to(run_dir / "jobs")): read_json(p)
           for p in (run_dir / "jobs").rglob("result.json") if p not in before}
    assert set(new) == {"untrained/evaluate-03", "03-fourth/train", "03-fourth/fisher",
                        "03-fourth/evaluate-00-01-02-03"}
    assert {name: r["precision"] for name, r in new.items()} == dict.fromkeys(new, "bf16-mixed")
    manifest = read_json(run_dir / "manifest.json")
    assert manifest["config"]["trainer"]["precision"] == "bf16-mixed"
    report = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    assert "Setup: single, curriculum, EWC 0.1, precision bf16-mixed" in report.stdout.splitlines(), report.stdout
