#!/usr/bin/env bash
# A ResNet-50 step change checked and measured in one device call: the build (kiln-bench and the
# GPU suites named), the suites, compute-sanitizer on chosen test cases, graph replay against
# eager, a switch off and on alternating on the step, one eager step under Nsight Compute per
# side, and PyTorch's anchor last.
#   SUITES="gpu_test_gemm_bn" SANITIZE="gpu_test_gemm_bn:*mask from x*" SWITCH=KILN_FUSED_DGRAD_RELU \
#     MODELS="resnet50:256:3 resnet50:64:1" NCU=1 VERIFY=1 TORCH=1 bash tools/device/resnet_check.sh
# SUITES=all builds and runs every GPU suite.
# SANITIZE="suite:filter ..." runs each suite's test cases matching the doctest filter under each
# tool of SANITIZE_TOOLS (default memcheck). MODELS lists model:batch:rounds for ab_switch.sh
# (off is SWITCH=0, on the default). NCU=1 profiles one eager b256 step with the default and,
# with SWITCH set, one with SWITCH=0 (the method of docs/performance.md), summarised side by
# side by tools/bench/ncu_step_summary.py. VERIFY=1 runs kiln-bench --verify-graph at batch 64.
# TORCH=1 runs .bench/torch_resnet50_quick.py (carried; the project's shared bench/) eager at
# batches 64 and 256 (TORCH_MODE=compile adds torch.compile at 256). PROBE="--conv1x1
# --tail-gemm" runs kiln-fusion-probe's modes named; NCU_PROBE="K,C,HW ..." runs ncu on the 1x1
# forward alone on those shapes (below); NCU_KERNELS="MODE:KERNEL ..." runs ncu on a kernel in a
# kiln-fusion-probe mode (below; NCU_STALLS=1 adds the stall reasons to both; NCU_SASS=1 adds,
# for each, where its warps wait instruction by instruction: tools/bench/ncu_sass_top.py).
# CONFIGS="default VAR=0 ..." alternates configurations ROUNDS times at each of BATCHES
# (tools/device/resnet_ab.sh).
# Filters in SANITIZE must not contain spaces (the list splits on them). OPS=1 times every op of
# 5 eager b256 steps by op and by op and input shape (kiln-bench --profile --profile-by-input;
# CUDA events around each op): which call of the step a kernel class is; OPS_ENV="VAR=value"
# adds a second table under that setting. TRACE=1 (below) traces the graph step's kernels with
# CUPTI; PLANS=1 (below) gives every process one convolution plan file. Run from the repository root with .deps (and .bench)
# carried; a summary in $OUT/resnet.txt, every log in $OUT/resnet-logs.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/resnet.txt"
L=/tmp/resnet-logs
mkdir -p $L
t0=$(date +%s)
finish() {
  [ -f "${KILN_CONV_PLANS:-}" ] && cp "$KILN_CONV_PLANS" "$OUT/"
  tar -czf "$OUT/resnet-logs.tgz" -C /tmp resnet-logs
  echo "resnet_check: $(( $(date +%s) - t0 )) s" | tee -a "$S"
}
SUITES=${SUITES:-}
# SUITES=all: every GPU suite (tests/gpu/test_NAME.cpp builds gpu_test_NAME).
if [ "$SUITES" = all ]; then
  SUITES=$(ls tests/gpu/test_*.cpp | sed 's|tests/gpu/test_|gpu_test_|; s|\.cpp$||' | tr '\n' ' ')
fi
. tools/device/lib.sh
# shellcheck disable=SC2086
kiln_build kiln-bench $SUITES ${PROBE:+kiln-fusion-probe} ${NCU_PROBE:+kiln-fusion-probe} \
  ${NCU_KERNELS:+kiln-fusion-probe} ||
  { finish; exit 1; }
