"""`leanagent serve`: Lean's premise-selection protocol, on a real server on 127.0.0.1 driven by httpx.

The index is the tiny random encoder's over one demo repository (38 premises in 4 files), built once per
module. Expected answers are computed from the index's own primitives (state and premise embeddings, a plain
dot product, a sort), not from the server's code path, and accessibility is checked against
`leanagent retrieve --file`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from leanagent.cli import build_parser
from leanagent.data.corpus import serialize_premise
from leanagent.data.synthetic import write_demo_repos
from leanagent.index import PremiseIndex, build_index
from leanagent.model.presets import write_random_encoder
from leanagent.serve import PremiseServer, RetrieveRequest, ServeLimits, create_app, lean_name, listen, module_name

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

    def __init__(self, app) -> None:
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))  # logs reach caplog
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


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("serve")
    repo = write_demo_repos(root / "data", 1)[0]
    model = write_random_encoder(root / "model", "tiny")
    build_index(model, repo, root / "index")
    return {"root": root, "repo": repo, "index": PremiseIndex.load(root / "index")}


@pytest.fixture(scope="module")
def live(built):
    with LiveServer(create_app(built["index"])) as server:
        yield server


STRICT = ServeLimits(max_k=5, max_new_premises=2, max_state_chars=200, max_decl_chars=100, max_body_bytes=3000)


@pytest.fixture(scope="module")
def strict(built):
    with LiveServer(create_app(built["index"], STRICT)) as server:
        yield server


def expected(index: PremiseIndex, state: str, rows: list[int] | None, new: list[tuple[str, str]], k: int) -> list:
    """The answer from first principles: every accessible indexed premise not replaced by a new one, and the new
    ones, scored by a dot product with the state's embedding, sorted."""
    query = index.encode_state(state)
    scores = (query @ index.embeddings.t())[0].tolist()
    names = [p["full_name"] for p in index.premises]
    new_names = {name for name, _ in new}
    candidates = [(scores[r], names[r]) for r in (range(len(names)) if rows is None else rows)
                  if names[r] not in new_names]
    if new:
        rows_new = index.encode_premises([serialize_premise(name, decl) for name, decl in new])
        candidates += list(zip((query @ rows_new.t())[0].tolist(), [name for name, _ in new], strict=True))
    candidates.sort(key=lambda c: -c[0])
    return [{"name": name, "score": score} for score, name in candidates[:k]]


def assert_same(answer: list, wanted: list) -> None:
    assert [a["name"] for a in answer] == [w["name"] for w in wanted]
    assert [a["score"] for a in answer] == pytest.approx([w["score"] for w in wanted], abs=1e-6)


def rows_of(index: PremiseIndex, modules: list[str]) -> list[int]:
    return [r for path, info in index.files.items() if module_name(path) in modules for r in range(*info.rows)]


def post(url: str, body: str | bytes) -> httpx.Response:
    return httpx.post(f"{url}/retrieve", content=body, headers={"Content-Type": "application/json"}, timeout=60)


# ---- the lists the client caches ----------------------------------------------------------------

def test_indexed_lists_are_stable_and_named_as_lean_names(live, built) -> None:
    index = built["index"]
    modules = httpx.get(f"{live.url}/indexed-modules").json()
    premises = httpx.get(f"{live.url}/indexed-premises").json()
    assert modules == MODULES
    assert premises[:3] == ["Core.frob_zero", "Core.frob_zark", "Core.frob_quon"]
    assert premises == [p["full_name"] for p in index.premises] and len(premises) == 38
    assert httpx.get(f"{live.url}/indexed-modules").json() == modules  # the same order every time
    assert httpx.get(f"{live.url}/indexed-premises").json() == premises
    assert httpx.get(f"{live.url}/max-new-premises").text == "2048"
    health = httpx.get(f"{live.url}/health").json()
    assert health["status"] == "ok" and health["premises"] == 38 and health["modules"] == 4


