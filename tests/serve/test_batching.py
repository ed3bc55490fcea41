"""Batched requests: concurrent `/retrieve` calls share encoder passes and answer as an unbatched server does (fp32),
whatever the grouping; the shared pass itself equals the one-at-a-time encodings."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanagent.data.corpus import serialize_premise
from leanagent.serve import PremiseServer, RetrieveRequest, ServeLimits, create_app
from leanagent.serve.batching import token_parts
from leanagent.serve.schemas import ServerStopping

from .conftest import LONG, LiveServer


def _bodies(built) -> list[dict]:
    """The test split's states, a third of them with new premises (some shared across requests, some repeated)."""
    theorems = json.loads((built["repo"] / "random" / "test.json").read_text())
    states = [t["state_before"] for th in theorems for t in th["traced_tactics"]]
    bodies = []
    for i, state in enumerate((states * 3)[:36]):
        body = {"state": state, "k": 10 + i % 7}
        if i % 3 == 0:
            name = f"RepoA.new{i % 5}"
            body["new_premises"] = [{"name": name, "decl": f"theorem {name} : Eq (frob {i}) 0"},
                                    {"name": "RepoA.shared", "decl": "theorem RepoA.shared (x : Nat) : Eq (quon x) x"}]
        if i % 4 == 1:
            body["imported_modules"] = ["Core.Basic", 1 + i % 3]
        bodies.append(body)
    return bodies


def test_batched_answers_equal_unbatched_ones_for_concurrent_requests(built) -> None:
    bodies = _bodies(built)
    index = built["index"]
    with LiveServer(create_app(index, ServeLimits(batching=False))) as plain, httpx.Client(timeout=120) as http:
        wanted = [http.post(f"{plain.url}/retrieve", json=b).json() for b in bodies]
    assert all(isinstance(w, list) and w for w in wanted)
    # A long wait lets passes gather many requests; how many each takes changes no answer.
    app = create_app(index, ServeLimits(batching=True, batch_wait_ms=50))
    with LiveServer(app) as batched:
        def client(c: int) -> list[tuple[int, list]]:
            with httpx.Client(timeout=120) as client_http:
                return [(i, client_http.post(f"{batched.url}/retrieve", json=bodies[i]).json())
                        for i in range(c, len(bodies), 12)]

        with ThreadPoolExecutor(12) as pool:
            answers = dict(hit for batch in pool.map(client, range(12)) for hit in batch)
        health = httpx.get(f"{batched.url}/health").json()
    assert sorted(answers) == list(range(len(bodies)))
    for i, answer in answers.items():
        assert [h["name"] for h in answer] == [h["name"] for h in wanted[i]], i
        assert [h["score"] for h in answer] == pytest.approx([h["score"] for h in wanted[i]], abs=1e-6), i
    assert health["batching"] is True and 1 <= health["encoder_passes"] <= len(bodies) == health["requests"]
    with LiveServer(create_app(index)) as default:  # batched unless told not to (see ServeLimits.batching)
        assert httpx.get(f"{default.url}/health").json()["batching"] is True


def test_one_pass_of_states_and_premises_equals_their_own_passes(built) -> None:
    """The grouping's arithmetic: states and premise texts of several lengths in one sorted pass give each row its
    own pass's embedding, up to float rounding (padding is masked), premises rounded to bf16 as stored."""
    index = built["index"]
    states = [b["state"] for b in _bodies(built)[:9]]
    texts = [serialize_premise(p["full_name"], p["text"]) for p in index.premises[:7]]
    together, premises = index.encode_together(states, texts)
    alone = torch.cat([index.encode_state(s) for s in states])
    assert together.shape == alone.shape and torch.allclose(together, alone, atol=1e-6)
    assert torch.allclose(premises, index.encode_premises(texts), atol=1e-2)  # bf16 rows: within its rounding
    assert (premises == index.encode_premises(texts)).float().mean() > 0.99


def test_a_pass_ranked_together_equals_each_request_ranked_alone(built) -> None:
    """One product of a pass's states with the index, one top-k: each request keeps its own mask and k (all
    premises, a module's, or a few rows) and gets the names and scores its own ranking gives."""
    index = built["index"]
    server = PremiseServer(index, ServeLimits(batching=False))
    states, _ = index.encode_together([b["state"] for b in _bodies(built)[:8]], [])
    n = len(server.row_names)
    some = np.zeros(n, dtype=bool)
    some[[0, 3, 5]] = True
    queries = [(None, 10), (server._accessible(RetrieveRequest(state="s", imported_modules=["Core.Basic"])), 4),
               (some, 7), (None, 1), (np.ones(n, dtype=bool), 16), (some, 2), (None, n + 5), (None, 3)]
    together = server._top_indexed(states, queries)
    alone = [server._top_indexed(states[i:i + 1], [q])[0] for i, q in enumerate(queries)]
    assert [len(t) for t in together] == [10, 4, 3, 1, 16, 2, len(server.premise_names), 3]
    for mine, theirs in zip(together, alone, strict=True):
        assert [name for _, name in mine] == [name for _, name in theirs]
        assert [s for s, _ in mine] == pytest.approx([s for s, _ in theirs], abs=1e-6)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.text(max_size=40), max_size=30), st.integers(1, 64), st.integers(1, 32))
def test_token_parts_keep_the_order_and_each_part_within_its_budget(texts, budget, max_len) -> None:
    """A pass of many new premises is encoded a part at a time, the server's stop looked for between parts: the parts
    are the texts in order, each within the budget unless one text alone is over it."""
    parts = token_parts(texts, budget, max_len)
    assert [t for part in parts for t in part] == texts and parts and all(parts[1:])
    for part in parts:
        tokens = sum(min(len(t.encode()), max_len) for t in part)
        assert tokens <= budget or len(part) == 1


def test_an_aborted_encoder_answers_what_waits_and_what_comes_with_a_503(built) -> None:
    """At a stop the encoder's thread ended after every request it held: with the heaviest requests queued, the
    process exited a minute after the signal. Aborted, each request waiting or still to come is a 503 at once."""
    server = PremiseServer(built["index"], ServeLimits())
    server.abort()
    with pytest.raises(ServerStopping):
        server.retrieve(RetrieveRequest(state="x", k=3, new_premises=[{"name": "A.b", "decl": "theorem A.b : True"}]))
    server.close(wait_s=LONG)
    plain = PremiseServer(built["index"], ServeLimits(batching=False))
    plain.abort()
    with pytest.raises(ServerStopping):
        plain.retrieve(RetrieveRequest(state="x", k=3))
