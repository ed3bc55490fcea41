#!/usr/bin/env bash
# The main job on a fresh machine: install, write 3 synthetic repositories and a tiny random
# ByT5 encoder, then run the lifelong curriculum flow on CPU with 2 DDP ranks (gloo) under
# Prefect's temporary local server. Rerunning skips every finished stage.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
LA=.venv/bin/leanagent
[ -d demo/data ] || $LA demo-data demo/data --repos 3 --scale 3 --theorems 90
[ -d demo/model ] || $LA init-model demo/model --preset tiny
$LA validate demo/data/repo_0 demo/data/repo_1 demo/data/repo_2
$LA run --config configs/demo.yaml
