#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine that has CUDA, torch and nvcc but no network
# (docs/BENCHMARKS.md, "GPU"): install the wheels carried in .whl/ (scripts/gpu/fetch_wheels.sh
# downloads them), then, each stage bounded and logged under $OUT so a failure does not hide the
# rest:
#   1. tests/gpu: FlashInfer against the torch backend, CUDA-graph replay against eager, the
#      engine's greedy tokens against HF on CUDA (the first test JIT-compiles FlashInfer's kernels;
#      the build is saved as $OUT/fi.tgz and reused from .fi-cache/ when carried back)
#   2. bench_decode_step on a Qwen3-0.6B-shaped bf16 checkpoint: decode steps at batch 1/8/32/64
#      with and without CUDA graphs against the HBM roofline, prefill against the matmul peak
#   3. pdcluster bench --launch: 1 prefill + 1 decode node sharing the GPU, fake transfer backend
# Usage (repo root): OUT=/tmp/out DEADLINE_S=450 bash scripts/gpu/device_check.sh
set -u
OUT=${OUT:-/tmp/gpu-out}
DEADLINE_S=${DEADLINE_S:-450}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

stamp "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2; nproc; git log -1 --format='commit %H' 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"

stamp "install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
if [ -f .fi-cache/fi.tgz ]; then tar xzf .fi-cache/fi.tgz -C / && echo "restored FlashInfer JIT build"; fi
python3 -c "import flashinfer, zmq, msgspec, fastapi, transformers; print('flashinfer', flashinfer.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/env.txt"

stamp "1. GPU tests (timeout $(( $(left) - 200 ))s)"
timeout $(( $(left) - 200 )) python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA --timeout 600 tests/gpu \
  2>&1 | tee "$OUT/gpu_tests.txt" | grep -vE "^(PASSED|SKIPPED) " | tail -40
( cd / && tar czf "$OUT/fi.tgz" tmp/fiws/.cache/flashinfer 2>/dev/null ); ls -la "$OUT/fi.tgz"

stamp "2. decode steps and prefill, Qwen3-0.6B shape"
MODEL=/tmp/qwen3-0.6b
python3 -m common.cli make-tiny-model --shape qwen3-0.6b --dtype bfloat16 "$MODEL" > /dev/null 2>&1 || echo "make-tiny-model failed"
STEP="python3 -m common.tools.bench_decode_step --model-path $MODEL --device cuda --dtype bfloat16 --attention-backend flashinfer --batch 1,8,32,64 --context 1024 --warmup 10 --steps 100"
timeout $(( $(left) - 120 > 30 ? 120 : 30 )) $STEP --prefill 512,2048,8192 --json "$OUT/decode_graph.json" 2>&1 | grep -v "^\s*$" | tail -14
timeout 70 $STEP --disable-cuda-graph --json "$OUT/decode_eager.json" 2>&1 | grep -v "^\s*$" | tail -8

stamp "3. pdcluster bench, 1P1D on one GPU ($(left)s left)"
NODE="--device cuda --dtype bfloat16 --mem-fraction-static 0.3 --grammar-backend none"
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 5 )) python3 -m common.cli bench --launch --model-path "$MODEL" --transfer-backend fake \
    --prefill-args="$NODE" --decode-args="$NODE" --num-prompts 128 --input-len 1024 --output-len 64 \
    --request-rate 32 --json "$OUT/bench_1p1d.json" 2>&1 | tail -30 | tee "$OUT/bench_1p1d.txt"
fi
stamp "done"
