#!/usr/bin/env bash
# A switch of core/switches.h off and on, alternating, in one device call (after
# validate.sh build): `kiln-bench --model M --batches N --graph-only` for each model, ROUNDS
# times each side, one JSON per run in $OUT.
#   SWITCH=KILN_ROW_KERNELS MODELS="vit_b_16:128:2 vit_s_16:128:1" bash tools/device/ab_switch.sh
# MODELS lists model:batch:rounds. Off is SWITCH=0; on is the default (the variable unset).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
SWITCH=${SWITCH:?SWITCH=KILN_... (a switch of core/switches.h)}
MODELS=${MODELS:-"vit_b_16:128:2 vit_s_16:128:1"}
B=${B:-build-gpu}
mkdir -p "$OUT"
for spec in $MODELS; do
  IFS=: read -r model batch rounds <<< "$spec"
  for i in $(seq "$rounds"); do
    for side in off on; do
      echo "$model $SWITCH $side:"
      if [ $side = off ]; then
        env "$SWITCH=0" $B/kiln-bench --model "$model" --batches "$batch" --graph-only \
          --json "$OUT/ab-$model-$side-$i.json" 2>&1 | grep -E "graph|error|unavailable"
      else
        env -u "$SWITCH" $B/kiln-bench --model "$model" --batches "$batch" --graph-only \
          --json "$OUT/ab-$model-$side-$i.json" 2>&1 | grep -E "graph|error|unavailable"
      fi
    done
  done
done
