#!/usr/bin/env bash
# Which switch makes ResNet-50's training step reproducible again where the tail fold runs?
# `kiln-bench --model resnet50 --verify-graph` (eager against graph replay, bit for bit; a
# difference inside B's warm-up is between two eager runs) repeated under each configuration,
# ROUNDS rounds with the configurations in the same order each round, then a tally per
# configuration; a run that differs adds verify-graph's lines naming what differs and by how much.
# BASE is added to every configuration (default: layer 1's tails folded at b64).
#   CONFIGS="default KILN_PDL=0 KILN_WGRAD_X_GRAM=0" ROUNDS=3 BATCH=64 \
#     bash tools/device/fold_determinism.sh
# A configuration is "default" (BASE alone) or a comma-separated list of VAR=value settings.
# No run starts once DEADLINE seconds (default 480) have passed since the script began, so that
# the tally comes back inside one device call. BUILD="kiln-bench ..." builds those targets
# first (tools/device/lib.sh). Logs of every run under /tmp/fold-det-logs; the summary in
# $OUT/fold-det.txt.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/fold-det.txt"
L=/tmp/fold-det-logs
mkdir -p "$L"
ROUNDS=${ROUNDS:-2}
BATCH=${BATCH:-64}
BASE=${BASE-KILN_TAIL_FOLD_MIN=10000000}
CONFIGS=${CONFIGS:-default}
DEADLINE=${DEADLINE:-480}
t0=$(date +%s)
# shellcheck source=tools/device/lib.sh
. tools/device/lib.sh
if [ -n "${BUILD:-}" ]; then
  # shellcheck disable=SC2086
  kiln_build $BUILD || exit 1
fi
declare -A pass runs
for i in $(seq "$ROUNDS"); do
  for cfg in $CONFIGS; do
    if [ $(( $(date +%s) - t0 )) -ge "$DEADLINE" ]; then
      echo "deadline ($DEADLINE s): round $i, $cfg not run" | tee -a "$S"
      break 2
    fi
    vars=()
    [ -n "$BASE" ] && IFS=, read -r -a vars <<< "$BASE"
    if [ "$cfg" != default ]; then
      IFS=, read -r -a more <<< "$cfg"
      vars+=("${more[@]}")
    fi
    log="$L/$cfg-$i.log"
    t1=$(date +%s)
    env "${vars[@]}" timeout 120 "$B/kiln-bench" --model resnet50 --batches "$BATCH" \
      --verify-graph > "$log" 2>&1
    rc=$?
    verdict=$(grep -E "^verdict|error" "$log" | tail -1)
    echo "round $i $cfg ($(( $(date +%s) - t1 )) s, rc $rc): ${verdict:-no verdict}" | tee -a "$S"
    # Which tensors, how many elements and how far apart (an ulp-sized difference is a summation
    # order; a large one, or inf/NaN, is a read of something stale or never written).
    [ "$rc" != 0 ] && grep -E " DIFFER, |^      [a-z]" "$log" | head -8 | tee -a "$S"
    runs[$cfg]=$(( ${runs[$cfg]:-0} + 1 ))
    [ "$rc" = 0 ] && pass[$cfg]=$(( ${pass[$cfg]:-0} + 1 ))
  done
done
for cfg in $CONFIGS; do
  echo "tally $cfg: ${pass[$cfg]:-0} of ${runs[$cfg]:-0} bitwise" \
    "(BASE ${BASE:-none}, batch $BATCH)" | tee -a "$S"
done
tar -czf "$OUT/fold-det-logs.tgz" -C /tmp fold-det-logs
echo "fold_determinism: $(( $(date +%s) - t0 )) s" | tee -a "$S"
