#!/usr/bin/env bash
# GPU checks of what kiln-train's users see (issue 18), run after tools/device/check.sh has built
# build-gpu, with .deps/fashion-mnist carried:
#   bash tools/device/check.sh '^(test_cli|test_kiln_predict|test_kiln_train)$' \
#     bash tools/device/usage-check.sh
# 1. the per-step log costs no throughput: compare epoch 2's img/s with docs/lab/fashion-mnist.md
#    (resnet_small, 2 epochs: 62,000 img/s in epoch 2; ResNet-18 recipe: 29,270 img/s);
# 2. kiln-predict on the GPU names the same classes as on the CPU;
# 3. --pretrained + --freeze-backbone with mixed precision and the CUDA graph keeps the backbone;
# 4. --dummy trains ResNet-50 on synthetic data (img/s near kiln-bench's graph figure);
# 5. kiln-plot draws the run.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
B=build-gpu
D=.deps/fashion-mnist
rc=0
step() { echo "== $*"; }

step "1. Fashion-MNIST, resnet_small, 2 epochs"
$B/kiln-train --data $D --epochs 2 --workers 6 --output "$OUT/fm" > "$OUT/fm.log" 2>&1 || rc=1
grep -E "done in|final" "$OUT/fm.log"
wc -l < "$OUT/fm/steps.jsonl"

step "2. kiln-predict, cuda vs cpu"
$B/kiln-export-images --data $D --split test --limit 300 --out "$OUT/val" > /dev/null || rc=1
$B/kiln-predict --weights "$OUT/fm/model.safetensors" --device cuda --top 1 "$OUT/val" \
  > "$OUT/pred_cuda.txt" 2>&1 || rc=1
$B/kiln-predict --weights "$OUT/fm/model.safetensors" --device cpu --top 1 "$OUT/val" \
  > "$OUT/pred_cpu.txt" 2>&1 || rc=1
python3 - "$OUT/pred_cuda.txt" "$OUT/pred_cpu.txt" <<'EOF' || rc=1
import sys
def tops(path):
    lines = open(path).read().splitlines()
    return [l.split("%", 1)[1].strip() for l in lines if "%" in l]
g, c = tops(sys.argv[1]), tops(sys.argv[2])
same = sum(a == b for a, b in zip(g, c))
print(f"top-1 agree on {same} of {len(c)} images (cuda vs cpu)")
sys.exit(0 if len(g) == len(c) == 300 and same >= 297 else 1)
EOF

step "3. fine-tuning with --freeze-backbone (amp + graph)"
$B/kiln-train --data $D --epochs 1 --workers 6 --pretrained "$OUT/fm/model.safetensors" \
  --freeze-backbone --output "$OUT/ft" > "$OUT/ft.log" 2>&1 || rc=1
grep -E "pretrained|freeze|final" "$OUT/ft.log"
python3 - "$OUT/fm/model.safetensors" "$OUT/ft/model.safetensors" <<'EOF' || rc=1
import sys
import numpy as np
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
worst = max(float(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() + 1e-12))
            for k in a if k.endswith("weight") and "bn" not in k and not k.startswith("fc."))
print(f"frozen conv weights: largest relative change {worst:.2e} (fp16 rounding only: < 1e-3)")
sys.exit(0 if worst < 1e-3 else 1)
EOF

step "4. --dummy ResNet-50, batch 256"
$B/kiln-train --dummy --dummy-images 25600 -a resnet50 -b 256 -p 20 --output "$OUT/dummy" \
  > "$OUT/dummy.log" 2>&1 || rc=1
grep -E "step +100/100|done in" "$OUT/dummy.log"

step "5. kiln-plot"
python3 tools/kiln-plot "$OUT/fm" -o "$OUT/curves.png" || rc=1
exit $rc
