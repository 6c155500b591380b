#!/usr/bin/env bash
# Download, into .whl/ (git-ignored via .git/info/exclude), the wheels scripts/gpu/device_check.sh
# installs on a GPU machine that has CUDA, torch and nvcc but no network: the cp312 manylinux
# builds of the project's runtime dependencies that such an image lacks, at the versions of
# requirements/cpu.lock, plus flashinfer-python at requirements/gpu.lock's version.
#
# The flashinfer wheel (59 MB) is repacked without csrc/'s subfolders (27 MB of sources of kernels
# the engine never builds: MoE, Blackwell, sampling, ...): the FA2 prefill/decode module it
# JIT-compiles needs only csrc's top-level files and data/include. That keeps everything a device
# run carries under its 64 MiB limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
lock() { grep -E "^$1==" requirements/$2.lock | head -1; }
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64)
for p in pyzmq msgspec fastapi starlette pydantic pydantic-core uvicorn annotated-types typing-inspection \
         opentelemetry-api httptools llguidance transformers; do
  $PIP download -q --no-deps "${PLAT[@]}" -d .whl "$(lock $p cpu)"
done
$PIP download -q --no-deps "${PLAT[@]}" -d .whl "$(lock apache-tvm-ffi gpu)"
FI=$(lock flashinfer-python gpu)
tmp=$(mktemp -d)
$PIP download -q --no-deps -d "$tmp" "$FI"
python3 - "$tmp"/flashinfer_python-*.whl .whl <<'PY'
import os, sys, zipfile
src = zipfile.ZipFile(sys.argv[1])
dst = zipfile.ZipFile(os.path.join(sys.argv[2], os.path.basename(sys.argv[1])), "w", zipfile.ZIP_DEFLATED, compresslevel=9)
for info in src.infolist():
    name = info.filename
    if name.startswith("flashinfer/data/csrc/") and name.count("/") >= 4 and not name.startswith("flashinfer/data/csrc/nv_internal/"):
        continue
    dst.writestr(info, src.read(name))
dst.close()
PY
rm -rf "$tmp"
du -sh .whl
