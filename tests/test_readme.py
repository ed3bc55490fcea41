"""README's commands run as written, after its main job, in a fresh copy of the repository.

The copy holds the repository's files (what a clone has) and this test's own virtual environment under
`.venv`, so README's `.venv/bin/...` commands and `bash scripts/demo.sh` run exactly as a user types them.
Every bash block that README marks with `<!-- readme-test -->` is then run in order, after the demo.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ddp, pytest.mark.prefect]

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKED_BLOCK = re.compile(r"<!-- readme-test -->\n```bash\n(.*?)\n```", re.S)
DEMO_LINES = 62  # "at most about 60 lines": what the main job prints, all of it (61 on its first run)


def _readme_blocks() -> list[str]:
    return MARKED_BLOCK.findall((REPO_ROOT / "README.md").read_text())


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("clone") / "leanagent"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    (copy / ".venv").symlink_to(Path(sys.prefix))
    return copy


def _bash(clone: Path, script: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                           "PREFECT_API_URL", "LEANAGENT_VERBOSE")}
    # The copy's code, not the editable install's; a Prefect home of its own for the temporary server.
    env.update(PYTHONPATH=str(clone), PREFECT_HOME=str(clone / ".prefect"), DO_NOT_TRACK="1")
    (clone / ".prefect").mkdir(exist_ok=True)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=clone, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_readme_has_its_two_setup_commands_and_marked_blocks():
    readme = (REPO_ROOT / "README.md").read_text()
    setup = re.search(r"## Set up on a fresh machine\n\n```bash\n(.*?)\n```", readme, re.S)
    assert setup is not None
    assert [line.split("#")[0].strip() for line in setup.group(1).splitlines()] == ["bash scripts/demo.sh",
                                                                                     "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (REPO_ROOT / ".ci" / "run").read_text()
    assert len(_readme_blocks()) >= 2


def test_the_demo_then_every_marked_readme_block_runs_as_written(clone):
    demo = _bash(clone, "bash scripts/demo.sh", timeout=1800)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    printed = (demo.stdout + demo.stderr).splitlines()
    assert len(printed) <= DEMO_LINES, "\n".join(printed)
    assert "Recall@10 (row: trained through; column: evaluated on)" in demo.stdout
    for block in _readme_blocks():
        ran = _bash(clone, block, timeout=900)
        assert ran.returncode == 0, f"{block}\n--- stdout:\n{ran.stdout[-3000:]}\n--- stderr:\n{ran.stderr[-3000:]}"
        assert "Traceback" not in ran.stderr, ran.stderr
