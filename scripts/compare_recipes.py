"""Train one curriculum under three recipes and print them side by side with `leanagent report`.

    python scripts/compare_recipes.py OUT [--repos 2] [--scale 3] [--theorems 90] [--epochs 3]
                                         [--preset tiny|byt5-small | --model PATH] [--accelerator cpu|gpu]
                                         [--devices 2]
                                         [--precision auto] [--max-seq-len 256] [--corpus-autocast]
                                         [--lr LR] [--no-compile] [--parallel]
                                         [--mathlib-scale [--files 1000] [--premises 38000] [--eval-share 0.15]
                                          [--states ../shared/data/minif2f-lean4-ld182/random/test.json]]

The recipes: `mse + random` (LeanAgent's), `infonce + random` and `infonce + mined` (`model.loss`,
`data.negatives`; docs/training.md, "Training recipes"). Everything else is the same in the three configs:
the generated repositories (`leanagent demo-data`), the encoder (`leanagent init-model`, random weights, the
same seed; or `--model`, any checkpoint or Hugging Face model `model.name_or_path` takes), the curriculum,
batch size and epochs, so the three train the same number of optimizer steps
(mining changes which negatives are drawn, not how many). Each is a `leanagent run` (the lifelong flow) in a
run_dir of its own under OUT; a rerun skips what is done. The data is generated: the figures say which recipe
learns these synthetic repositories faster, not what it does on LeanDojo data.

`--mathlib-scale` writes each repository as a mathlib-shaped dataset instead (`leanagent.data.synthetic_scale`:
`--files` files and `--premises` premises each, an import DAG hundreds of files deep, `--theorems` theorems),
with its hints on, so a state shows words of the premises its tactic uses, and each state's length drawn from
the real proof states of `--states` (minif2f's test split by default): contexts of real lengths against tens of
thousands of candidates.

`--parallel` runs the three recipes at once, each `leanagent run` with a Prefect home (so a temporary server and
its database) of its own: on a machine with cores and accelerator memory to spare (a GPU box) the comparison
takes about the time of one recipe. Each run's output then goes to OUT/NAME.log, not the terminal.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

from leanagent.data.synthetic_scale import ScaleSpec, write_scale_dataset
from leanagent.data.theorems import load_states

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STATES = REPO_ROOT.parent / "shared" / "data" / "minif2f-lean4-ld182" / "random" / "test.json"
RECIPES = {"mse-random": ("mse", "random"), "infonce-random": ("infonce", "random"),
           "infonce-mined": ("infonce", "mined")}


def leanagent_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "leanagent.cli", *args]


def leanagent_env(**extra: str) -> dict[str, str]:
    # Each `leanagent run` starts Prefect's temporary server; on a busy machine it takes longer than Prefect's 20 s.
    return {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", **os.environ, **extra}


def leanagent(*args: str) -> None:
    subprocess.run(leanagent_argv(*args), check=True, env=leanagent_env())


def run_recipes(configs: dict[str, Path], out: Path, parallel: bool) -> None:
    """`leanagent run` for each recipe's config: one after another, or all at once, each with its own Prefect home
    (two temporary servers on one SQLite database would lock each other out) and its output in OUT/NAME.log."""
    if not parallel:
        for config in configs.values():
            leanagent("run", "--config", str(config))
        return
    running = {}
    for name, config in configs.items():
        with open(out / f"{name}.log", "w") as log:
            running[name] = subprocess.Popen(leanagent_argv("run", "--config", str(config)), stdout=log,
                                             stderr=subprocess.STDOUT,
                                             env=leanagent_env(PREFECT_HOME=str(out / f".prefect-{name}")))
    failed = [name for name, proc in running.items() if proc.wait() != 0]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (see {', '.join(str(out / f'{n}.log') for n in failed)})")


def write_config(path: Path, args: argparse.Namespace, repos: list[Path], model: Path, loss: str,
                 negatives: str) -> Path:
    gpu = args.accelerator == "gpu"
    cfg = {
        "model": {"name_or_path": str(model), "lr": args.lr or (2e-3 if not gpu else 1e-4), "warmup_steps": 10,
                  "max_seq_len": args.max_seq_len, "loss": loss, "corpus_autocast": args.corpus_autocast,
                  "compile": "auto" if args.compile else False},
        "data": {"batch_size": 8, "eval_batch_size": 32, "max_seq_len": args.max_seq_len, "num_workers": 0,
                 "negatives": negatives, "mined_pool": args.mined_pool},
        "trainer": {"accelerator": args.accelerator, "devices": args.devices,
                    "precision": args.precision, "accumulate_grad_batches": 1},
        "lifelong": {"epochs_per_repo": args.epochs, "curriculum": True, "ewc_lambda": 0.0},
        "run_dir": str(path.parent / path.stem),
        "repos": [{"path": str(r)} for r in repos],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_scale_repos(data: Path, args: argparse.Namespace) -> None:
    """`args.repos` mathlib-shaped datasets, data/repo_I from seed I, written under a dot-name, then renamed."""
    # every context of the split file, as the retriever reads it
    lengths = tuple(len(s.encode()) for s in load_states([args.states])) if args.states.is_file() else ()
    if not lengths:
        print(f"no {args.states}: the states take the generator's own lengths", file=sys.stderr)
    partial = data.with_name(f".{data.name}")
    for i in range(args.repos):
        write_scale_dataset(partial / f"repo_{i}", ScaleSpec(files=args.files, premises=args.premises,
                                                             theorems=args.theorems, seed=i, hinted=True,
                                                             state_lengths=lengths, eval_share=args.eval_share))
    partial.rename(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repos", type=int, default=2)
    parser.add_argument("--scale", type=int, default=3, help="demo-data: multiplies the premises per repository")
    parser.add_argument("--theorems", type=int, default=90, help="demo-data: theorems per repository")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per repository, the same for every recipe")
    parser.add_argument("--mined-pool", type=int, default=50)
    parser.add_argument("--preset", choices=("tiny", "byt5-small"), default="tiny")
    parser.add_argument("--model", help="start every recipe from this model (a folder, a checkpoint or a hub id, "
                                        "as model.name_or_path takes it) instead of a random --preset encoder")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="auto", help="trainer.precision (default auto: LeanAgent's bf16-mixed "
                                                           "on a GPU; on a CPU its own, by its bf16 matmuls)")
    parser.add_argument("--max-seq-len", type=int, default=256, help="model and data max_seq_len, in bytes")
    parser.add_argument("--corpus-autocast", action="store_true",
                        help="model.corpus_autocast: embed the corpus under bf16 autocast (faster on a bf16 CPU)")
    parser.add_argument("--lr", type=float, help="model.lr (default: 2e-3 on cpu, 1e-4 on gpu)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="model.compile: false (default: auto, which compiles the encoder's blocks under CUDA)")
    parser.add_argument("--parallel", action="store_true", help="the three recipes at once (see above)")
    parser.add_argument("--mathlib-scale", action="store_true",
                        help="mathlib-shaped repositories with minif2f-length states (see above)")
    parser.add_argument("--files", type=int, default=1000, help="--mathlib-scale: corpus files per repository")
    parser.add_argument("--premises", type=int, default=38000, help="--mathlib-scale: premises per repository")
    parser.add_argument("--eval-share", type=float, default=0.15,
                        help="--mathlib-scale: the share of theorems in val, and again in test")
    parser.add_argument("--states", type=Path, default=DEFAULT_STATES,
                        help="--mathlib-scale: a LeanDojo split file whose states' lengths the contexts take")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    data, model = out / "data", args.model or out / f"model-{args.preset}"
    if not data.is_dir():
        if args.mathlib_scale:
            write_scale_repos(data, args)
        else:
            leanagent("demo-data", str(data), "--repos", str(args.repos), "--scale", str(args.scale),
                      "--theorems", str(args.theorems))
    if args.model is None and not model.is_dir():
        leanagent("init-model", str(model), "--preset", args.preset)
    repos = sorted(p for p in data.iterdir() if p.is_dir())
    configs = {name: write_config(out / f"{name}.yaml", args, repos, model, loss, negatives)
               for name, (loss, negatives) in RECIPES.items()}
    run_recipes(configs, out, args.parallel)
    leanagent("report", *(str(out / name) for name in configs), "--markdown")


if __name__ == "__main__":
    main()
