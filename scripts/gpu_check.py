"""One prepared GPU check: bf16 training and the Fisher pass on one GPU with NCCL, on a random
byt5-small-shaped encoder, reporting examples/s and the fraction of the GPU's bf16 peak.

    .venv/bin/python scripts/gpu_check.py OUT [--peak-tflops 989]

The FLOP estimate is the usual 6 x parameters x tokens for a training step (forward + backward);
the Fisher pass does one forward and one backward per example, so the same 6x applies. The time
is the whole `fit`, validation (corpus embedding) included, so the training figures are a lower bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leanagent.config import PipelineConfig, dump_config
from leanagent.data.corpus import Corpus
from leanagent.data.examples import build_train_examples
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import load_split
from leanagent.jobs import run_job
from leanagent.model.presets import encoder_config, write_random_encoder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the script itself")
    args = parser.parse_args()
    out = args.out.resolve()
    preset = "tiny" if args.cpu_smoke else "byt5-small"
    model = write_random_encoder(out / "model", preset)
    repo = write_demo_repos(out / "data", 1, seed=0, theorems_per_repo=400, scale=6)[0]
    cfg = PipelineConfig.model_validate({
        "model": {"name_or_path": str(model), "warmup_steps": 10, "max_seq_len": 512},
        "data": {"batch_size": 8, "max_seq_len": 512, "num_workers": 2},
        "trainer": {"accelerator": "cpu" if args.cpu_smoke else "gpu", "devices": 1, "precision": "bf16-mixed",
                    "accumulate_grad_batches": 1},
    })
    cfg_path = out / "gpu.yaml"
    dump_config(cfg, cfg_path)
    train = run_job(cfg, cfg_path, "train", repo, out / "train")
    fisher = run_job(cfg, cfg_path, "fisher", repo, out / "fisher", checkpoint=Path(train["checkpoint"]))

    corpus = Corpus.from_jsonl(repo / "corpus.jsonl")
    examples = build_train_examples(corpus, load_split(repo / "random" / "train.json"))
    ctx_tokens = sum(len(e.context.encode()) + 1 for e in examples) / len(examples)
    prem_tokens = sum(len(p.text.encode()) + 1 for p in corpus.premises) / len(corpus.premises)
    tokens_per_example = ctx_tokens + (1 + cfg.data.num_negatives) * prem_tokens
    c = encoder_config(preset)
    params = c.vocab_size * c.d_model + c.num_layers * (4 * c.d_model * c.d_kv * c.num_heads + 3 * c.d_model * c.d_ff)
    report = {}
    for name, result, count in (("train", train, train["num_train_examples"] * train["epoch"]),
                                ("fisher", fisher, fisher["num_examples"])):
        rate = count / result["fit_seconds"]
        flops = 6 * params * tokens_per_example * rate
        report[name] = {"examples_per_s": rate, "tflops": flops / 1e12,
                        "fraction_of_peak": flops / 1e12 / args.peak_tflops, "fit_seconds": result["fit_seconds"]}
    report["train_metrics"] = train["metrics"]
    report["fisher_file"] = fisher["fisher"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
