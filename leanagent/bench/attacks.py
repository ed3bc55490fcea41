"""The attacks `leanagent bench abuse` replays (each once cost the server seconds, gigabytes, a lockout or a
traceback within every limit), one table entry each: its bar beyond the common ones (`abuse.py`), what it sends,
the server it needs (`source`: an index, a run followed, or none for a command that must refuse at once; `args`:
its flags; `nofile`: its descriptor limit), and the function that sends it, which reports where its own bar was not
met (`Outcome.problems`). Each is bounded in count and time; `small` shrinks every count for a quick run (the unit
test's)."""

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
from urllib.parse import unquote, urlsplit

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


CACHE_BATCH = 256  # new premises a request of the cache attack sends (its servers take that many)
CACHE_RATIO = 1.5  # the cache's memory against its budget, at most (blocks, the allocator's rounding)


def cache_memory(ctx: Context, server: Server) -> Outcome:
    """The same requests to this server (--cache-mb N) and to one without a cache, taking turns: the difference in
    their resident memory is what the cache costs, against its budget."""
    width = json.loads((ctx.index / "index.json").read_text())["embedding_dim"]
    budget = float(ctx.cache_mb)
    premises = int(2 * budget * 2**20 / (width * 4 + 200))  # twice what the budget holds: it must drop some
    plain = Server(ctx.index, ("--cache-mb", "0", "--max-new-premises", str(CACHE_BATCH)), ctx.work / "access.log")
    statuses: Counter = Counter()
    try:
        for r in range(0, premises, CACHE_BATCH):
            new = [{"name": f"Cache.p{i}", "decl": f"theorem Cache.p{i} : {i} = {i}"}
                   for i in range(r, r + CACHE_BATCH)]
            body = json.dumps({"state": STATE, "k": 3, "new_premises": new}).encode()
            statuses[_post(server.url, body)] += 1
            _post(plain.url, body)
        cost = server.rss_mb() - plain.rss_mb()
    finally:
        plain.stop()
    return Outcome(statuses, sum(statuses.values()),
                   f"{premises:,} new premises of width {width}: the server with --cache-mb {budget:g} holds "
                   f"{cost:.1f} MB more than the same server without a cache ({cost / budget:.2f}x its budget)",
                   [f"{cost / budget:.2f}x its budget"] if cost > CACHE_RATIO * budget else [])


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


@dataclass
class Command:
    """A `leanagent` command run to its end: its exit code, stderr, wall seconds and peak resident memory (MB, the
    kernel's count for that one process)."""

    code: int
    err: str
    seconds: float
    peak_mb: float

    @property
    def last_line(self) -> str:
        err = self.err.strip()
        return (err.splitlines()[-1][:240] if err else "") + (" Traceback" if "Traceback" in err else "")


# Runs a command and writes its peak resident memory (kB) to a file. A process of its own, small: the kernel's peak
# for a child forked from a large process (this one, torch loaded) counts the parent's pages the fork shared.
PEAK = ("import resource, subprocess, sys\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    code = subprocess.call(sys.argv[2:], stdout=subprocess.DEVNULL)\n"
        "    f.write(f'{code} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}')\n")


