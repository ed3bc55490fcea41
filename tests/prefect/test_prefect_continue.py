"""Repositories that arrive later: a run of two repositories, continued with a third, ends as a fresh run of three.

One run, shared by the module: `repos` lists repo_0 and repo_1 (renamed `second`), and `repos_dir` holds a
half-copied upload, which is skipped by name. Then repo_2 is copied into `repos_dir` as the readiness rule says
(under a dot-name, then renamed) and the same config runs again: only repo_2's jobs launch, and the recall
matrix, the untrained row and the lifelong metrics equal those of the session's fresh three-repository run
(`lifelong_run3`, same order, same settings), number for number. The refusals then run against the continued
run_dir, which each leaves as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from leanagent.flows.artifacts import SUMMARY_KEY, TABLE_KEY
from leanagent.flows.lifelong import lifelong_retrieval
from leanagent.run.manifest import ManifestMismatchError
from tests.conftest import FinishedRun, file_times, read_json
from tests.prefect.prefect_api import flow_run_artifacts, wait_for_logs

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(config: Path) -> tuple[dict, object]:
    state = lifelong_retrieval(config_path=str(config), return_state=True)
    assert state.is_completed(), state.message
    return state.result(), state.state_details.flow_run_id


@pytest.fixture(scope="module")
def continued(lifelong_run3: FinishedRun, demo_assets, write_cpu_config, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("continued")
    incoming = root / "incoming"
    half = shutil.copytree(demo_assets.repos[2], incoming / "half_copied")
    (half / "random" / "test.json").unlink()  # an upload still being copied, against the rule
    first, second = demo_assets.repos[:2]
    config = write_cpu_config(root / "config.yaml", root / "run", [first, second], repos_dir=str(incoming))
    raw = yaml.safe_load(config.read_text())
    raw["repos"][1]["name"] = "second"  # its folder is repo_1: progress lines and results must say "second"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as the reference run had it
        two, two_id = _run(config)
        jobs_after_two = file_times(root / "run" / "jobs")
        # `leanagent serve RUN_DIR` beside the run, asked all along by a client while the run learns repo_2.
        with ServedRun(root / "run") as served:
            shutil.copytree(demo_assets.repos[2], incoming / ".repo_2")  # copy under a dot-name, then rename
            (incoming / ".repo_2").rename(incoming / "repo_2")
            three, three_id = _run(config)
            served.wait_for_stage("repo_2")
    return {"root": root, "config": config, "incoming": incoming, "two": two, "two_id": two_id, "three": three,
            "three_id": three_id, "jobs_after_two": jobs_after_two, "served": served}


class ServedRun:
    """`leanagent serve RUN_DIR --follow-s 1` in its own process, and a client thread asking it all along."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.answers: list[tuple[int, str | None]] = []  # (status, the stage /health named just before)
        self.stages: list[str] = []
        self._stop = threading.Event()

    def __enter__(self) -> ServedRun:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        self.proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(self.run_dir), "--port",
                                      "0", "--follow-s", "1"], stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                     env=env)
        self.banner = self.proc.stderr.readline()
        assert self.banner.startswith("serving "), self.banner
        self.url = self.banner.split(" at ", 1)[1].split(";", 1)[0]
        self.first_health = httpx.get(f"{self.url}/health", timeout=60).json()
        self.first_modules = httpx.get(f"{self.url}/indexed-modules", timeout=60).json()
        self.thread = threading.Thread(target=self._ask, daemon=True)
        self.thread.start()
        return self

    def _ask(self) -> None:
        body = {"state": "x y n m : Nat\n⊢ frob 0 = 0", "k": 5, "imported_modules": [0, 1]}
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                stage = http.get(f"{self.url}/health").json()["stage"]
                self.stages.append(stage)
                self.answers.append((http.post(f"{self.url}/retrieve", json=body).status_code, stage))
                self._stop.wait(0.2)

    def wait_for_stage(self, name: str, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while httpx.get(f"{self.url}/health", timeout=60).json()["stage"] != name:
            assert time.monotonic() < deadline, f"the server did not take stage {name}"
            time.sleep(0.2)
        self.modules = httpx.get(f"{self.url}/indexed-modules", timeout=60).json()
        time.sleep(1.0)  # a few more requests on the new stage (not a deadline: the client asks every 0.2 s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(timeout=120)
        self.proc.send_signal(signal.SIGINT)
        self.rc = self.proc.wait(timeout=60)
        self.log = self.proc.stderr.read()


def test_the_third_repository_continues_the_run_and_ends_as_a_fresh_run_of_three(continued, lifelong_run3) -> None:
    fresh, three = lifelong_run3.summary, continued["three"]
    assert continued["two"]["order"] == ["repo_0", "second"] and three["order"] == ["repo_0", "second", "repo_2"]
    assert fresh["order"] == ["repo_0", "repo_1", "repo_2"]  # the same curriculum order, one name changed
    assert three["matrix"] == fresh["matrix"]
    assert three["baseline"] == fresh["baseline"]
    assert three["lifelong"] == fresh["lifelong"]
    assert [r["epochs"] for r in three["rows"]] == [r["epochs"] for r in fresh["rows"]]  # max_epochs advanced
    # Only the new repository's jobs ran; nothing of the first run's was touched.
    jobs = continued["root"] / "run" / "jobs"
    now = file_times(jobs)
    before = continued["jobs_after_two"]
    assert {k: v for k, v in now.items() if k in before} == before
    new_jobs = {str(p.parent.relative_to(jobs)) for p in jobs.rglob("result.json")} - {
        str(Path(k).parent) for k in before if k.endswith("result.json")}
    assert new_jobs == {"untrained/evaluate-02", "02-repo_2/train", "02-repo_2/fisher", "02-repo_2/evaluate-00-01-02"}
    train = read_json(jobs / "02-repo_2" / "train" / "result.json")
    assert train["resumed_from"] == read_json(jobs / "01-second" / "train" / "result.json")["checkpoint"]
    assert train["ewc"] is True  # anchored by second's Fisher
    messages = wait_for_logs(continued["three_id"], lambda m: sum("skipped" in x for x in m) >= 9)
    assert sum("finished in an earlier run; skipped" in m for m in messages) == 9  # 2 x (untrained, train, fisher) + 3
    # The report grows by a row and a column.
    report = subprocess.run([sys.executable, "-m", "leanagent.cli", "report", str(continued["root"] / "run")],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    rows = [line.split()[0] for line in report.stdout.splitlines()[1:4]]
    assert rows == ["repo_0", "second", "repo_2"]


def test_progress_lines_and_stages_use_the_configured_name(continued) -> None:
    messages = wait_for_logs(continued["two_id"], lambda m: any(x.startswith("[progress] train second") for x in m))
    assert any(m.startswith("[progress] train second") for m in messages)
    assert not any(m.startswith("[progress]") and "repo_1" in m for m in messages)
    assert (continued["root"] / "run" / "jobs" / "01-second" / "train" / "result.json").is_file()


def test_a_folder_that_does_not_validate_is_skipped_by_name(continued) -> None:
    for summary in (continued["two"], continued["three"]):
        [line] = summary["not_ready"]
        assert line.startswith("half_copied: not ready, skipped this run (") and "test.json" in line, line
    artifacts = sorted(flow_run_artifacts(continued["three_id"]), key=lambda a: a.created)
    summary = [a for a in artifacts if a.key == SUMMARY_KEY][-1]
    assert "Not ready" in str(summary.data) and "half_copied" in str(summary.data)
    # The continued run's table covers the whole sequence, the first run's repositories included.
    table = [a for a in artifacts if a.key == TABLE_KEY][-1].data
    rows = json.loads(table) if isinstance(table, str) else table
    assert [r["repository"] for r in rows] == ["repo_0", "second", "repo_2"]


def test_a_rerun_with_nothing_new_launches_nothing(continued) -> None:
    run_dir = continued["root"] / "run"
    before = file_times(run_dir)
    summary, flow_run_id = _run(continued["config"])
    assert summary["nothing_new"] and summary["matrix"] == continued["three"]["matrix"]
    after = file_times(run_dir)
    assert after.pop(".lock") and before.pop(".lock")  # taken and let go: the run's only write
    assert after == before
    line = "nothing new: 3 repositories trained, 0 waiting, 1 not ready in repos_dir"
    messages = wait_for_logs(flow_run_id, lambda m: line in m)
    assert line in messages and not any(m.startswith("[rank ") for m in messages)


def test_leanagent_run_with_nothing_new_answers_without_prefect(continued, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    run = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(continued["config"])],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("nothing new: 3 repositories trained, 0 waiting"), run.stdout
    assert "repo_2" in run.stdout and "WF5" in run.stdout  # the run's report
    assert run.stderr.splitlines() == [f"warning: {continued['three']['not_ready'][0]}"]
    assert not (tmp_path / "prefect").exists()  # no temporary server, no database: Prefect was not started


def _deployment_run(parameters: dict, name: str) -> subprocess.CompletedProcess:
    """A run of a deployment of the flow, as a worker (or `leanagent.deployments.serve`) runs it: `python -m
    prefect.engine` in its own process, on the session's Prefect server. What it prints is what the worker's console
    shows."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    with pytest.MonkeyPatch.context() as env:
        env.chdir(REPO_ROOT)  # the deployment's entrypoint is recorded relative to the working directory
        deployment = lifelong_retrieval.to_deployment(name=name).apply()
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    environment["PREFECT_API_URL"] = PREFECT_API_URL.value()
    return subprocess.run([sys.executable, "-m", "prefect.engine", str(flow_run.id)], capture_output=True, text=True,
                          timeout=600, env=environment, cwd=REPO_ROOT)


def test_a_config_the_run_is_ahead_of_has_nothing_new_in_the_cli_the_flow_and_a_deployment(continued,
                                                                                            tmp_path: Path) -> None:
    """The run's first two repositories without its repos_dir: what docs/continuing.md leaves when the demo's own
    config runs again. Nothing new, naming what the run has beyond it and the config that gave it; exit 0."""
    run_dir = continued["root"] / "run"
    behind = _edited(continued, tmp_path, lambda raw: raw.pop("repos_dir"))
    line = f"nothing new: the run is ahead of this config (repo_2, from {continued['config']})"
    before = file_times(run_dir)
    before.pop(".lock", None)
    cli = subprocess.run([sys.executable, "-m", "leanagent.cli", "run", "--config", str(behind)], capture_output=True,
                         text=True, timeout=120, cwd=REPO_ROOT)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(line + "\n") and "repo_2" in cli.stdout.split("\n", 1)[1], cli.stdout
    summary, flow_run_id = _run(behind)
    assert summary["nothing_new"] and summary["matrix"] == continued["three"]["matrix"]
    assert line in wait_for_logs(flow_run_id, lambda m: line in m)
    served = _deployment_run({"config_path": str(behind)}, f"behind-{os.getpid()}")
    assert served.returncode == 0, served.stderr[-3000:]
    assert line in served.stderr and "Traceback" not in served.stderr, served.stderr[-3000:]
    after = file_times(run_dir)
    after.pop(".lock", None)
    assert after == before  # the run keeps its sequence, its manifest and every file


def test_a_deployment_run_that_contradicts_the_run_is_refused_in_one_line(continued, tmp_path: Path) -> None:
    dropped = _edited(continued, tmp_path, lambda raw: raw["repos"].pop(0))
    served = _deployment_run({"config_path": str(dropped)}, f"dropped-{os.getpid()}")
    refusals = [m for m in served.stderr.splitlines() if "Finished in state Refused(" in m]
    assert len(refusals) == 1 and "repository 'repo_0'" in refusals[0], served.stderr[-3000:]
    assert "Traceback" not in served.stderr and "unexpected exception" not in served.stderr, served.stderr[-3000:]


def _edited(continued, tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(continued["config"].read_text())
    edit(raw)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("change", ["dropped", "reordered", "renamed", "changed dataset"])
def test_a_run_that_does_not_extend_the_sequence_is_refused_by_name(continued, change: str, tmp_path: Path) -> None:
    run_dir, incoming = continued["root"] / "run", continued["incoming"]
    config = continued["config"]
    test_json = incoming / "repo_2" / "random" / "test.json"
    original = test_json.read_bytes()
    if change == "dropped":
        config, expected = _edited(continued, tmp_path, lambda raw: raw["repos"].pop(0)), \
            r"repository 'repo_0' \(#1 of this run's sequence, .*\) is not in the config any more"
    elif change == "reordered":
        config, expected = _edited(continued, tmp_path, lambda raw: raw["repos"].reverse()), \
            r"the config lists repository 'second' before 'repo_0', but this run was given 'repo_0' first"
    elif change == "renamed":
        (incoming / "repo_2").rename(incoming / "repo_two")
        expected = r"repository 'repo_2' \(#3 .*\) is now named 'repo_two'"
    else:
        test_json.write_bytes(original[:-2] + b" ]")
        expected = r"the dataset of repository 'repo_2' \(#3 .*\) changed since the run recorded it \(.*test.json: "
    before = file_times(run_dir)
    before.pop(".lock", None)
    try:
        with pytest.raises(ManifestMismatchError, match=expected) as info:
            lifelong_retrieval(config_path=str(config))
        assert "\n" not in str(info.value)  # one line
    finally:
        if (incoming / "repo_two").exists():
            (incoming / "repo_two").rename(incoming / "repo_2")
        test_json.write_bytes(original)
    after = file_times(run_dir)
    after.pop(".lock", None)
    assert after == before


def test_the_server_follows_the_run_to_its_new_stage_without_a_restart(continued) -> None:
    served = continued["served"]
    assert served.first_health["stage"] == "second" and served.first_health["stage_number"] == 2
    assert "stage second (#2) of" in served.banner
    # Every request answered, on the old stage and then on the new, by the one process.
    statuses = [status for status, _ in served.answers]
    assert statuses and set(statuses) == {200}, served.answers
    assert served.stages[0] == "second" and served.stages[-1] == "repo_2"
    assert "now serving stage repo_2 (#3)" in served.log and served.log.count("now serving") == 1
    assert served.rc == 128 + signal.SIGINT
    # The new repository's modules are listed, after those the clients cached at the earlier stage.
    assert served.modules[: len(served.first_modules)] == served.first_modules
    assert any(m.startswith("RepoC.") for m in served.modules[len(served.first_modules):])
    assert not any(m.startswith("RepoC.") for m in served.first_modules)
