#!/usr/bin/env bash
# The portable build on other x86-64 CPUs than the one CI has, emulated by qemu-user
# (Debian's qemu-user; tools/kiln.sh installs it for its test command on x86-64 hosts):
#   1. the CPU suites that compare results bit for bit and run quickly emulated, under
#      `-cpu Conroe` (SSE2-SSSE3 only: no SSE4.2, AVX or FMA; other cache sizes): among them the
#      FP-contraction checks (test_elementwise), FusedSGD/AdamW against SGD/AdamW (test_amp), the
#      RGB-against-channel check (test_image). About 90 s; the other suites pass emulated too
#      but take minutes (docs/lab/ci.md, 2026-12-05);
#   2. kiln-train's first 3 steps (Fashion-MNIST, resnet_small of width 8, one thread) natively,
#      under `-cpu Conroe` and under `-cpu max` (qemu's every feature: AVX2, FMA, other cache
#      sizes): the checkpoints written at the stop, weights and optimizer state, must be equal
#      bit for bit (Eigen's GEMM blocking once followed the CPU's caches: docs/lab/ci.md).
# Exit 77 (CTest: Skipped) where it cannot run: not an x86-64 host, no qemu-x86_64, a native
# build (-march=native code may use what the emulated CPUs lack), no Fashion-MNIST.
#   bash tests/emulated_cpu.sh BUILD_DIR NATIVE(ON|OFF)
set -uo pipefail
build=${1:?usage: emulated_cpu.sh BUILD_DIR NATIVE}
native=${2:?usage: emulated_cpu.sh BUILD_DIR NATIVE}
skip() {
  echo "emulated_cpu: skipped: $*"
  exit 77
}
[ "$(uname -m)" = x86_64 ] || skip "the host is $(uname -m), not x86-64"
qemu=$(command -v qemu-x86_64) || skip "qemu-x86_64 not found (Debian: qemu-user)"
case "$native" in ON | on | TRUE | true | 1) skip "a native build (KILN_NATIVE=ON)" ;; esac
data=/usr/share/datasets/fashion-mnist
[ -e "$data/train-images-idx3-ubyte.gz" ] || skip "no Fashion-MNIST in $data (dataset-fashion-mnist)"

work=$(mktemp -d "${TMPDIR:-/tmp}/kiln_emulated_cpu.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail=0

suites=(test_elementwise test_amp test_optim test_muon test_image test_batch_norm test_softmax
        test_loss test_reduce test_grad_accumulate test_pool test_transformer_ops test_vit
        test_matmul test_autograd)
echo "== CPU suites under qemu -cpu Conroe"
for t in "${suites[@]}"; do
  if OMP_NUM_THREADS=2 KILN_SOURCE_DIR="$(cd "$(dirname "$0")/.." && pwd)" \
    "$qemu" -cpu Conroe "$build/$t" > "$work/$t.log" 2>&1; then
    echo "$t: $(grep -E '^\[doctest\] test cases' "$work/$t.log")"
  else
    tail -20 "$work/$t.log"
    echo "emulated_cpu: FAILED: $t under -cpu Conroe"
    fail=1
  fi
done

# kiln-train stops after step 3 (its test hook raises SIGTERM: the stop path runs too) and writes
# checkpoint.safetensors; exit status 143.
train() {  # train NAME [qemu -cpu MODEL]
  local name=$1
  shift
  OMP_NUM_THREADS=1 KILN_TRAIN_TEST_STOP=3 "$@" "$build/kiln-train" "$data" --width 8 -j 0 \
    --output "$work/$name" --quiet > "$work/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 143 ]; then
    tail -5 "$work/$name.log"
    echo "emulated_cpu: FAILED: kiln-train ($name) exited $rc, not 143 (stopped after step 3)"
    fail=1
    return 1
  fi
}
echo "== kiln-train, 3 steps: natively, under -cpu Conroe and -cpu max"
train native &&
  for cpu in Conroe max; do
    train "$cpu" "$qemu" -cpu "$cpu" || continue
    if cmp -s "$work/native/checkpoint.safetensors" "$work/$cpu/checkpoint.safetensors"; then
      echo "$cpu: the checkpoint equals the native run's bit for bit"
    else
      echo "emulated_cpu: FAILED: the checkpoint after 3 steps under -cpu $cpu differs from the" \
        "native run's"
      fail=1
    fi
  done
exit $fail
