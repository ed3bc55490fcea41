"""`leanagent serve`'s HTTP protocol, Lean's premise-selection API, on a real uvicorn server on 127.0.0.1 driven by
httpx: the lists the client caches, both clients' golden bodies, accessibility against `leanagent retrieve --file`,
new premises, limits and refusals, and bounded concurrent load.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from leanagent.index.query import PremiseIndex
from leanagent.serve import ServeLimits, create_app, module_name

from .conftest import (
    MODULES,
    NEW_CLIENT,
    OLD_CLIENT,
    REPO_ROOT,
    STATE,
    LiveServer,
    assert_same,
    expected,
    post,
    rows_of,
)


@pytest.fixture(scope="module")
def live(built):
    with LiveServer(create_app(built["index"])) as server:
        yield server


STRICT = ServeLimits(max_k=5, max_new_premises=2, max_state_chars=200, max_decl_chars=100, max_body_bytes=3000,
                     max_positions=500)


@pytest.fixture(scope="module")
def strict(built):
    with LiveServer(create_app(built["index"], STRICT)) as server:
        yield server


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
    assert httpx.get(f"{live.url}/max-new-premises").text == "64"
    health = httpx.get(f"{live.url}/health").json()
    assert health["status"] == "ok" and health["premises"] == 38 and health["modules"] == 4


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


# A user's or LeanHammer's body: modules and premises by name (a list may mix names and positions).
BY_NAME = ('{"state":"x y n m : Nat\\n⊢ Eq (HAdd.hAdd (glend 0) (blix (quon x) m)) (HAdd.hAdd 0 (quon (blix x m)))",'
           '"imported_modules":["Core.Basic",1],"local_premises":["RepoA.vrix_zero",35],"k":100}')


def test_names_or_positions_in_imported_modules_and_local_premises(live, built) -> None:
    index = built["index"]
    premises = httpx.get(f"{live.url}/indexed-premises").json()
    assert premises.index("RepoA.vrix_zero") != 35
    local = [premises.index("RepoA.vrix_zero"), 35]
    by_position = {**json.loads(BY_NAME), "imported_modules": [0, 1], "local_premises": local}
    answer = post(live.url, BY_NAME)
    assert answer.status_code == 200, answer.text
    assert answer.json() == post(live.url, json.dumps(by_position)).json()
    rows = sorted(set(rows_of(index, ["Core.Basic", "RepoA.Base"]))
                  | {r for r, p in enumerate(index.premises) if p["full_name"] in {premises[i] for i in local}})
    assert_same(answer.json(), expected(index, STATE, rows, [], 100))
    assert len(answer.json()) == len(rows) > 12 + 11


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
                           "--file", "RepoA/Ext.lean", "--line", "500", "-k", "100", "--json",
                           "--dtype", "fp32"],  # as the live server's index: the scores are compared exactly
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
    ("live", b"[1, 2]", 422, "must be a JSON object with a state, found a JSON array"),
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
    ("live", b'{"state": "s", "imported_modules": [0, "Core.Nowhere"]}', 422, 'imported_modules[1]: "Core.Nowhere" is '
                                                                          "not a module name in GET /indexed-modules"),
    ("live", b'{"state": "s", "local_premises": ["RepoA.nowhere"]}', 422, 'local_premises[0]: "RepoA.nowhere" is not '
                                                                        "a premise name in GET /indexed-premises"),
    ("live", b'{"state": "s", "imported_modules": [1.5]}', 422, "imported_modules: 1 of its 1 entries are not "
                                                                "positions (integers) or names (strings) ([0] 1.5)"),
    ("live", b'{"state": "s", "new_premises": [{"name": "a"}]}', 422, 'new_premises: 1 of its 1 entries are not '
                                                                     'objects {"name": string, "decl": string} ([0] '
                                                                     '{"name": "a"})'),
    ("live", b'{"state": "s", "new_premises": {"name": "a"}}', 422, "new_premises: must be an array, found a JSON "
                                                                   "object"),
    # One error per field, however many entries are wrong (each entry's own error took 2.5 GB for a million):
    ("live", json.dumps({"state": "s", "local_premises": [0.5] * 1000, "imported_modules": [None, 0, []]}).encode(),
     422, "local_premises: 1,000 of its 1,000 entries are not positions (integers) or names (strings) ([0] 0.5, [1] "
          "0.5, [2] 0.5, and 997 more); imported_modules: 2 of its 3 entries"),
    ("strict", json.dumps({"state": "s", "new_premises": [_decl("a"), _decl("b"), _decl("c")]}).encode(), 413,
     "new_premises: more than this server's 2 (GET /max-new-premises)"),
    ("strict", json.dumps({"state": "s" * 201}).encode(), 413, "state: 201 characters, more than this server's 200"),
    ("strict", json.dumps({"state": "s", "new_premises": [_decl("a", 100)]}).encode(), 413,
     'new premise "a": decl of 112 characters, more than this server\'s 100'),
    ("strict", json.dumps({"state": "s", "pad": " " * 3000}).encode(), 413, "more than this server's 3,000"),
    # What once ended in a 500 and a 115-line traceback, each a 4xx with one line now:
    ("live", b'{"state": "s", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "nests arrays or objects deeper than this server decodes"),
    ("live", b'{"state": "s", "local_premises": [1000000000000000000000000000000]}', 422,
     "local_premises[0]: 1000000000000000000000000000000 is not a position in GET /indexed-premises (0-37)"),
    ("strict", b'{"state": "s", "local_premises": [' + b"1" * 2000 + b"]}", 422,
     'local_premises[0]: 1111111111111111111111111111111111111... is not a position'),
    # Python refuses to read an integer of more than 4,300 digits, anywhere, even in a key nobody reads:
    ("live", b'{"state": "s", "unknown": [' + b"7" * 4301 + b"]}", 422,
     "an integer too large for any field (Exceeds the limit (4300 digits) for integer string conversion"),
    ("live", b'{"state": "s\\ud800"}', 422, "state: not Unicode text (a lone surrogate at character 1)"),
    ("live", b'{"state": "s", "new_premises": [{"name": "\\udfff", "decl": "d"}]}', 422,
     "new_premises[0].name: not Unicode text (a lone surrogate at character 0)"),
    ("live", b'{"state": "s", "local_premises": [NaN]}', 400, "NaN is not a JSON value"),
    ("live", json.dumps({"state": "s", "local_premises": ["x" * 5000]}).encode(), 422,
     'local_premises[0]: "' + "x" * 36 + '... is not a premise name'),
]


@pytest.mark.parametrize(("which", "body", "status", "reason"), BAD_REQUESTS)
def test_each_bad_request_is_refused_in_one_line(request, which: str, body: bytes, status: int, reason: str) -> None:
    server = request.getfixturevalue(which)
    answer = post(server.url, body)
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert isinstance(error, dict) and set(error) == {"error"}  # never parses as a result array
    assert reason in error["error"] and "\n" not in error["error"] and "Traceback" not in answer.text, error
    assert len(answer.content) < 600  # a short prefix of the input at most, whatever its size


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
        served = app.state.holder.requests
    assert sorted(i for i, _, _ in results) == list(range(clients * per_client))  # nothing lost
    assert all(status == 200 for _, status, _ in results)
    for i, _, answer in results:  # nothing mixed up between requests
        assert [h["name"] for h in answer] == [h["name"] for h in wanted[i]], i
        assert [h["score"] for h in answer] == pytest.approx([h["score"] for h in wanted[i]], abs=1e-6)
    assert served == 2 * clients * per_client
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with pytest.raises(httpx.ConnectError):  # stopped: nothing listens any more
        httpx.get(f"{server.url}/health", timeout=5)
