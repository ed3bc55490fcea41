"""A scheduled deployment of one run_dir (`deployments/serve.py --cron`): a second run waits for the first.

Two runs of the session's finished three-repository run (nothing new: no job), through a real served deployment
on the session's Prefect server. The first is held inside its flow deterministically, not by a sleep: its
`config_path` is a named pipe, whose read blocks until the test writes the config into it. While it is held,
the second run, triggered from the `config` form as the UI does, must wait in "AwaitingConcurrencySlot"; it
starts once the first has finished, and says "nothing new" as the first does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from leanagent.ground.config import load_config
from tests.conftest import FinishedRun
from tests.prefect.prefect_api import flow_run_logs, served_deployment, stop_serving, wait_for_logs

pytestmark = [pytest.mark.prefect, pytest.mark.ddp]

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 300  # the served runner's start and each run's start on a busy 2-core machine; never waited in full


def _until(what: str, done, timeout_s: float = STARTUP_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


def test_a_second_run_of_a_scheduled_deployment_waits_for_the_first(lifelong_run3: FinishedRun,
                                                                     tmp_path: Path) -> None:
    name = f"scheduled-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_RUNNER_POLL_FREQUENCY="1")
    held = tmp_path / "config.fifo"
    os.mkfifo(held)
    config_text = lifelong_run3.config_path.read_text()  # absolute paths: the pipe's folder does not matter
    form = load_config(lifelong_run3.config_path).model_dump(mode="json")
    with open(tmp_path / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "deployments/serve.py", "--name", name, "--config-path",
                                  str(lifelong_run3.config_path), "--cron", "0 3 * * 1"], cwd=REPO_ROOT, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        with get_client(sync_client=True) as client:
            deployment = served_deployment(client, name, STARTUP_S, serve)
            assert deployment.schedules and deployment.global_concurrency_limit.limit == 1
            first = client.create_flow_run_from_deployment(deployment.id, parameters={"config_path": str(held)})
            _until("the first run running (held reading its config)",
                   lambda: client.read_flow_run(first.id).state.is_running())
            second = client.create_flow_run_from_deployment(deployment.id, parameters={"config": form})
            _until("the second run waiting for the first",
                   lambda: client.read_flow_run(second.id).state.name == "AwaitingConcurrencySlot")
            assert client.read_flow_run(first.id).state.is_running()
            with open(held, "w") as pipe:  # let the first run read its config and go on
                pipe.write(config_text)
            ids = (first.id, second.id)
            _until("both runs final", lambda: all(client.read_flow_run(i).state.is_final() for i in ids))
            runs = [client.read_flow_run(i) for i in ids]
            assert all(r.state.is_completed() for r in runs), [r.state for r in runs]
            done_first, started_second = runs[0].end_time, runs[1].start_time
            assert started_second >= done_first, (done_first, started_second)
        line = "nothing new: 3 repositories trained, 0 waiting"
        for run in runs:
            messages = wait_for_logs(run.id, lambda m: line in m)
            assert line in messages, messages[-20:]
            assert not any(m.startswith("[rank ") for m in flow_run_logs(run.id))
    finally:
        _release(held)
        stop_serving(serve)


def _release(pipe: Path) -> None:
    """A first run still held (the test failed before it wrote the config) reads an empty file and is refused."""
    try:
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader: nothing is held
        pass


def test_the_shipped_deployments_schedule_a_repos_dir_config_one_run_at_a_time() -> None:
    """deployments/prefect.yaml as `prefect deploy` reads it: a weekly schedule, off by default, on a config whose
    runs learn what arrived in its repos_dir, and one flow run at a time per deployment."""
    from prefect.cli.deploy._models import PrefectYamlModel

    spec = PrefectYamlModel.model_validate(yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text()))
    runs = [d for d in spec.deployments if d.entrypoint == "flows/lifelong.py:lifelong_retrieval"]
    [sweep] = [d for d in spec.deployments if d.entrypoint == "flows/sweep.py:lifelong_sweep"]
    assert len(runs) == 2 and len(spec.deployments) == 3
    assert (sweep.concurrency_limit.limit, sweep.concurrency_limit.collision_strategy) == (1, "ENQUEUE")
    from prefect.flows import load_flow_from_entrypoint

    assert load_flow_from_entrypoint(str(REPO_ROOT / sweep.entrypoint)).name == "lifelong-sweep"
    for deployment in runs:
        limit = deployment.concurrency_limit
        assert (limit.limit, limit.collision_strategy) == (1, "ENQUEUE"), deployment.name
        [schedule] = deployment.schedules
        assert schedule.active is False
        config = load_config(REPO_ROOT / schedule.parameters["config_path"])
        assert config.repos_dir is not None, deployment.name
