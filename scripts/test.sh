#!/usr/bin/env bash
# The project's test command: install if needed, lint, then the whole suite (real gloo DDP, real Prefect flows,
# a real two-node SLURM cluster started by the tests). `bash scripts/test.sh -m "not slow"` skips the slow part.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# SLURM's daemons and client for tests/slurm (Debian's packages, ~10 s), where they are missing and can be installed.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client >/dev/null
  else
    echo "note: SLURM is not installed and cannot be here (not root, or no apt-get): tests/slurm will be skipped" >&2
  fi
fi
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
