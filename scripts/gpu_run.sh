#!/usr/bin/env bash
# The prepared device check, as one command (the device machine has torch, lightning and transformers,
# and takes the few missing packages as wheels from .whl/): the rank programs on the GPU with NCCL and
# bf16-mixed (scripts/gpu_check.py), then `leanagent bench --device cuda` on a mathlib-scale corpus.
#   bash scripts/gpu_run.sh OUT            (OUT: where logs and JSON go)
set -uo pipefail
OUT=${1:?usage: gpu_run.sh OUT}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
WORK=$(mktemp -d)
( time $PY -m leanagent.cli demo-data "$WORK/data" --mathlib-scale ) 2>&1 | tail -5 | tee "$OUT/demo-data.log"
DATASET=$(ls -d "$WORK"/data/*/ 2>/dev/null | head -1)
[ -f "$WORK/data/corpus.jsonl" ] && DATASET="$WORK/data"
timeout 300 $PY -m leanagent.cli bench --dataset "$DATASET" --preset byt5-small --device cuda --min-seconds 2 \
  --json "$OUT/bench_cuda.json" 2>&1 | tail -40 | tee "$OUT/bench_cuda.log"
timeout 200 $PY scripts/gpu_check.py "$WORK/gpu_check" 2>&1 | tail -40 | tee "$OUT/gpu_check.log"
