"""Shared by the `leanagent serve` tests: one index (the tiny random encoder's over one demo repository, 38
premises in 4 files, built once for the session), Lean clients' golden bodies, a real uvicorn server on
127.0.0.1 (`LiveServer`), and the expected answers computed from the index's own primitives (state and premise
embeddings, a plain dot product, a sort), not from the server's code path.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import uvicorn

from leanagent.bench.attacks import measured
from leanagent.data.corpus import serialize_premise
from leanagent.data.synthetic import write_demo_repos
from leanagent.index.build import build_index
from leanagent.index.query import PremiseIndex
from leanagent.model.presets import write_random_encoder
from leanagent.serve import listen, module_name

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE = "x y n m : Nat\n⊢ Eq (HAdd.hAdd (glend 0) (blix (quon x) m)) (HAdd.hAdd 0 (quon (blix x m)))"
MODULES = ["Core.Basic", "RepoA.Base", "RepoA.Ext", "RepoA.Main"]

# Golden bodies, byte for byte as the Lean clients send them (`Json.compress`, the keys in the client's order).
# Older clients (<= v4.30): state, local_premises (positions in /indexed-premises), new_premises, k.
OLD_CLIENT = ('{"state":"x y n m : Nat\\n⊢ Eq (HAdd.hAdd (glend 0) (blix (quon x) m)) (HAdd.hAdd 0 (quon (blix x m)))",'
              '"local_premises":[0,1,2,3,9,10,11,12,13,14],'
              '"new_premises":[{"name":"RepoA.glend_zero","decl":"theorem RepoA.glend_zero (x : Nat) : '
              'Eq (glend x) 0"}],"k":6}')
# Newer clients: the imported modules by position in /indexed-modules (local_premises empty), and the module
# system's two fields.
NEW_CLIENT = ('{"state":"x y n m : Nat\\n⊢ Eq (HAdd.hAdd (glend 0) (blix (quon x) m)) (HAdd.hAdd 0 (quon (blix x m)))",'
              '"local_premises":[],"imported_modules":[0,1],'
              '"new_premises":[{"name":"RepoA.glend_zero","decl":"theorem RepoA.glend_zero (x : Nat) : '
              'Eq (glend x) 0"},{"name":"RepoA.glend_blix","decl":"/-- a new lemma -/\\ntheorem RepoA.glend_blix '
              '(x y : Nat) : Eq (glend (blix x y)) (blix (glend x) y)"}],'
              '"k":100,"caller_in_module_system":false,"imported_all_modules":[]}')


class LiveServer:
    """uvicorn in a thread on a socket bound to 127.0.0.1:0 (no port race), stopped as Ctrl-C would stop it."""

    def __init__(self, app, access_log: bool = False) -> None:
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=access_log))  # logs reach caplog
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("serve")
    repo = write_demo_repos(root / "data", 1)[0]
    model = write_random_encoder(root / "model", "tiny")
    build_index(model, repo, root / "index")
    # fp32 queries: batched and unbatched answers are compared exactly (other dtypes agree to their rounding).
    return {"root": root, "repo": repo, "index": PremiseIndex.load(root / "index", dtype="fp32")}


def expected(index: PremiseIndex, state: str, rows: list[int] | None, new: list[tuple[str, str]], k: int) -> list:
    """The answer from first principles: every accessible indexed premise not replaced by a new one, and the new
    ones, scored by a dot product with the state's embedding, sorted."""
    query = index.encode_state(state)
    scores = (query @ index.embeddings.float().t())[0].tolist()  # the stored bf16 rows' exact products
    names = [p["full_name"] for p in index.premises]
    new_names = {name for name, _ in new}
    candidates = [(scores[r], names[r]) for r in (range(len(names)) if rows is None else rows)
                  if names[r] not in new_names]
    if new:
        rows_new = index.encode_premises([serialize_premise(name, decl) for name, decl in new])
        candidates += list(zip((query @ rows_new.float().t())[0].tolist(), [name for name, _ in new], strict=True))
    candidates.sort(key=lambda c: -c[0])
    return [{"name": name, "score": score} for score, name in candidates[:k]]


def assert_same(answer: list, wanted: list) -> None:
    assert [a["name"] for a in answer] == [w["name"] for w in wanted]
    assert [a["score"] for a in answer] == pytest.approx([w["score"] for w in wanted], abs=1e-6)


def rows_of(index: PremiseIndex, modules: list[str]) -> list[int]:
    return [r for path, info in index.files.items() if module_name(path) in modules for r in range(*info.rows)]


def post(url: str, body: str | bytes) -> httpx.Response:
    return httpx.post(f"{url}/retrieve", content=body, headers={"Content-Type": "application/json"}, timeout=60)


LONG = 60  # seconds a test waits at most for what a server does at once: generous on a loaded machine


@contextmanager
def serving(source: Path, *args: str, env: dict[str, str] | None = None,
            nofile: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`leanagent serve SOURCE ARGS --port 0` as a user runs it; (its URL, the process), stopped with SIGINT.
    `nofile`: its limit of open files, soft and hard (`ulimit -n`)."""
    # PYTHONFAULTHANDLER: a server that does not stop is sent SIGABRT, which then prints every thread's stack.
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONFAULTHANDLER": "1",
                **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(source), "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE if "--access-log" in args else None,  # uvicorn's access log
                            preexec_fn=None if nofile is None else lambda: resource.setrlimit(
                                resource.RLIMIT_NOFILE, (nofile, nofile)))
    try:
        lines = []
        while True:
            line = proc.stderr.readline()
            assert line, f"the server ended: {''.join(lines)}"
            lines.append(line)
            if line.startswith("serving "):
                break
        proc.banner = "".join(lines)  # type: ignore[attr-defined]
        yield line.split(" at ", 1)[1].split(";", 1)[0], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=LONG)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # the stacks of a server that did not stop, for the failure
                proc.wait(timeout=LONG)
                said = proc.stderr.read()
                pytest.fail(f"`leanagent serve` still ran {LONG} s after SIGINT; its stderr after the banner, "
                            f"with every thread's stack:\n{said[-6000:]}")


def command_alone(argv: list[str], tmp_path: Path) -> tuple[int, bool, str, int]:
    """`leanagent ARGV` in a process of its own: its exit code, whether it imported torch, its stderr and its peak
    resident memory in bytes (measured from a small process: see `leanagent.bench.attacks.PEAK`)."""
    said = tmp_path / "command.said"
    probe = ("import sys\nfrom leanagent.cli.main import main\n"
             f"try:\n    main({argv!r})\nexcept SystemExit as exc:\n"
             f"    open({str(said)!r}, 'w').write(f\"{{exc.code}} {{'torch' in sys.modules}}\")\n")
    done = measured([sys.executable, "-c", probe], tmp_path, {"PYTHONPATH": str(REPO_ROOT)})
    code, torch_loaded = said.read_text().split()
    return int(code), torch_loaded == "True", done.err, int(done.peak_mb * 2**20)


def stall(port: int) -> socket.socket:
    """A client that sends half a request line and stalls."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=LONG)
    conn.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le")
    return conn


def until(condition, seconds: float = LONG) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.05)


def open_connections(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def peak_rss(pid: int) -> int:
    """The process's resident high-water mark (Linux's VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")
