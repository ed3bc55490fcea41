"""The cost of following a run: what `leanagent serve RUN_DIR` spends swapping in a newer stage at Mathlib size.

`bench_swap` writes a Mathlib-sized corpus, two premise indexes of it (two stages of a run: the second's lists
extend the first's) and a run folder whose manifest names the first, starts `leanagent serve RUN_DIR` as a user
runs it, with a client asking all along, then records the second stage in the manifest and measures:

- the swap's time, from the manifest naming the new stage to the server saying it serves it (the new index and
  model loaded beside the old, checked, its tables built);
- the server's memory before, at its peak (Linux's VmHWM: the two stages at once), and after (the old stage let
  go; what the allocator returns to the system, it returns);
- every request's status, before, during and after.

With `embed: model` the indexes are embedded by the model (the tiny preset embeds 76,000 premises in about a
minute on a CPU); with `random`, their rows are random unit vectors of the model's width (a byt5-small index,
which would take a CPU a day to embed, at its true size) and the server is started with `--force`, which skips
the check that the model gives the stored rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from leanagent.bench.options import SwapOptions
from leanagent.bench.results import Section
from leanagent.bench.timing import process_peak_rss_mb, process_rss_mb
from leanagent.data.corpus import Corpus
from leanagent.data.synthetic_scale import ScaleSpec, write_scale_dataset
from leanagent.ground import model_identity
from leanagent.ground.names import CORPUS_FILE
from leanagent.index.build import build_index
from leanagent.index.files import read_names, write_index
from leanagent.model.presets import write_random_encoder
from leanagent.run.manifest import MANIFEST_NAME, repo_key


@dataclass
class SwapFigures(Section):
    premises: int
    width: int
    embed: str
    swap_s: float
    rss_before_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    requests: int
    failed: int
    statuses: dict[str, int] = field(default_factory=dict)

    def flat(self) -> dict:
        return {f"swap_{k}": v for k, v in asdict(self).items()}


def _memory(pid: int) -> dict[str, float]:
    """A process's resident memory now and its high-water mark, in MiB."""
    return {"rss": process_rss_mb(pid), "peak": process_peak_rss_mb(pid)}


def _index(model: Path, dataset: Path, out: Path, embed: str, after: Path | None = None) -> None:
    if embed == "model" and after is None:
        build_index(model, dataset, out)
        return
    corpus = Corpus.from_jsonl(dataset / CORPUS_FILE)
    if embed == "model":  # the second stage: the same rows (the same model), its lists extending the first's
        rows = load_file(str(after / "embeddings.safetensors"))["embeddings"]
    else:
        width = json.loads((model / "config.json").read_text())["d_model"]
        rows = torch.nn.functional.normalize(torch.randn(len(corpus), width, generator=torch.Generator().manual_seed(
            len(str(out)))), dim=1)
    write_index(out, corpus, rows, {"model": str(model), "model_identity": model_identity.identify(model),
                                    "max_seq_len": 512, "context_max_len": 1024},
                read_names(after) if after is not None else None)


def _manifest(run_dir: Path, stages: list[Path]) -> None:
    names = [f"stage{i}" for i in range(len(stages))]
    repos = {repo_key(i, name): {"index": i, "name": name, "stages": {
        f"eval-{j:02d}-{names[j]}": {"status": "done", "result": {"metrics": {"Recall@10": 0.0},
                                                                  "job": {"index": str(folder)}}}
        for j in range(i + 1)}} for i, (name, folder) in enumerate(zip(names, stages, strict=True))}
    tmp = run_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps({"order": names, "repos": repos}))
    os.replace(tmp, run_dir / MANIFEST_NAME)


def bench_swap(options: SwapOptions) -> SwapFigures:
    with tempfile.TemporaryDirectory(prefix="leanagent-swap-") as tmp:
        work = Path(options.work or tmp)
        dataset = write_scale_dataset(work / "data", ScaleSpec(files=options.files, premises=options.premises,
                                                              theorems=60))
        model = write_random_encoder(work / "model", options.preset)
        run_dir = work / "run"  # the stages' indexes inside it, where a run writes them (a server serves no other)
        first, second = run_dir / "index" / "00-stage0", run_dir / "index" / "01-stage1"
        _index(model, dataset, first, options.embed)
        _index(model, dataset, second, options.embed, after=first)
        _manifest(run_dir, [first])
        force = ["--force"] if options.embed == "random" else []
        proc = subprocess.Popen([sys.executable, "-m", "leanagent.cli", "serve", str(run_dir), "--port", "0",
                                 "--follow-s", "0.2", *force], stderr=subprocess.PIPE, text=True)
        statuses: dict[str, int] = {}
        stop = threading.Event()
        try:
            banner = proc.stderr.readline()
            if not banner.startswith("serving "):
                raise RuntimeError(f"the server did not start: {banner}{proc.stderr.read()}")
            url = banner.split(" at ", 1)[1].split(";", 1)[0]
            body = {"state": "⊢ a = b", "k": 10, "imported_modules": [0, 1, 2]}

            def ask() -> None:
                with httpx.Client(timeout=600) as http:
                    while not stop.is_set():
                        code = str(http.post(f"{url}/retrieve", json=body).status_code)
                        statuses[code] = statuses.get(code, 0) + 1

            client = threading.Thread(target=ask, daemon=True)
            client.start()
            time.sleep(1.0)  # requests on the first stage before the swap
            before = _memory(proc.pid)
            start = time.monotonic()
            _manifest(run_dir, [first, second])
            line = ""
            while "now serving" not in line:
                line = proc.stderr.readline()
                if not line:
                    raise RuntimeError("the server ended during the swap")
                if "cannot be served" in line:
                    raise RuntimeError(line.strip())
            swap_s = time.monotonic() - start
            time.sleep(3.0)  # requests on the new stage; the old one freed once its last request ends
            after = _memory(proc.pid)
        finally:
            stop.set()
            proc.terminate()
            proc.wait(timeout=120)
        width = int(json.loads((model / "config.json").read_text())["d_model"])
        return SwapFigures(options.premises, width, options.embed, round(swap_s, 2), round(before["rss"], 1),
                           round(after["peak"], 1), round(after["rss"], 1), sum(statuses.values()),
                           sum(n for code, n in statuses.items() if code != "200"), statuses)


def swap_table(f: SwapFigures) -> str:
    return "\n".join([
        f"swap: a run's second stage taken by `leanagent serve RUN_DIR` ({f.premises:,} premises, {f.width} wide, "
        f"rows {'embedded by the model' if f.embed == 'model' else 'random unit vectors'})",
        f"  from the manifest to serving it: {f.swap_s:.2f} s",
        f"  server memory: {f.rss_before_mb:,.0f} MB before, {f.rss_peak_mb:,.0f} MB at its peak, "
        f"{f.rss_after_mb:,.0f} MB after",
        f"  requests answered meanwhile: {f.requests} ({f.failed} not 200: {f.statuses})",
    ])
