"""Each mistake a new user makes gets one clear message from `leanagent run`, the one `leanagent train` prints.

Real commands in subprocesses: `leanagent run` (pointed at the session's Prefect server, PREFECT_API_URL, which
it must not even call: the checks come before Prefect), `leanagent train` for the same mistake. Each case checks
the exit code, that the message is printed once and no traceback at all, that nothing was written and no flow
run was created, and that the flow itself (a deployment's or the UI's run) ends Failed with the same message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from leanagent.flows.lifelong import REFUSED, lifelong_retrieval
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL

from leanagent.run.state import RunLock

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_harness")]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _command(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return subprocess.run([sys.executable, "-m", "leanagent.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO_ROOT)


def _flow_runs() -> int:
    with get_client(sync_client=True) as client:
        return len(client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC))


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
    # Lightning's own refusal came from rank 0 after the jobs had launched: 505 lines and 11 tracebacks.
    "a precision Lightning does not know": ("{good}", {"trainer": {"precision": "bf16-mix"}},
                                            "trainer.precision: 'bf16-mix' is not a valid value (did you mean "
                                            "'bf16-mixed'?); one of: auto, bf16-mixed, 32-true"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_one_clear_message_per_mistake(mistake, demo_assets, write_cpu_config, truncated_repo, tmp_path):
    dataset, overrides, expected = MISTAKES[mistake]
    paths = {"missing": tmp_path / "nope", "truncated": truncated_repo, "good": demo_assets.repos[1]}
    dataset = Path(dataset.format(**paths))
    expected = expected.format(**paths)
    run_dir = tmp_path / "run"
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, [demo_assets.repos[0], dataset], **overrides)

    runs = _flow_runs()
    run = _command("run", "--config", str(config))
    assert run.returncode == 1, run.stderr
    assert run.stderr.count(expected) == 1, run.stderr
    assert "Traceback" not in run.stderr + run.stdout and "Error logging to API" not in run.stderr, run.stderr
    assert run.stderr.startswith("error: ") and run.stdout == "", run.stderr
    assert not run_dir.exists()  # a refused run leaves the run_dir as it found it: no lock, no config
    assert _flow_runs() == runs  # answered before Prefect
    state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_failed() and state.name == REFUSED and expected in state.message  # what the Prefect UI shows
    assert not run_dir.exists()

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
    runs = _flow_runs()
    with RunLock(run_dir):
        before = sorted(p.name for p in run_dir.iterdir())
        run = _command("run", "--config", str(config))
        assert sorted(p.name for p in run_dir.iterdir()) == before
    assert run.returncode == 1
    expected = f"is in use by another run (pid {os.getpid()})"
    assert run.stderr.count(expected) == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and _flow_runs() == runs


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_run_dir_that_is_no_folder_is_refused_in_one_line_before_prefect(where, demo_assets, write_cpu_config,
                                                                           tmp_path):
    """README promises one line for a bad run_dir; it was a `NotADirectoryError` traceback from the run's lock."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file")
    run_dir = notes if where == "a file" else notes / "run"
    config = write_cpu_config(tmp_path / "config.yaml", run_dir, demo_assets.repos[:1])
    runs = _flow_runs()
    run = _command("run", "--config", str(config))
    expected = (f"error: run_dir {notes} exists and is not a folder; nothing was overwritten" if where == "a file"
                else f"error: run_dir {run_dir}: its parent {notes} is not a folder")
    assert run.returncode == 1 and run.stderr == expected + "\n" and run.stdout == "", run.stderr
    assert _flow_runs() == runs and notes.read_text() == "a user's file"
    state = lifelong_retrieval(config_path=str(config), return_state=True)  # a deployment's run: the same line
    assert state.is_failed() and state.name == REFUSED and state.message == expected.removeprefix("error: ")
    assert notes.read_text() == "a user's file"


def test_bad_input_answers_before_prefect_starts(demo_assets, write_cpu_config, tmp_path):
    """No server configured: the temporary server would be the slow part, and a bad input must not start it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    config = write_cpu_config(tmp_path / "config.yaml", tmp_path / "run", [demo_assets.repos[0], tmp_path / "nope"])
    typo = tmp_path / "typo.yaml"
    typo.write_text(config.read_text().replace("epochs_per_repo", "epochs_per_rep"))
    precision = write_cpu_config(tmp_path / "precision.yaml", tmp_path / "run", demo_assets.repos[:1],
                                 trainer={"precision": "bf16-mix"})
    for path, expected in ((config, f"dataset folder {tmp_path / 'nope'} does not exist"),
                           (typo, "lifelong.epochs_per_rep: unknown key (did you mean 'epochs_per_repo'?)"),
                           (precision, "trainer.precision: 'bf16-mix' is not a valid value (did you mean "
                                       "'bf16-mixed'?)")):
        run = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(path)],
                             capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
        assert run.returncode == 1 and expected in run.stderr, run.stderr
        # One message, nothing around it: no Prefect banner, no EventsWorker warning.
        assert run.stderr.startswith("error: ") and run.stderr.count("error: ") == 1 and run.stdout == "", run.stderr
        assert "prefect" not in run.stderr.lower() and "Worker" not in run.stderr, run.stderr
    assert not (tmp_path / "prefect").exists()  # no temporary server was started, no database written
