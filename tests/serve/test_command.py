"""The `leanagent serve` command as a user runs it: a real process that answers, stops on SIGTERM, refuses a stale
index in one line (and serves it with --force, warning), states its defaults, and listens on a socket that sends
without waiting for delayed ACKs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from leanagent.cli import build_parser
from leanagent.index.build import build_index
from leanagent.model.presets import write_random_encoder
from leanagent.serve import ServeLimits, listen

from .conftest import OLD_CLIENT, REPO_ROOT, STATE, assert_same, expected, post


def test_leanagent_serve_answers_and_stops_on_sigterm(built) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(built["root"] / "index"),
                             "--port", "0", "--dtype", "fp32"],  # as the fixture's index: compared exactly
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving 38 premises of ") and "set_option premiseSelection.apiBaseUrl" in line, line
        url = line.split(" at ", 1)[1].split(";", 1)[0]
        assert url.startswith("http://127.0.0.1:")
        answer = post(url, OLD_CLIENT).json()
        body = json.loads(OLD_CLIENT)
        wanted = expected(built["index"], STATE, body["local_premises"],
                          [("RepoA.glend_zero", body["new_premises"][0]["decl"])], 6)
        assert_same(answer, wanted)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    rest = proc.stderr.read()
    # 128 + 15, as every leanagent command ends on SIGTERM
    assert rc == 128 + signal.SIGTERM and "stopped (SIGTERM) after 1 retrieval(s)" in rest, rest
    assert "Traceback" not in rest, rest


def test_serve_help_states_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "INDEX", "--help"])
    text = capsys.readouterr().out
    limits = ServeLimits()
    for name in ServeLimits.model_fields:  # every limit is a flag, with the model's default
        flag, value = "--" + name.replace("_", "-"), getattr(limits, name)
        assert flag in text and f"(default: {value})" in " ".join(text.split()).replace("- ", "-"), flag


def test_the_listening_socket_sends_without_waiting_for_acks() -> None:
    """A response is two writes (headers, body): without TCP_NODELAY the body waited for the client's delayed ACK
    (40 ms a request on Linux). asyncio sets it only on sockets whose proto is TCP; `listen` makes them so."""
    sock = listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with socket.create_connection(sock.getsockname()[:2]):
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


@pytest.fixture()
def stale_index(built, tmp_path) -> Path:
    """An index whose model was retrained since it was built: new bytes under the same path, as a rerun of
    training leaves a checkpoint."""
    model = shutil.copytree(built["root"] / "model", tmp_path / "model")
    build_index(model, built["repo"], tmp_path / "index")
    other = write_random_encoder(tmp_path / "other", "tiny", seed=1)
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")
    return tmp_path / "index"


def test_serve_refuses_a_stale_index_and_serves_it_with_force(stale_index) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    refused = subprocess.run([sys.executable, "-m", "leanagent.cli", "serve", str(stale_index), "--port", "0"],
                             capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    err = refused.stderr.strip()
    assert refused.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("error: ") and "stale" in err, err
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(stale_index), "--port", "0",
                             "--force"], stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env)
    try:
        warning, serving = proc.stderr.readline(), proc.stderr.readline()
        url = serving.split(" at ", 1)[1].split(";", 1)[0]
        health = httpx.get(f"{url}/health", timeout=60).json()
        assert health["warnings"] == 1  # counted: the warning itself names paths, which no response gives
        assert str(stale_index) not in json.dumps(health)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert warning.startswith("warning: ") and "used anyway (--force)" in warning, warning
    assert serving.startswith("serving "), serving
    assert rc == 128 + signal.SIGTERM


@pytest.mark.parametrize("what", ["missing", "file", "empty"])
def test_serve_of_a_run_that_is_not_there_is_one_line_before_torch(tmp_path, what) -> None:
    """`serve runs/NAME` for a run that does not exist spoke of an index folder, 48 s later (torch imported first)."""
    source = tmp_path / "runs" / "NAME"
    if what == "file":
        source.parent.mkdir()
        source.write_text("x")
    elif what == "empty":
        source.mkdir(parents=True)
    probe = ("import sys\nfrom leanagent.cli.main import main\n"
             f"try:\n    main(['serve', {str(source)!r}])\n"
             "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules, 'uvicorn' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.stdout.split() == ["1", "False", "False"], (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: {source}: "), done.stderr
    assert "run" in done.stderr and "RUN_DIR" in done.stderr


def test_index_on_a_full_disk_is_one_line_and_leaves_no_file_of_it(built, tmp_path) -> None:
    """`leanagent index` on a full disk was a traceback (Errno 28). Now one line, and the files written before the
    disk filled are removed: nothing half-written is there to look like an index."""
    disk = tmp_path / "disk"
    disk.mkdir()
    pages = -(-(built["root"] / "index" / "embeddings.safetensors").stat().st_size // 4096)
    size = f"size={4 * (pages + 1)}k"  # room for the embeddings and a page more: the next file fills it
    if subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root, CAP_SYS_ADMIN) to fill a disk")
    try:
        done = subprocess.run([sys.executable, "-m", "leanagent.cli", "index", "--model", str(built["root"] / "model"),
                               "--dataset", str(built["repo"]), "--out", str(disk / "index")], capture_output=True,
                              text=True, cwd=REPO_ROOT, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)})
        left = sorted(p.name for p in (disk / "index").iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == (f"error: {disk / 'index'}: the index cannot be written (No space left on device); none "
                           f"of its files was left there\n")
    assert left == []
