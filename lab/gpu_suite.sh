#!/usr/bin/env bash
# The GPU checks and benchmarks in one command (fits one 10-minute device call). Each stage has
# its own time limit so one failure cannot eat the others. Results land in $OUT (default
# benchmarks/results). Usage: lab/gpu_suite.sh [tests] [sweep] [layers] [attention] [decode] [budget]
# (default: all). The GPU image brings torch/triton/transformers; this package installs offline.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
stages=${*:-tests sweep layers attention decode budget}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for stage in $stages; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tests) timeout 240 python3 -m pytest -q -p no:randomly tests/test_triton_kernels.py tests/test_gpu.py 2>&1 | tail -25 ;;
    # the old default (1 warp x 32 tokens, spills) against the no-spill candidates (ptxas_sm90.json)
    # and the tensor-core candidate (issue_model_sm90.json), MHA and GQA 4:1
    sweep) timeout 240 python3 -m lab gpu_attend_sweep 1024,32768 \
             0:32:1:2,0:16:4:2,0:32:8:2,mma/0:32:2:2,mma/0:32:4:2,mma/0:32:4:3,mma/0:32:8:2,mma-magic/0:32:4:2 \
             32/32,32/8 2>&1 | tail -40
           # head_dim 256 (Gemma 3 270M's 4:1): the narrow-head default against the wide-head one (4 x 16)
           timeout 120 python3 -m lab gpu_attend_sweep 1024,32768 0:32:1:2,0:16:4:2,0:16:8:2 4/1 --head-dim 256 \
             2>&1 | tail -12 ;;
    # per-layer append / flush / attend, plain KIVI and with each option's Triton append
    layers) timeout 120 python3 -m lab gpu_layer_costs 1 1024,32768 2>&1 | tail -12 ;;
    attention) timeout 200 kivi bench attention --device cuda --out "$OUT" 2>&1 | sed "/it\/s/d" ;;
    decode) timeout 300 kivi bench decode --device cuda --model llama2-7b-shape --contexts 1024,32768 --batches 1 \
              --new-tokens 64 --out "$OUT" 2>&1 | sed "/it\/s/d" ;;
    budget) timeout 300 kivi bench decode --device cuda --model llama2-7b-shape --contexts 4096 --budget-gib 40 \
              --new-tokens 32 --out "$OUT" 2>&1 | sed "/it\/s/d" ;;
    *) echo "unknown stage $stage (tests, sweep, layers, attention, decode, budget)"; exit 2 ;;
  esac
  echo "=== $stage rc=$?"
done
