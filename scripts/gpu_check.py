"""One prepared GPU check: the rank programs (train, then the Fisher pass) under torchrun with NCCL and
bf16-mixed, on a random byt5-small-shaped encoder, reporting examples/s and model FLOP utilisation.

    .venv/bin/python scripts/gpu_check.py OUT [--devices N] [--peak-tflops T] [--cpu-smoke]

FLOPs come from `leanagent.bench.perf` (the one FLOP model: a training step is 3x the forward of every real
sequence; the Fisher loop does one forward and one backward per example, the same 3x) and the peak from
its table by the GPU's name (`--peak-tflops` overrides it). The time is the whole `fit`, validation
(corpus embedding) included, so the training figures are a lower bound. `--devices`: ranks, one per GPU
(NCCL does not run two ranks on one GPU); default every visible GPU, at most 2. `--cpu-smoke`: the tiny
model on CPU with gloo, to check this script itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from leanagent.bench.perf import mfu, peak_bf16_tflops, training_flops
from leanagent.data.corpus import Corpus
from leanagent.data.examples import build_train_examples
from leanagent.data.synthetic import write_demo_repos
from leanagent.data.theorems import load_split
from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import JobRequest
from leanagent.ground.names import BYT5_SMALL, CORPUS_FILE, DEFAULT_SPLIT, TINY, TRAIN_PART, part_file
from leanagent.model.presets import encoder_config, write_random_encoder
from leanagent.preflight.run_job import run_job


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, help="ranks (one GPU each); default: visible GPUs, at most 2")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak (default: leanagent.bench.perf's table)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the script itself")
    args = parser.parse_args()
    out = args.out.resolve()
    preset = TINY if args.cpu_smoke else BYT5_SMALL
    devices = args.devices or (2 if args.cpu_smoke else max(1, min(2, torch.cuda.device_count())))
    peak = args.peak_tflops or (None if args.cpu_smoke else peak_bf16_tflops(torch.cuda.get_device_name(0)))
    model = write_random_encoder(out / "model", preset)
    repo = write_demo_repos(out / "data", 1, seed=0, theorems_per_repo=400, scale=6)[0]
    cfg = PipelineConfig.model_validate({
        "model": {"name_or_path": str(model), "warmup_steps": 10, "max_seq_len": 512},
        "data": {"batch_size": 8, "max_seq_len": 512, "num_workers": 2},
        "trainer": {"accelerator": "cpu" if args.cpu_smoke else "gpu", "devices": devices, "precision": "auto",
                    "accumulate_grad_batches": 1},
    })
    train = run_job(JobRequest(program="train", config=cfg, datasets=(repo,), out=out / "train"))
    fisher = run_job(JobRequest(program="fisher", config=cfg, datasets=(repo,), out=out / "fisher",
                                checkpoint=Path(train.checkpoint)))

    corpus = Corpus.from_jsonl(repo / CORPUS_FILE)
    examples = build_train_examples(corpus, load_split(repo / DEFAULT_SPLIT / part_file(TRAIN_PART)))
    # The FLOPs of a mean example: its context and 1 + negatives premises at their real lengths, cut as training cuts.
    cut = cfg.data.max_seq_len
    ctx = [min(len(e.context.encode()) + 1, cut) for e in examples]
    prem = [min(len(p.text.encode()) + 1, cut) for p in corpus.premises]
    flops_per_example = (training_flops(encoder_config(preset), ctx) / len(ctx)
                         + (1 + cfg.data.num_negatives) * training_flops(encoder_config(preset), prem) / len(prem))
    report: dict = {"devices": devices, "peak_bf16_tflops": peak}
    for name, result, count in (("train", train, train.num_train_examples * train.epoch),
                                ("fisher", fisher, fisher.num_examples)):
        rate = count / result.fit_seconds
        report[name] = {"examples_per_s": rate, "tflops": rate * flops_per_example / 1e12,
                        "mfu": mfu(rate * flops_per_example / devices, peak), "fit_seconds": result.fit_seconds,
                        "world_size": result.world_size}
    report["train_metrics"] = train.metrics.model_dump(by_alias=True, exclude_unset=True)
    report["compile"] = {k: getattr(train, k, None) for k in ("compiled", "compile_s", "compile_failed")}
    report["fisher_file"] = fisher.fisher
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