def measured(command: list[str], work: Path, env: dict[str, str] | None = None) -> Command:
    """`command` run to its end: its exit code, stderr, wall seconds and peak resident memory."""
    err, peak = work / "command.err", work / "command.peak"
    start = time.perf_counter()
    with open(err, "w") as f:
        subprocess.run([sys.executable, "-c", PEAK, str(peak), *command], stderr=f, timeout=TIMEOUT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    seconds = time.perf_counter() - start
    code, kb = peak.read_text().split()
    return Command(int(code), err.read_text(), seconds, int(kb) / 1024)


def run_command(argv: list[str], work: Path, env: dict[str, str] | None = None) -> Command:
    """`leanagent ARGV`, `measured`."""
    return measured([sys.executable, "-m", "leanagent.cli", *argv], work, env)


def _command(*argv: str, env: dict[str, str] | None = None, work: Path) -> Outcome:
    done = run_command(["serve", *argv], work, env)
    return Outcome(Counter({f"exit {done.code}": 1}), 0, f"{done.seconds:.1f} s: {done.last_line}")


def no_token(ctx: Context, server: None) -> Outcome:
    return _command(str(ctx.index), "--host", "0.0.0.0", "--port", "0", env={"LEANAGENT_SERVE_TOKEN": ""},
                    work=ctx.work)


def weak_tokens(ctx: Context, server: None) -> Outcome:
    out = Outcome()
    for content, mode in (("a", 0o644), ("abcdefgh/ijklmnop", 0o600), ("abcdefghijklmnopq", 0o644)):
        path = ctx.work / f"token-{mode:o}-{len(content)}"
        path.write_text(content + "\n")
        path.chmod(mode)
        one = _command(str(ctx.index), "--token-file", str(path), "--port", "0", work=ctx.work)
        out.statuses.update(one.statuses)
        out.note = one.note
    return out


def token_in_logs(ctx: Context, server: Server) -> Outcome:
    token = (ctx.work / "token").read_text().strip()
    base = server.url.rsplit("/", 1)[0]
    before = len((ctx.work / "access.log").read_text()) if (ctx.work / "access.log").is_file() else 0
    encoded = "".join(f"%{ord(c):02X}" for c in token)
    paths = [token] * 10 + [encoded, encoded.lower(), token[:-1], token[1:], token + "x", f"/{token}"]
    statuses = Counter(_post(f"{base}/{path}", _new_premise("A.b", 50)) for path in paths)
    statuses.update([_post(base, b"{}")])
    time.sleep(0.5)
    logged = (ctx.work / "access.log").read_text()[before:] + "".join(server.lines)
    decoded = unquote(logged)
    leaks = sum(1 for line in decoded.splitlines() if any(token[i:i + 8] in line for i in range(len(token) - 7)))
    problems = [f"{leaks} log lines hold 8 or more characters of the token"] if leaks else []
    return Outcome(statuses, len(paths) + 1, f"{logged.count('/TOKEN/')} access-log lines with TOKEN, "
                   f"{logged.count('/WRONG-TOKEN')} with WRONG-TOKEN, {leaks} with 8 or more of its characters "
                   f"(percent-encoded, cut short by one at either end, one too long, after a second slash)", problems)


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
    return Outcome(statuses, 6, f"{count:,} stalled sockets held every --max-connections slot",
                   [] if statuses.get("200", 0) == 5 else ["/health not answered"])


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
                   f"{'served' if taken else 'NOT served'}",
                   [] if taken and warned <= 3 else [f"{warned} warning lines, the next stage "
                                                     f"{'served' if taken else 'NOT served'}"])


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
                   f"embeddings /dev/zero)", [] if refused == 3 else [f"{3 - refused} stages not refused"])


def hot_swap(ctx: Context, server: Server) -> Outcome:
    with _Asking(server.url) as client:
        time.sleep(1.0)
        start = time.monotonic()
        ctx.add_stage("swap")
        taken = _wait_line(server, "now serving stage swap")
        seconds = time.monotonic() - start
        time.sleep(1.0)
    return Outcome(client.statuses, sum(client.statuses.values()),
                   f"swapped in {seconds:.1f} s" if taken else "NOT swapped", [] if taken else ["not swapped"])


def truncated_manifest(ctx: Context, server: None) -> Outcome:
    run = ctx.work / "cut-run"
    run.mkdir(exist_ok=True)
    (run / MANIFEST_NAME).write_text('{"version": 2, "order": ["a"], "repos": {"00-a": {"stag')
    return _command(str(run), "--port", "0", work=ctx.work)


def lockout(ctx: Context, server: Server) -> Outcome:
    """Sockets that declare the largest body and send nothing, as many as once held the whole --bodies-mb, and
    legitimate requests meanwhile: each must be answered."""
    port = _port(server)
    held = [_raw(port, _head(16 << 20)) for _ in range(16)]
    time.sleep(0.5)  # taken in by the server: their headers read, their bodies awaited
    statuses = Counter(_post(server.url, _new_premise("A.b", 50)) for _ in range(ctx.n(40, 8)))
    bodies = json.loads(request(f"{server.url}/health")[1])["bodies_mb"]
    for conn in held:
        conn.close()
    refused = sum(n for status, n in statuses.items() if status != "200")
    return Outcome(statuses, sum(statuses.values()),
                   f"16 sockets each declared 16 MiB and sent nothing; the bodies' budget held {bodies} MB meanwhile",
                   [f"{refused} legitimate requests not answered 200"] if refused else [])


HEAVY_DECL_CHARS = 7_000  # as the finding's: the model reads 512 bytes of each, whatever its length


def _heaviest(tag: str, premises: int) -> bytes:
    """The most encoder work one request may ask: as many new premises as allowed, each past the encoder's cut,
    named anew (`tag`) so that none is in the cache."""
    new = [{"name": f"Heavy{tag}.p{i}", "decl": (f"theorem Heavy{tag}.p{i} : " + "a + b = b + a ∧ " * 500)[
        :HEAVY_DECL_CHARS]} for i in range(premises)]
    return json.dumps({"state": STATE, "k": 10, "new_premises": new}).encode()


