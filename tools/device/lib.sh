# Shared steps of the device-call scripts (gemm_check.sh, resnet_check.sh, r50_seeds.sh,
# step_clocks.sh, fold_determinism.sh), sourced after the script sets B (the build folder), L
# (its log folder) and S (its summary).
# Each step writes its logs under $L and a line per result to $S (and stdout).

# kiln_need_dirs NAME: B, L and S must be set (a caller that sources this file alone, without a
# script that sets them, gets this message instead of cmake's about an empty build folder).
kiln_need_dirs() {
  [ -n "${B:-}" ] && [ -n "${L:-}" ] && [ -n "${S:-}" ] && return 0
  echo "$1: set B (the build folder), L (a log folder) and S (a summary file) before" \
    "sourcing tools/device/lib.sh" >&2
  return 1
}

# kiln_build TARGETS...: configure (sm_90, -march=native, headers from .deps/include) and build
# the targets; on failure the first errors go to the summary and it returns 1.
kiln_build() {
  local t0
  kiln_need_dirs kiln_build || return 2
  t0=$(date +%s)
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DKILN_NATIVE=ON -DKILN_DEPS_DIR="$PWD/.deps/include" \
    > "$L/configure.log" 2>&1 &&
    ninja -C "$B" -j 16 "$@" > "$L/build.log" 2>&1 ||
    { grep -hE "error|FAILED" "$L/configure.log" "$L/build.log" | head -30 | tee -a "$S"
      return 1; }
  echo "build $(( $(date +%s) - t0 )) s" | tee -a "$S"
}

# kiln_suites SUITES...: each doctest suite (300 s at most), its totals and first failures.
kiln_suites() {
  local t
  kiln_need_dirs kiln_suites || return 2
  for t in "$@"; do
    timeout 300 "$B/$t" > "$L/$t.log" 2>&1
    echo "$t: rc $?; $(grep -E "^\[doctest\] (test cases|assertions)" "$L/$t.log" | tr '\n' ' ')" |
      tee -a "$S"
    grep -E "ERROR|FAILED|error:" "$L/$t.log" | head -20 | tee -a "$S"
  done
}

# kiln_sanitize "suite:filter" ...: each suite's test cases matching the doctest filter (no
# spaces: the list splits on them) under each tool of SANITIZE_TOOLS (default memcheck).
kiln_sanitize() {
  local spec suite filter tool log
  kiln_need_dirs kiln_sanitize || return 2
  for spec in "$@"; do
    suite=${spec%%:*}
    filter=${spec#*:}
    for tool in ${SANITIZE_TOOLS:-memcheck}; do
      log="$L/$tool-$suite.log"
      timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 1 "$B/$suite" -tc="$filter" \
        > "$log" 2>&1
      echo "$tool $suite ($filter): rc $?; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[doctest\] assertions" "$log" | tr '\n' ' ')" |
        tee -a "$S"
    done
  done
}
