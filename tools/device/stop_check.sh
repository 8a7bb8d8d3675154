#!/usr/bin/env bash
# kiln-train's stop and mid-epoch resume on the GPU, in one device call (the CPU side is
# tests/test_kiln_train.cpp): the DeviceLoader suite (an epoch started at batch k), then a
# ResNet-18 on synthetic data (whole-step CUDA graph, f16):
#   1. straight: EPOCHS epochs of STEPS steps;
#   2. stopped: KILN_TRAIN_TEST_STOP=STOP raises SIGTERM after step STOP (exit 143 expected, a
#      checkpoint with epoch_batches_done), then --resume to the end;
#   3. killed: --checkpoint-steps CK, SIGKILL once the first checkpoint is on disk, then --resume;
#   4. --deterministic: twice straight and once stopped and resumed, each compared bit for bit;
# and for each the exit codes, the steps logged (each step once), the checkpoint's metadata and
# the losses around the stop beside the straight run's (in the default mode equal bits are not
# expected across processes on the GPU: cuDNN's timed choices and its unordered sums; with
# --deterministic they are; README, Reproducibility).
#   bash tools/device/stop_check.sh       (no data carried; about two minutes)
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/stop.txt"
L=$OUT
. tools/device/lib.sh
kiln_build kiln-train gpu_test_device_loader || exit 1
kiln_suites gpu_test_device_loader
EPOCHS=${EPOCHS:-2} STEPS=${STEPS:-100} STOP=${STOP:-130} CK=${CK:-25}
train=($B/kiln-train --dummy --dummy-images $((STEPS * 128)) -a resnet18 -b 128 --epochs "$EPOCHS"
  --seed 0 --quiet)
job() {  # job OUTPUT_DIR [flags...]
  local dir=$1
  shift
  "${train[@]}" --output "$dir" "$@"
}
# The steps logged, whether each appears once, and the losses at steps STOP-1..STOP+2.
steps() {
  python3 - "$1/steps.jsonl" "$STOP" <<'PY' 2>&1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
n = [r["step"] for r in rows]
stop = int(sys.argv[2])
around = {r["step"]: round(r["loss"], 5) for r in rows if stop - 1 <= r["step"] <= stop + 2}
print(f"{len(n)} steps, 1..{max(n)} each once: {n == list(range(1, max(n) + 1))}; losses {around}")
PY
}
meta() {  # the checkpoint's kiln.step, kiln.epoch and epoch_batches_done
  python3 - "$1/checkpoint.safetensors" <<'PY' 2>&1
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    m = json.loads(f.read(n)).get("__metadata__", {})
print({k: m.get(k) for k in ("kiln.epoch", "kiln.step", "epoch_batches_done")})
PY
}
t0=$(date +%s)
job /tmp/stop-a --overwrite > "$L/stop-a.log" 2>&1
echo "straight: rc $? ($(( $(date +%s) - t0 )) s); $(steps /tmp/stop-a)" | tee -a "$S"
KILN_TRAIN_TEST_STOP=$STOP job /tmp/stop-b --overwrite > "$L/stop-b.log" 2>&1
echo "stopped at $STOP: rc $? (143 expected); $(meta /tmp/stop-b); $(grep -c . /tmp/stop-b/steps.jsonl) steps logged" |
  tee -a "$S"
grep "kiln-train: stopped" "$L/stop-b.log" | tee -a "$S"
job /tmp/stop-b --resume /tmp/stop-b/checkpoint.safetensors > "$L/stop-b2.log" 2>&1
echo "resumed: rc $?; $(steps /tmp/stop-b); model_best: $(ls /tmp/stop-b/model_best.safetensors 2>&1)" |
  tee -a "$S"
rm -rf /tmp/stop-c
# Started directly (not through job) so that $! is kiln-train's own pid.
"${train[@]}" --output /tmp/stop-c --checkpoint-steps "$CK" > "$L/stop-c.log" 2>&1 &
pid=$!
for _ in $(seq 600); do [ -e /tmp/stop-c/checkpoint.safetensors ] && break; sleep 0.1; done
kill -9 $pid
wait $pid
echo "killed: rc $? (137 expected); $(meta /tmp/stop-c)" | tee -a "$S"
job /tmp/stop-c --resume /tmp/stop-c/checkpoint.safetensors > "$L/stop-c2.log" 2>&1
echo "resumed: rc $?; $(steps /tmp/stop-c)" | tee -a "$S"
# 4. --deterministic: two straight runs, and a run stopped at STOP and resumed, must give the same
# bits (model files compared with cmp, every step's loss); and the images/s of each epoch beside
# the default mode's (run 1).
same() {  # same DIR_A DIR_B: the model files and the per-step losses compared
  python3 - "$1" "$2" <<'PY' 2>&1
import filecmp, json, sys
a, b = sys.argv[1:3]
la = [json.loads(l)["loss"] for l in open(a + "/steps.jsonl")]
lb = [json.loads(l)["loss"] for l in open(b + "/steps.jsonl")]
first = next((i + 1 for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)
print(f"model files equal: {filecmp.cmp(a + '/model.safetensors', b + '/model.safetensors', shallow=False)}; "
      f"losses of {len(la)} / {len(lb)} steps equal: {la == lb}"
      + ("" if first is None else f" (first difference at step {first})"))
PY
}
speed() {  # each epoch's images/s from DIR/log.jsonl
  python3 -c 'import json,sys; print([round(json.loads(l)["images_per_s"]) for l in open(sys.argv[1])])' \
    "$1/log.jsonl" 2>&1
}
job /tmp/stop-d1 --overwrite --deterministic > "$L/stop-d1.log" 2>&1
echo "deterministic: rc $?; images/s per epoch $(speed /tmp/stop-d1) (default mode $(speed /tmp/stop-a))" |
  tee -a "$S"
job /tmp/stop-d2 --overwrite --deterministic > "$L/stop-d2.log" 2>&1
echo "deterministic again: rc $?; $(same /tmp/stop-d1 /tmp/stop-d2)" | tee -a "$S"
KILN_TRAIN_TEST_STOP=$STOP job /tmp/stop-d3 --overwrite --deterministic > "$L/stop-d3.log" 2>&1
echo "deterministic, stopped at $STOP: rc $? (143 expected)" | tee -a "$S"
job /tmp/stop-d3 --deterministic --resume /tmp/stop-d3/checkpoint.safetensors > "$L/stop-d4.log" 2>&1
echo "deterministic, resumed: rc $?; $(same /tmp/stop-d1 /tmp/stop-d3)" | tee -a "$S"
echo "default mode, straight against stopped and resumed: $(same /tmp/stop-a /tmp/stop-b)" |
  tee -a "$S"
