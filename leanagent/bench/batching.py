"""`leanagent bench batching`: batched against unbatched `PremiseServer.retrieve` in process (no HTTP), and the two
parts of a batched pass.

The test split's states of a dataset, k = 32, no lists, once one after another and then from `threads` threads at
once, the two servers taking turns `rounds` times over the same loaded index (ms per request, wall and this
process's CPU; each way's best round kept). Then the parts, `threads` states each way: the encoder (one pass of them
all against one pass each) and the ranking against the index (one product and top-k for them all against one each;
also at byt5-small's width, 1,472, over as many random rows as the index has, since a tiny index's 64 make the
product cheap); each the best of 3 rounds in which the two ways take turns (`best_of_rounds`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from leanagent.bench.options import BatchingOptions
from leanagent.bench.results import Section
from leanagent.bench.timing import best_of_rounds
from leanagent.data.theorems import load_states
from leanagent.ground.names import DEFAULT_SPLIT, TEST_PART, part_file
from leanagent.index.query import PremiseIndex
from leanagent.model.topk import top_k_accessible
from leanagent.serve.schemas import RetrieveRequest, ServeLimits
from leanagent.serve.server import PremiseServer

BYT5_SMALL_WIDTH = 1472
K = 32


@dataclass
class ServerRow(Section):
    """One server's best round: ms per request one at a time and from the threads, wall and CPU."""

    alone_ms: float
    alone_cpu_ms: float
    threads_ms: float
    threads_cpu_ms: float


@dataclass
class BatchingFigures(Section):
    premises: int
    requests: int
    threads: int
    batched: ServerRow | None = None
    unbatched: ServerRow | None = None
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # part: (ms one at a time, ms together)

    def flat(self) -> dict:
        out: dict = {"premises": self.premises, "requests": self.requests, "threads": self.threads}
        for mode in ("batched", "unbatched"):
            row = getattr(self, mode)
            if row is not None:
                out.update({f"{mode}_{key}": value for key, value in row.flat().items()})
        for part, (alone, together) in self.parts.items():
            out.update({f"{part}_alone_ms": alone, f"{part}_together_ms": together})
        return out


def _round(server: PremiseServer, requests: list[RetrieveRequest], threads: int) -> ServerRow:
    cpu, wall = time.process_time(), time.perf_counter()
    for request in requests:
        server.retrieve(request)
    alone = ((time.perf_counter() - wall) / len(requests) * 1000, (time.process_time() - cpu) / len(requests) * 1000)
    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(server.retrieve, requests * 2))
    many = ((time.perf_counter() - wall) / len(requests) / 2 * 1000,
            (time.process_time() - cpu) / len(requests) / 2 * 1000)
    return ServerRow(alone[0], alone[1], many[0], many[1])


def _best(rows: list[ServerRow]) -> ServerRow:
    return min(rows, key=lambda r: r.threads_ms)


def _ms(alone, together) -> tuple[float, float]:
    """ms of each way, after a warm-up of each: the best of 3 rounds in which they take turns."""
    alone(), together()
    best, _ = best_of_rounds({"alone": alone, "together": together}, torch.device("cpu"), 0.0, rounds=3)
    return best["alone"] * 1000, best["together"] * 1000


def _ranking(states: torch.Tensor, embeddings: torch.Tensor) -> tuple[float, float]:
    everything = torch.ones(len(states), len(embeddings), dtype=torch.bool)
    return _ms(lambda: [top_k_accessible(states[i:i + 1], embeddings, everything[:1], K) for i in range(len(states))],
               lambda: top_k_accessible(states, embeddings, everything, K))


def bench_batching(options: BatchingOptions) -> BatchingFigures:
    index = PremiseIndex.load(options.index, dtype=options.dtype)
    states = options.dataset / DEFAULT_SPLIT / part_file(TEST_PART)
    requests = [RetrieveRequest(state=s, k=K) for s in load_states([states])]
    if not requests:
        raise ValueError(f"{states}: no proof state to send")
    servers = {"unbatched": PremiseServer(index, ServeLimits(batching=False)), "batched": PremiseServer(index)}
    for server in servers.values():
        for request in requests[:8]:
            server.retrieve(request)  # warm-up
    rounds: dict[str, list[ServerRow]] = {name: [] for name in servers}
    for _ in range(options.rounds):
        for name, server in servers.items():
            rounds[name].append(_round(server, requests, options.threads))
    figures = BatchingFigures(len(index), len(requests), options.threads, _best(rounds["batched"]),
                              _best(rounds["unbatched"]))
    states = [r.state for r in requests[: options.threads]]
    figures.parts["encoder"] = _ms(lambda: [index.encode_state(s) for s in states],
                                   lambda: index.encode_together(states, []))
    rows = index.embeddings.shape[0]
    figures.parts[f"ranking_{index.embeddings.shape[1]}"] = _ranking(torch.randn(len(states),
                                                                                 index.embeddings.shape[1]),
                                                                     index.embeddings)
    wide = torch.randn(rows, BYT5_SMALL_WIDTH).to(torch.bfloat16).float()
    figures.parts[f"ranking_{BYT5_SMALL_WIDTH}"] = _ranking(torch.randn(len(states), BYT5_SMALL_WIDTH), wide)
    return figures


def batching_table(figures: BatchingFigures) -> str:
    lines = [f"PremiseServer.retrieve in process, {figures.requests} requests, {figures.premises:,} premises, "
             f"k = {K} (ms per request; the best of the rounds)",
             f"  {'server':<10} {'one at a time':>14} {'(CPU)':>8} {f'{figures.threads} threads':>12} {'(CPU)':>8}"]
    for mode in ("batched", "unbatched"):
        row = getattr(figures, mode)
        lines.append(f"  {mode:<10} {row.alone_ms:>14.1f} {row.alone_cpu_ms:>8.1f} {row.threads_ms:>12.1f} "
                     f"{row.threads_cpu_ms:>8.1f}")
    lines.append(f"  the parts of a batched pass, {figures.threads} states (ms): one at a time, together, ratio")
    lines += [f"  {part:<16} {alone:>10.1f} {together:>10.1f} {alone / together:>8.1f}x"
              for part, (alone, together) in figures.parts.items()]
    return "\n".join(lines)
