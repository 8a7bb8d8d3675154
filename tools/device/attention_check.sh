#!/usr/bin/env bash
# cuDNN attention's backward tail mask (cuda/cudnn_attention.h, sdpa::tail_mask_needed) in one
# device call: the attention suite with the mask and, for its regression case, without it
# (KILN_CUDNN_TAIL_MASK=0: that case must fail at L 197 and pass at 256); then kiln-bench's ViT
# steps with kiln's kernels (KILN_CUDNN_ATTENTION=0), cuDNN with the mask (the default) and
# cuDNN without it, each row with the loss scaler's skipped steps; then PyTorch's anchor
# (.bench/torch_vit.py, carried) in the same call.
#   bash tools/device/attention_check.sh          (SKIP_TORCH=1 leaves PyTorch out)
# Run from the repository root with .deps carried; one line per run in $OUT/attention.txt.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-gpu}
S="$OUT/attention.txt"
L=/tmp/attention-logs
mkdir -p $L
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$PWD/.deps/include" > $L/configure.log 2>&1 &&
  ninja -C $B -j 16 kiln-bench gpu_test_cudnn_attention ${EXTRA_TARGETS:-} > $L/build.log 2>&1 ||
  { grep -E "error|FAILED" $L/build.log | head -30; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" | tee -a "$S"
unit() {  # name, env (A=B or -), doctest filter (optional)
  local name=$1 envs=$2 filter=${3:-}
  [ "$envs" = - ] && envs=
  env $envs $B/gpu_test_cudnn_attention ${filter:+-tc="$filter"} > $L/unit-$name.log 2>&1
  local rc=$?
  echo "unit $name: rc $rc; $(grep -E "^\[doctest\] assertions" $L/unit-$name.log);" \
    "failing at: $(grep -E "^ +l := " $L/unit-$name.log | sort | uniq -c | tr -s ' ' | tr '\n' ' ')" |
    tee -a "$S"
}
unit mask -
unit unmasked KILN_CUDNN_TAIL_MASK=0 "*very negative*"
bench() {  # name, env (A=B or -), kiln-bench arguments...
  local name=$1 envs=$2
  shift 2
  [ "$envs" = - ] && envs=
  env $envs $B/kiln-bench "$@" --json "$L/$name.json" > $L/$name.log 2>&1
  echo "$name: $(grep -E " graph | eager " $L/$name.log | tr -s ' ' | cut -c1-230)" | tee -a "$S"
  grep -E "unavailable|error" $L/$name.log | head -2 | tee -a "$S"
}
for m in vit_b_16 vit_s_16; do
  a="--model $m --batches 128 --graph-only"
  bench $m-kiln KILN_CUDNN_ATTENTION=0 $a
  bench $m-cudnn - $a
  bench $m-unmasked KILN_CUDNN_TAIL_MASK=0 $a
  bench $m-cudnn-2 - $a
done
bench vit_b_16-bf16 - --model vit_b_16 --batches 128 --graph-only --precision bf16
if [ "${SKIP_TORCH:-0}" != 1 ] && [ -f .bench/torch_vit.py ]; then
  PYTHONUNBUFFERED=1 timeout 300 python3 .bench/torch_vit.py vit_b_16,vit_s_16 128 2>&1 |
    grep -v Warning | tee -a "$S"
fi
tar -czf "$OUT/attention-logs.tgz" -C /tmp attention-logs
echo "attention_check: $(( $(date +%s) - t0 )) s" | tee -a "$S"
