#!/usr/bin/env bash
# One device call that checks a change end to end on the GPU machine (../shared/GPU.md):
#   bash tools/device/validate.sh build      configure + build (sm_90, -march=native)
#   bash tools/device/validate.sh test       every ctest suite, CPU and GPU (the CPU suites run
#                                            on the machine's Intel CPU: the native build there
#                                            differs from CI's)
#   bash tools/device/validate.sh sanitize   compute-sanitizer memcheck and racecheck on the
#                                            transformer suite
#   bash tools/device/validate.sh bench      kiln-bench ResNet-50 and the ViTs, then PyTorch's
#                                            anchors (.bench/torch_vit.py, torch_resnet50_quick.py)
# The device's copy of the tree is a git repository whose HEAD is older than this tree: do not
# run git commands that rewrite its working tree there (git stash, checkout, reset), or the
# build sees old sources.
# Steps may be combined: validate.sh build test. Logs and JSON go to $OUT; header-only
# dependencies travel in .deps/include, the Fashion-MNIST files in .deps/fashion-mnist, the
# PyTorch scripts in .bench/ (carry both).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=build-gpu
rc=0
for step in "$@"; do
  t0=$(date +%s)
  case "$step" in
    build)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        lscpu | grep -E "^Model name"
        grep -o -w -E "avx512f|avx2|fma" /proc/cpuinfo | sort | uniq -c; } > "$OUT/machine.txt"
      cat "$OUT/machine.txt"
      # The copy's files keep this machine's mtimes, which can be older than the objects a kept
      # build folder holds from an earlier call: ninja would then skip changed sources. When the
      # sources' contents differ from the last build's, every source is touched (a full build).
      sum=$(git ls-files -co --exclude-standard -z | xargs -0 sha1sum 2>/dev/null | sha1sum)
      if [ -d $B ] && [ "$(cat $B/.sources.sha1 2>/dev/null)" != "$sum" ]; then
        git ls-files -co --exclude-standard -z | xargs -0 touch -c
      fi
      cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$PWD/.deps/include" \
        > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      ninja -C $B -j 16 > "$OUT/build.log" 2>&1 ||
        { grep -E "error|FAILED|undefined" -A5 "$OUT/build.log" | head -80; exit 1; }
      echo "$sum" > $B/.sources.sha1
      ;;
    test)
      # The kiln-train, kiln-predict and kiln-plot suites read Fashion-MNIST from the Debian
      # package's folder; the GPU machine has no such package, so a carried copy goes there.
      fm=/usr/share/datasets/fashion-mnist
      if [ ! -d $fm ] && [ -d .deps/fashion-mnist ]; then
        mkdir -p $fm 2>/dev/null && cp .deps/fashion-mnist/* $fm/ 2>/dev/null ||
          echo "could not install Fashion-MNIST in $fm: the kiln-train suites will fail"
      fi
      ctest --test-dir $B -j 6 --output-on-failure --timeout 500 > "$OUT/ctest.log" 2>&1 || rc=1
      grep -E "tests passed|\*\*\*|Failed|Passed" "$OUT/ctest.log" | grep -v " Passed " | tail -30
      grep -E "tests passed" "$OUT/ctest.log"
      [ $rc -ne 0 ] && grep -B3 -A15 "ERROR:\|FATAL\|exception\|FAIL " "$OUT/ctest.log" | head -200
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 $B/gpu_test_transformer_ops \
          -tc="layer_norm*,dropout*,embedding*,scaled_dot_product_attention: the fused*" \
          > "$OUT/sanitize-$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $?"
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race" "$OUT/sanitize-$tool.log" |
          sort | uniq -c | head -10
      done
      ;;
    bench)
      for m in "resnet50 256" "vit_s_16 128" "vit_b_16 128"; do
        set -- $m
        $B/kiln-bench --model $1 --batches $2 --graph-only --json "$OUT/bench-$1.json" 2>&1 |
          grep -E "graph|error"
      done
      $B/kiln-bench --model vit_b_16 --batches 128 --graph-only --precision bf16 2>&1 |
        grep -E "graph|error"
      [ -f .bench/torch_vit.py ] &&
        PYTHONUNBUFFERED=1 timeout 420 python3 .bench/torch_vit.py vit_b_16,vit_s_16 128 2>&1 |
        grep -v Warning | tee "$OUT/torch_vit.json"
      ;;
    *) echo "unknown step '$step' (build, test, sanitize, bench)"; exit 2 ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
exit $rc
