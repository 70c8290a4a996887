#!/usr/bin/env bash
# Pure bf16 and --max-batch on one H200, about 4.5-5 minutes (at most 6:30 if every step hits its timeout). Run from the repo root with torchao installed:
#   OUT=/some/dir bash benchmarks/gpu_jobs/memory.sh
# Everything lands in $OUT: *.log (stdout+stderr) and *.json.
set -u
OUT=${OUT:?set OUT to the output folder}
export PYTHONPATH=. OMP_NUM_THREADS=8
PY=${PYTHON:-python}
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/timeline.log"; }

# 1. The CUDA tests of pure bf16, --max-batch and the files around them (~40 s).
stamp "tests (gpu marker)"
timeout 60 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_skips.py tests/test_recipes.py tests/test_memory.py \
  tests/test_policy.py > "$OUT/tests_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/tests_gpu.log"

# 2. The largest ResNet18 224px batch per precision (~1.5-2 min): doubling from 512 to at most 16384, bisecting to
#    512, no new try after 15 s per precision. The speed table before it is cut to one short round at batch 32.
stamp "--max-batch"
timeout 120 $PY -m precisionloop.recipes.resnet18_bench --device cuda --precisions fp32,tf32,bf16,fp16 \
  --batch-sizes 32 --iters 3 --warmup 1 --rounds 1 --no-hand-loop \
  --max-batch --max-batch-start 512 --max-batch-cap 16384 --max-batch-resolution 512 --max-batch-seconds 15 \
  > "$OUT/max_batch.log" 2>&1; echo "rc=$?" >> "$OUT/max_batch.log"

# 3. Pure bf16 against mixed bf16 on the recipe's reference Transformer, 500 steps each, same init and batches (~1.5 min: torchao compiles its AdamW step once per parameter shape, ~7 shapes).
stamp "transformer pure vs mixed bf16"
timeout 150 $PY benchmarks/pure_bf16.py transformer --device cuda --steps 500 --json "$OUT/pure_bf16_transformer.json" \
  > "$OUT/pure_bf16_transformer.log" 2>&1; echo "rc=$?" >> "$OUT/pure_bf16_transformer.log"

# 4. Digits accuracy: pure bf16 against fp32 (~30 s, compiling again for the MLP's shapes).
stamp "digits pure bf16 vs fp32"
timeout 60 $PY benchmarks/pure_bf16.py digits --device cuda --json "$OUT/pure_bf16_digits.json" \
  > "$OUT/pure_bf16_digits.log" 2>&1; echo "rc=$?" >> "$OUT/pure_bf16_digits.log"
stamp "done"