@pytest.mark.parametrize(("name", "written"), [
    ("Nat.add_comm", "Nat.add_comm"),
    ("Finset.sum_α₁", "Finset.sum_α₁"),
    ("Foo.bar'", "Foo.bar'"),
    ("_private.Mathlib.Logic.0.foo", "_private.Mathlib.Logic.«0».foo"),
    ("Foo.«term_+_».bar", "Foo.«term_+_».bar"),
    ("Foo.a b", "Foo.«a b»"),
])
def test_names_are_written_as_lean_reads_them(name: str, written: str) -> None:
    assert lean_name(name) == written


@pytest.mark.parametrize(("path", "module"), [
    ("RepoA/Base.lean", "RepoA.Base"),
    (".lake/packages/mathlib/Mathlib/Algebra/Group/Defs.lean", "Mathlib.Algebra.Group.Defs"),
    (".lake/packages/lean4/src/lean/Init/Prelude.lean", "Init.Prelude"),
    (".lake/packages/lean4/src/lean/lake/Lake/Build.lean", "Lake.Build"),
    ("./Lean4Example.lean", "Lean4Example"),
])
def test_module_names_of_corpus_paths(path: str, module: str) -> None:
    assert module_name(path) == module


# ---- golden requests of both client formats --------------------------------------------------------

def test_old_client_format(live, built) -> None:
    index = built["index"]
    body = json.loads(OLD_CLIENT)
    answer = post(live.url, OLD_CLIENT)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    wanted = expected(index, STATE, body["local_premises"], [("RepoA.glend_zero", body["new_premises"][0]["decl"])], 6)
    assert_same(answer.json(), wanted)
    assert all(set(hit) == {"name", "score"} for hit in answer.json())
    # Only the listed premises and the new one can be suggested.
    allowed = {index.premises[r]["full_name"] for r in body["local_premises"]} | {"RepoA.glend_zero"}
    assert {hit["name"] for hit in answer.json()} <= allowed


def test_new_client_format(live, built) -> None:
    index = built["index"]
    body = json.loads(NEW_CLIENT)
    new = [(p["name"], p["decl"]) for p in body["new_premises"]]
    answer = post(live.url, NEW_CLIENT).json()
    wanted = expected(index, STATE, rows_of(index, ["Core.Basic", "RepoA.Base"]), new, 100)
    assert_same(answer, wanted)
    assert len(answer) == 12 + 11 + 2  # every premise of the two modules, and the new ones
    assert [hit["score"] for hit in answer] == sorted((hit["score"] for hit in answer), reverse=True)


@pytest.mark.parametrize("body", [{"state": STATE, "k": 100},
                                  {"state": STATE, "local_premises": None, "imported_modules": None, "k": 100}])
def test_no_lists_means_everything_is_accessible(live, built, body) -> None:
    answer = post(live.url, json.dumps(body)).json()
    assert_same(answer, expected(built["index"], STATE, None, [], 100))
    assert len(answer) == 38


def test_empty_lists_mean_only_the_new_premises(live, built) -> None:
    body = {"state": STATE, "local_premises": [], "imported_modules": [], "k": 10,
            "new_premises": [{"name": "RepoA.only", "decl": "theorem RepoA.only : Eq (glend 0) 0"}]}
    assert [hit["name"] for hit in post(live.url, json.dumps(body)).json()] == ["RepoA.only"]


# ---- accessibility by module, against `leanagent retrieve --file` -------------------------------------

def _client_view(index: PremiseIndex, file: str, line: int) -> dict:
    """What a Lean client editing `file` at `line` sends: its imports (transitively) as modules, and the file's own
    premises that end before `line` by position in /indexed-premises."""
    imported = index.corpus.transitive_imports(file)
    names = [p["full_name"] for p in index.premises]
    own = [names.index(index.premises[r]["full_name"]) for r in range(*index.files[file].rows)
           if tuple(index.premises[r]["end"]) <= (line, 0)]
    return {"state": STATE, "imported_modules": [MODULES.index(module_name(p)) for p in sorted(imported)],
            "local_premises": own, "k": 100}


