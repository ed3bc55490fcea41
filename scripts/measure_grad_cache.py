"""What `model.grad_cache` saves and costs: one training step's peak memory and time, cached and not, in one run.

    python scripts/measure_grad_cache.py [--preset tiny] [--layers 2] [--batch 32] [--negatives 3]
                                         [--budget 16384] [--states ../shared/data/minif2f-lean4-ld182/random/test.json]

A batch of `--batch` contexts, each with its positive and `--negatives` negatives (InfoNCE over all of the batch's
premises, as `model.loss: infonce` trains), random bytes at the split's real state lengths for the contexts and at
the same lengths for the premises (cut at 1,024, as `data.max_seq_len`). Each variant runs in a child process of its
own (the retriever's real `training_step` and a backward, dropout on, fp32, after one warm-up step), so the peak
resident memory it adds over the model and batch (getrusage's high-water mark less the RSS before the step) is its
own. Prints and, with `--json`, writes both rows and the ratios. On a GPU the activations are what fills the
memory; on a CPU the same figures come out of RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STATES = REPO_ROOT.parent / "shared" / "data" / "minif2f-lean4-ld182" / "random" / "test.json"


def lengths(states: Path, n: int, seed: int) -> list[int]:
    found = [len(t["state_before"].encode()) + 1 for th in json.loads(states.read_text())
             for t in th["traced_tactics"]] if states.is_file() else [300]
    rng = random.Random(seed)
    return [min(rng.choice(found), 1024) for _ in range(n)]


def child(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from transformers import ByT5Tokenizer, T5EncoderModel

    from leanagent.bench.timing import peak_rss_mb, rss_mb
    from leanagent.model.options import RetrieverOptions
    from leanagent.model.presets import encoder_config
    from leanagent.model.retriever import PremiseRetriever

    config = encoder_config(args.preset)
    config.num_layers = args.layers
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:  # the weights are read into memory; the folder goes
        T5EncoderModel(config).save_pretrained(tmp)
        ByT5Tokenizer().save_pretrained(tmp)
        model = PremiseRetriever(RetrieverOptions(name_or_path=tmp, loss="infonce", token_budget=args.budget,
                                                  grad_cache=args.cached))
    per = 1 + args.negatives

    def pool(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(lens)
        ids = torch.randint(3, 259, (len(lens), width))
        mask = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()
        return ids * mask, mask

    ctx_lens, prem_lens = lengths(args.states, args.batch, 1), lengths(args.states, args.batch * per, 2)
    (cids, cmask), (pids, pmask) = pool(ctx_lens), pool(prem_lens)
    label = torch.zeros(args.batch, args.batch * per)
    label[torch.arange(args.batch), torch.arange(args.batch) * per] = 1
    batch = {"context_ids": cids, "context_mask": cmask, "context_lengths": ctx_lens, "premise_ids": pids,
             "premise_mask": pmask, "premise_lengths": prem_lens, "label": label,
             "index": list(range(args.batch))}
    model.log = lambda *a, **k: None  # no Trainer to log to

    def step() -> float:
        start = time.perf_counter()
        model.training_step(batch, 0).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up: the allocator's first pools, then the peak counts the step alone
    before = rss_mb()
    seconds = step()
    print(json.dumps({"grad_cache": args.cached, "step_s": seconds, "peak_added_mb": peak_rss_mb() - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "byt5-small"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--negatives", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16384, help="model.token_budget: tokens per encoder call")
    parser.add_argument("--states", type=Path, default=DEFAULT_STATES)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cached", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for cached in (False, True):
        argv = [sys.executable, __file__, "--child", "--preset", args.preset, "--layers", str(args.layers),
                "--batch", str(args.batch), "--negatives", str(args.negatives), "--budget", str(args.budget),
                "--states", str(args.states), *(["--cached"] if cached else [])]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"grad_cache {str(cached).lower():>5}: step {rows[-1]['step_s']:.2f} s, peak memory added "
              f"{rows[-1]['peak_added_mb']:.0f} MiB", flush=True)
    summary = {"preset": args.preset, "layers": args.layers, "batch": args.batch, "negatives": args.negatives,
               "budget": args.budget, "rows": rows, "memory_ratio": rows[1]["peak_added_mb"] / rows[0]["peak_added_mb"],
               "time_ratio": rows[1]["step_s"] / rows[0]["step_s"]}
    print(f"cached / uncached: memory {summary['memory_ratio']:.2f}x, time {summary['time_ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
