#!/usr/bin/env bash
# Builds kiln on the GPU machine and runs the GPU suites (and optionally more), logging to $OUT.
# Used through the device tool:  bash tools/device/check.sh [ctest regex] [extra command...]
# Header-only dependencies travel in .deps/include (see ../shared/GPU.md).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
regex=${1:-^gpu_}
shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
# The H200 is sm_90: build for it only (KILN_CUDA_ARCHS overrides), native CPU code.
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${KILN_CUDA_ARCHS:-90}" -DKILN_NATIVE=ON \
  -DKILN_DEPS_DIR="$PWD/.deps/include" > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
ninja -C build-gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
ctest --test-dir build-gpu -R "$regex" --output-on-failure --timeout 300 > "$OUT/ctest.log" 2>&1
rc=$?
grep -E "tests passed|Test +#|Failed|\*\*\*" "$OUT/ctest.log" | tail -40
if [ $rc -ne 0 ]; then grep -B2 -A12 "ERROR\|FATAL\|exception" "$OUT/ctest.log" | head -150; fi
if [ $# -gt 0 ]; then "$@"; fi
exit $rc
