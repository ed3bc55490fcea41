"""Each mistake a new user makes gets one clear message from `leanagent run`, the one `leanagent train` prints.

Real commands in subprocesses: `leanagent run` against the session's Prefect server (PREFECT_API_URL, so no
temporary server is started per case), `leanagent train` for the same mistake. Each case checks the exit code,
that the message is printed once and no traceback at all, that nothing was written, and that the flow run in
Prefect ended Failed with the same message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL

from leanagent.run_state import RunLock

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_harness")]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _command(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO_ROOT)


def _latest_flow_run_state():
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        return run.state


@pytest.fixture
def truncated_repo(demo_assets, tmp_path: Path) -> Path:
    """A corpus.jsonl whose 4th line was cut in half, as a copy interrupted mid-file leaves it."""
    repo = shutil.copytree(demo_assets.repos[1], tmp_path / "truncated")
    lines = (repo / "corpus.jsonl").read_text().splitlines(keepends=True)
    lines[3] = lines[3][: len(lines[3]) // 2] + "\n"
    (repo / "corpus.jsonl").write_text("".join(lines))
    return repo


MISTAKES = {
    "missing dataset": ("{missing}", {}, "dataset folder {missing} does not exist"),
    "truncated corpus line": ("{truncated}", {}, "corpus.jsonl:4: not valid JSON"),
    "4 GPUs on a machine without one": ("{good}", {"trainer": {"accelerator": "gpu", "devices": 4}},
                                        "asks for trainer.devices: 4 GPU(s), but torch sees 0"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_one_clear_message_per_mistake(mistake, demo_assets, write_cpu_config, truncated_repo, tmp_path):
    dataset, overrides, expected = MISTAKES[mistake]
    paths = {"missing": tmp_path / "nope", "truncated": truncated_repo, "good": demo_assets.repos[1]}
    dataset = Path(dataset.format(**paths))
    expected = expected.format(**paths)
    run_dir = tmp_path / "run"
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, [demo_assets.repos[0], dataset], **overrides)

    run = _command("run", "--config", str(config))
    assert run.returncode == 1, run.stderr
    assert run.stderr.count(expected) == 1, run.stderr
    assert "Traceback" not in run.stderr + run.stdout and "Error logging to API" not in run.stderr, run.stderr
    error_lines = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, run.stderr
    assert not run_dir.exists()  # a refused run leaves the run_dir as it found it: no lock, no config
    state = _latest_flow_run_state()
    assert state.is_failed() and expected in state.message  # what the Prefect UI shows

    train = _command("train", "--config", str(config), "--dataset", str(dataset), "--out", str(tmp_path / "job"))
    assert train.returncode == 1 and train.stderr.count(expected) == 1, train.stderr
    # The same text as `leanagent run`'s, from its first line on.
    assert train.stderr.strip() == run.stderr[run.stderr.index("error: "):].strip()
    if mistake == "truncated corpus line":
        # The unreadable line is named once; what follows from it (theorems in files it held) is one summary.
        assert run.stderr.count("not in the corpus") == 1, run.stderr


def test_a_run_dir_in_use_is_refused_in_one_line_naming_the_holder(demo_assets, write_cpu_config, tmp_path):
    run_dir = tmp_path / "run"
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, demo_assets.repos[:1])
    with RunLock(run_dir):
        before = sorted(p.name for p in run_dir.iterdir())
        run = _command("run", "--config", str(config))
        assert sorted(p.name for p in run_dir.iterdir()) == before
    assert run.returncode == 1
    expected = f"is in use by another run (pid {os.getpid()})"
    assert run.stderr.count(expected) == 1 and "Traceback" not in run.stderr, run.stderr
    assert _latest_flow_run_state().is_failed()
