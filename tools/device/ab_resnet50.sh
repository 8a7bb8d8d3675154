#!/usr/bin/env bash
# ResNet-50 before and after a change, in one device call (after validate.sh or
# resnet_check.sh has built this tree): builds kiln-bench at BASE and alternates
# `kiln-bench --model resnet50 --batches N --graph-only` between it and this tree's build,
# ROUNDS times each at each of BATCHES (default 256). PROBE="--stem ..." first runs those
# kiln-fusion-probe modes on both sides (for a change no switch turns off: a compiler barrier,
# a launch bound); it builds kiln-fusion-probe on both sides.
# The device's copy of the history stops where the session began, so BASE travels as a folder:
# here, before the call, `bash tools/device/ab_resnet50.sh --prepare BASE` writes .ab-base/
# (BASE's version of every file that differs from the working tree, and the list of files BASE
# lacks); carry .ab-base, and on the device the script builds this tree with those files put back.
#   bash tools/device/ab_resnet50.sh --prepare f912d02   # here
#   ROUNDS=2 BATCHES="64 256" PROBE="--stem" bash tools/device/ab_resnet50.sh   # device, carry .ab-base
set -uo pipefail
if [ "${1:-}" = --prepare ]; then
  BASE=${2:?usage: ab_resnet50.sh --prepare BASE_COMMIT}
  git rev-parse --verify -q "$BASE^{commit}" > /dev/null || { echo "no commit $BASE here"; exit 1; }
  grep -qx '/.ab-base/' .git/info/exclude 2> /dev/null || echo '/.ab-base/' >> .git/info/exclude
  rm -rf .ab-base && mkdir -p .ab-base/tree
  git rev-parse --short "$BASE" > .ab-base/name
  : > .ab-base/absent
  git diff --name-only --no-renames "$BASE" -- . | while read -r f; do
    if git cat-file -e "$BASE:$f" 2> /dev/null; then
      mkdir -p ".ab-base/tree/$(dirname "$f")" && git show "$BASE:$f" > ".ab-base/tree/$f"
    else
      echo "$f" >> .ab-base/absent
    fi
  done
  # Files not yet added travel with the tree too (the call copies what git does not ignore).
  git ls-files --others --exclude-standard >> .ab-base/absent
  echo "ab_resnet50: .ab-base holds $(find .ab-base/tree -type f | wc -l) files of $(cat .ab-base/name)," \
    "$(wc -l < .ab-base/absent) absent there; carry .ab-base"
  exit 0
fi
[ -d .ab-base/tree ] || { echo "ab_resnet50: no .ab-base here (run --prepare BASE before the call, carry .ab-base)"; exit 1; }
BASE=$(cat .ab-base/name)
ROUNDS=${ROUNDS:-2}
BATCHES=${BATCHES:-256}
PROBE=${PROBE:-}
B=${B:-build-gpu}
W=/tmp/ab-base
rm -rf "$W" && mkdir -p "$W"
# This tree without its builds and ignored folders (.deps is named in the cmake line), then BASE's files.
tar -cf - --exclude=./build\* --exclude=./.git --exclude=./.ab-base --exclude=./.deps --exclude=./.bench \
  --exclude=./.imagenette . | tar -xf - -C "$W"
cp -r .ab-base/tree/. "$W"/
while read -r f; do rm -f "$W/$f"; done < .ab-base/absent
cmake -S "$W" -B "$W/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$PWD/.deps/include" \
  > /dev/null 2>&1 && ninja -C "$W/b" -j 16 kiln-bench ${PROBE:+kiln-fusion-probe} > /dev/null 2>&1 ||
  { echo "build of $BASE failed"; exit 1; }
if [ -n "$PROBE" ]; then
  ninja -C "$B" -j 16 kiln-fusion-probe > /dev/null 2>&1 || { echo "build of kiln-fusion-probe in $B failed"; exit 1; }
fi
name() { [ "$1" = base ] && echo "$BASE" || echo "this tree"; }  # (the device copy's git HEAD may be stale)
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
