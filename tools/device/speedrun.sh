#!/usr/bin/env bash
# The CIFAR-10 speedrun comparison in one device call (after validate.sh build; carry .data for
# the JPEGs and .bench for the anchor): kiln-speedrun over RUNS timed runs, then the anchor
# airbench94_muon.py (an ignored copy in .bench/airbench/, never committed) over ANCHOR_RUNS
# runs on the same JPEGs, converted by tools/bench/cifar10_to_pt.py. The anchor's own run count
# is its loop's; the copy run here is edited to ANCHOR_RUNS (it writes into /tmp only).
#   RUNS=20 ANCHOR_RUNS=10 ANCHOR_TIMEOUT=300 RECIPE=legacy|muon bash tools/device/speedrun.sh [kiln] [anchor]
# Output: $OUT/speedrun-<recipe>.json (kiln), $OUT/airbench.log and $OUT/airbench.json (the anchor).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
B=${B:-build-gpu}
RUNS=${RUNS:-20}
RECIPE=${RECIPE:-legacy}
ANCHOR_RUNS=${ANCHOR_RUNS:-10}
ANCHOR_TIMEOUT=${ANCHOR_TIMEOUT:-300}
DATA=/tmp/cifar10
mkdir -p "$OUT" "$DATA"
[ -d $DATA/train ] || tar -xzf .data/cifar10.tar.gz -C $DATA || exit 1
for side in ${*:-kiln anchor}; do
  case $side in
    kiln)
      $B/kiln-speedrun $DATA --recipe "$RECIPE" --runs "$RUNS" --json "$OUT/speedrun-$RECIPE.json" 2>&1 |
        tee "$OUT/speedrun-$RECIPE.log" | grep -v "^run " ;;
    anchor)
      [ -f .bench/airbench/airbench94_muon.py ] || { echo "no .bench/airbench/airbench94_muon.py"; continue; }
      A=/tmp/airbench
      mkdir -p $A
      python3 tools/bench/cifar10_to_pt.py $DATA $A/cifar10 || continue
      sed "s/for run in range(200)/for run in range($ANCHOR_RUNS)/" \
        .bench/airbench/airbench94_muon.py > $A/airbench94_muon.py
      t0=$(date +%s)
      (cd $A && timeout "$ANCHOR_TIMEOUT" python3 airbench94_muon.py) > "$OUT/airbench.log" 2>&1
      echo "anchor: exit $?, $(( $(date +%s) - t0 )) s with compilation"
      python3 - "$OUT/airbench.log" "$OUT/airbench.json" <<'PY'
import json, statistics, sys
rows = []
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[1] == "eval":
        rows.append({"tta_val_acc": float(cells[4]), "seconds": float(cells[5])})
rows = rows[1:]  # the first is the warm-up run (random labels)
if rows:
    a = [r["tta_val_acc"] * 100 for r in rows]; t = [r["seconds"] for r in rows]
    s = {"runs": len(rows), "accuracy_mean": statistics.mean(a),
         "accuracy_std": statistics.stdev(a) if len(a) > 1 else 0.0,
         "seconds_mean": statistics.mean(t), "seconds_median": statistics.median(t),
         "seconds_min": min(t), "seconds_max": max(t)}
    json.dump({"summary": s, "rows": rows}, open(sys.argv[2], "w"))
    print(f"anchor: {len(rows)} runs: accuracy {s['accuracy_mean']:.2f}% ± {s['accuracy_std']:.2f}, "
          f"time {s['seconds_mean']:.3f} s mean, median {s['seconds_median']:.3f}, "
          f"min {s['seconds_min']:.3f}, max {s['seconds_max']:.3f}")
else:
    print("anchor: no finished runs in the log")
PY
      ;;
  esac
done