# shellcheck disable=SC2086
kiln_suites $SUITES
# shellcheck disable=SC2086
kiln_sanitize ${SANITIZE:-}
# PLANS=1: every process of the call shares one convolution plan file (KILN_CONV_PLANS; the first
# to meet a problem tunes it, the rest take its choice), so that A/B rounds, ncu (whose own
# tuning keeps other plans: docs/lab/step-profiles.md) and the trace run the same cuDNN plans.
# The file comes back in $OUT. Set after the suites and sanitizers, which tune on their own.
if [ "${PLANS:-0}" = 1 ]; then
  export KILN_CONV_PLANS=$L/conv-plans.txt
  rm -f "$KILN_CONV_PLANS"
  # A plain process writes the b256 plans first, whatever runs next (ncu must not be the one).
  timeout 200 $B/kiln-bench --model resnet50 --batches 256 --graph-only > $L/plans-writer.log 2>&1
  n=$(cat "$KILN_CONV_PLANS" 2>/dev/null | wc -l)
  echo "plans: $(( n > 0 ? n - 1 : 0 )) records written by a plain b256 process" | tee -a "$S"
fi
if [ "${VERIFY:-0}" = 1 ]; then
  timeout 300 $B/kiln-bench --model resnet50 --batches 64 --verify-graph > $L/verify.log 2>&1
  echo "verify-graph resnet50 b64: rc $?; $(grep -E "^verdict" $L/verify.log | tail -2)" | tee -a "$S"
fi
if [ -n "${PROBE:-}" ]; then  # PROBE="--conv1x1" etc.: kiln-fusion-probe's modes, one after another
  for mode in $PROBE; do
    timeout 300 $B/kiln-fusion-probe $mode 2>&1 | tee -a "$S"
  done
fi
MODELS=${MODELS-resnet50:256:3}
[ -n "$MODELS" ] && [ -n "${SWITCH:-}" ] && MODELS="$MODELS" OUT=$L/ab B=$B \
  bash tools/device/ab_switch.sh 2>&1 | tee -a "$S"
# CONFIGS (with ROUNDS, BATCHES): configurations alternated by resnet_ab.sh at each batch size.
if [ -n "${CONFIGS:-}" ]; then
  for b in ${BATCHES:-256}; do
    CONFIGS="$CONFIGS" ROUNDS=${ROUNDS:-3} BATCH=$b B=$B bash tools/device/resnet_ab.sh 2>&1 |
      tee -a "$S"
  done
fi
if [ "${NCU:-0}" = 1 ]; then
  prof() {  # $1: the CSV; the rest: environment for kiln-bench
    local csv=$1; shift
    env "$@" timeout 400 ncu --clock-control none --cache-control none --profile-from-start off \
      --metrics gpu__time_duration.sum,dram__bytes.sum --csv $B/kiln-bench --model resnet50 \
      --batches 256 --eager-only --profile > "$csv" 2> "$csv.err"
    echo "ncu $*: rc $?" | tee -a "$S"
  }
  prof $L/step-on.csv KILN_UNUSED=0
  if [ -n "${SWITCH:-}" ]; then
    prof $L/step-off.csv "$SWITCH=0"
    python3 tools/bench/ncu_step_summary.py $L/step-off.csv --compare $L/step-on.csv \
      --kernels 25 >> "$S" 2>&1
  fi
  python3 tools/bench/ncu_step_summary.py $L/step-on.csv --kernels 40 >> "$S" 2>&1
fi
# TRACE=1: the graph step's kernels as they really run (kiln-bench --trace-kernels: CUPTI, nothing
# serialised), at each of TRACE_BATCHES (256), summarised by tools/bench/kernel_trace_summary.py
# beside NCU=1's profile when there is one; the CSVs come back gzipped in $OUT. TRACE_B2B=1: 10
# replays issued back to back (--trace-back-to-back), with the gaps between them.
if [ "${TRACE:-0}" = 1 ]; then
  b2b=()
  [ "${TRACE_B2B:-0}" = 1 ] && b2b=(--trace-back-to-back)
  for b in ${TRACE_BATCHES:-256}; do
    timeout 300 $B/kiln-bench --model resnet50 --batches "$b" --graph-only \
      --trace-kernels $L/trace-b$b.csv "${b2b[@]}" > $L/trace-b$b.log 2>&1
    echo "trace b$b: rc $?" | tee -a "$S"
    cat $L/trace-b$b.log >> "$S"
    if [ -f $L/trace-b$b.csv ]; then
      ncu_arg=""
      [ "$b" = 256 ] && [ -f $L/step-on.csv ] && ncu_arg="--ncu $L/step-on.csv"
      # shellcheck disable=SC2086
      python3 tools/bench/kernel_trace_summary.py $L/trace-b$b.csv --kernels 40 $ncu_arg \
        >> "$S" 2>&1
      gzip -c $L/trace-b$b.csv > "$OUT/trace-b$b.csv.gz"
    fi
  done
