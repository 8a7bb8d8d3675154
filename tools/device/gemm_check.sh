#!/usr/bin/env bash
# cuBLASLt GEMM tuning (cuda/blas.cpp: a problem's first 8 heuristic algorithms timed, the
# fastest kept) in one device call: the build; gpu_test_blas; KILN_GEMM_TUNE off and on,
# alternating (ab_switch.sh), on the models of MODELS; every tuned GEMM problem of one eager
# vit_b_16 step (KILN_GEMM_TUNE_LOG=1) with that step's per-op profile; then, with FAILOVER=1,
# nvJPEG's failover run (jpeg-check.sh failover with STACKS=1, stall 60 s at call 100) in the
# same build. SUITES (default gpu_test_blas) lists the GPU suites run first; VERIFY=1 adds
# kiln-bench's graph-replay check on vit_s_16 (batch 32); TORCH=1 runs PyTorch's vit_b_16 anchor
# (.bench/torch_vit.py, carried) last, in the same call. SANITIZE="suite:filter ..." runs each
# suite's test cases matching the doctest filter under compute-sanitizer, each tool of
# SANITIZE_TOOLS (default memcheck). SWITCH (default KILN_GEMM_TUNE) names the switch of the
# off/on runs. NCU="regex" reads Nsight Compute's SpeedOfLight section (time, memory and SM
# throughput; NCU_SECTIONS lists others, whose full text lands in the logs) for the first
# NCU_COUNT (default 12) kernels of an eager vit_b_16 step whose names match. MODELS="" skips the
# off/on runs; PROFILE=0 the eager profile.
#   bash tools/device/gemm_check.sh              (MODELS="vit_b_16:128:2 vit_s_16:128:1 resnet50:256:1")
# Run from the repository root with .deps carried; a summary in $OUT/gemm.txt, every log in
# $OUT/gemm-logs.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/gemm.txt"
L=/tmp/gemm-logs
mkdir -p $L
t0=$(date +%s)
finish() {
  tar -czf "$OUT/gemm-logs.tgz" -C /tmp gemm-logs
  echo "gemm_check: $(( $(date +%s) - t0 )) s" | tee -a "$S"
}
SUITES=${SUITES:-gpu_test_blas}
targets="kiln-bench $SUITES ${EXTRA_TARGETS:-}"
[ "${FAILOVER:-0}" = 1 ] && targets="$targets kiln-train kiln-loader-bench"
. tools/device/lib.sh
# shellcheck disable=SC2086
kiln_build $targets || { finish; exit 1; }
# shellcheck disable=SC2086
kiln_suites $SUITES
# shellcheck disable=SC2086
kiln_sanitize ${SANITIZE:-}
if [ "${VERIFY:-0}" = 1 ]; then
  timeout 300 $B/kiln-bench --model vit_s_16 --batches 32 --verify-graph > $L/verify.log 2>&1
  echo "verify-graph vit_s_16 b32: rc $?; $(grep -E "^verdict" $L/verify.log | tail -2)" | tee -a "$S"
fi
MODELS=${MODELS-vit_b_16:128:2 vit_s_16:128:1 resnet50:256:1}
[ -n "$MODELS" ] && SWITCH=${SWITCH:-KILN_GEMM_TUNE} MODELS="$MODELS" \
  OUT=$L/ab B=$B bash tools/device/ab_switch.sh 2>&1 | tee -a "$S"
if [ "${PROFILE:-1}" = 1 ]; then
  KILN_GEMM_TUNE_LOG=1 timeout 300 $B/kiln-bench --model vit_b_16 --batches 128 --eager-only \
    --profile > $L/profile.log 2>&1
  grep -F "[kiln gemm]" $L/profile.log | tee -a "$S"
  grep -vF "[kiln gemm]" $L/profile.log | tail -45 >> "$S"
fi
if [ -n "${NCU:-}" ]; then
  sections=""
  for sec in ${NCU_SECTIONS:-SpeedOfLight}; do sections="$sections --section $sec"; done
  timeout 400 ncu --clock-control none -k "regex:${NCU}" -c "${NCU_COUNT:-12}" $sections \
    $B/kiln-bench --model vit_b_16 --batches 128 --eager-only > $L/ncu.log 2>&1
  echo "ncu: rc $?" | tee -a "$S"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput" \
    $L/ncu.log | sed 's/  */ /g' | cut -c1-150 >> "$S"
fi
if [ "${FAILOVER:-0}" = 1 ]; then
  OUT=$L/jpeg B=$B SKIP_TESTS=1 STACKS=1 STALL_AT=100 STALL_S=60 \
    bash tools/device/jpeg-check.sh failover 2>&1 | tee -a "$S"
fi
if [ "${TORCH:-0}" = 1 ] && [ -f .bench/torch_vit.py ]; then
  PYTHONUNBUFFERED=1 timeout 300 python3 .bench/torch_vit.py vit_b_16 128 2>&1 | grep -v Warning |
    tee -a "$S"
fi
finish
