#!/usr/bin/env bash
# On the GPU machine, in one call: build this tree (all targets) and an older tree (kiln-bench
# only) side by side, run the GPU suites of this tree, compute-sanitizer memcheck on the named
# suites, then kiln-bench --model resnet50 for both trees (alternating, same GPU) and the
# bitwise graph-vs-eager check. Logs go to $OUT.
#   bash tools/device/compare.sh BEFORE_DIR "BATCHES" "MEMCHECK_SUITES..."
# BEFORE_DIR holds the older tree's sources (e.g. `git archive REV | tar -x -C .before`);
# header-only dependencies travel in .deps/include (../shared/GPU.md).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
before=$1
batches=${2:-64,256}
memcheck=${3:-}
deps="$PWD/.deps/include"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
configure() {  # dir build_dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$deps" \
    > "$OUT/configure-$(basename "$1").log" 2>&1
}
configure . build-gpu || { tail -30 "$OUT"/configure-*.log; exit 1; }
configure "$before" "$before/build-gpu" || { echo "before: configure failed"; exit 1; }
ninja -C build-gpu -j 12 > "$OUT/build-after.log" 2>&1 &
pa=$!
ninja -C "$before/build-gpu" -j 6 kiln-bench kiln-train > "$OUT/build-before.log" 2>&1 &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
echo "builds: after rc=$ra before rc=$rb ($(( $(date +%s) - t0 )) s)"
[ $ra -ne 0 ] && { grep -E "error|FAILED" -A5 "$OUT/build-after.log" | head -60; exit 1; }
[ $rb -ne 0 ] && { grep -E "error|FAILED" -A5 "$OUT/build-before.log" | head -30; exit 1; }
ctest --test-dir build-gpu -R '^gpu_' --output-on-failure --timeout 300 > "$OUT/ctest-gpu.log" 2>&1
rc=$?
grep -E "tests passed|Test +#|\*\*\*" "$OUT/ctest-gpu.log" | tail -25
[ $rc -ne 0 ] && grep -B2 -A12 "ERROR\|FATAL\|exception" "$OUT/ctest-gpu.log" | head -80
echo "gpu suites done ($(( $(date +%s) - t0 )) s)"
for s in $memcheck; do
  timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "./build-gpu/$s" > "$OUT/memcheck-$s.log" 2>&1
  echo "memcheck $s: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-$s.log" | tail -1) $(grep -E 'test cases:' "$OUT/memcheck-$s.log" | tail -1)"
done
echo "memcheck done ($(( $(date +%s) - t0 )) s)"
bench() {  # name binary
  "$2" --model resnet50 --batches "$batches" > "$OUT/bench-$1.log" 2>&1
  echo "== $1"; grep -E "img/s" "$OUT/bench-$1.log" | head -12
}
for r in $(seq "${BENCH_REPS:-1}"); do
  bench "before$r" "$before/build-gpu/kiln-bench"
  bench "after$r" ./build-gpu/kiln-bench
done
# Checkpoints written by the older tree load in this one: train 1 epoch there on a tiny IDX
# folder (CKPT_DATA), resume for a 2nd epoch here, then evaluate its model.safetensors here.
if [ -n "${CKPT_DATA:-}" ]; then
  ck=$(mktemp -d)
  "$before/build-gpu/kiln-train" --data "$CKPT_DATA" --epochs 1 -b 32 --output "$ck/before" \
    > "$OUT/ckpt.log" 2>&1 && \
  ./build-gpu/kiln-train --data "$CKPT_DATA" --epochs 2 -b 32 --output "$ck/after" \
    --resume "$ck/before/checkpoint.safetensors" >> "$OUT/ckpt.log" 2>&1 && \
  ./build-gpu/kiln-train --data "$CKPT_DATA" --weights "$ck/before/model.safetensors" --evaluate \
    --output "$ck/eval" >> "$OUT/ckpt.log" 2>&1
  echo "old checkpoints in the new tree: rc=$?"; grep -iE "epoch|top-1|error" "$OUT/ckpt.log" | tail -8
fi
./build-gpu/kiln-bench --model resnet50 --verify-graph --batches 64 > "$OUT/verify.log" 2>&1
echo "verify-graph: rc=$? $(grep -E '^verdict' "$OUT/verify.log" | tail -2)"
echo "total $(( $(date +%s) - t0 )) s"
exit $rc
