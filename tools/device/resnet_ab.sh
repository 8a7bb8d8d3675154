#!/usr/bin/env bash
# Several configurations of the ResNet-50 step alternated in one device call (after a build):
# `kiln-bench --model resnet50 --batches B --graph-only` per configuration, ROUNDS rounds, the
# configurations in the same order each round. A configuration is "default" or a comma-separated
# list of VAR=value settings (switches of core/switches.h).
#   CONFIGS="default KILN_CONV1X1_STATS=0 KILN_CONV1X1_STATS=0,KILN_FUSED_DGRAD_RELU=0" \
#     ROUNDS=3 BATCH=256 bash tools/device/resnet_ab.sh
# Each process tunes its convolutions afresh, which moves the step by up to ±0.3 ms
# (docs/lab/convolution.md): compare configurations by their means over the rounds.
set -uo pipefail
B=${B:-build-gpu}
ROUNDS=${ROUNDS:-3}
BATCH=${BATCH:-256}
CONFIGS=${CONFIGS:-default}
for i in $(seq "$ROUNDS"); do
  for cfg in $CONFIGS; do
    vars=()
    [ "$cfg" != default ] && IFS=, read -r -a vars <<< "$cfg"
    line=$(env "${vars[@]}" $B/kiln-bench --model resnet50 --batches "$BATCH" --graph-only 2>&1 |
      grep -E "graph|error" | head -1)
    echo "round $i $cfg: $line"
  done
done
