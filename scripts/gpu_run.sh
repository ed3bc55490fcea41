#!/usr/bin/env bash
# The prepared device check, as one command (the device machine has torch, lightning and transformers,
# and takes the few missing packages as wheels from .whl/). In order of what matters, each under its own
# timeout so that one stuck part leaves the others' figures:
#   1. `leanagent bench --device cuda` on a mathlib-scale corpus (embedding, retrieval, train vs Fisher,
#      training examples/s, tokens/s and MFU of a byt5-small-shaped encoder at L = 512 and 1024 in bf16);
#   2. the rank programs (train, then Fisher) under torchrun with NCCL and bf16-mixed (scripts/gpu_check.py);
#   3. the GPU-only tests (vectorised Fisher equals the loop on CUDA);
#   4. the same training steps under torch.compile, as a measure of the head room.
#   bash scripts/gpu_run.sh OUT            (OUT: where logs and JSON go; at most 8 files)
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
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
  $PY -c "import torch, pytorch_lightning, transformers; print('torch', torch.__version__, 'pytorch_lightning', pytorch_lightning.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/gpu.txt"
WORK=$(mktemp -d)
( time $PY -m leanagent.cli demo-data "$WORK/data" --mathlib-scale ) 2>&1 | tail -5 | tee "$OUT/demo-data.log"
DATASET=$(ls -d "$WORK"/data/*/ 2>/dev/null | head -1)
[ -f "$WORK/data/corpus.jsonl" ] && DATASET="$WORK/data"
timeout ${BENCH_S:-200} $PY -m leanagent.cli bench --dataset "$DATASET" --preset byt5-small --device cuda \
  --min-seconds 2 --embed-sample ${EMBED_SAMPLE:-1024} --json "$OUT/bench_cuda.json" 2>&1 | tee "$OUT/bench_cuda.log" | tail -40
timeout ${CHECK_S:-170} $PY scripts/gpu_check.py "$WORK/gpu_check" 2>&1 | tee "$OUT/gpu_check.log" | tail -30
timeout ${TESTS_S:-60} $PY -m pytest -q -p no:cacheprovider tests/unit/test_fisher_vectorised.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -5
timeout ${COMPILE_S:-100} $PY - "$OUT/compiled.json" <<'PYEOF' 2>&1 | tee "$OUT/compiled.log" | tail -12
import json, sys
from leanagent.bench import bench_cuda_training, format_table
rows = []
for length in (512, 1024):
    rows += bench_cuda_training(batch_sizes=(32,), lengths=(length,), compile_model=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=2)
    print(format_table({"dataset": "random bytes", "device": "cuda", "cuda_training": rows}), flush=True)
PYEOF
echo "gpu_run done"
