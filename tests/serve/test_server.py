"""`PremiseServer`, the protocol without HTTP: new premises ranked with indexed ones and cached, states encoded
as the index encodes them."""

from __future__ import annotations

import pytest
import torch

from leanagent.serve import PremiseServer, RetrieveRequest, ServeLimits
from leanagent.serve.cache import ENTRY_OVERHEAD

from .conftest import STATE, assert_same, expected


def test_new_premises_are_ranked_with_indexed_ones_and_cached(built) -> None:
    index = built["index"]
    # A new premise whose text is an indexed premise's own scores as that premise does: one scale for both.
    source = index.premises[10]
    twin = source["text"]  # already tagged with its own name, so the new name leaves it as it is
    # Unbatched: a twin ties with its source exactly only when embedded in a pass of its own, as `expected` does
    # (in a shared pass its row moves by float rounding; test_batching.py compares the two paths).
    # Room for two rows of this index (64 values each, as stored, and an entry's overhead): bounded in bytes.
    row_bytes = 64 * index.embeddings.element_size()
    server = PremiseServer(index, ServeLimits(cache_mb=2.5 * (row_bytes + ENTRY_OVERHEAD) / 2**20, batching=False))
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


def test_state_embedding_is_the_index_s(built) -> None:
    """The server encodes states with the index's own formatting (a leading `N goals` dropped)."""
    index = built["index"]
    server = PremiseServer(index)
    a = server.retrieve(RetrieveRequest(state="1 goals\n" + STATE, k=5))
    b = server.retrieve(RetrieveRequest(state=STATE, k=5))
    assert a == b and torch.equal(index.encode_state(STATE), index.encode_state("1 goals\n" + STATE))