def _max_new(server: Server) -> int:
    return int(request(f"{server.url}/max-new-premises")[1])


def heaviest(ctx: Context, server: Server) -> Outcome:
    """The heaviest legal requests of two kinds: the most encoder work (new premises), the most names to resolve
    (a premise's name repeated up to the body's limit)."""
    premises = _max_new(server)
    body = _heaviest(f"{time.monotonic_ns()}", premises)
    name = json.loads(request(f"{server.url}/indexed-premises")[1])[0]
    count = ctx.n(900_000, 90_000) * 14 // (len(name) + 3)  # 15 MB of it, within --max-body-bytes
    names = json.dumps({"state": STATE, "k": 10, "local_premises": [name] * count}).encode()
    statuses = Counter([_post(server.url, body), _post(server.url, names)])
    return Outcome(statuses, 2, f"{premises:,} new premises (GET /max-new-premises) of {HEAVY_DECL_CHARS:,} "
                   f"characters, {len(body) / 2**20:.1f} MB; {count:,} premise names, {len(names) / 2**20:.1f} MB")


STOP_WITHIN_S = 15.0


def _stop(sig: signal.Signals) -> Callable[[Context, Server], Outcome]:
    def stop(ctx: Context, server: Server) -> Outcome:
        """Two CPU hogs, 3 of the heaviest legal requests in flight and a body that never arrives whole, then the
        signal: each request answered or a 503, no traceback, an exit within STOP_WITHIN_S with 128 + N."""
        premises = _max_new(server)
        bodies = [_heaviest(f"{sig.name}{k}{time.monotonic_ns()}", premises) for k in range(3)]
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        replies: list[str] = []
        try:
            port = _port(server)
            stalled = _raw(port, _head(300_000) + b'{"state": "' + b"s" * 100_000)
            answered = json.loads(request(f"{server.url}/health")[1])["requests"]
            threads = [threading.Thread(target=lambda b=b: replies.append(_post(server.url, b))) for b in bodies]
            for t in threads:
                t.start()
            deadline = time.monotonic() + TIMEOUT
            while json.loads(request(f"{server.url}/health")[1])["requests"] < answered + 3 and \
                    time.monotonic() < deadline:  # all 3 handed to the encoder
                time.sleep(0.02)
            start = time.monotonic()
            server.proc.send_signal(sig)
            replies.append(_status_of(stalled))
            code = server.proc.wait(timeout=TIMEOUT)
            seconds = time.monotonic() - start
            for t in threads:
                t.join(timeout=TIMEOUT)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        statuses = Counter(replies)
        statuses[f"exit {code}"] += 1
        problems = [f"{n} x {status}" for status, n in statuses.items()
                    if status not in ("200", "503", f"exit {128 + sig}")]
        if seconds > STOP_WITHIN_S:
            problems.append(f"an exit {seconds:.1f} s after the signal")
        return Outcome(statuses, 4, f"exit {code} {seconds:.1f} s after {sig.name}, under two CPU hogs, with 3 of the "
                       f"heaviest requests ({premises} new premises each) and a body never sent whole in flight",
                       problems)
    return stop


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _refused_alike(ctx: Context, commands: dict[str, list[str]], what: str) -> Outcome:
    """Commands that must refuse in one line from a file's size: each against `leanagent serve --help` (the
    command's start, nothing read), its time within 1 s of that and its peak memory within 100 MB."""
    start = run_command(["serve", "--help"], ctx.work)
    statuses: Counter = Counter()
    problems, said = [], []
    for name, argv in commands.items():
        done = run_command(argv, ctx.work)
        statuses[f"exit {done.code}"] += 1
        extra_s, extra_mb = done.seconds - start.seconds, done.peak_mb - start.peak_mb
        said.append(f"{name} {done.seconds:.1f} s, {done.peak_mb:.0f} MB")
        if done.code != 1 or done.err.count("\n") != 1 or "Traceback" in done.err:
            problems.append(f"{name}: {done.last_line}")
        if extra_s > 1.0 or extra_mb > 100:
            problems.append(f"{name}: {extra_s:+.1f} s, {extra_mb:+.0f} MB over the command's start")
    note = (f"{what}: {', '.join(said)} (the command's start alone: {start.seconds:.1f} s, {start.peak_mb:.0f} MB); "
            f"{done.last_line}")
    return Outcome(statuses, 0, note, problems)


def big_manifest(ctx: Context, server: None) -> Outcome:
    run = ctx.work / "big-run"
    run.mkdir(exist_ok=True)
    _sparse(run / MANIFEST_NAME, 2 << 30)
    return _refused_alike(ctx, {"report": ["report", str(run)], "serve": ["serve", str(run), "--port", "0"],
                                "retrieve": ["retrieve", str(run), "--state", "x"]}, "a 2 GiB sparse manifest")


