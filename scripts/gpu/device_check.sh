#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine that has CUDA, torch and nvcc but no network
# (docs/BENCHMARKS.md, "GPU"): install the wheels carried in .whl/ (scripts/gpu/fetch_wheels.sh
# downloads them), then, each stage bounded and logged under $OUT so a failure does not hide the
# rest:
#   1. tests/gpu: FlashInfer against the torch backend, CUDA-graph replay against eager, the
#      engine's greedy tokens against HF on CUDA, the fused ops against torch, KV digests on the
#      GPU against the CPU's (the first tests JIT-compile FlashInfer's kernels, ~1 min)
#   2. bench_decode_step on a Qwen3-0.6B-shaped bf16 checkpoint: decode steps at batch 1/8/32/64
#      (CUDA graphs + fused kernels; graphs with plain torch ops; eager) against the HBM roofline,
#      prefill against the matmul peak
#   3. pdcluster bench --launch: 1 prefill + 1 decode node sharing the GPU, fake transfer backend,
#      with KV digests (the default) and without (PDC_KV_INTEGRITY=0)
# Usage (repo root): OUT=/tmp/out DEADLINE_S=450 bash scripts/gpu/device_check.sh
set -u
OUT=${OUT:-/tmp/gpu-out}
DEADLINE_S=${DEADLINE_S:-480}
STAGES=${STAGES:-"tests decode cluster"}  # any of: tests profile decode cluster
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

stamp "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2; echo "cores $(nproc)"; } 2>&1

stamp "install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import flashinfer, zmq, msgspec, fastapi, transformers; print('flashinfer', flashinfer.__version__, 'transformers', transformers.__version__)"

MODEL=/tmp/qwen3-0.6b
if has decode || has profile || has cluster; then
  python3 -m common.cli make-tiny-model --shape qwen3-0.6b --dtype bfloat16 "$MODEL" > /dev/null 2>&1 || echo "make-tiny-model failed"
fi
if has tests; then
stamp "1. GPU tests (timeout ${TESTS_S:=$(( $(left) - 240 ))}s)"
timeout $TESTS_S python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs --tb=short --timeout 600 tests/gpu \
  > "$OUT/gpu_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|tokens equal" "$OUT/gpu_tests.txt" | tail -30
fi
if has profile; then
  stamp "profile of one CUDA-graph decode step"
  timeout 90 python3 scripts/gpu/profile_decode.py "$MODEL" --batch 1,64 2>&1 | grep -vE "INFO|WARN" | tail -24
fi
if has decode; then
stamp "2. decode steps and prefill, Qwen3-0.6B shape"
STEP="python3 -m common.tools.bench_decode_step --model-path $MODEL --device cuda --dtype bfloat16 --attention-backend flashinfer --batch 1,8,32,64 --context 1024 --warmup 10 --steps 100"
echo "--- CUDA graphs, fused kernels"
timeout 150 $STEP --prefill 512,2048,8192 --json "$OUT/decode_graph.json" 2>&1 | grep -E "^(\||prefill|device|model|roof)" 
echo "--- CUDA graphs, plain torch ops (PDC_FUSED_KERNELS=0)"
PDC_FUSED_KERNELS=0 timeout 90 $STEP --json "$OUT/decode_unfused.json" 2>&1 | grep -E "^\|"
echo "--- eager, fused kernels"
timeout 90 $STEP --disable-cuda-graph --json "$OUT/decode_eager.json" 2>&1 | grep -E "^\|"
fi

NODE="--device cuda --dtype bfloat16 --mem-fraction-static 0.3 --grammar-backend none"
BENCH="python3 -m common.cli bench --launch --model-path $MODEL --transfer-backend fake --num-prompts 128 --input-len 1024 --output-len 64 --request-rate 32"
has cluster && for variant in digest nodigest; do
  stamp "3. pdcluster bench 1P1D on one GPU, KV digests ${variant#no} ($(left)s left)"
  [ "$(left)" -gt 50 ] || break
  env $([ $variant = nodigest ] && echo PDC_KV_INTEGRITY=0) timeout $(( $(left) - 5 )) $BENCH \
    --prefill-args="$NODE" --decode-args="$NODE" --json "$OUT/bench_1p1d_$variant.json" 2>&1 \
    | grep -E "throughput|^TTFT|^ITL|^TPOT|^E2E|kv_transfer|decode step split|mean prefill forward|CPU seconds|leak check|error|Error" 
done
rm -f "$OUT"/*.png
stamp "done"
