"""The state's encoder pass and the corpus embedding rate at byt5-small's full shape, per `--dtype`, in one run.

    python scripts/measure_dtypes.py [--states ../shared/data/minif2f-lean4-ld182/random/test.json]
                                     [--device cpu] [--dtypes fp32,bf16,int8] [--repeats 3] [--json OUT]

The encoder is byt5-small's (12 layers, `leanagent.model.presets`) with random weights from its T5Config: no
download, and the time of a pass does not depend on the weights. States: the median-length one of the split
(262 bytes for minif2f's test split) and a 1,024-byte one (the cut; the longest states are cut there), encoded
as `PremiseIndex.encode_state` encodes them, each the median of `--repeats` passes after one warm-up. The corpus
rate: 64 premises of the split's premise lengths, embedded as `PremiseIndex.encode_together` does (sorted,
token-budget sub-batches). `leanagent.model.dtypes.AUTO_CPU` records what this chose on the project's machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from leanagent.data.dataset import tokenize_texts  # noqa: E402
from leanagent.model.dtypes import apply_dtype, precision  # noqa: E402
from leanagent.model.loading import load_model  # noqa: E402
from leanagent.model.presets import write_random_encoder  # noqa: E402

DEFAULT_STATES = REPO_ROOT.parent / "shared" / "data" / "minif2f-lean4-ld182" / "random" / "test.json"


def pick_states(file: Path) -> dict[str, str]:
    """The median-length state of a LeanDojo split and a 1,024-byte one (a longer state's first 1,024 bytes)."""
    theorems = json.loads(file.read_text()) if file.is_file() else []
    found = sorted({t["state_before"] for th in theorems for t in th.get("traced_tactics", [])},
                   key=lambda s: len(s.encode()))
    if not found:
        found = ["x y : Nat\n⊢ x + y = y + x" * 8]
    median = found[len(found) // 2]
    long = max(found, key=lambda s: len(s.encode())).encode()
    long = (long * (1024 // len(long) + 1))[:1024].decode(errors="ignore")
    return {f"state_{len(median.encode())}b": median, f"state_{len(long.encode())}b": long}


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: the first pass allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def encode(retriever, dtype: str, texts: list[str], max_len: int) -> torch.Tensor:
    """As the index encodes: cut at `max_len`, sorted token-budget sub-batches, at `dtype`'s precision."""
    device = retriever.device
    ids, mask = tokenize_texts(retriever.tokenizer, texts, max_len)
    with torch.inference_mode(), precision(dtype, device):
        return retriever.encode_pool(ids.to(device), mask.to(device), mask.sum(dim=1).tolist(), sort=True)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=Path, default=DEFAULT_STATES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="fp32,bf16,int8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--premises", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    states = pick_states(args.states)
    premise_texts = [("theorem t (x : Nat) : " + "frob x = x ∧ " * 40)[: 120 + 6 * i] for i in range(args.premises)]
    out: dict = {"device": args.device, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                 "torch_threads": torch.get_num_threads(), "preset": "byt5-small"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_encoder(Path(tmp) / "byt5-small", "byt5-small")
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            retriever = load_model(folder, args.device).retriever
            resolved = apply_dtype(retriever, dtype)

            for name, state in states.items():
                seconds = timed(lambda s=state, r=retriever, d=resolved: encode(r, d, [s], 1024), args.repeats)
                out[f"{resolved}_{name}_s"] = seconds
                print(f"{resolved:>5} {name}: {seconds:.3f} s", flush=True)
            seconds = timed(lambda r=retriever, d=resolved: encode(r, d, premise_texts, 512), 1)
            out[f"{resolved}_premises_per_s"] = len(premise_texts) / seconds
            print(f"{resolved:>5} corpus: {len(premise_texts) / seconds:.1f} premises/s", flush=True)
            del retriever
    out["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
