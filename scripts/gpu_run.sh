#!/usr/bin/env bash
# The prepared device checks (the device machine has torch, lightning and transformers, and takes the missing
# packages, Prefect's among them, as wheels from .whl/). PARTS picks which run, in this order; each runs under its
# own timeout, so that a stuck part leaves the others' figures. On a fresh H200 every Python process that imports
# torch and transformers takes 15-30 s to start (measured 2026-12-04), so the parts do not all fit in the 600 s one
# device command may take: give each call the parts that fit (the times below), one after another while the
# machine is warm.
#   serve    `leanagent serve` on the device, alone on the GPU: `leanagent bench serve` on the mathlib-scale index
#            (76,000 premises) of SERVE_PRESET (tiny; byt5-small builds its index in 50 s on an H200), batched and
#            unbatched, --dtype bf16, the new client's body; its JSON in $OUT/serve.json, its rows in serve.log
#            [SERVE_S, 300 s]
#   recipes  the training recipes side by side at byt5-small: mse + random, infonce + random, infonce + mined on the
#            same generated curriculum at equal steps (scripts/compare_recipes.py --parallel: the three flows at
#            once on the one GPU, each with its own Prefect temporary server), the report in recipes.md, the runs'
#            logs and manifests in recipes.tgz. RECIPE_ARGS replaces the curriculum's size (default: 2 demo
#            repositories, --scale 3 --theorems 60, 2 epochs each, lr 3e-4: 8 jobs per recipe, about 420 s on an
#            H200, most of it the jobs' start); the mathlib-scale comparison of docs/training.md is
#            RECIPE_ARGS="--mathlib-scale --files 500 --premises 19000 --theorems 200 --max-seq-len 512", longer.
#            While they run: the GPU-only tests (the vectorised Fisher equals the loop on CUDA) and the encoder tests,
#            whose speed does not matter  [RECIPES_S, 480 s; TESTS_S, 120 s]
#   checks   the rank programs (train, then Fisher) under torchrun with NCCL, bf16-mixed and compiled blocks
#            (scripts/gpu_check.py: examples/s and MFU; compiling the blocks took over a minute on 2026-12-04)
#            [CHECK_S, 300 s]
#   bench    `leanagent bench path --device cuda --preset byt5-small` on a fresh mathlib-scale corpus (the rows of
#            docs/performance.md: MFU on real tokens, embedding in fp32 against bf16), in bench.json  [BENCH_S, 300 s]
#   curriculum `leanagent bench curriculum` on the GPU: a curriculum of repositories sharing a dependency, run twice
#            (re-embedding every corpus, as LeanAgent, then embedding once), where each run's time went, in
#            curriculum.json. CURRICULUM_ARGS sizes it (default: 2 repositories, byt5-small, a dependency of 10,000
#            premises: 7 jobs per run, most of their time the jobs' start on a fresh machine)  [CURRICULUM_S, 540 s]
#
#   PARTS=recipes bash scripts/gpu_run.sh OUT   (OUT: where logs and JSON go: at most 8 files; PARTS default
#                                                "serve recipes checks")
#   bash scripts/gpu_run.sh OUT --cpu-smoke     (every part, bench too, on CPU, small, with the tiny model: checks
#                                                the script)
#
# Contexts of real lengths come from $STATES (a LeanDojo split file), when present: ../shared/data's minif2f
# test split, or .gpu/test.json in a device call (copy it there and name .gpu in the call's carry).
set -uo pipefail
OUT=${1:?usage: [PARTS="serve recipes checks curriculum bench"] gpu_run.sh OUT [--cpu-smoke]}
SMOKE=${2:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
if [ -d .whl ] && [ "$SMOKE" != "--cpu-smoke" ]; then  # the device's wheels (its Python's), not this machine's
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
STATES=${STATES:-}
for f in .gpu/test.json ../shared/data/minif2f-lean4-ld182/random/test.json; do
  [ -z "$STATES" ] && [ -f "$f" ] && STATES=$f
done
STATE_ARG=()  # what the recipes and the bench pass on
[ -n "$STATES" ] && STATE_ARG=(--states "$STATES")
if [ "$SMOKE" = "--cpu-smoke" ]; then
  DEVICE=cpu; ACCEL=cpu; PRESET=tiny; SERVE_DTYPE=fp32; SERVE_ARGS=--no-mathlib; CHECK_ARGS=--cpu-smoke
  BENCH_DATA="--repos 1"; BENCH_ARGS="--train-batches 1 --fisher-examples 4 --embed-sample 16"
  DEFAULT_PARTS="serve recipes checks curriculum bench"
  RECIPE_ARGS=${RECIPE_ARGS:---scale 1 --theorems 30 --epochs 1}
  CURRICULUM_ARGS=${CURRICULUM_ARGS:---repos 2 --dependency-files 10 --dependency-premises 200 --theorems 20}
  TESTS=(tests/unit/test_encoder.py -m "not slow" -k mask)
else
  DEVICE=cuda; ACCEL=gpu; PRESET=byt5-small; SERVE_DTYPE=bf16; SERVE_ARGS=; CHECK_ARGS=
  BENCH_DATA=--mathlib-scale; BENCH_ARGS="--embed-sample 1024"
  DEFAULT_PARTS="serve recipes checks"
  RECIPE_ARGS=${RECIPE_ARGS:---scale 3 --theorems 60 --epochs 2 --lr 3e-4}
  CURRICULUM_ARGS=${CURRICULUM_ARGS:---repos 2 --dependency-files 300 --dependency-premises 10000}
  TESTS=(tests/unit/test_fisher_vectorised.py tests/unit/test_encoder.py -m "not slow" -k "cuda or mask")
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  nproc
  $PY -c "import torch, pytorch_lightning, transformers, prefect; print('torch', torch.__version__, 'pytorch_lightning',
pytorch_lightning.__version__, 'transformers', transformers.__version__, 'prefect', prefect.__version__)"
  echo "states: ${STATES:-none}"; } 2>&1 | tee "$OUT/gpu.txt"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT  # models, checkpoints and indexes: what matters is copied to OUT
