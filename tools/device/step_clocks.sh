#!/usr/bin/env bash
# Why the timed graph step and the traced one differ: on one H200 (2026-12-06, v43) kiln-bench
# timed b256 at 23.47 ms a step while its three traced replays, each run alone after a sync,
# spanned 22.59-22.94 ms (on an H100, v36, the two agreed within 0.1 ms). Either the GPU waits
# between replays issued back to back, or its clocks drop under sustained load. This builds
# kiln-bench and, with nvidia-smi sampling the SM clock, power and the clock-event reasons every
# 100 ms, runs at each of BATCHES (256): the timed graph row; the trace of 3 replays with a sync
# between; the trace of 10 replays back to back (--trace-back-to-back: the gap before each
# replay and the period). Then the samples by phase (tools/bench/smi_phases.py).
#   BATCHES="256 64" bash tools/device/step_clocks.sh     (results in $OUT/clocks.txt)
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/clocks.txt"
L=/tmp/clock-logs
mkdir -p "$L"
. tools/device/lib.sh
kiln_build kiln-bench || exit 1
reasons=clocks_event_reasons.active
nvidia-smi --query-gpu=$reasons --format=csv > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$reasons \
  --format=csv,noheader,nounits -lms 100 > "$L/smi.csv" 2> "$L/smi.err" &
smi=$!
mark() { echo "$(date +%s.%N) $*" >> "$L/marks.txt"; }
sleep 1
for b in ${BATCHES:-256}; do
  mark "start graph-b$b"
  timeout 120 $B/kiln-bench --model resnet50 --batches "$b" --graph-only 2>&1 | grep -E "graph" |
    tee -a "$S"
  mark "end graph-b$b"
  sleep 1
  mark "start synced-b$b"
  timeout 120 $B/kiln-bench --model resnet50 --batches "$b" --graph-only \
    --trace-kernels "$L/t-$b.csv" 2>&1 | grep -E "kernel trace|graph" | tee -a "$S"
  mark "end synced-b$b"
  sleep 1
  mark "start b2b-b$b"
  timeout 120 $B/kiln-bench --model resnet50 --batches "$b" --graph-only \
    --trace-kernels "$L/b2b-$b.csv" --trace-back-to-back 2>&1 | grep -E "kernel trace|graph" |
    tee -a "$S"
  mark "end b2b-b$b"
  sleep 1
done
kill "$smi"
python3 tools/bench/smi_phases.py "$L/smi.csv" "$L/marks.txt" | tee -a "$S"
for f in "$L"/b2b-*.csv; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
tar -czf "$OUT/clock-logs.tgz" -C /tmp clock-logs
