#!/usr/bin/env bash
# The prepared device check, as one command (the device machine has torch, lightning and transformers,
# and takes the few missing packages as wheels from .whl/). In order of what matters, each part under its
# own timeout so that one stuck part leaves the others' figures (the defaults fit 15 minutes of device time
# with the machine's start):
#   1. `leanagent bench --device cuda` on a fresh mathlib-scale corpus, contexts from a real LeanDojo split
#      file when one is at $STATES (their real lengths): the training step padded / sorted / sorted + one
#      mask / + compiled (examples/s, real tokens/s, token efficiency, MFU on real tokens, compile time cold
#      and warm), the Fisher loop and vectorised pass against that step, fixed-length rows at L = 512, 1024;
#   2. the rank programs (train, then Fisher) under torchrun with NCCL and bf16-mixed, on every visible GPU
#      up to 2 ranks (scripts/gpu_check.py; NCCL runs one rank per GPU);
#   3. the GPU-only tests (the vectorised Fisher equals the loop on CUDA) and the encoder tests;
#   4. `leanagent serve` on the device (scripts/measure_serve.py: batched only, --dtype bf16; the tiny preset's
#      mathlib-scale index, so that building it fits), its JSON in $OUT/serve.json;
#   5. on a GPU (not with --cpu-smoke), the training recipes side by side at byt5-small: mse + random,
#      infonce + random, infonce + mined on the same generated curriculum at equal steps
#      (scripts/compare_recipes.py; needs prefect, skipped without it), the report in recipes.log. RECIPE_ARGS
#      passes more options: the mathlib-scale comparison of docs/training.md is RECIPE_ARGS="--mathlib-scale
#      --files 500 --premises 19000 --theorems 200 --max-seq-len 512" with RECIPES_S=480, the other parts' time
#      lowered (BENCH_S, CHECK_S, TESTS_S, SERVE_S) or run on its own.
# The parts' default timeouts add up to under 600 s, the device's limit for one command: raise one (BENCH_S,
# CHECK_S, TESTS_S, SERVE_S, RECIPES_S) only with another lowered, or run the script twice.
#
#   bash scripts/gpu_run.sh OUT                (OUT: where logs and JSON go; at most 8 files)
#   bash scripts/gpu_run.sh OUT --cpu-smoke    (the same steps on CPU with the tiny model: checks the script)
set -uo pipefail
OUT=${1:?usage: gpu_run.sh OUT [--cpu-smoke]}
SMOKE=${2:-}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STATES=${STATES:-../shared/data/minif2f-lean4-ld182/random/val.json}
if [ "$SMOKE" = "--cpu-smoke" ]; then
  DEVICE=cpu; PRESET=tiny; MATHLIB="--repos 1"; EXTRA="--train-batches 1 --fisher-examples 4 --embed-sample 16"
  CHECK_ARGS=--cpu-smoke; TESTS=(tests/unit/test_encoder.py -m "not slow")
  SERVE_DTYPE=fp32; SERVE_ARGS=--skip-mathlib
else
  DEVICE=cuda; PRESET=byt5-small; MATHLIB=--mathlib-scale; EXTRA="--embed-sample ${EMBED_SAMPLE:-1024}"
  CHECK_ARGS=; TESTS=(tests/unit/test_fisher_vectorised.py tests/unit/test_encoder.py -m "not slow" -k "cuda or mask")
  SERVE_DTYPE=bf16; SERVE_ARGS=
fi
STATE_ARGS=
if [ -f "$STATES" ]; then STATE_ARGS="--states $STATES"; else echo "no $STATES: the bench's contexts are the dataset's"; fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"; nproc;
  $PY -c "import torch, pytorch_lightning, transformers; print('torch', torch.__version__, 'pytorch_lightning', pytorch_lightning.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/gpu.txt"
WORK=$(mktemp -d)
( time $PY -m leanagent.cli demo-data "$WORK/data" $MATHLIB ) 2>&1 | tail -5 | tee "$OUT/demo-data.log"
DATASET=$(ls -d "$WORK"/data/*/ 2>/dev/null | head -1)
[ -f "$WORK/data/corpus.jsonl" ] && DATASET="$WORK/data"
# shellcheck disable=SC2086
timeout ${BENCH_S:-230} $PY -m leanagent.cli bench --dataset "$DATASET" --preset $PRESET --device $DEVICE \
  --min-seconds 2 --no-launch $EXTRA $STATE_ARGS --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -45
# shellcheck disable=SC2086
timeout ${CHECK_S:-120} $PY scripts/gpu_check.py "$WORK/gpu_check" $CHECK_ARGS 2>&1 | tee "$OUT/gpu_check.log" | tail -30
timeout ${TESTS_S:-60} $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
# shellcheck disable=SC2086
timeout ${SERVE_S:-90} $PY scripts/measure_serve.py "$WORK/serve" --device $DEVICE --modes batched \
  --serve-args "--dtype $SERVE_DTYPE" $SERVE_ARGS --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" | tail -20
if [ "$DEVICE" = cuda ] && $PY -c "import prefect" 2>/dev/null; then
  timeout ${RECIPES_S:-90} $PY scripts/compare_recipes.py "$WORK/recipes" --preset byt5-small --accelerator gpu \
    --devices 1 --repos 2 --epochs ${RECIPE_EPOCHS:-2} ${RECIPE_ARGS:-} 2>&1 | tee "$OUT/recipes.log" | tail -40
fi
echo "gpu_run done"
