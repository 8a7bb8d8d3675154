#!/usr/bin/env bash
# ResNet-50 before and after a change, in one device call (after validate.sh build): builds
# kiln-bench at BASE (a commit of this repository, in a worktree under /tmp) and alternates
# `kiln-bench --model resnet50 --batches N --graph-only` between it and this tree's build,
# ROUNDS times each at each of BATCHES (default 256). PROBE="--stem ..." first runs those
# kiln-fusion-probe modes on both sides (for a change no switch turns off: a compiler barrier,
# a launch bound).
#   ROUNDS=2 BATCHES="64 256" PROBE="--stem" bash tools/device/ab_resnet50.sh a1846cc
set -uo pipefail
BASE=${1:?usage: ab_resnet50.sh BASE_COMMIT}
ROUNDS=${ROUNDS:-2}
BATCHES=${BATCHES:-256}
PROBE=${PROBE:-}
B=${B:-build-gpu}
W=/tmp/ab-base
git rev-parse --verify -q "$BASE^{commit}" > /dev/null || { echo "no commit $BASE here"; exit 1; }
git worktree add -f "$W" "$BASE" > /dev/null 2>&1 || { echo "git worktree add failed"; exit 1; }
cmake -S "$W" -B "$W/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$PWD/.deps/include" \
  > /dev/null 2>&1 && ninja -C "$W/b" -j 16 kiln-bench ${PROBE:+kiln-fusion-probe} > /dev/null 2>&1 ||
  { echo "build of $BASE failed"; exit 1; }
name() { [ "$1" = base ] && echo "$BASE" || git rev-parse --short HEAD; }
for mode in $PROBE; do
  for side in base this; do
    dir=$B; [ $side = base ] && dir=$W/b
    echo "$side ($(name $side)), kiln-fusion-probe $mode:"
    timeout 300 "$dir/kiln-fusion-probe" "$mode" 2>&1
  done
done
for batch in $BATCHES; do
  for i in $(seq "$ROUNDS"); do
    for side in base this; do
      bin=$B/kiln-bench; [ $side = base ] && bin=$W/b/kiln-bench
      echo "$side ($(name $side)):"
      $bin --model resnet50 --batches "$batch" --graph-only 2>&1 | grep -E "graph|error"
    done
  done
done