def test_accessibility_by_module_matches_retrieve_file(live, built) -> None:
    index, folder = built["index"], built["root"] / "index"
    # In the middle of RepoA/Ext.lean: RepoA.Main's premises and Ext's later ones are out of reach.
    body = _client_view(index, "RepoA/Ext.lean", 47)
    answer = post(live.url, json.dumps(body)).json()
    hits = index.retrieve(STATE, k=100, file="RepoA/Ext.lean", line=47)
    assert [h["name"] for h in answer] == [h.full_name for h in hits]
    assert [h["score"] for h in answer] == pytest.approx([h.score for h in hits], abs=1e-6)
    assert len(answer) == 12 + 11 + 3 and not any(h["name"].startswith("RepoA.snysp") for h in answer)
    # Past the file's last premise, through the command a user runs: all of Ext's premises are accessible.
    body = _client_view(index, "RepoA/Ext.lean", 500)
    answer = post(live.url, json.dumps(body)).json()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "leanagent.cli", "retrieve", str(folder), "--state", STATE,
                           "--file", "RepoA/Ext.lean", "--line", "500", "-k", "100", "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    cli = json.loads(done.stdout)["premises"]
    assert [h["name"] for h in answer] == [p["full_name"] for p in cli]
    assert [h["score"] for h in answer] == pytest.approx([p["score"] for p in cli], abs=1e-6)
    assert len(answer) == 12 + 11 + 8


# ---- new premises -------------------------------------------------------------------------------------

def test_a_new_premise_replaces_the_indexed_one_of_its_name(live, built) -> None:
    index = built["index"]
    decl = "theorem RepoA.clig_zero (x : Nat) : Eq (blix (glend x) (quon m)) (frob 0)"
    body = {"state": STATE, "k": 100, "new_premises": [{"name": "RepoA.clig_zero", "decl": decl}]}
    answer = post(live.url, json.dumps(body)).json()
    assert_same(answer, expected(index, STATE, None, [("RepoA.clig_zero", decl)], 100))
    names = [hit["name"] for hit in answer]
    assert len(names) == 38 and names.count("RepoA.clig_zero") == 1  # replaced, not added
    indexed = {h.full_name: h.score for h in index.retrieve(STATE, k=38)}
    served = next(hit["score"] for hit in answer if hit["name"] == "RepoA.clig_zero")
    assert abs(served - indexed["RepoA.clig_zero"]) > 1e-3  # the new declaration's score, not the stored one


def test_new_premises_are_ranked_with_indexed_ones_and_cached(built) -> None:
    index = built["index"]
    # A new premise whose text is an indexed premise's own scores as that premise does: one scale for both.
    source = index.premises[10]
    twin = source["text"]  # already tagged with its own name, so the new name leaves it as it is
    server = PremiseServer(index, ServeLimits(cache_size=2))
    request = RetrieveRequest(state=STATE, k=100, new_premises=[{"name": "RepoA.twin", "decl": twin}])
    answer = server.retrieve(request)
    assert_same(answer, expected(index, STATE, None, [("RepoA.twin", twin)], 100))
    score = {hit["name"]: hit["score"] for hit in answer}
    assert len(answer) == 39 and score["RepoA.twin"] == pytest.approx(score[source["full_name"]], abs=1e-2)
    assert server.retrieve(request) == answer and server._cache.hits == 1  # the second time from the cache
    # The cache stays within its bound; an evicted premise is simply embedded again, with the same answer.
    many = [{"name": f"RepoA.n{i}", "decl": f"theorem RepoA.n{i} : Eq (frob {i}) {i}"} for i in range(5)]
    wide = server.retrieve(RetrieveRequest(state=STATE, k=100, new_premises=many))
    assert len(server._cache) == 2 and len(wide) == 38 + 5
    assert server.retrieve(RetrieveRequest(state=STATE, k=100, new_premises=many)) == wide