def big_token(ctx: Context, server: None) -> Outcome:
    token = _sparse(ctx.work / "big-token", 1 << 30)
    token.chmod(0o600)
    return _refused_alike(ctx, {"serve": ["serve", str(ctx.index), "--token-file", str(token), "--port", "0"]},
                          "a 1 GiB sparse token file")


def missing_run(ctx: Context, server: None) -> Outcome:
    out = _refused_alike(ctx, {"serve": ["serve", str(ctx.work / "runs" / "NAME"), "--port", "0"]},
                         "a run that is not there")
    if "no such run" not in out.note:
        out.problems.append("the line does not say there is no such run")
    return out


def banner_host(ctx: Context, server: None) -> Outcome:
    """`serve --host 0.0.0.0`: the URL the banner gives Lean names this machine, not localhost nor 0.0.0.0."""
    token = ctx.work / "banner-token"
    served = Server(ctx.index, ("--host", "0.0.0.0", "--token-file", str(token)), ctx.work / "access.log")
    code = served.stop(signal.SIGINT)
    host = urlsplit(served.url).hostname or ""
    wrong = host in ("localhost", "0.0.0.0", "::") or host.startswith("127.")
    return Outcome(Counter({f"exit {code}": 1}), 0, f"the banner's URL: http://{host}:PORT/TOKEN",
                   [f"the banner names {host}"] if wrong else [])


