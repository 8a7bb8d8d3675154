#!/usr/bin/env bash
# kiln's entry script for a fresh Debian machine (run as root, or with sudo available):
#   bash tools/kiln.sh train [kiln-train flags...]   install what is missing, build, train
#   bash tools/kiln.sh test                          install what is missing, build, run all tests
#   bash tools/kiln.sh build                         install what is missing, build
# Environment: KILN_BUILD_DIR (default build), KILN_CUDA (AUTO|ON|OFF, default AUTO),
# KILN_JOBS (parallel build jobs, default: number of cores), KILN_NATIVE (ON|OFF, default ON:
# this script builds for the machine it runs on, so -march=native is safe and the CPU backend's
# GEMMs ~3x faster), KILN_CUDA_ARCHS (CMAKE_CUDA_ARCHITECTURES; default: CMakeLists.txt's list
# of every GPU generation kiln supports; .ci/run narrows it).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
build_dir=${KILN_BUILD_DIR:-build}
jobs=${KILN_JOBS:-$(nproc)}

# Debian packages kiln needs: compiler and build tools, header-only libraries, zlib for gzipped
# IDX files, the Fashion-MNIST data set for the default training job, matplotlib for
# tools/kiln-plot's training curves, and libjpeg-turbo for the CPU JPEG path (optional at
# configure time).
packages=(g++ cmake ninja-build libeigen3-dev libstb-dev doctest-dev zlib1g-dev dataset-fashion-mnist
          python3-matplotlib libjpeg62-turbo-dev)
# The test command also runs the portable build on emulated x86-64 CPUs (tests/emulated_cpu.sh).
test_packages=()
[ "$(uname -m)" = x86_64 ] && test_packages=(qemu-user)

install_missing() {  # install_missing [extra packages...]
  local missing=()
  for p in "${packages[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kiln: installing missing packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# build [target...]: configure and build the named targets (all when none).
build() {
  # nvcc lives outside PATH in a default toolkit install; let CMake's CUDA detection see it.
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  local archs=()
  [ -n "${KILN_CUDA_ARCHS:-}" ] && archs=(-DCMAKE_CUDA_ARCHITECTURES="$KILN_CUDA_ARCHS")
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA="${KILN_CUDA:-AUTO}" \
    -DKILN_NATIVE="${KILN_NATIVE:-ON}" "${archs[@]}"
  local targets=()
  for t in "$@"; do targets+=(--target "$t"); done
  cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  train)
    install_missing
    build kiln-train
    exec "$build_dir/kiln-train" "$@"
    ;;
  test)
    install_missing "${test_packages[@]}"
    build
    cd "$build_dir"
    ctest --output-on-failure -j "$jobs" "$@"
    ;;
  build)
    install_missing
    build
    ;;
  *)
    echo "usage: bash tools/kiln.sh {train [flags]|test|build}" >&2
    exit 2
    ;;
esac
