#!/usr/bin/env bash
# Issue 17 on the GPU machine, in one device call: builds kiln for sm_90, runs the install /
# consumer, launcher and build-info tests, prints every tool's --version, then launches
#   launch_probe (rendezvous only, no GPU) under torchrun --standalone, torchrun --nnodes 2 (two
#     launches on this host), Slurm's and Open MPI's variables (and mpirun if installed);
#   kiln-train / kiln-bench --nproc larger than the GPUs (must fail before starting anything);
#   kiln-bench --model resnet18 under torchrun, with 1 rank and with 2 ranks on one GPU (NCCL may
#     refuse two ranks on one device: reported as such, not as a launch failure);
#   kiln-bench rebuilt for sm_80 only, which must stop with one line saying what to rebuild with.
# Usage (device tool, .deps carried as for tools/device/check.sh):
#   bash tools/device/launch-check.sh
# Logs go to $OUT; each check prints PASS, FAIL or NOTE with its log's name. Exit status: the
# number of FAILs.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
mkdir -p "$OUT"
B=${B:-build-launch}
fails=0
pass() { echo "PASS  $*"; }
fail() { echo "FAIL  $*"; fails=$((fails + 1)); }
note() { echo "NOTE  $*"; }
torchrun() { timeout 180 python3 -m torch.distributed.run "$@"; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DKILN_NATIVE=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_DEPS_DIR="$PWD/.deps/include" > "$OUT/configure.log" 2>&1 \
  || { tail -30 "$OUT/configure.log"; exit 99; }
ninja -C $B -j 16 kiln kiln-train kiln-bench kiln-convert kiln-export-images kiln-loader-bench \
  kiln-fusion-probe launch_probe test_dist test_build_info gpu_test_runtime > "$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" -A5 "$OUT/build.log" | head -60; exit 99; }
echo "build: $(( $(date +%s) - t0 )) s"

# 1. Tests: install + consumers (find_package, pkg-config, add_subdirectory) against this
#    machine's CUDA, cuDNN and NCCL; launcher parsing and rendezvous; build info; the runtime suite.
ctest --test-dir $B -R '^(consumer_|test_dist$|test_build_info$|gpu_test_runtime$)' \
  --output-on-failure --timeout 300 > "$OUT/ctest.log" 2>&1 \
  && pass "ctest consumer_*, test_dist, test_build_info, gpu_test_runtime (ctest.log)" \
  || { fail "ctest (ctest.log)"; grep -E "Test +#|Failed|Error|error" "$OUT/ctest.log" | head -30; }
grep -E "Test +#" "$OUT/ctest.log"

# 2. --version of every tool.
for t in kiln-train kiln-bench kiln-convert kiln-export-images kiln-loader-bench kiln-fusion-probe; do
  if line=$(./$B/$t --version 2>&1) && [[ $line == "$t "* ]]; then pass "$line"; else fail "$t --version: $line"; fi
done

# 3. launch_probe: the rendezvous under each launcher (no GPU needed).
probe_ok() { grep -q "launch_probe: OK, 2 rank(s) met" "$1"; }
torchrun --standalone --nproc_per_node=2 --no-python ./$B/launch_probe > "$OUT/probe-torchrun-standalone.log" 2>&1
probe_ok "$OUT/probe-torchrun-standalone.log" && pass "torchrun --standalone --nproc_per_node=2 launch_probe" \
  || fail "torchrun --standalone launch_probe (probe-torchrun-standalone.log)"

P=$(port)
for node in 0 1; do
  torchrun --nnodes=2 --node_rank=$node --nproc_per_node=1 --master_addr=127.0.0.1 --master_port=$P \
    --no-python ./$B/launch_probe > "$OUT/probe-torchrun-nnodes2-node$node.log" 2>&1 &
done
wait
probe_ok "$OUT/probe-torchrun-nnodes2-node0.log" && pass "torchrun --nnodes 2 (two launches, master port $P) launch_probe" \
  || fail "torchrun --nnodes 2 launch_probe (probe-torchrun-nnodes2-node*.log)"

P=$(port)
for r in 0 1; do
  env SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_LOCALID=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$P \
    timeout 120 ./$B/launch_probe > "$OUT/probe-slurm-$r.log" 2>&1 &
done
wait
probe_ok "$OUT/probe-slurm-0.log" && grep -q "Slurm" "$OUT/probe-slurm-0.log" \
  && pass "Slurm variables launch_probe" || fail "Slurm variables launch_probe (probe-slurm-*.log)"

P=$(port)
for r in 0 1; do
  env OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$P timeout 120 ./$B/launch_probe > "$OUT/probe-ompi-$r.log" 2>&1 &
done
wait
probe_ok "$OUT/probe-ompi-0.log" && grep -q "Open MPI" "$OUT/probe-ompi-0.log" \
  && pass "Open MPI variables launch_probe" || fail "Open MPI variables launch_probe (probe-ompi-*.log)"
