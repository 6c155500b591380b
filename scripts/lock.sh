#!/usr/bin/env bash
# Resolve the dependency locks (`make lock`; `make lock UPGRADE=1` moves every pin to the newest
# release that fits). Without UPGRADE, versions already in a lock are kept where they still fit,
# so re-running with nothing changed leaves every lock byte-identical.
#
#   requirements/cpu.lock     the CPU install path: pyproject.toml + [cpu,test] + requirements/cpu.in
#                             (make setup, .ci/run, deploy/docker/Dockerfile.cpu)
#   requirements/gpu.lock     what deploy/docker/Dockerfile.gpu installs on top of its CUDA PyTorch
#                             base: pyproject.toml + [gpu], without torch (gpu-overrides.txt)
#   requirements/router.lock  our router's image: its few dependencies at cpu.lock's versions
#   requirements/sglang-router.lock  the sglang-router venv (make router-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
TOOLS=.venv-tools
if ! "$TOOLS/bin/uv" --version 2>/dev/null | grep -q "^uv $UV_VERSION "; then
    python3 -m venv --clear "$TOOLS"
    "$TOOLS/bin/pip" install -q "uv==$UV_VERSION"
fi
# The torch +cpu wheel is not on PyPI: a find-links directory (FIND_LINKS, default this machine's
# /opt/wheels) or PyTorch's CPU index (TORCH_INDEX=https://download.pytorch.org/whl/cpu) has it.
src=()
[ -d "${FIND_LINKS:-/opt/wheels}" ] && src+=(--find-links "${FIND_LINKS:-/opt/wheels}")
[ -n "${TORCH_INDEX:-}" ] && src+=(--extra-index-url "$TORCH_INDEX" --index-strategy unsafe-best-match)
upgrade=(); [ -n "${UPGRADE:-}" ] && upgrade=(--upgrade)
compile() {  # <python version> <output> <inputs and flags...>
    local py=$1 out=$2; shift 2
    # uv prefers the versions already in -o: start the temp file from the current lock. An
    # unchanged result leaves the lock untouched (its mtime too, so `make setup` does not rebuild).
    local tmp="$out.tmp"
    cp "$out" "$tmp" 2>/dev/null || : > "$tmp"
    "$TOOLS/bin/uv" pip compile --quiet --no-header --python-version "$py" \
        --python-platform x86_64-manylinux_2_28 "${upgrade[@]}" -o "$tmp" "$@"
    if cmp -s "$tmp" "$out"; then rm "$tmp"; else mv "$tmp" "$out"; echo "updated $out"; fi
}
compile 3.11 requirements/cpu.lock pyproject.toml requirements/cpu.in --extra cpu --extra test "${src[@]}"
# NVIDIA's PyTorch images run Python 3.12.
compile 3.12 requirements/gpu.lock pyproject.toml --extra gpu --override requirements/gpu-overrides.txt
compile 3.11 requirements/router.lock requirements/router.in -c requirements/cpu.lock
compile 3.11 requirements/sglang-router.lock requirements/sglang-router.in
echo "locks written: requirements/{cpu,gpu,router,sglang-router}.lock"
