"""Concurrent requests' encoder work in one pass: their states and their uncached new premises, deduplicated.

Why: a request's cost on a CPU is its state's encoder pass, and 32 passes of one state each cost far more than
one pass of 32 states sorted by length (`PremiseIndex.encode_together`: fewer, larger matmuls, little padding).
One thread owns the encoder and the new-premise cache; a request hands it its state and new premises and waits.
When the thread is free it takes every waiting request up to a token budget, so under load the passes grow
by themselves. It waits a little longer (at most `wait_s`, a few ms) only while other requests are still
arriving (read and checked, not yet handed over), so a lone client never waits. The pass's requests are then
ranked against the index together (`rank`: one product of all their states with the embeddings, which are read
once per pass instead of once per request), each with its own mask and k, on the encoder's thread too (see
`encode`).

At a server's stop (`abort`), requests still waiting and the pass under way end at once with a 503
(`ServerStopping`): a pass of many new premises is encoded `PART_TOKENS` at a time, the stop looked for between
parts, so the thread ends within one part, not after every request it holds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from leanagent.index.query import PremiseIndex
from leanagent.serve.cache import EmbeddingCache
from leanagent.serve.schemas import ServerStopping

# New premises a pass encodes between two looks for a stop: 16 premises at the index's usual 512 bytes (within a
# second with the tiny encoder on a loaded 2-core CPU).
PART_TOKENS = 8192


def token_parts(texts: list[str], budget: int, max_len: int) -> list[list[str]]:
    """`texts` in consecutive parts of at most `budget` tokens each (ByT5: a byte a token, cut at `max_len`); at
    least one text a part, and one part (maybe empty) when they all fit."""
    parts: list[list[str]] = [[]]
    tokens = 0
    for text in texts:
        n = min(len(text.encode()), max_len)
        if parts[-1] and tokens + n > budget:
            parts.append([])
            tokens = 0
        parts[-1].append(text)
        tokens += n
    return parts


@dataclass
class Arrival:
    """One request on its way to the encoder (counted until it is handed over or given up)."""

    handed_over: bool = False


@dataclass
class _Job:
    state: str
    texts: list[str]
    tokens: int
    query: Any  # what `rank` reads besides the state (the server's mask and k)
    finish: Callable[[torch.Tensor, list[torch.Tensor], Any], Any]
    future: Future = field(default_factory=Future)


class EncoderBatcher:
    """The encoder's one thread: `encode(state, texts, query, finish)` from any thread, answered from a shared pass.

    `rank(states, queries)`: the pass's states (one row each) and their requests' queries, in order, to a ranking
    per request; one call per pass."""

    def __init__(self, index: PremiseIndex, cache: EmbeddingCache, token_budget: int, wait_s: float,
                 rank: Callable[[torch.Tensor, list[Any]], list[Any]]) -> None:
        self.index = index
        self.cache = cache
        self.rank = rank
        self.token_budget = token_budget
        self.wait_s = wait_s
        self.passes = self.batched_requests = 0
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._arriving = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._aborted = False

    def close(self, wait_s: float = 0.0) -> None:
        """End the encoder's thread once the requests it holds are answered (a server swapped out lets go of its
        index this way: the thread holds it); `wait_s`: how long to wait for that end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if wait_s and thread is not None and thread is not threading.current_thread():
            thread.join(timeout=wait_s)

    def abort(self) -> None:
        """The server stops: every request waiting, and the one whose pass is under way (at its next part), ends with
        `ServerStopping`; the thread then ends. Idempotent."""
        with self._cond:
            self._aborted = self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in waiting:
            job.future.set_exception(ServerStopping())

    @contextmanager
    def arriving(self) -> Iterator[Arrival]:
        """Count a request from when its body is read until `encode` takes it (or it is refused)."""
        arrival = Arrival()
        with self._cond:
            self._arriving += 1
        try:
            yield arrival
        finally:
            with self._cond:
                if not arrival.handed_over:
                    self._arriving -= 1
                    self._cond.notify_all()

    def encode(self, state: str, texts: list[str], query: Any,
               finish: Callable[[torch.Tensor, list[torch.Tensor], Any], Any], arrival: Arrival | None = None) -> Any:
        """`finish(state_row, text_rows, ranked)`, with `ranked` what `rank` gave this request's `query`, run on the
        encoder's thread after the next pass that takes this request: every torch op on one thread, since on a
        loaded CPU a second thread's OpenMP team spins against the first one's (the likely cause of the batched
        server's higher CPU time per request over HTTP when ranking ran on the request's thread)."""
        # ByT5 reads a token a byte, cut at the index's lengths: what the job adds to a pass
        tokens = min(len(state.encode()), self.index.state_max_len) + sum(
            min(len(t.encode()), self.index.premise_max_len) for t in texts)
        job = _Job(state, texts, tokens, query, finish)
        with self._cond:
            if self._aborted:
                raise ServerStopping()
            if self._closed:
                raise RuntimeError("this server was swapped out and closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="leanagent-encoder", daemon=True)
                self._thread.start()
            if arrival is not None and not arrival.handed_over:
                arrival.handed_over = True
                self._arriving -= 1
            self._queue.append(job)
            self._cond.notify_all()
        return job.future.result()

    def _take(self) -> list[_Job] | None:
        """The next pass's requests: all waiting ones up to the token budget (at least one); None once closed and
        nothing is left."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            deadline = time.monotonic() + self.wait_s
            while self._arriving and sum(j.tokens for j in self._queue) < self.token_budget:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            jobs = [self._queue.popleft()]
            tokens = jobs[0].tokens
            while self._queue and tokens + self._queue[0].tokens <= self.token_budget:
                tokens += self._queue[0].tokens
                jobs.append(self._queue.popleft())
            return jobs

    def _run(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            try:
                states, rows = self._pass(jobs)
                ranked = self.rank(states, [job.query for job in jobs])
            except BaseException as exc:  # each waiting request gets the failure (a 500 naming it), not a hang
                for job in jobs:
                    job.future.set_exception(exc)
            else:
                for i, job in enumerate(jobs):
                    try:
                        job.future.set_result(job.finish(states[i:i + 1], rows[i], ranked[i]))
                    except BaseException as exc:  # this request's own failure
                        job.future.set_exception(exc)

    def _pass(self, jobs: list[_Job]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The jobs' states (a row each) and each job's new-premise rows, from one encoder pass."""
        found, missing = {}, []
        for job in jobs:
            hits, misses = self.cache.lookup(job.texts)
            found.update(hits)
            missing.extend(t for t in misses if t not in found)
        missing = list(dict.fromkeys(missing))
        parts = token_parts(missing, min(self.token_budget, PART_TOKENS), self.index.premise_max_len)
        states, first = self.index.encode_together([job.state for job in jobs], parts[0])
        encoded = [first]
        for part in parts[1:]:  # many new premises: a token budget at a time, the stop looked for between them
            if self._aborted:
                raise ServerStopping()
            encoded.append(self.index.encode_together([], part)[1])
        rows = torch.cat(encoded) if len(encoded) > 1 else first
        self.cache.store(missing, rows)
        found.update(zip(missing, rows, strict=True))
        self.passes += 1
        self.batched_requests += len(jobs)
        return states, [[found[t] for t in job.texts] for job in jobs]
