#!/usr/bin/env bash
# Per-step training losses of kiln-train under several configurations, side by side: whether a
# change follows the same trajectory as what it replaces (the same seed, the CPU decoder, so that
# the batches are the same), and whether a configuration repeats itself. Each configuration of
# CONFIGS (comma-separated VAR=val settings, or default; a name may repeat) trains EPOCHS (2)
# epochs on DATA (the Imagenette recipe of tools/device/r50_seeds.sh by default); the losses of
# chosen steps from each run's steps.jsonl go to $OUT/trace.txt.
#   python3 -m zipfile -e .imagenette/imagenette112.zip /tmp/ &&
#     CONFIGS="default default KILN_GEMM_TALL=0 KILN_GEMM_TALL=0" bash tools/device/step_trace.sh
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
DATA=${DATA:-/tmp/imn112}
S="$OUT/trace.txt"  # lib.sh: the summary and the logs
L=/tmp
read -r -a args <<< "${ARGS:---image-size 112 --label-smoothing 0.1 --workers 16}"
. tools/device/lib.sh
kiln_build kiln-train > /tmp/trace-build.log 2>&1 || { tail -20 /tmp/trace-build.log; exit 1; }
runs=()
i=0
for config in ${CONFIGS:?CONFIGS=\"default VAR=0 ...\"}; do
  vars=()
  [ "$config" != default ] && IFS=, read -r -a vars <<< "$config"
  name="$i-${config//[=,]/_}"
  env "${vars[@]}" timeout ${RUN_TIMEOUT:-120} $B/kiln-train "$DATA" --arch resnet50 \
    --epochs ${EPOCHS:-2} -b 128 --lr 0.1 --wd 5e-4 --warmup-epochs 1 --seed ${SEED:-0} \
    --decoder cpu -p 1000 "${args[@]}" --output "/tmp/trace-$name" --overwrite \
    > "/tmp/trace-$name.log" 2>&1
  echo "$name: rc $?" | tee -a "$OUT/trace.txt"
  runs+=("$name")
  i=$((i + 1))
done
python3 - "${runs[@]}" <<'PY' | tee -a "$OUT/trace.txt"
import json, sys
names = sys.argv[1:]
logs = {n: [json.loads(l) for l in open(f"/tmp/trace-{n}/steps.jsonl")] for n in names}
print("step " + " ".join(f"{n[:14]:>14}" for n in names))
for i in [0, 1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 72, 100, 145, 200, 300]:
    if all(i < len(logs[n]) for n in names):
        print(f"{i + 1:4d} " + " ".join(f"{logs[n][i]['loss']:14.7f}" for n in names))
peaks = []
for n in names:
    early = logs[n][:300]
    k = max(range(len(early)), key=lambda j: early[j]["loss"])
    peaks.append(f"{early[k]['loss']:.2f}@{k + 1}")
print("early peak " + " ".join(f"{p:>14}" for p in peaks))
print("final loss scale " + " ".join(str(logs[n][-1]["loss_scale"]) for n in names))
PY
