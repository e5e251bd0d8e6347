#!/usr/bin/env bash
# The GPU checks and benchmarks in one command (fits one 10-minute device call): correctness first,
# then the timings, each stage under its own time limit so one failure cannot eat the others.
# Usage: lab/gpu_suite.sh [stage ...] (default: tests decode budget). The stages' limits are what
# they needed on an H200 (benchmarks/results/h200/README.md): all of them do not fit one call, so
# name the ones a call should run (e.g. `tests decode budget`, then `profile sweep256 attention`).
# Logs and results land in $RESULTS (default /tmp/gpu_results) and, tarred after every stage, in
# $OUT/results.tgz.
# The GPU image brings torch/triton/transformers; missing packages travel as wheels in .whl/
# (carry it), the test model as .gpu/model.gguf (`python -m lab gguf_truncate`, carry .gpu).
# KIVI_GIT_SHA: the sha of the code measured (the device's copy of .git can be stale).
set -u -o pipefail
export PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-/tmp/gpu_results}
mkdir -p "$RESULTS"
stages=${*:-tests decode budget}
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$RESULTS/wheels.log" 2>&1 || { cat "$RESULTS/wheels.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$RESULTS/install.log" 2>&1 \
  || { cat "$RESULTS/install.log"; exit 1; }
[ -f .gpu/model.gguf ] && export KIVI_GPU_TEST_MODEL=$PWD/.gpu/model.gguf
# The CUDA C++ decode kernel (kivi_ops/cuda): torch.utils.cpp_extension builds it where the image has
# nvcc; else the library prebuilt without a GPU (`python -m lab cuda_decode_model --library
# .gpu/libkivi_cuda_decode.so`, carry .gpu): the PyPI nvcc is too big to carry.
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ] && [ -f .gpu/libkivi_cuda_decode.so ]; then
  export KIVI_CUDA_DECODE_LIB=$PWD/.gpu/libkivi_cuda_decode.so
fi
echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none) KIVI_CUDA_DECODE_LIB=${KIVI_CUDA_DECODE_LIB:-}"
echo "sha ${KIVI_GIT_SHA:-unknown}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# DEADLINE: seconds from the start for the whole suite (a device call is killed at its limit,
# and a killed call returns only what is under $OUT): a stage gets what is left of it.
DEADLINE=${DEADLINE:-570}
run() {  # run STAGE SECONDS COMMAND...: its log in $RESULTS/STAGE.log, its last lines and status here
  local stage=$1 limit=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - start) ))
  if [ "$left" -lt 20 ]; then echo "=== $stage skipped: ${left}s left"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $stage (t=$(( $(date +%s) - start ))s, limit ${limit}s)"
  timeout "$limit" "$@" >"$RESULTS/$stage.log" 2>&1
  local rc=$?
  grep -v -e "it/s\]" -e "^\[{" "$RESULTS/$stage.log" | tail -n "${TAIL:-15}"
  echo "=== $stage rc=$rc (t=$(( $(date +%s) - start ))s)"
  # after every stage: what a killed call still brings back
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/results.tgz" -C "$RESULTS" .; fi
}
for stage in $stages; do
  case $stage in
    # every CUDA kernel and path against the CPU reference, in parallel processes (compiles dominate)
    tests) TAIL=25 run tests 210 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 16 --timeout 150 -rfE --tb=line \
             --junitxml="$RESULTS/tests.xml" tests/test_triton_kernels.py tests/test_gpu.py tests/test_gpu_deploy.py \
             tests/test_overflow.py tests/test_dispatch.py tests/test_weight_quant.py tests/test_cuda_cpp_kernel.py ;;
    # the decode kernel's launch configurations (default 1 warp x 32 tokens; no-spill 4 x 16) and the
    # tensor-core candidate, MHA and GQA 4:1, then head_dim 256 (Gemma 3's 4:1)
    sweep) TAIL=40 run sweep 100 python3 -m lab gpu_attend_sweep 1024,32768 \
             0:32:1:2,0:16:4:2,0:32:4:2,0:32:8:2,mma/0:32:2:2,mma/0:32:4:2,mma-magic/0:32:2:2 32/32,32/8 --json
           TAIL=12 run sweep256 90 python3 -m lab gpu_attend_sweep 1024,32768 0:32:1:2,0:16:4:2,0:16:8:2 4/1 \
             --head-dim 256 --json ;;
    # the CUDA C++ decode kernel (kivi_ops/cuda) against the Triton default and SDPA: what decides its dispatch
    sweepcuda) TAIL=30 run sweepcuda 120 python3 -m lab gpu_attend_sweep 1024,32768 \
             0:32:1:2,cuda/0:0:0:0,cuda/1:0:0:0,cuda/16:0:0:0 32/32,32/8 --json ;;
    attention) run attention 75 python3 -m kivi_cli bench attention --device cuda --out "$RESULTS" ;;
    decode) run decode 200 python3 -m kivi_cli bench decode --device cuda --model llama2-7b-shape --contexts 1024,32768 --batches 1 \
              --new-tokens 64 --out "$RESULTS" ;;
    profile) TAIL=40 run profile 150 python3 -m lab gpu_profile_step --context 1024 --out "$RESULTS" ;;
    budget) run budget 200 python3 -m kivi_cli bench decode --device cuda --model llama2-7b-shape --contexts 4096 --budget-gib 40 \
              --new-tokens 32 --out "$RESULTS" ;;
    layers) run layers 90 python3 -m lab gpu_layer_costs 1 1024,32768 ;;
    # the paged, 3-bit and OTT kernels on CUDA (never run on a GPU yet)
    paged) TAIL=25 run paged 200 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 16 --timeout 150 -rfE \
             --tb=line tests/test_paged_gpu.py tests/test_paged_triton.py tests/test_three_bit.py tests/test_triton_ott.py ;;
    # the served stream, static vs paged KIVI-2, compiled under CUDA graphs: every decode bucket of
    # the paged engine is one graph (kivi_ops/row_view.py)
    serve) TAIL=30 run serve 240 python3 -m kivi_cli bench serve --device cuda --budget-gib 1 --max-seq-len 2048 \
             --duration 60 --requests 2000 --compile --caches kivi,kivi-paged --out "$RESULTS" --json ;;
    *) echo "unknown stage $stage (tests, sweep, sweepcuda, attention, decode, profile, budget, layers, paged, serve)"
       exit 2 ;;
  esac
done
