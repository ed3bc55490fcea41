"""Read back what a flow run left on the Prefect server: its logs and its artifacts.

Tests check the server's copy, not the in-process return value, because that copy is what a
user sees in the UI; log records reach it in batches, so reads poll until the expected line shows.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import Artifact

PAGE = 200


def flow_run_logs(flow_run_id: UUID) -> list[str]:
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                    limit=PAGE, offset=len(messages))
            messages += [log.message for log in page]
            if len(page) < PAGE:
                return messages


def wait_for_logs(flow_run_id: UUID, done: Callable[[list[str]], bool], timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        messages = flow_run_logs(flow_run_id)
        if done(messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1.0)


def flow_run_artifacts(flow_run_id: UUID) -> list[Artifact]:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def served_deployment(client, name: str, timeout_s: float, server=None):
    """The deployment `lifelong-retrieval/NAME` once a `deployments/serve.py` process has registered it.

    `server` (its Popen) ends the wait early, with its output, if it exits first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.read_deployment_by_name(f"lifelong-retrieval/{name}")
        except Exception:  # noqa: BLE001 - not registered yet
            pass
        if server is not None and server.poll() is not None:
            raise AssertionError(f"the serving process exited ({server.returncode}) before the deployment was served")
        if time.monotonic() > deadline:
            raise AssertionError(f"the deployment {name} was not served within {timeout_s:.0f} s")
        time.sleep(0.5)


def stop_serving(server: subprocess.Popen) -> None:
    """End a `deployments/serve.py` process as Ctrl-C does (its runner deregisters), killed if it hangs."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=10)
