"""Batched against unbatched `PremiseServer.retrieve` in process (no HTTP): ms per request, wall and CPU.

    python scripts/measure_batching.py INDEX DATASET [--threads 32] [--rounds 3] [--dtype fp32]

The quick check beside scripts/measure_serve.py (which goes through real `leanagent serve` processes): the test
split's states of DATASET, k = 32, no lists, once one after another and then from `--threads` threads at once,
the two servers taking turns `--rounds` times over the same loaded index. CPU time is this process's. Then the two
parts of a batched pass, `--threads` states each way: the encoder (one pass of them all against one pass each) and
the ranking against the index (one product and top-k for them all against one each; also at byt5-small's width,
1,472, over as many random rows as the index has, since the tiny preset's 64 make the product cheap); each the
best of 3 rounds in which the two ways take turns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from leanagent.bench.timing import best_of_rounds  # noqa: E402
from leanagent.index import PremiseIndex  # noqa: E402
from leanagent.model.topk import top_k_accessible  # noqa: E402
from leanagent.serve import PremiseServer, RetrieveRequest, ServeLimits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", type=Path)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()
    index = PremiseIndex.load(args.index, dtype=args.dtype)
    theorems = json.loads((args.dataset / "random" / "test.json").read_text())
    requests = [RetrieveRequest(state=t["state_before"], k=32) for th in theorems for t in th["traced_tactics"]]
    servers = {"unbatched": PremiseServer(index, ServeLimits(batching=False)), "batched": PremiseServer(index)}
    for server in servers.values():
        for request in requests[:8]:
            server.retrieve(request)  # warm-up
    for rnd in range(args.rounds):
        for name, server in servers.items():
            cpu, wall = time.process_time(), time.perf_counter()
            for request in requests:
                server.retrieve(request)
            seq = ((time.perf_counter() - wall) / len(requests) * 1000,
                   (time.process_time() - cpu) / len(requests) * 1000)
            cpu, wall = time.process_time(), time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(server.retrieve, requests * 2))
            par = ((time.perf_counter() - wall) / len(requests) / 2 * 1000,
                   (time.process_time() - cpu) / len(requests) / 2 * 1000)
            passes = server.batcher.passes if server.batcher else None
            print(f"round {rnd} {name:>9}: one at a time {seq[0]:6.1f} ms/request (CPU {seq[1]:5.1f}); "
                  f"{args.threads} threads {par[0]:6.1f} ms/request (CPU {par[1]:5.1f}); encoder passes so far "
                  f"{passes}", flush=True)
    parts(index, [r.state for r in requests[:args.threads]])


def _ms(alone, together) -> tuple[float, float]:
    """ms of each way, after a warm-up of each: the best of 3 rounds in which they take turns (`best_of_rounds`)."""
    alone(), together()
    best, _ = best_of_rounds({"alone": alone, "together": together}, torch.device("cpu"), 0.0, rounds=3)
    return best["alone"] * 1000, best["together"] * 1000


def _ranking(states: torch.Tensor, embeddings: torch.Tensor) -> tuple[float, float]:
    """ms to rank `states` against every row (k = 32): one at a time, then all in one product."""
    everything = torch.ones(len(states), len(embeddings), dtype=torch.bool)
    return _ms(lambda: [top_k_accessible(states[i:i + 1], embeddings, everything[:1], 32)
                        for i in range(len(states))],
               lambda: top_k_accessible(states, embeddings, everything, 32))


def parts(index: PremiseIndex, states: list[str]) -> None:
    """A batched pass's encoder and ranking, together against one request at a time."""
    n = len(states)
    alone, together = _ms(lambda: [index.encode_state(s) for s in states], lambda: index.encode_together(states, []))
    print(f"encoder, {n} states: one pass each {alone:.0f} ms, one pass of all {together:.0f} ms "
          f"({alone / together:.1f}x)", flush=True)
    rows = index.embeddings.shape[0]
    for width, embeddings in ((index.embeddings.shape[1], index.embeddings),
                              (1472, torch.randn(rows, 1472).to(torch.bfloat16).float())):
        alone, together = _ranking(torch.randn(n, width), embeddings)
        print(f"ranking, {n} states x {rows:,} rows {width} wide: each alone {alone:.0f} ms, together "
              f"{together:.0f} ms ({alone / together:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
