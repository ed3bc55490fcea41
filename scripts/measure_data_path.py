"""The training data path, old against new, on a mathlib-scale synthetic dataset, in one run.

    .venv/bin/python scripts/measure_data_path.py              # the data path before the fast path, against this tree
    .venv/bin/python scripts/measure_data_path.py --baseline 76d4902 --examples 8000 --keep /tmp/scale

The dataset is written by this tree's `leanagent demo-data --mathlib-scale` generator (or reused with
`--dataset`). The baseline is ``git archive REF leanagent`` unpacked into a temporary folder (the
working tree and its git state are not touched); by default REF is the commit before the one that
added ``leanagent/data/tokenize.py`` (HEAD while that file is not committed). Each variant runs in
its own child process, so its corpus load time and memory are its own. Per variant:

- corpus load: seconds (best of 3), the RSS it adds (resident after load, and peak during load), and
  the Python heap it takes (tracemalloc, after load and peak: exact where RSS moves with the allocator);
- negatives + collate: examples/s of ``dataset[i]`` + ``dataset.collate`` over shuffled training examples,
  batch 4, 3 negatives (1 in-file), 1024 bytes, one process; once with every cache cold (premise texts
  are computed on first touch, as in a first epoch), then again over the same examples;
- negatives alone: examples/s of ``sample_negatives`` (caches warm);
- premise tokenization: premises/s of ``tokenize_premises`` in batches of 64, first touch and again;
- a digest of 200 collated batches with fixed negatives: equal digests mean identical tensors.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BATCH, NEGATIVES, IN_FILE, MAX_LEN = 4, 3, 1, 1024


# Its own memory helpers, not leanagent.bench.timing's: the child measures another tree's `leanagent` (the baseline
# archive), which may not have them.
def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mb() -> float:
    """The process's resident high-water mark so far (getrusage: KiB on Linux, bytes on macOS). The child has only
    imported before the load, so its peak during the load is this less the RSS before it (or more, never less)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def child(dataset: Path, examples_to_run: int, out: Path) -> None:
    import torch
    from transformers import ByT5Tokenizer

    import leanagent
    from leanagent.data.corpus import Corpus
    from leanagent.data.dataset import TrainDataset, build_train_examples, sample_negatives, tokenize_premises
    from leanagent.data.theorems import load_split

    tokenizer = ByT5Tokenizer()
    corpus_file = dataset / "corpus.jsonl"
    result: dict[str, object] = {"leanagent": str(Path(leanagent.__file__).parent)}

    gc.collect()
    before = _rss_mb()
    t0 = time.perf_counter()
    corpus = Corpus.from_jsonl(corpus_file)
    times = [time.perf_counter() - t0]
    gc.collect()
    result["load_rss_mb"] = _rss_mb() - before
    result["load_peak_mb"] = max(_peak_rss_mb() - before, result["load_rss_mb"])
    for _ in range(2):
        t0 = time.perf_counter()
        Corpus.from_jsonl(corpus_file)
        times.append(time.perf_counter() - t0)
    result["load_s"] = min(times)
    del corpus
    gc.collect()
    tracemalloc.start()  # exact Python-heap figures (RSS moves with the allocator); slows this load, not timed
    corpus = Corpus.from_jsonl(corpus_file)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    result["load_heap_mb"], result["load_heap_peak_mb"] = current / 2**20, peak / 2**20
    result["premises"], result["files"] = len(corpus), len(corpus.paths)

    examples = build_train_examples(corpus, load_split(dataset / "random" / "train.json"))
    result["train_examples"] = len(examples)
    order = list(range(len(examples)))
    random.Random(0).shuffle(order)
    order = order[: examples_to_run - examples_to_run % BATCH]

    ds = TrainDataset(corpus, examples, tokenizer, NEGATIVES, IN_FILE, MAX_LEN, MAX_LEN, seed=0)
    for label in ("cold", "warm"):  # the same examples twice: premise texts are computed on first touch
        t0 = time.perf_counter()
        for b in range(0, len(order), BATCH):
            ds.collate([ds[i] for i in order[b : b + BATCH]])
        result[f"collate_examples_per_s_{label}"] = len(order) / (time.perf_counter() - t0)

    rng = random.Random(1)
    t0 = time.perf_counter()
    for i in order:
        sample_negatives(corpus, examples[i], NEGATIVES, IN_FILE, rng)
    result["negatives_examples_per_s"] = len(order) / (time.perf_counter() - t0)

    fresh = Corpus.from_jsonl(corpus_file)  # premise texts not computed yet
    sample = random.Random(2).sample(range(len(fresh)), min(8192, len(fresh)))
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        for b in range(0, len(sample), 64):
            tokenize_premises(tokenizer, fresh, sample[b : b + 64], MAX_LEN)
        result[f"tokenize_premises_per_s_{label}"] = len(sample) / (time.perf_counter() - t0)

    fixed = TrainDataset(corpus, examples, tokenizer, NEGATIVES, IN_FILE, MAX_LEN, MAX_LEN, seed=0, deterministic=True)
    digest = hashlib.sha256()
    for b in range(0, min(len(order), 200 * BATCH), BATCH):
        batch = fixed.collate([fixed[i] for i in order[b : b + BATCH]])
        for key in sorted(batch):
            tensor = batch[key]
            digest.update(key.encode() + str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    result["digest"] = digest.hexdigest()[:16]
    out.write_text(json.dumps(result))


def _run_child(pythonpath: Path, dataset: Path, examples: int, tmp: Path, name: str) -> dict[str, object]:
    out = tmp / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(pythonpath), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(dataset), "--examples", str(examples),
           "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=tmp)
    result = json.loads(out.read_text())
    if Path(str(result["leanagent"])).resolve() != (pythonpath / "leanagent").resolve():
        raise SystemExit(f"{name}: imported leanagent from {result['leanagent']}, not {pythonpath}")
    return result


ROWS = (
    ("corpus load (s, best of 3)", "load_s", "{:.2f}"),
    ("corpus load RSS added (MiB)", "load_rss_mb", "{:.0f}"),
    ("corpus load peak RSS added (MiB)", "load_peak_mb", "{:.0f}"),
    ("corpus Python heap after load (MiB)", "load_heap_mb", "{:.1f}"),
    ("corpus Python heap peak during load (MiB)", "load_heap_peak_mb", "{:.1f}"),
    ("negatives + collate, first touch (examples/s)", "collate_examples_per_s_cold", "{:,.0f}"),
    ("negatives + collate, again (examples/s)", "collate_examples_per_s_warm", "{:,.0f}"),
    ("negatives alone (examples/s)", "negatives_examples_per_s", "{:,.0f}"),
    ("tokenize premises, first touch (premises/s)", "tokenize_premises_per_s_cold", "{:,.0f}"),
    ("tokenize premises, again (premises/s)", "tokenize_premises_per_s_warm", "{:,.0f}"),
    ("digest of 200 fixed-negative batches", "digest", "{}"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision whose leanagent/ is the old path (default: the commit "
                                           "before leanagent/data/tokenize.py was added)")
    parser.add_argument("--dataset", type=Path, help="use this dataset instead of generating one")
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--premises", type=int, default=76000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=4000, help="training examples per timed loop")
    parser.add_argument("--keep", type=Path, help="write the generated dataset here and keep it")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.examples, args.out)
        return
    if args.baseline is None:
        added = subprocess.run(["git", "log", "--format=%h", "--diff-filter=A", "--", "leanagent/data/tokenize.py"],
                               cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
        args.baseline = f"{added[-1]}^" if added else "HEAD"

    with tempfile.TemporaryDirectory(prefix="leanagent-measure-") as tmp_name:
        tmp = Path(tmp_name)
        dataset = args.dataset
        if dataset is None:
            sys.path.insert(0, str(REPO))
            from leanagent.data.synthetic_scale import ScaleSpec, write_scale_dataset

            dataset = args.keep or tmp / "dataset"
            t0 = time.perf_counter()
            write_scale_dataset(dataset, ScaleSpec(files=args.files, premises=args.premises, seed=args.seed))
            print(f"generated {dataset} ({args.files} files, {args.premises} premises) in "
                  f"{time.perf_counter() - t0:.1f} s")
        baseline = tmp / "baseline"
        baseline.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline, "leanagent"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
        old = _run_child(baseline, dataset, args.examples, tmp, "old")
        new = _run_child(REPO, dataset, args.examples, tmp, "new")

    print(f"\n{new['files']} files, {new['premises']} premises, {new['train_examples']} training examples; "
          f"batch {BATCH}, {NEGATIVES} negatives, {MAX_LEN} bytes, one process, {args.examples} examples per loop\n")
    print(f"| {'':46} | {'old (' + args.baseline + ')':>16} | {'new':>16} | {'new/old':>7} |")
    print(f"|{'-' * 48}|{'-' * 18}|{'-' * 18}|{'-' * 9}|")
    for label, key, fmt in ROWS:
        a, b = old[key], new[key]
        ratio = f"{b / a:.2f}x" if isinstance(a, float) and a else ("same" if a == b else "DIFFERENT")
        print(f"| {label:46} | {fmt.format(a):>16} | {fmt.format(b):>16} | {ratio:>7} |")
    if old["digest"] != new["digest"]:
        raise SystemExit("the new data path does not give the old path's tensors")


if __name__ == "__main__":
    main()