if command -v mpirun > /dev/null; then
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$(port) timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 \
    -x MASTER_ADDR -x MASTER_PORT ./$B/launch_probe > "$OUT/probe-mpirun.log" 2>&1
  probe_ok "$OUT/probe-mpirun.log" && pass "mpirun -np 2 launch_probe" || fail "mpirun launch_probe (probe-mpirun.log)"
else
  note "mpirun is not installed here: Open MPI checked through its variables only"
fi

# 4. --nproc beyond the visible GPUs: a clear error, quickly, nothing started.
ngpu=$(nvidia-smi -L | wc -l)
n=$((ngpu + 1))
for t in "kiln-train --nproc $n" "kiln-bench --model resnet18 --nproc $n"; do
  s=$(date +%s)
  ./$B/${t%% *} ${t#* } > "$OUT/nproc.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && grep -q "needs one GPU per process, but $ngpu CUDA device(s) are visible" "$OUT/nproc.log" \
     && [ $(( $(date +%s) - s )) -lt 20 ]; then pass "$t: $(tail -1 "$OUT/nproc.log")"
  else fail "$t (rc $rc): $(tail -3 "$OUT/nproc.log")"; fi
done

# 5. Real data-parallel runs under torchrun (resnet18, synthetic data, batch 32).
bench=(./$B/kiln-bench --model resnet18 --batches 32 --graph-only)
torchrun --standalone --nproc_per_node=1 --no-python "${bench[@]}" > "$OUT/bench-torchrun-1.log" 2>&1 \
  && pass "torchrun --standalone --nproc_per_node=1 kiln-bench" \
  || fail "torchrun 1 rank kiln-bench (bench-torchrun-1.log): $(grep -i error "$OUT/bench-torchrun-1.log" | head -2)"
P=$(port)
for node in 0 1; do
  NCCL_DEBUG=WARN torchrun --nnodes=2 --node_rank=$node --nproc_per_node=1 --master_addr=127.0.0.1 \
    --master_port=$P --no-python "${bench[@]}" > "$OUT/bench-torchrun-nnodes2-node$node.log" 2>&1 &
done
wait
logs="$OUT/bench-torchrun-nnodes2-node0.log $OUT/bench-torchrun-nnodes2-node1.log"
if grep -q "images/s\|img/s" "$OUT/bench-torchrun-nnodes2-node0.log" && ! grep -qi "error" $logs; then
  pass "torchrun --nnodes 2, 2 ranks on one GPU, kiln-bench ran data-parallel"
elif grep -qi "rendezvous:" $logs; then
  fail "torchrun --nnodes 2 kiln-bench: the rendezvous failed: $(grep -ih "rendezvous:" $logs | head -2)"
elif grep -qi "duplicate gpu\|nccl" $logs; then
  note "torchrun --nnodes 2 kiln-bench: rendezvous passed; NCCL refused two ranks on one GPU: $(grep -ih "duplicate\|nccl.*error\|error" $logs | head -2)"
else
  fail "torchrun --nnodes 2 kiln-bench: $(tail -3 $logs)"
fi
torchrun --standalone --nproc_per_node=2 --no-python "${bench[@]}" > "$OUT/bench-torchrun-2.log" 2>&1
if [ "$ngpu" -ge 2 ]; then
  grep -q "images/s\|img/s" "$OUT/bench-torchrun-2.log" && pass "torchrun --nproc_per_node=2 kiln-bench" \
    || fail "torchrun --nproc_per_node=2 kiln-bench (bench-torchrun-2.log)"
else
  # Expected: rank 1 stops because GPU 1 does not exist (one line naming it).
  note "torchrun --nproc_per_node=2 on 1 GPU: $(grep -ih "error" "$OUT/bench-torchrun-2.log" | head -2)"
fi
# 6. A build without code for this GPU (sm_80 SASS only; the H200 is 9.0): kiln must stop at
#    start-up with one line naming the GPU and what to rebuild with. Last: it rebuilds in place.
cmake $B -DCMAKE_CUDA_ARCHITECTURES=80-real > "$OUT/configure-80.log" 2>&1 \
  && ninja -C $B -j 16 kiln-bench > "$OUT/build-80.log" 2>&1 || fail "sm_80 rebuild (build-80.log)"
timeout 120 ./$B/kiln-bench --model resnet18 --batches 32 --graph-only > "$OUT/arch-mismatch.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "rebuild kiln with -DCMAKE_CUDA_ARCHITECTURES=" "$OUT/arch-mismatch.log"; then
  pass "wrong-arch build stops: $(grep -o "CUDA device.*" "$OUT/arch-mismatch.log" | head -1)"
else
  fail "wrong-arch build (rc $rc): $(tail -3 "$OUT/arch-mismatch.log")"
fi
./$B/kiln-bench --version

echo "device-launch-check: $fails failure(s)"
exit $fails