# ---- limits and bad requests --------------------------------------------------------------------------

@pytest.mark.parametrize(("k", "length"), [(0, 0), (-3, 0), (1, 1), (1000, 5)])
def test_k_is_capped_and_k_below_one_gives_nothing(strict, k: int, length: int) -> None:
    answer = post(strict.url, json.dumps({"state": STATE[:100], "k": k}))
    assert answer.status_code == 200 and isinstance(answer.json(), list)
    assert len(answer.json()) == length


def _decl(name: str, size: int = 10) -> dict:
    return {"name": name, "decl": "theorem " + name + " : " + "x" * size}


BAD_REQUESTS = [
    ("live", b"{not json", 400, "body is not JSON: Expecting property name"),
    ("live", b"\xff\xfe{}", 400, "not UTF-8 JSON"),
    ("live", b"[1, 2]", 422, "must be a JSON object with a state, found a JSON list"),
    ("live", b"{}", 422, "state: Field required"),
    ("live", b'{"state": 3}', 422, "state: Input should be a valid string"),
    ("live", b'{"state": "s", "k": "5"}', 422, "k: Input should be a valid integer"),
    ("live", b'{"state": "s", "k": true}', 422, "k: Input should be a valid integer"),
    ("live", b'{"state": "s", "local_premises": [0, -1]}', 422, "local_premises[1]: -1 is not a position in GET "
                                                                "/indexed-premises (0-37)"),
    ("live", b'{"state": "s", "local_premises": [38, 40]}', 422, "local_premises[0]: 38 is not a position in GET "
                                                                 "/indexed-premises (0-37) (and 1 more)"),
    ("live", b'{"state": "s", "imported_modules": [4]}', 422, "imported_modules[0]: 4 is not a position in GET "
                                                              "/indexed-modules (0-3)"),
    ("live", b'{"state": "s", "imported_modules": ["Core.Basic"]}', 422, "imported_modules.0: Input should be a "
                                                                         "valid integer"),
    ("live", b'{"state": "s", "new_premises": [{"name": "a"}]}', 422, "new_premises.0.decl: Field required"),
    ("live", b'{"state": "s", "new_premises": {"name": "a"}}', 422, "new_premises: Input should be a valid list"),
    ("strict", json.dumps({"state": "s", "new_premises": [_decl("a"), _decl("b"), _decl("c")]}).encode(), 413,
     "new_premises: 3 premises, more than this server's 2 (GET /max-new-premises)"),
    ("strict", json.dumps({"state": "s" * 201}).encode(), 413, "state: 201 characters, more than this server's 200"),
    ("strict", json.dumps({"state": "s", "new_premises": [_decl("a", 100)]}).encode(), 413,
     "new_premises[0] (a): decl of 112 characters, more than this server's 100"),
    ("strict", json.dumps({"state": "s", "pad": " " * 3000}).encode(), 413, "more than this server's 3,000"),
]


@pytest.mark.parametrize(("which", "body", "status", "reason"), BAD_REQUESTS)
def test_each_bad_request_is_refused_in_one_line(request, which: str, body: bytes, status: int, reason: str) -> None:
    server = request.getfixturevalue(which)
    answer = post(server.url, body)
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert isinstance(error, dict) and set(error) == {"error"}  # never parses as a result array
    assert reason in error["error"] and "\n" not in error["error"] and "Traceback" not in answer.text, error


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/retrieve", 405), ("POST", "/indexed-premises", 405),
                                                         ("GET", "/nowhere", 404)])
def test_wrong_method_or_path_is_one_line_listing_the_api(live, method: str, path: str, status: int) -> None:
    answer = httpx.request(method, f"{live.url}{path}")
    assert answer.status_code == status
    assert "POST /retrieve" in answer.json()["error"] and "\n" not in answer.json()["error"]


