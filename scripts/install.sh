#!/usr/bin/env bash
# Create .venv (once) and install leanagent into it. torch is pinned to the CPU build that
# this project's machines carry; on a GPU machine install your CUDA torch first, then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import leanagent.flows, leanagent.tasks, leanagent.deployments, torch, torchdata, pytorch_lightning, tensorboard, prefect, transformers, matplotlib, psutil, tqdm, ctranslate2, pytest, hypothesis, ruff, mkdocs, material" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[dev]"
fi
