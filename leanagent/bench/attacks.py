"""The attacks `leanagent bench abuse` replays (issue 38's fourteen findings, slowloris and a hot swap under load),
one table entry each: the finding it replays, what it sends, the server it needs (`source`: an index, a run
followed, or none for a server that must refuse to start; `args`: its flags), and the function that sends it.
Each is bounded in count and time; `small` shrinks every count for a quick run (the unit test's)."""

from __future__ import annotations

import http.client
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from leanagent.bench.target import Outcome, Server, request
from leanagent.ground.names import TINY
from leanagent.run.manifest import MANIFEST_NAME, MANIFEST_VERSION, repo_key

STATE = "x y n m : Nat\n⊢ Eq (HAdd.hAdd (glend 0) (blix (quon x) m)) (HAdd.hAdd 0 (quon (blix x m)))"
NAME = ".".join(["a"] * 512)[:1023]  # 1,023 characters in 512 parts, within --max-name-chars
SPACED = ".".join(["a b"] * 256)[:1023]  # the same with whitespace inside its parts
TIMEOUT = 120


def build_index_for(work: Path) -> Path:
    """The demo's index shape: a tiny random encoder over one demo repository, built once under `work`."""
    index = work / "index"
    if not (index / "index.json").is_file():
        from leanagent.data.synthetic import write_demo_repos
        from leanagent.index.build import build_index
        from leanagent.model.presets import write_random_encoder

        repo = write_demo_repos(work / "data", 1)[0]
        model = work / "model" if (work / "model").is_dir() else write_random_encoder(work / "model", TINY)
        build_index(model, repo, index)
    return index


@dataclass
class Context:
    """Where the attacks work, the index they are served, the run a following server reads, and the size."""

    work: Path
    index: Path
    small: bool
    names: list[str] = field(default_factory=list)  # the run's stages so far, in order

    def n(self, full: int, small: int) -> int:
        return small if self.small else full

    @property
    def cache_mb(self) -> int:
        return self.n(8, 2)

    @property
    def connections(self) -> int:
        return self.n(1024, 30)

    def expand(self, args: tuple[str, ...]) -> tuple[str, ...]:
        """A server's flags, with {work}, {cache_mb} and {connections} filled in."""
        return tuple(a.format(work=self.work, cache_mb=self.cache_mb, connections=self.connections) for a in args)

    def source(self, kind: str) -> Path:
        if kind == "index":
            return self.index
        if not self.names:
            self.add_stage("a")
        return self.work / "run"

    def add_stage(self, name: str, outside: Path | None = None,
                  prepare: Callable[[Path], None] | None = None) -> Path:
        """A finished stage whose evaluation wrote its index in the run (a copy of the bench's), or a link to
        `outside`; `prepare` changes the folder before the manifest names it."""
        folder = self.work / "run" / "index" / f"{len(self.names):02d}-{name}"
        folder.parent.mkdir(parents=True, exist_ok=True)
        if outside is not None:
            folder.symlink_to(outside)
        else:
            shutil.copytree(self.index, folder)
        if prepare is not None:
            prepare(folder)
        self.names.append(name)
        self.write_manifest()
        return folder

    def write_manifest(self, raw: str | None = None) -> None:
        """The run's manifest naming every stage so far (as the flow writes one), or `raw` as it is."""
        run = self.work / "run"
        repos = {}
        for i, name in enumerate(self.names):
            scored = {"Recall@10": 50.0}
            result = {"program": "evaluate", "metrics": scored, "evaluations": [{"metrics": scored}],
                      "out": f"{repo_key(i, name)}/evaluate", "index": str(run / "index" / f"{i:02d}-{name}")}
            repos[repo_key(i, name)] = {"index": i, "name": name, "stages": {
                f"eval-{j:02d}-{self.names[j]}": {"status": "done", "result": result} for j in range(i + 1)}}
        text = raw if raw is not None else json.dumps({"version": MANIFEST_VERSION, "order": self.names,
                                                        "repos": repos})
        tmp = run / f".{MANIFEST_NAME}.tmp"
        tmp.write_text(text)
        os.replace(tmp, run / MANIFEST_NAME)


def _post(url: str, body: bytes) -> str:
    try:
        return str(request(f"{url}/retrieve", "POST", body, TIMEOUT)[0])
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__