def _content_length(reply: bytes) -> int:
    head = reply.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next(int(line.split(":", 1)[1]) for line in head.splitlines() if line.startswith("content-length:"))


def test_a_body_declared_too_large_is_refused_before_it_is_read(strict) -> None:
    with socket.create_connection(("127.0.0.1", int(strict.url.rsplit(":", 1)[1])), timeout=30) as conn:
        conn.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999999\r\n\r\n{")
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _content_length(reply):
            chunk = conn.recv(65536)
            assert chunk, reply
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "999,999,999 bytes, more than this server's 3,000" in reply


# ---- concurrency ----------------------------------------------------------------------------------------

def test_bounded_concurrent_load_loses_nothing_and_stops_cleanly(built, caplog) -> None:
    clients, per_client = 8, 12
    index = built["index"]
    bodies = []
    for c in range(clients):
        for m in range(per_client):
            body = {"state": f"x y : Nat\n⊢ Eq (glend {c}) (blix (quon {m}) y)", "k": 3 + (c + m) % 20}
            if m % 3 == 0:
                body["imported_modules"] = [0, (c + m) % 4]
            if m % 2 == 0:
                body["new_premises"] = [_decl(f"RepoA.c{c}m{m}"), _decl("RepoA.shared")]
            bodies.append(body)
    caplog.set_level(logging.WARNING)
    app = create_app(index)
    with LiveServer(app) as server:
        with httpx.Client(timeout=120) as sequential:
            wanted = [sequential.post(f"{server.url}/retrieve", json=b).json() for b in bodies]
        assert all(isinstance(w, list) and w for w in wanted)

        def client(c: int) -> list[tuple[int, int, object]]:
            with httpx.Client(timeout=120) as http:
                out = []
                for m in range(per_client):
                    i = c * per_client + m
                    answer = http.post(f"{server.url}/retrieve", json=bodies[i])
                    out.append((i, answer.status_code, answer.json()))
                return out

        with ThreadPoolExecutor(clients) as pool:
            results = [r for batch in pool.map(client, range(clients)) for r in batch]
        served = app.state.premise_server.requests
    assert sorted(i for i, _, _ in results) == list(range(clients * per_client))  # nothing lost
    assert all(status == 200 for _, status, _ in results)
    for i, _, answer in results:  # nothing mixed up between requests
        assert [h["name"] for h in answer] == [h["name"] for h in wanted[i]], i
        assert [h["score"] for h in answer] == pytest.approx([h["score"] for h in wanted[i]], abs=1e-6)
    assert served == 2 * clients * per_client
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with pytest.raises(httpx.ConnectError):  # stopped: nothing listens any more
        httpx.get(f"{server.url}/health", timeout=5)


# ---- the command --------------------------------------------------------------------------------------

def test_leanagent_serve_answers_and_stops_on_sigterm(built) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(built["root"] / "index"),
                             "--port", "0"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
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
    assert rc == 0 and "stopped (SIGTERM) after 1 retrieval(s)" in rest and "Traceback" not in rest, rest


def test_serve_help_states_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "INDEX", "--help"])
    text = capsys.readouterr().out
    limits = ServeLimits()
    for flag, value in (("--max-k", limits.max_k), ("--max-new-premises", limits.max_new_premises),
                        ("--cache-size", limits.cache_size)):
        assert flag in text and f"(default {value})" in " ".join(text.split()), flag


def test_state_embedding_is_the_index_s(built) -> None:
    """The server encodes states with the index's own formatting (a leading `N goals` dropped)."""
    index = built["index"]
    server = PremiseServer(index)
    a = server.retrieve(RetrieveRequest(state="1 goals\n" + STATE, k=5))
    b = server.retrieve(RetrieveRequest(state=STATE, k=5))
    assert a == b and torch.equal(index.encode_state(STATE), index.encode_state("1 goals\n" + STATE))


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