fi
# NCU_STALLS=1: ncu also takes the share of active warps stalled for each reason (the
# WarpStateStats section's text names only the total), printed largest first by ncu_stalls.
STALLS="long_scoreboard short_scoreboard barrier membar wait mio_throttle lg_throttle \
  math_pipe_throttle tex_throttle dispatch_stall no_instruction not_selected selected sleeping \
  branch_resolving drain misc imc_miss"
stall_args=()
if [ "${NCU_STALLS:-0}" = 1 ]; then
  m=""
  for r in $STALLS; do m="$m${m:+,}smsp__warp_issue_stalled_${r}_per_warp_active.pct"; done
  stall_args=(--metrics "$m")
fi
ncu_stalls() {
  [ "${NCU_STALLS:-0}" = 1 ] || return 0
  echo "stalls, % of active warps (largest first):" | tee -a "$S"
  grep -E "^ +smsp__warp_issue_stalled_" "$1" |
    sed -E 's/^ *smsp__warp_issue_stalled_(.*)_per_warp_active\.pct +%? +([0-9.,]+).*/\2 \1/' |
    tr -d ',' | sort -rn | head -8 | tee -a "$S"
}
# NCU_SASS=1: one more ncu run of the same launch with the source counters (warp-state samples
# per SASS instruction; the report in /tmp, not among the logs), the source page exported as CSV
# among the logs, and its summary by opcode and instruction.
# ncu_sass KERNEL_REGEX LOGNAME BINARY ARGS...
ncu_sass() {
  [ "${NCU_SASS:-0}" = 1 ] || return 0
  local k=$1 name=$2
  shift 2
  timeout 300 ncu -k "regex:$k" --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats -o "/tmp/ncu-sass-$name" -f "$@" > "$L/sass-$name.log" 2>&1 &&
    ncu -i "/tmp/ncu-sass-$name.ncu-rep" --page source --csv --print-source sass > "$L/sass-$name.csv" \
      2>> "$L/sass-$name.log"
  echo "ncu sass $name: rc $?" | tee -a "$S"
  python3 tools/bench/ncu_sass_top.py "$L/sass-$name.csv" 2>&1 | tee -a "$S"
}
# NCU_PROBE="256,1024,14 128,512,28": the 1x1 forward with statistics alone on each shape
# (kiln-fusion-probe --conv1x1 --shape K,C,HW; its third launch) under ncu's speed-of-light, warp
# state and scheduler sections, once as built and once under NCU_PROBE_ENV (e.g.
# KILN_GEMM_PINGPONG=1) when set: the stall reasons that say what bounds the kernel.
if [ -n "${NCU_PROBE:-}" ]; then
  for shape in $NCU_PROBE; do
    for e in KILN_UNUSED=0 ${NCU_PROBE_ENV:-}; do
      log=$L/ncu-probe-${shape//,/-}-${e%%=*}.txt
      env "$e" timeout 120 ncu -k regex:dgrad1x1_bn_sums_wgmma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy "${stall_args[@]}" $B/kiln-fusion-probe --conv1x1 --shape "$shape" \
        > "$log" 2>&1
      echo "ncu probe $shape $e: rc $?" | tee -a "$S"
      grep -iE "duration|throughput|stall|warp cycles per issued|eligible|issued warp" "$log" |
        grep -v "smsp__warp_issue_stalled" | head -30 | tee -a "$S"
      ncu_stalls "$log"
    done
    ncu_sass dgrad1x1_bn_sums_wgmma "probe-${shape//,/-}" $B/kiln-fusion-probe --conv1x1 --shape "$shape"
  done
fi
# NCU_KERNELS="--stem:stem_conv_stats_wgmma --stem:stem_wgrad_wgmma": each kernel (a regex of
# its name) in the kiln-fusion-probe mode before the colon, its third launch, under the same ncu
# sections as NCU_PROBE (and NCU_STALLS): what bounds a kernel that the probe only times. ncu's
# default clock control (base clocks locked), unlike the step profile's --clock-control none:
# its durations compare with each other, not with the step profile's or the probe's.
# ncu_kernel KERNEL_REGEX NAME TIMEOUT LABEL BINARY ARGS...: the kernel's third launch under those
# sections, a summary, its stall reasons (NCU_STALLS) and its SASS samples (NCU_SASS).
ncu_kernel() {
  local kernel=$1 name=$2 limit=$3 label=$4
  shift 4
  local log=$L/ncu-$name.txt
  timeout "$limit" ncu -k "regex:$kernel" --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis "${stall_args[@]}" "$@" > "$log" 2>&1
  echo "ncu $label: rc $?" | tee -a "$S"
  grep -iE "duration|throughput|stall|warp cycles per issued|eligible|issued warp|occupancy" \
    "$log" | grep -v "smsp__warp_issue_stalled" | head -40 | tee -a "$S"
  ncu_stalls "$log"
  ncu_sass "$kernel" "$name" "$@"
}
if [ -n "${NCU_KERNELS:-}" ]; then
  for spec in $NCU_KERNELS; do
    mode=${spec%%:*}
    kernel=${spec#*:}
    ncu_kernel "$kernel" "kernel-${kernel//[^A-Za-z0-9_]/_}" 180 "$kernel ($mode)" \
      $B/kiln-fusion-probe "$mode"
  done
fi
# NCU_STEP_KERNELS="REGEX ...": each kernel (a regex of its name without spaces: '.' matches
# one; template flags may read 1/0 or true/false) in the eager b256 step, its third launch, under
# NCU_KERNELS' sections, and with NCU_SASS=1 its stalls per SASS instruction: a kernel of the
# step that no kiln-fusion-probe mode runs (e.g. the tails that read r compact, kSub2:
# 'dgrad1x1_bn_sums_wgmma_kernel<(1|true),.(1|true),.(1|true),.(0|false),.(1|true),.(1|true)(,.(0|false)){6},.(1|true)>').
if [ -n "${NCU_STEP_KERNELS:-}" ]; then
  for kernel in $NCU_STEP_KERNELS; do
    name=step-$(printf '%s' "$kernel" | tr -c 'A-Za-z0-9_' '_' | cut -c1-48)
    ncu_kernel "$kernel" "$name" 300 "$name (the eager b256 step)" \
      $B/kiln-bench --model resnet50 --batches 256 --eager-only
  done
fi
if [ "${OPS:-0}" = 1 ]; then  # OPS_ENV="VAR=value": a second table under that setting
  for e in KILN_UNUSED=0 ${OPS_ENV:-}; do
    env "$e" timeout 300 $B/kiln-bench --model resnet50 --batches 256 --eager-only --profile \
      --profile-by-input > $L/ops-${e%%=*}.log 2>&1
    echo "ops profile $e: rc $?" | tee -a "$S"
    sed -n '/^per-op profile/,$p' $L/ops-${e%%=*}.log >> "$S"
  done
fi
if [ "${TORCH:-0}" = 1 ] && [ -f .bench/torch_resnet50_quick.py ]; then
  PYTHONUNBUFFERED=1 timeout 300 python3 .bench/torch_resnet50_quick.py ${TORCH_MODE:-eager} 64,256 2>&1 |
    grep -v Warning | tee -a "$S"
fi
finish
