"""`leanagent serve RUN_DIR --engine ct2` takes a run's next stage as the torch engine does: converted on the
follower's thread (once, cached next to the stage's index), swapped in, every request answered meanwhile.

A real `leanagent serve` process on 127.0.0.1:0 and a client thread asking it all along; the run is a manifest whose
stages are two indexes of two different models (so the second stage needs a conversion of its own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from leanagent.ground import model_identity
from leanagent.ground.names import FP32, TINY, TORCH
from leanagent.index.build import build_index
from leanagent.model.presets import write_random_encoder

from .conftest import OLD_CLIENT, REPO_ROOT
from .test_follow import _manifest, _stage_index


def test_serve_with_ct2_swaps_stages_without_a_failed_request(built, tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = _stage_index(built, run_dir, "00-a")
    second_model = write_random_encoder(tmp_path / "model-b", TINY, seed=1)
    second = run_dir / "index" / "01-b"  # where a run writes a stage's index: a server serves no other
    build_index(second_model, built["repo"], second, engine=TORCH, dtype=FP32)
    _manifest(run_dir, [("a", first)])
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(run_dir), "--port", "0", "--engine",
                             "ct2", "--follow-s", "0.2"], stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    statuses: list[int] = []
    stop = threading.Event()
    try:
        banner = proc.stderr.readline()
        assert "stage a (#1)" in banner and "(ct2 fp32, scoring fp32-chunks)" in banner, banner
        url = banner.split(" at ", 1)[1].split(";", 1)[0]

        def ask() -> None:
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    statuses.append(client.post(f"{url}/retrieve", content=OLD_CLIENT,
                                                headers={"Content-Type": "application/json"}).status_code)

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        while len(statuses) < 3:
            assert proc.poll() is None and client.is_alive()
            time.sleep(0.05)
        _manifest(run_dir, [("a", first), ("b", second)])
        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/health", timeout=60).json()["stage"] != "b":
            assert time.monotonic() < deadline, "the server did not take stage b"
            time.sleep(0.1)
        answered = len(statuses)
        while len(statuses) < answered + 3:  # answered by stage b too
            time.sleep(0.05)
        health = httpx.get(f"{url}/health", timeout=60).json()
    finally:
        stop.set()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    log = proc.stderr.read()
    assert rc == 128 + signal.SIGINT, log
    assert statuses and set(statuses) == {200}, statuses
    assert (health["engine"], health["dtype"], health["scoring"]) == ("ct2", "fp32", "fp32-chunks")
    assert "now serving stage b (#2)" in log and "cannot be served" not in log, log
    assert len(list(second.glob("ct2-*"))) == 1  # converted once, next to the stage's index
    meta = json.loads(next(second.glob("ct2-*/leanagent.json")).read_text())
    recorded = json.loads((second / "index.json").read_text())["model_identity"]
    assert meta["model_sha256"] == model_identity.digest(recorded)  # of the second stage's model, checked as its rows
