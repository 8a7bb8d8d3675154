#!/usr/bin/env bash
# ResNet-50 trained with a set of switches on and off, seeds interleaved, in one device call: a
# convergence check for ResNet-50 step changes that ResNet-18's Fashion-MNIST recipe does not
# exercise (docs/lab/norm-conv.md). Builds kiln-train, then for each seed of SEEDS runs the
# default and then OFF (VAR=0 settings, comma-separated) for EPOCHS epochs on DATA (default
# .deps/fashion-mnist, carried), with ARGS added to the recipe; one log per run (all of them
# with the build's in $OUT/r50-logs.tgz), a summary line each in $OUT/r50.txt and, last, each
# configuration's mean and its per-seed difference from the first (tools/bench/seed_summary.py).
# CONFIGS="default VAR=0 VAR=0,VAR2=0 ..." instead of OFF: those configurations in turn for each
# seed (each a comma-separated list of settings, or default).
#   OFF=KILN_CONV1X1_STATS=0,KILN_FUSED_DGRAD_RELU=0 SEEDS="0 1" EPOCHS=6 bash tools/device/r50_seeds.sh
#   python3 -m zipfile -e .imagenette/imagenette112.zip /tmp/ &&
#     DATA=/tmp/imn112 ARGS="--image-size 112 --label-smoothing 0.1 --workers 16
#     --zero-init-residual" EPOCHS=30 CONFIGS="default VAR=0" SEEDS="0 1 2" bash tools/device/r50_seeds.sh
# (the Imagenette recipe of docs/lab/norm-conv.md, v26; without --zero-init-residual an early
# loss spike, PyTorch's too, left v25's 21 runs between 70.3 and 78.2% top-1; with it v26's 14
# ended between 79.6 and 81.7%)
# ARCH (default resnet50) names another model: the Fashion-MNIST recipe of
# docs/lab/fashion-mnist.md is ARCH=resnet18 EPOCHS=30 ARGS="--augment --workers 8".
# PLANS=1: every run shares one convolution plan file (KILN_CONV_PLANS; the first run tunes, the
# rest take its choices). Runs of the same code in different processes otherwise train different
# bits — cuDNN's plans are tuned per process, and --decoder auto times the decoders — which made
# an A/A comparison on Imagenette come out −0.50 points, s.e. 0.11 (docs/lab/norm-conv.md, v42).
# PLANS=1 with --decoder cpu in ARGS is not enough for two runs of the same code to train the same
# bits: checked with CONFIGS="... KILN_UNUSED=0" (docs/lab/norm-conv/calls-2026-12-06-v43-h200.txt,
# call 1), the runs parted before step 50, and their A/A difference came out +0.36 points, s.e.
# 0.19. cuDNN's convolutions with statistics sum across thread blocks in no fixed order (README,
# "Reproducibility"); only --deterministic, slower, makes runs repeat.
# (.imagenette, an ignored, carried folder: thunderInfy/imagenette re-encoded by
# tools/bench/shrink_jpegs.cpp at 1/2 size (112 px on the short side), quality 68, and stored
# uncompressed in one zip file: 13,394 small files would not fit in what a call carries.)
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/r50.txt"
# The build's and each run's logs go to L and come back as one archive: a call returns at most 8
# files, and a log per run in $OUT pushed the summary itself out (2026-12-05, third record).
L=/tmp/r50-logs
mkdir -p "$L"
DATA=${DATA:-.deps/fashion-mnist}
. tools/device/lib.sh
finish() {
  tar -czf "$OUT/r50-logs.tgz" -C /tmp r50-logs
}
kiln_build kiln-train || { finish; exit 1; }
read -r -a args <<< "${ARGS:---workers 8}"
configs=${CONFIGS:-"default ${OFF:?OFF=VAR=0,... (the switches of the 'off' side), or CONFIGS}"}
# The highest training loss of the first 300 steps (four epochs of the Imagenette recipe) and
# its step: the warm-up's loss spike, if any.
early_peak() {
  python3 - "$1" <<'PY' 2>/dev/null || echo "no steps.jsonl"
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])][:300]
i = max(range(len(steps)), key=lambda k: steps[k]["loss"])
print(f"early peak loss {steps[i]['loss']:.2f} at step {i + 1}")
PY
}
if [ "${PLANS:-0}" = 1 ]; then
  export KILN_CONV_PLANS=$L/conv-plans.txt
  rm -f "$KILN_CONV_PLANS"
fi
for seed in ${SEEDS:-0 1}; do
  for config in $configs; do
    vars=()
    [ "$config" != default ] && IFS=, read -r -a vars <<< "$config"
    # The names of the old on/off form when OFF is given.
    side=${config//[=,]/_}
    [ -z "${CONFIGS:-}" ] && { [ "$config" = default ] && side=on || side=off; }
    log="$L/r50-$side-$seed.log"
    s0=$(date +%s)
    env "${vars[@]}" timeout ${RUN_TIMEOUT:-120} $B/kiln-train "$DATA" --arch "${ARCH:-resnet50}" \
      --epochs ${EPOCHS:-6} -b 128 --lr 0.1 --wd 5e-4 --warmup-epochs 1 --seed "$seed" \
      "${args[@]}" --output "/tmp/r50-$side-$seed" --overwrite > "$log" 2>&1
    rc=$?
    echo "seed $seed $side: rc $rc, $(( $(date +%s) - s0 )) s; $(grep -E "top-1" "$log" | tail -1);" \
      "$(early_peak "/tmp/r50-$side-$seed/steps.jsonl")" | tee -a "$S"
  done
done
# Each configuration's runs, mean and spread, and its per-seed difference from the first's.
python3 tools/bench/seed_summary.py "$S" | tee -a "$S"
finish