def _new_premise(name: str, decl_chars: int) -> bytes:
    decl = (name.replace(" ", "") + ".") * (decl_chars // (len(name) + 1) + 1)
    return json.dumps({"state": STATE, "k": 5, "new_premises": [{"name": name, "decl": decl[:decl_chars]}]}).encode()


def _raw(port: int, data: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    conn.sendall(data)
    return conn


def _port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1].split("/")[0])


def _head(length: int) -> bytes:
    return (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % length)


def _status_of(conn: socket.socket) -> str:
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except OSError:
        pass
    conn.close()
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"


def long_name(ctx: Context, server: Server) -> Outcome:
    chars = ctx.n(100_000, 10_000)
    statuses = Counter(_post(server.url, _new_premise(name, chars)) for name in (NAME, SPACED))
    return Outcome(statuses, 2, f"declarations of {chars:,} characters")


def parallel_long_names(ctx: Context, server: Server) -> Outcome:
    count, chars = ctx.n(48, 8), ctx.n(20_000, 5_000)
    bodies = [_new_premise(NAME if i % 2 else SPACED, chars) for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        return Outcome(Counter(pool.map(lambda b: _post(server.url, b), bodies)), count)


def million_floats(ctx: Context, server: Server) -> Outcome:
    count = ctx.n(1_000_000, 100_000)
    body = b'{"state": "s", "local_premises": [' + b"0.5," * (count - 1) + b"0.5]}"
    return Outcome(Counter([_post(server.url, body)]), 1, f"{len(body) / 2**20:.1f} MB")


def name_bodies(ctx: Context, server: Server) -> Outcome:
    count, size = ctx.n(4, 2), ctx.n(16 << 20, 1 << 20)  # the largest body --max-body-bytes takes
    names = (size - 64) // 4
    body = b'{"state": "s", "imported_modules": [' + b'"a",' * (names - 1) + b'"a"]}'
    with ThreadPoolExecutor(count) as pool:
        statuses = Counter(pool.map(lambda _: _post(server.url, body), range(count)))
    return Outcome(statuses, count, f"{count} at once, {len(body) / 2**20:.1f} MB and {names:,} names each")


def huge_integer(ctx: Context, server: Server) -> Outcome:
    bodies = [b'{"state": "s", "unknown": [' + b"7" * 4301 + b"]}",
              b'{"state": "s", "local_premises": [' + b"9" * 5000 + b"]}"]
    return Outcome(Counter(_post(server.url, b) for b in bodies), 2)


def cache_memory(ctx: Context, server: Server) -> Outcome:
    """The same requests to this server (--cache-mb N) and to one without a cache, taking turns: the difference in
    their resident memory is what the cache costs, against its budget."""
    width = json.loads((ctx.index / "index.json").read_text())["embedding_dim"]
    budget = float(ctx.cache_mb)
    premises = int(2 * budget * 2**20 / (width * 4 + 200))  # twice what the budget holds: it must drop some
    plain = Server(ctx.index, ("--cache-mb", "0"), ctx.work / "access.log")
    statuses: Counter = Counter()
    try:
        for r in range(0, premises, 256):
            new = [{"name": f"Cache.p{i}", "decl": f"theorem Cache.p{i} : {i} = {i}"} for i in range(r, r + 256)]
            body = json.dumps({"state": STATE, "k": 3, "new_premises": new}).encode()
            statuses[_post(server.url, body)] += 1
            _post(plain.url, body)
        cost = server.rss_mb() - plain.rss_mb()
    finally:
        plain.stop()
    return Outcome(statuses, sum(statuses.values()),
                   f"{premises:,} new premises of width {width}: the server with --cache-mb {budget:g} holds "
                   f"{cost:.1f} MB more than the same server without a cache ({cost / budget:.2f}x its budget)")


def hang_ups(ctx: Context, server: Server) -> Outcome:
    port, count = _port(server), ctx.n(50, 10)
    for i in range(count):
        conn = _raw(port, _head(10_000) + b'{"state": "' + b"s" * 200)
        if i % 2:  # half of them reset, half closed
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()
    for _ in range(count // 2):
        _raw(port, b"POST /retr").close()
    time.sleep(0.5)
    return Outcome(Counter({"hung up": count + count // 2, _post(server.url, _new_premise("A.b", 50)): 1}), 1)


def _command(*argv: str, env: dict[str, str] | None = None) -> Outcome:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "leanagent.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    err = done.stderr.strip()
    return Outcome(Counter({f"exit {done.returncode}": 1}), 0,
                   f"{time.perf_counter() - start:.1f} s: {err.splitlines()[-1][:240] if err else ''}"
                   + (" Traceback" if "Traceback" in err else ""))


def no_token(ctx: Context, server: None) -> Outcome:
    return _command(str(ctx.index), "--host", "0.0.0.0", "--port", "0", env={"LEANAGENT_SERVE_TOKEN": ""})


def weak_tokens(ctx: Context, server: None) -> Outcome:
    out = Outcome()
    for content, mode in (("a", 0o644), ("abcdefgh/ijklmnop", 0o600), ("abcdefghijklmnopq", 0o644)):
        path = ctx.work / f"token-{mode:o}-{len(content)}"
        path.write_text(content + "\n")
        path.chmod(mode)
        one = _command(str(ctx.index), "--token-file", str(path), "--port", "0")
        out.statuses.update(one.statuses)
        out.note = one.note
    return out


def token_in_logs(ctx: Context, server: Server) -> Outcome:
    token = (ctx.work / "token").read_text().strip()
    base = server.url.rsplit("/", 1)[0]
    statuses = Counter(_post(f"{base}/{token}", _new_premise("A.b", 50)) for _ in range(10))
    statuses.update([_post(base, b"{}")])
    time.sleep(0.5)
    logged = (ctx.work / "access.log").read_text() + "".join(server.lines)
    return Outcome(statuses, 11, f"{logged.count('/TOKEN/')} access-log lines, {logged.count(token)} with the token")


def stalled_sockets(ctx: Context, server: Server) -> Outcome:
    count = ctx.connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 256), hard))
    port = _port(server)
    stalled = [_raw(port, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le") for _ in range(count)]
    time.sleep(1.0)
    statuses = Counter(str(request(f"{server.url}/health")[0]) for _ in range(5))
    statuses.update([_post(server.url, _new_premise("A.b", 50))])
    for conn in stalled:
        conn.close()
    return Outcome(statuses, 6, f"{count:,} stalled sockets held every --max-connections slot")


def slowloris(ctx: Context, server: Server) -> Outcome:
    port, count = _port(server), ctx.n(300, 30)
    stalled = [_raw(port, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le") for _ in range(count)]
    statuses = Counter([_post(server.url, _new_premise("A.b", 50))])
    statuses.update(_status_of(conn) for conn in stalled)  # each closed at --request-timeout-s 2
    return Outcome(statuses, count + 1)


def _wait_line(server: Server, text: str, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(text in line for line in server.lines):
            return True
        time.sleep(0.05)
    return False


class _Asking:
    """A client asking all along, on one connection, while the run changes."""

    def __init__(self, url: str) -> None:
        self.url, self.statuses, self._stop = url, Counter(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps({"state": STATE, "k": 5, "imported_modules": [0, 1]}).encode()
        while not self._stop.is_set():
            self.statuses[_post(self.url, body)] += 1

    def __enter__(self) -> _Asking:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=TIMEOUT)


def manifest_shapes(ctx: Context, server: Server) -> Outcome:
    with _Asking(server.url) as client:
        for raw in ('{"order": 5, "repos": {}}', '{"order": ["a"], "repos": {"00-a": {"stages": []}}}',
                    '{"order": ["a"], "rep'):
            ctx.write_manifest(raw)
            time.sleep(1.0)  # five polls
        ctx.add_stage("b")
        taken = _wait_line(server, "now serving stage b")
    warned = sum("cannot follow the run" in line for line in server.lines)
    return Outcome(client.statuses, sum(client.statuses.values()),
                   f"{warned} warning lines for 3 bad manifests; the stage written after: "
                   f"{'served' if taken else 'NOT served'}")


def _pipe(folder: Path) -> None:
    (folder / "embeddings.safetensors").unlink()
    os.mkfifo(folder / "embeddings.safetensors")


def _zero(folder: Path) -> None:
    (folder / "embeddings.safetensors").unlink()
    (folder / "embeddings.safetensors").symlink_to("/dev/zero")


def bad_indexes(ctx: Context, server: Server) -> Outcome:
    refused = 0
    with _Asking(server.url) as client:
        for name, how in (("outside", {"outside": ctx.index}), ("pipe", {"prepare": _pipe}),
                          ("zero", {"prepare": _zero})):
            ctx.add_stage(name, **how)  # the follower looks at the newest stage: one at a time
            refused += _wait_line(server, f"stage {name} (#")
    return Outcome(client.statuses, sum(client.statuses.values()),
                   f"{refused} of 3 stages refused in one line each (an index outside the run, embeddings a pipe, "
                   f"embeddings /dev/zero)")


def hot_swap(ctx: Context, server: Server) -> Outcome:
    with _Asking(server.url) as client:
        time.sleep(1.0)
        start = time.monotonic()
        ctx.add_stage("swap")
        taken = _wait_line(server, "now serving stage swap")
        seconds = time.monotonic() - start
        time.sleep(1.0)
    return Outcome(client.statuses, sum(client.statuses.values()),
                   f"swapped in {seconds:.1f} s" if taken else "NOT swapped")


def truncated_manifest(ctx: Context, server: None) -> Outcome:
    run = ctx.work / "cut-run"
    run.mkdir(exist_ok=True)
    (run / MANIFEST_NAME).write_text('{"version": 2, "order": ["a"], "repos": {"00-a": {"stag')
    return _command(str(run), "--port", "0")


def sighup(ctx: Context, server: Server) -> Outcome:
    body = json.dumps({"state": STATE, "k": 3, "local_premises": [0, 1, 2], "pad": "x" * 300_000}).encode()
    conn = _raw(_port(server), _head(len(body)) + body[:200_000])
    deadline = time.monotonic() + 60
    while json.loads(request(f"{server.url}/health")[1]).get("bodies_mb", 0) < 0.2:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGHUP)
    conn.sendall(body[200_000:])
    status = _status_of(conn)
    code = server.proc.wait(timeout=TIMEOUT)
    return Outcome(Counter({status: 1, f"exit {code}": 1}), 1, "the request in flight when SIGHUP came")


@dataclass(frozen=True)
class Attack:
    name: str
    finding: str
    what: str
    run: Callable[[Context, Server | None], Outcome]
    source: str = "index"  # "index", "run" (the server follows a run) or "none" (the server must not start)
    args: tuple[str, ...] = ()


ATTACKS: tuple[Attack, ...] = (
    Attack("long-name", "1", "one new premise named by 512 parts (1,023 characters) over a long declaration, "
           "without whitespace and with it", long_name),
    Attack("parallel-names", "2", "48 such requests of 20 kB at once", parallel_long_names),
    Attack("million-floats", "3", "1M floats in local_premises", million_floats),
    Attack("name-bodies", "4", "bodies of module names at --max-body-bytes, several at once", name_bodies),
    Attack("huge-integer", "5", "integers of 4,301 and 5,000 digits, in a key nobody reads and in a list",
           huge_integer),
    Attack("cache", "6", "twice --cache-mb of distinct new premises", cache_memory, args=("--cache-mb", "{cache_mb}")),
    Attack("hang-ups", "7", "clients that hang up mid-body, and mid request line", hang_ups),
    Attack("no-token", "8", "serve --host 0.0.0.0 without a token", no_token, source="none"),
    Attack("weak-tokens", "9", "token files: 1 character world-readable, a '/', mode 644", weak_tokens,
           source="none"),
    Attack("token-logs", "9", "requests with --access-log and a token: the token in the log", token_in_logs,
           args=("--token-file", "{work}/token", "--access-log")),
    Attack("stalled-sockets", "10", "every connection slot held by a stalled socket, then GET /health",
           stalled_sockets, args=("--max-connections", "{connections}")),
    Attack("manifest-shapes", "11", "manifests of the wrong shape and cut short while followed, then a new stage",
           manifest_shapes, source="run", args=("--follow-s", "0.2")),
    Attack("bad-indexes", "12", "stages whose index lies outside the run, or whose embeddings are a pipe or "
           "/dev/zero", bad_indexes, source="run", args=("--follow-s", "0.2")),
    Attack("hot-swap", "swap", "a new stage taken while a client asks all along", hot_swap, source="run",
           args=("--follow-s", "0.2")),
    Attack("cut-manifest", "13", "serve RUN_DIR with its manifest cut short", truncated_manifest, source="none"),
    Attack("slowloris", "slowloris", "half-sent requests that stall, beside a good one", slowloris,
           args=("--request-timeout-s", "2")),
    Attack("sighup", "14", "SIGHUP with a request in flight", sighup),
)