def full_disk(ctx: Context, server: None) -> Outcome:
    """`leanagent index` onto a disk that fills midway (a small tmpfs: root only): one line, no file of it left."""
    disk = ctx.work / "full-disk"
    disk.mkdir(exist_ok=True)
    pages = -(-(ctx.index / "embeddings.safetensors").stat().st_size // 4096)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={4 * (pages + 1)}k", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        return Outcome(Counter({"not run": 1}), 0, "mounting a small tmpfs needs root")
    try:
        done = run_command(["index", "--model", str(ctx.work / "model"), "--dataset", str(ctx.work / "data" / "repo_0"),
                            "--out", str(disk / "index")], ctx.work)
        left = sorted(p.name for p in (disk / "index").iterdir()) if (disk / "index").is_dir() else []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    problems = [] if done.code == 1 and done.err.count("\n") == 1 else [done.last_line]
    if left:
        problems.append(f"left {', '.join(left)}")
    return Outcome(Counter({f"exit {done.code}": 1}), 0, f"{len(left)} files left; {done.last_line}", problems)


def descriptors(ctx: Context, server: Server) -> Outcome:
    """A server under `ulimit -n 256`, 400 sockets at once: counted or refused, never "Too many open files"."""
    before = len(server.lines)
    port = _port(server)
    stalled = []
    for _ in range(ctx.n(400, 300)):
        try:
            stalled.append(_raw(port, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le"))
        except OSError:  # refused beyond the limit, or the kernel's queue full
            pass
    time.sleep(1.0)
    for conn in stalled:
        conn.close()
    time.sleep(1.0)
    statuses = Counter([_post(server.url, _new_premise("A.b", 50))])
    logged = server.lines[before:]
    out_of = sum("Errno 24" in line for line in logged)
    warned = next((line.strip() for line in server.lines if "the process may open" in line), "no warning")
    return Outcome(statuses, 1, f"{len(stalled)} sockets connected of {ctx.n(400, 300)}; {out_of} lines of Errno "
                   f"24; {warned}", [f"{out_of} lines of Errno 24"] if out_of else [])


def manifest_grows(ctx: Context, server: Server) -> Outcome:
    """The followed run's manifest becomes a 2 GiB sparse file (each poll read it whole), then a stage is added."""
    with _Asking(server.url) as client:
        run = ctx.work / "run"
        tmp = _sparse(run / f".{MANIFEST_NAME}.big", 2 << 30)
        os.replace(tmp, run / MANIFEST_NAME)
        time.sleep(2.0)  # ten polls
        ctx.add_stage("after-big")
        taken = _wait_line(server, "now serving stage after-big")
    warned = sum("more than a run manifest ever holds" in line for line in server.lines)
    problems = [] if taken and warned == 1 else [f"{warned} warning lines; the next stage "
                                                 f"{'served' if taken else 'NOT served'}"]
    return Outcome(client.statuses, sum(client.statuses.values()),
                   f"{warned} warning line for ten polls of a 2 GiB manifest; the stage written after: "
                   f"{'served' if taken else 'NOT served'}", problems)


@dataclass(frozen=True)
class Attack:
    name: str
    bar: str  # what this attack must show beyond the common bars (`abuse.py`), for the table
    what: str
    run: Callable[[Context, Server | None], Outcome]
    source: str = "index"  # "index", "run" (the server follows a run) or "none" (a command that must refuse)
    args: tuple[str, ...] = ()
    nofile: int | None = None  # the server's limit of open files (`ulimit -n`)
    health: bool = True  # /health must be answered all along (not where the attack holds every socket there is)
    exits: str = "exit 1"  # what a command of source "none" must end with


FOLLOW = ("--follow-s", "0.2")
ATTACKS: tuple[Attack, ...] = (
    Attack("long-name", "200", "one new premise named by 512 parts (1,023 characters) over a long declaration, "
           "without whitespace and with it", long_name),
    Attack("parallel-names", "200", "48 such requests of 20 kB at once", parallel_long_names),
    Attack("million-floats", "422", "1M floats in local_premises", million_floats),
    Attack("name-bodies", "4xx", "bodies of module names at --max-body-bytes, several at once", name_bodies),
    Attack("huge-integer", "422", "integers of 4,301 and 5,000 digits, in a key nobody reads and in a list",
           huge_integer),
    Attack("heaviest", "200", "the heaviest legal requests: the most new premises, each past the encoder's cut; "
           "the most premise names a body holds", heaviest),
    Attack("lockout", "no 503", "16 sockets declaring 16 MiB bodies that never come, and legitimate requests "
           "meanwhile", lockout, args=("--request-timeout-s", "120")),
    Attack("cache", "within budget", "twice --cache-mb of distinct new premises", cache_memory,
           args=("--cache-mb", "{cache_mb}", "--max-new-premises", str(CACHE_BATCH))),
    Attack("hang-ups", "1 line", "clients that hang up mid-body, and mid request line", hang_ups),
    Attack("no-token", "1 line", "serve --host 0.0.0.0 without a token", no_token, source="none"),
    Attack("weak-tokens", "1 line", "token files: 1 character world-readable, a '/', mode 644", weak_tokens,
           source="none"),
    Attack("big-token", "1 line, +1 s, +100 MB", "a 1 GiB sparse token file, mode 600", big_token, source="none"),
    Attack("token-logs", "no 8 characters of it", "requests with --access-log and a token, some spelt otherwise "
           "(percent-encoded, cut short, one too long): the token in the log", token_in_logs,
           args=("--token-file", "{work}/token", "--access-log")),
    Attack("banner-host", "the server machine's name", "serve --host 0.0.0.0: the URL the banner gives Lean",
           banner_host, source="none", exits="exit 130"),
    Attack("stalled-sockets", "/health 200", "every connection slot held by a stalled socket, then GET /health",
           stalled_sockets, args=("--max-connections", "{connections}")),
    Attack("descriptors", "no Errno 24", "400 sockets at once at a server under `ulimit -n 256`", descriptors,
           nofile=256, health=False),
    Attack("manifest-shapes", "1 line each", "manifests of the wrong shape and cut short while followed, then a new "
           "stage", manifest_shapes, source="run", args=FOLLOW),
    Attack("manifest-grows", "1 line", "the followed run's manifest turned into a 2 GiB sparse file, then a new "
           "stage", manifest_grows, source="run", args=FOLLOW),
    Attack("bad-indexes", "1 line each", "stages whose index lies outside the run, or whose embeddings are a pipe or "
           "/dev/zero", bad_indexes, source="run", args=FOLLOW),
    Attack("hot-swap", "swapped", "a new stage taken while a client asks all along", hot_swap, source="run",
           args=FOLLOW),
    Attack("cut-manifest", "1 line", "serve RUN_DIR with its manifest cut short", truncated_manifest, source="none"),
    Attack("big-manifest", "1 line, +1 s, +100 MB", "report, serve and retrieve of a run whose manifest is a 2 GiB "
           "sparse file", big_manifest, source="none"),
    Attack("missing-run", "1 line, +1 s", "serve runs/NAME, a run that is not there", missing_run, source="none"),
    Attack("full-disk", "1 line, no file", "`leanagent index` onto a disk that fills midway", full_disk,
           source="none"),
    Attack("slowloris", "408", "half-sent requests that stall, beside a good one", slowloris,
           args=("--request-timeout-s", "2")),
    *(Attack(f"stop-{sig.name[3:].lower()}", "200 or 503, exit 15 s", f"{sig.name} with 3 of the heaviest requests "
             f"in flight, under two CPU hogs", _stop(sig)) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)),
)
