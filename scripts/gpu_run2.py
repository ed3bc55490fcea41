"""Second device run: Fisher loop vs vectorised on the bench data, and training rows with peak memory."""
import json
import sys
import tempfile
from pathlib import Path

import torch

from leanagent.bench import bench_cuda_training, bench_data, bench_train_vs_fisher, format_table
from leanagent.data.corpus import Corpus
from leanagent.model.presets import write_random_encoder
from leanagent.model.retriever import PremiseRetriever

out, dataset = Path(sys.argv[1]), Path(sys.argv[2])
device, preset, examples = (sys.argv[3], sys.argv[4], 4) if len(sys.argv) > 3 else ("cuda", "byt5-small", 32)
results = {}
corpus = Corpus.from_jsonl(dataset / "corpus.jsonl")
_, train, _ = bench_data(dataset, corpus, "random", 0.2)
model = PremiseRetriever(str(write_random_encoder(Path(tempfile.mkdtemp()) / "model", preset))).to(device)
for method in ("loop", "vectorised"):
    results[method] = bench_train_vs_fisher(model, corpus, train, torch.device(device), torch.bfloat16, examples,
                                            method)
    print(method, results[method], flush=True)
del model
if device == "cuda":
    torch.cuda.empty_cache()
    results["cuda_training"] = bench_cuda_training()
else:
    results["cuda_training"] = bench_cuda_training((2,), (32,), 1, device="cpu", preset="tiny")
print(format_table({"dataset": "random bytes", "device": "cuda", "cuda_training": results["cuda_training"]}))
for row in results["cuda_training"]:
    print(row.get("length"), row.get("batch_size"), row.get("peak_memory_gb"), row.get("error", ""))
(out / "run2.json").write_text(json.dumps(results, indent=2))
