#!/usr/bin/env bash
# Issue 15 on the GPU machine: builds kiln with CUDA (+ nvJPEG, libjpeg-turbo), runs the decoder
# suites, then kiln-loader-bench (stb, turbo, nvjpeg at 1/8/16 workers) on a generated
# ImageNet-like corpus and, in `train` mode, kiln-train on JPEGs against kiln-bench synthetic in
# the same call. Logs under $OUT (at most 8 files come back: build.log, tests.log, bench.log,
# bench.json, train.log, synth.log).
#
#   bash tools/device/jpeg-check.sh check            # build, tests, loader bench (~5 min)
#   bash tools/device/jpeg-check.sh train            # build, tests, end to end: kiln-bench
#                                                    #   synthetic, then kiln-train on 20,000
#                                                    #   train / 2,000 val JPEGs, 3 epochs,
#                                                    #   b256, 16 workers (~6 min)
#   bash tools/device/jpeg-check.sh all              # train, then check's loader bench
#   bash tools/device/jpeg-check.sh tests            # build, tests
#   bash tools/device/jpeg-check.sh failover         # build, tests, kiln-train with a decode
#                                                    #   stream that stops draining (below)
# Knobs (environment): N (loader-bench corpus, default 6000), WORKERS (1,8,16), BATCHES (8),
# TRAIN_N (20000), VAL_N (2000), EPOCHS (3), DECODERS (one kiln-train run per entry,
# DECODER[:HOST_FRACTION]: default "nvjpeg" (share auto); e.g. "nvjpeg nvjpeg:0 nvjpeg:0.5 cpu"), TRAIN_TIMEOUT (600 s),
# SKIP_TESTS=1, EXTRA_TARGETS (more build targets), STALL_AT (20 100),
# STALL_S (120), STACKS (1: failover dumps the stacks of a silent run), B (build directory,
# default build-jpeg; another script's build directory is reused as it is).
# Run from the repository root (or a copy of it); header-only dependencies come from
# .deps/include there or beside it (../.deps/include), see ../shared/GPU.md.
set -uo pipefail
mode=${1:-check}
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
deps="$PWD/.deps/include"
[ -d "$deps" ] || deps="$PWD/../.deps/include"
N=${N:-6000}
WORKERS=${WORKERS:-1,8,16}
BATCHES=${BATCHES:-8}
TRAIN_N=${TRAIN_N:-20000}
VAL_N=${VAL_N:-2000}
EPOCHS=${EPOCHS:-3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
targets="kiln-loader-bench gpu_test_crop_resize gpu_test_gpu_jpeg test_jpeg_turbo test_image_folder"
[ "$mode" != check ] && targets="$targets kiln-train kiln-bench"
[ -n "${EXTRA_TARGETS:-}" ] && targets="$targets $EXTRA_TARGETS"
B=${B:-build-jpeg}
{ cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$deps" &&
  ninja -C "$B" -j 16 $targets; } > "$OUT/build.log" 2>&1 ||
  { grep -E "error|FAILED|Error" -A5 "$OUT/build.log" | head -60; exit 1; }
grep "kiln:" "$OUT/build.log"
echo "build: $(( $(date +%s) - t0 )) s"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  for t in gpu_test_crop_resize gpu_test_gpu_jpeg test_jpeg_turbo test_image_folder; do
    echo "== $t" >> "$OUT/tests.log"
    timeout 300 "$B/$t" >> "$OUT/tests.log" 2>&1
    echo "$t: rc $?"
  done
  grep -E "MESSAGE|ERROR|test cases|Status" "$OUT/tests.log" | head -60
fi
loader_bench() {
  corpus=/tmp/kiln-jpeg-corpus
  rm -rf "$corpus"
  timeout 200 "$B/kiln-loader-bench" --generate "$N" --classes 100 --output-dir "$corpus" \
    --batches 0 2>&1 | tee -a "$OUT/bench.log"
  timeout 300 "$B/kiln-loader-bench" --folder "$corpus" --decoder stb,turbo,nvjpeg \
    --workers "$WORKERS" -b 256 --batches "$BATCHES" --json "$OUT/bench.json" 2>&1 | tee -a "$OUT/bench.log"
  timeout 120 "$B/kiln-loader-bench" --folder "$corpus" --decoder turbo,nvjpeg --workers 16 \
    -b 256 --batches "$BATCHES" --eval 2>&1 | tee -a "$OUT/bench.log"
}
end_to_end() {
  data=/tmp/kiln-jpeg-train
  rm -rf "$data"
  timeout 300 "$B/kiln-loader-bench" --generate "$TRAIN_N" --val "$VAL_N" --classes 100 \
    --output-dir "$data" --batches 0 2>&1 | tee -a "$OUT/train.log"
  # Same call: the synthetic figure, then kiln-train on the JPEG folder.
  timeout 240 "$B/kiln-bench" --model resnet50 --batches 256 --graph-only 2>&1 | tee "$OUT/synth.log"
  # The trainer's own ceiling: kiln-train on synthetic input (--dummy), same epochs and batch.
  echo "== kiln-train --dummy" | tee -a "$OUT/train.log"
  timeout 200 "$B/kiln-train" --arch resnet50 --dummy --dummy-images "$TRAIN_N" -b 256 \
    --epochs "$EPOCHS" --print-freq 20 --output /tmp/kiln-dummy-out --overwrite 2>&1 | tee -a "$OUT/train.log"
  for spec in ${DECODERS:-nvjpeg}; do  # DECODER or DECODER:HOST_FRACTION
    dec=${spec%%:*}
    frac=auto  # kiln-train's default
    [[ $spec == *:* ]] && frac=${spec#*:}
    echo "== kiln-train --decoder $dec --host-decode-fraction $frac" | tee -a "$OUT/train.log"
    timeout "${TRAIN_TIMEOUT:-600}" "$B/kiln-train" --arch resnet50 --data "$data" -b 256 \
      --workers 16 --epochs "$EPOCHS" --decoder "$dec" --host-decode-fraction "$frac" \
      --print-freq 20 --output /tmp/kiln-jpeg-out --overwrite 2>&1 | tee -a "$OUT/train.log"
  done
  grep -E "images/s|img/s" "$OUT/synth.log" | tail -3
  grep -E "^==|ImageFolder|done in|auto:|decoded" "$OUT/train.log"
}
# nvJPEG's failover (data/gpu_jpeg.h) in a real training: the decode stream stops draining for
# STALL_S s after the training loader's nvJPEG call N for each N in STALL_AT (20: epoch 1, before
# the first evaluation; 100: epoch 2), the guard gives up after 5 s, and the run must go on at
# its pace and end long before the stall does. Logs: stall-N.log, each line with the second it
# appeared (the log shows where a wait happened); the wall time is printed. STACKS=1: the first
# time the run prints nothing for 8 s after its failover warning, every thread's stack goes to
# stacks-N.txt (gdb where the machine has it, else each thread's kernel wait channel).
dump_stacks() {  # pid (of a run started with tools/device/stack_shim.so preloaded)
  if command -v gdb > /dev/null; then
    gdb -p "$1" -batch -ex "thread apply all bt 20" 2>&1 | grep -vE "^\[(New|Thread debugging)"
    return
  fi
  echo "each thread's name, wait channel and system call"
  for t in /proc/"$1"/task/*; do
    echo "$(basename "$t") $(cat "$t/comm") wchan=$(cat "$t/wchan" 2>/dev/null) syscall=$(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"
  done
  [ -f /tmp/stack_shim.so ] || return
  local before
  before=$(wc -l < "$raw")
  for t in /proc/"$1"/task/*; do  # tgkill(pid, tid, SIGUSR2): the shim prints that thread's stack; 234 and 12 are x86-64 Linux's numbers
    python3 -c "import ctypes,sys; ctypes.CDLL(None).syscall(234, int(sys.argv[1]), int(sys.argv[2]), 12)" \
      "$1" "$(basename "$t")"
    sleep 0.2
  done
  sleep 1
  # Frames in kiln-train are "kiln-train(+offset)": named by the nearest symbol below the
  # return address (a Release build has a symbol table, no line tables).
  echo "stacks (kiln-train frames named from its symbol table):"
  tail -n +$((before + 1)) "$raw" | grep -E "^== stack|\[0x" |
    python3 -c '
import bisect, re, subprocess, sys
syms = []
for line in subprocess.run(["nm", "-C", "-n", "--defined-only", sys.argv[1]],
                           capture_output=True, text=True).stdout.splitlines():
    parts = line.split(" ", 2)
    if len(parts) == 3 and parts[1] in "tTwW":
        syms.append((int(parts[0], 16), parts[2]))
addrs = [a for a, _ in syms]
for line in sys.stdin:
    m = re.search(r"kiln-train\(\+(0x[0-9a-f]+)\)", line)
    if m and syms:
        off = int(m.group(1), 16) - 1
        i = bisect.bisect_right(addrs, off) - 1
        print("  " + (syms[i][1][:200] + " +%#x" % (off + 1 - addrs[i]) if i >= 0 else line.strip()))
    else:
        print("  " + re.sub(r" \[0x[0-9a-f]+\]$", "", line.strip())[:200])
' "$B/kiln-train"
}
failover() {
  data=/tmp/kiln-jpeg-train
  [ -d "$data/train" ] || timeout 300 "$B/kiln-loader-bench" --generate "$TRAIN_N" \
    --val "$VAL_N" --classes 100 --output-dir "$data" --batches 0 > "$OUT/corpus.log" 2>&1
  for at in ${STALL_AT:-20 100}; do
    echo "== kiln-train --decoder nvjpeg, decode stream stalled ${STALL_S:-120} s at call $at"
    local t1 raw=/tmp/stall-$at.raw log="$OUT/stall-$at.log" last=0 quiet=0 dumped=0 n pid kpid
    t1=$(date +%s%N)
    : > "$log"
    local preload=
    if [ "${STACKS:-0}" = 1 ] && [ ! -f /tmp/stack_shim.so ]; then
      cc -shared -fPIC -O1 -o /tmp/stack_shim.so tools/device/stack_shim.c || echo "no stack shim"
    fi
    [ "${STACKS:-0}" = 1 ] && [ -f /tmp/stack_shim.so ] && preload=/tmp/stack_shim.so
    LD_PRELOAD=$preload KILN_JPEG_TEST_STALL="$at:${STALL_S:-120}" KILN_JPEG_STALL_S=5 timeout 400 \
      "$B/kiln-train" --arch resnet50 --data "$data" -b 256 --workers 16 --epochs "$EPOCHS" \
      --decoder nvjpeg --print-freq 20 --output /tmp/kiln-stall-out --overwrite > "$raw" 2>&1 &
    pid=$!
    while kill -0 $pid 2> /dev/null; do
      sleep 1
      n=$(wc -l < "$raw")
      if [ "$n" -ne $last ]; then
        sed -n "$((last + 1)),${n}p" "$raw" | sed "s/^/$(date +%s) /" >> "$log"
        last=$n
        quiet=0
      else
        quiet=$((quiet + 1))
      fi
      if [ "${STACKS:-0}" = 1 ] && [ $quiet -ge 8 ] && [ $dumped = 0 ] && grep -q "GPU JPEG" "$raw"; then
        kpid=$(pgrep -P $pid | head -1)
        [ -n "$kpid" ] && dump_stacks "$kpid" > "$OUT/stacks-$at.txt" 2>&1
        echo "$(date +%s) [stacks dumped after ${quiet} s of silence]" >> "$log"
        dumped=1
      fi
    done
    wait $pid
    rc=$?
    n=$(wc -l < "$raw")
    [ "$n" -ne $last ] && sed -n "$((last + 1)),${n}p" "$raw" | sed "s/^/$(date +%s) /" >> "$log"
    echo "rc $rc, wall $(( ($(date +%s%N) - t1) / 1000000 )) ms"
    grep -E "warning: GPU JPEG|done in|decoded|error|auto|stacks dumped|model saved" "$log" | head -20
  done
}
case "$mode" in
  check) loader_bench ;;
  train) end_to_end ;;
  failover) failover ;;
  tests) ;;  # the build and the suites only
  all) end_to_end; loader_bench ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
