#!/usr/bin/env bash
# The project's test command: install if needed, lint, then the whole suite (real gloo DDP, real Prefect).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
