"""Train one curriculum under three recipes and print them side by side with `leanagent report`.

    python scripts/compare_recipes.py OUT [--repos 2] [--scale 3] [--theorems 90] [--epochs 3]
                                         [--preset tiny|byt5-small] [--accelerator cpu|gpu] [--devices 2]

The recipes: `mse + random` (LeanAgent's), `infonce + random` and `infonce + mined` (`model.loss`,
`data.negatives`; docs/training.md, "Training recipes"). Everything else is the same in the three configs:
the generated repositories (`leanagent demo-data`), the encoder (`leanagent init-model`, random weights, the
same seed), the curriculum, batch size and epochs, so the three train the same number of optimizer steps
(mining changes which negatives are drawn, not how many). Each is a `leanagent run` (the lifelong flow) in a
run_dir of its own under OUT; a rerun skips what is done. The data is generated: the figures say which recipe
learns these synthetic repositories faster, not what it does on LeanDojo data.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

RECIPES = {"mse-random": ("mse", "random"), "infonce-random": ("infonce", "random"),
           "infonce-mined": ("infonce", "mined")}


def leanagent(*args: str) -> None:
    # Each `leanagent run` starts Prefect's temporary server; on a busy machine it takes longer than Prefect's 20 s.
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", **os.environ}
    subprocess.run([sys.executable, "-m", "leanagent.cli", *args], check=True, env=env)


def write_config(path: Path, args: argparse.Namespace, repos: list[Path], model: Path, loss: str,
                 negatives: str) -> Path:
    gpu = args.accelerator == "gpu"
    cfg = {
        "model": {"name_or_path": str(model), "lr": 2e-3 if not gpu else 1e-4, "warmup_steps": 10,
                  "max_seq_len": 256, "loss": loss},
        "data": {"batch_size": 8, "eval_batch_size": 32, "max_seq_len": 256, "num_workers": 0,
                 "negatives": negatives, "mined_pool": args.mined_pool},
        "trainer": {"accelerator": args.accelerator, "devices": args.devices,
                    "precision": "bf16-mixed", "accumulate_grad_batches": 1},
        "lifelong": {"epochs_per_repo": args.epochs, "curriculum": True, "ewc_lambda": 0.0},
        "run_dir": str(path.parent / path.stem),
        "repos": [{"path": str(r)} for r in repos],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repos", type=int, default=2)
    parser.add_argument("--scale", type=int, default=3, help="demo-data: multiplies the premises per repository")
    parser.add_argument("--theorems", type=int, default=90, help="demo-data: theorems per repository")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per repository, the same for every recipe")
    parser.add_argument("--mined-pool", type=int, default=50)
    parser.add_argument("--preset", choices=("tiny", "byt5-small"), default="tiny")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    data, model = out / "data", out / f"model-{args.preset}"
    if not data.is_dir():
        leanagent("demo-data", str(data), "--repos", str(args.repos), "--scale", str(args.scale),
                  "--theorems", str(args.theorems))
    if not model.is_dir():
        leanagent("init-model", str(model), "--preset", args.preset)
    repos = sorted(p for p in data.iterdir() if p.is_dir())
    run_dirs = []
    for name, (loss, negatives) in RECIPES.items():
        config = write_config(out / f"{name}.yaml", args, repos, model, loss, negatives)
        leanagent("run", "--config", str(config))
        run_dirs.append(str(out / name))
    leanagent("report", *run_dirs, "--markdown")


if __name__ == "__main__":
    main()
