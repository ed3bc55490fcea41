"""`POST /retrieve` fuzzed, as the trusted servers are: whatever body arrives (any JSON value, a request object with
any values in its fields, any bytes up to past the body limit), a real server on 127.0.0.1 answers a 2xx or a 4xx
with one line, never a 500, and its memory stays bounded. Reproducible: derandomized, bounded examples."""

from __future__ import annotations

import json
import resource

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanagent.serve import ServeLimits, create_app

from .conftest import STATE, LiveServer

LIMITS = ServeLimits(max_body_bytes=8192, max_new_premises=8, max_positions=256, max_name_chars=64,
                     max_decl_chars=2000, max_state_chars=4000, max_k=50)
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=5), max_leaves=20)
NAMES = st.sampled_from(["RepoA.glend_zero", "Core.Basic", "«a b».c", "x", "", "RepoA.Main"])
POSITION = st.one_of(st.integers(-3, 60), st.integers(), NAMES, JSON)
NEW = st.one_of(st.fixed_dictionaries({"name": st.one_of(NAMES, st.text(max_size=70)),
                                       "decl": st.text(max_size=300)}), JSON)
REQUEST = st.fixed_dictionaries({}, optional={
    "state": st.one_of(st.just(STATE), st.text(max_size=200), JSON),
    "local_premises": st.one_of(st.lists(POSITION, max_size=20), JSON),
    "imported_modules": st.one_of(st.lists(POSITION, max_size=8), JSON),
    "imported_all_modules": st.one_of(st.lists(POSITION, max_size=8), JSON),
    "new_premises": st.one_of(st.lists(NEW, max_size=10), JSON),
    "k": st.one_of(st.integers(-5, 100), st.integers(), JSON),
    "caller_in_module_system": st.one_of(st.booleans(), JSON),
})


@pytest.fixture(scope="module")
def server(built):
    with LiveServer(create_app(built["index"], LIMITS)) as live, httpx.Client(timeout=120) as http:
        yield live.url, http


def _answered(server, body: bytes) -> None:
    url, http = server
    answer = http.post(f"{url}/retrieve", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code < 500, (answer.status_code, answer.text, body[:200])
    if answer.status_code == 200:
        hits = answer.json()
        assert isinstance(hits, list) and all(set(h) == {"name", "score"} for h in hits)
    else:
        error = answer.json()["error"]
        assert isinstance(error, str) and "\n" not in error and len(error) <= 500


def _peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@FUZZ
@given(st.one_of(REQUEST, JSON))
def test_any_json_gets_a_2xx_or_a_4xx(server, value) -> None:
    before = _peak_kb()
    _answered(server, json.dumps(value).encode())
    assert _peak_kb() - before < 256 * 1024  # kB: no request of these sizes grows the process by 256 MB


@FUZZ
@given(st.binary(max_size=LIMITS.max_body_bytes + 100))
def test_any_bytes_get_a_4xx(server, body) -> None:
    url, http = server
    answer = http.post(f"{url}/retrieve", content=body)
    assert 400 <= answer.status_code < 500 or (answer.status_code == 200 and body.strip().startswith(b"{")), \
        (answer.status_code, answer.text, body[:100])