PARTS=${PARTS:-$DEFAULT_PARTS}
wanted() { [[ " $PARTS " == *" $1 "* ]] && echo "=== $1 ($(date -u +%T))"; }

if wanted serve; then
  # shellcheck disable=SC2086
  timeout "${SERVE_S:-300}" $PY -m leanagent.cli bench serve "$WORK/serve" --preset "${SERVE_PRESET:-tiny}" \
    --device $DEVICE --modes batched unbatched --bodies "new client" --serve-args "--dtype $SERVE_DTYPE" $SERVE_ARGS \
    --json "$OUT/serve.json" > "$OUT/serve.log" 2>&1
  echo "serve: rc $?"; tail -12 "$OUT/serve.log"
fi

if wanted recipes; then
  # shellcheck disable=SC2086
  timeout "${RECIPES_S:-480}" $PY scripts/compare_recipes.py "$WORK/recipes" --preset $PRESET --accelerator $ACCEL \
    --devices 1 --repos 2 --no-compile --parallel "${STATE_ARG[@]}" $RECIPE_ARGS > "$OUT/recipes.md" 2>&1 &
  RECIPES=$!
  timeout "${TESTS_S:-120}" $PY -m pytest -q -p no:cacheprovider --basetemp "$WORK/pytest" "${TESTS[@]}" \
    > "$OUT/tests.log" 2>&1
  echo "tests: rc $?"; tail -3 "$OUT/tests.log"
  wait $RECIPES
  echo "recipes: rc $?"; tail -25 "$OUT/recipes.md"
  # what a partial run leaves is in the manifests: every finished stage's metrics
  ( cd "$WORK/recipes" 2>/dev/null && tar czf "$OUT/recipes.tgz" --exclude='*.ckpt' --exclude='*.safetensors' \
      --exclude='*.pt' --exclude='data' --exclude='model-*' --exclude='.prefect-*' . )
fi

if wanted checks; then
  # shellcheck disable=SC2086
  timeout "${CHECK_S:-300}" $PY scripts/gpu_check.py "$WORK/gpu_check" $CHECK_ARGS > "$OUT/gpu_check.log" 2>&1
  echo "gpu_check: rc $?"; grep -v '^\[rank' "$OUT/gpu_check.log" | tail -30
fi

if wanted curriculum; then
  # shellcheck disable=SC2086
  timeout "${CURRICULUM_S:-540}" $PY -m leanagent.cli bench curriculum --accelerator $ACCEL --devices 1 \
    --preset $PRESET $CURRICULUM_ARGS --json "$OUT/curriculum.json" > "$WORK/curriculum.log" 2>&1
  echo "curriculum: rc $?"; tail -8 "$WORK/curriculum.log"
fi

if wanted bench; then
  # shellcheck disable=SC2086
  $PY -m leanagent.cli demo-data "$WORK/bench-data" $BENCH_DATA > /dev/null
  DATASET=$WORK/bench-data  # a mathlib-scale corpus is one dataset; --repos 1 writes repo_0 inside
  [ -f "$DATASET/corpus.jsonl" ] || DATASET=$WORK/bench-data/repo_0
  # shellcheck disable=SC2086
  timeout "${BENCH_S:-300}" $PY -m leanagent.cli bench path --dataset "$DATASET" --preset $PRESET --device $DEVICE \
    --min-seconds 2 --no-launch $BENCH_ARGS "${STATE_ARG[@]}" --json "$OUT/bench.json" > "$WORK/bench.log" 2>&1
  echo "bench: rc $?"; tail -45 "$WORK/bench.log"  # its table (the 8-file limit: the JSON is what comes back)
fi
echo "=== done ($(date -u +%T))"
