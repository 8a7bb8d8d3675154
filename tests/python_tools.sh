#!/usr/bin/env bash
# kiln's Python tools (tools/*.py, tools/bench/*.py, tools/kiln-plot) on bad command lines and
# bad files: each must end with a message and a non-zero status, never a Python traceback, and
# `--help` must succeed (or name the module it needs). Cases, for every tool: --help; a missing
# file; bytes that are not text, also named .gz; an empty file; a directory; an unknown flag;
# plus the number flags that once ended in a traceback (negative counts, zero rates, a bad
# --calls pattern).
#
# Every tool runs under `python3 -S` (no site-packages): torch, numpy and matplotlib are then
# missing on every machine, so the tools that need them take their one-line "needs ..." exit
# and the rest run on the standard library alone, the same here as in CI. kiln-plot's own
# drawing is tests/test_kiln_plot.cpp's.
# Exit 77 (CTest: Skipped) without python3.
#   bash tests/python_tools.sh SOURCE_DIR
set -uo pipefail
src=${1:?usage: python_tools.sh SOURCE_DIR}
python=$(command -v python3) || {
  echo "python_tools: skipped: python3 not found"
  exit 77
}
work=$(mktemp -d "${TMPDIR:-/tmp}/kiln_python_tools.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
# Bytes that are not UTF-8 (the same every run), and the same under a .gz name (the tools open
# .gz files with gzip).
for _ in $(seq 256); do printf '\x80\xff\x00\xfe,\x81garbage\n'; done >notext.bin
cp notext.bin fake.csv.gz
: >empty.csv
mkdir folder

failures=0
runs=0
# check EXPECT TOOL ARGS...: EXPECT is "ok" (status 0, or 1 with "needs", or 77) or "fail"
# (status neither 0 nor 124: a message and an error status).
check() {
  local expect=$1 tool=$2
  shift 2
  local out rc
  out=$(timeout 120 "$python" -S "$tool" "$@" 2>&1 </dev/null)
  rc=$?
  runs=$((runs + 1))
  local why=
  if grep -q '^Traceback' <<<"$out"; then
    why="a traceback"
  elif [ "$rc" = 124 ]; then
    why="no answer in 120 s"
  elif [ "$expect" = ok ] && ! { [ "$rc" = 0 ] || [ "$rc" = 77 ] ||
    { [ "$rc" = 1 ] && grep -q 'needs' <<<"$out"; }; }; then
    why="status $rc"
  elif [ "$expect" = fail ] && { [ "$rc" = 0 ] || [ -z "$out" ]; }; then
    why="status $rc and $(wc -c <<<"$out") bytes of message for bad input"
  fi
  if [ -n "$why" ]; then
    failures=$((failures + 1))
    echo "FAIL: ${tool#"$src"/} $*: $why"
    tail -n 5 <<<"$out" | sed 's/^/    /'
  fi
}

tools=("$src"/tools/*.py "$src"/tools/bench/*.py "$src"/tools/kiln-plot)
for tool in "${tools[@]}"; do
  [ -f "$tool" ] || continue
  check ok "$tool" --help
  check fail "$tool" "$work/no-such-file.csv"
  check fail "$tool" notext.bin
  check fail "$tool" fake.csv.gz
  check fail "$tool" empty.csv
  check fail "$tool" folder
  check fail "$tool" --no-such-flag
done

bench=$src/tools/bench
trace=$src/docs/lab/step-profiles/step-2026-12-07f/trace-b64.csv.gz
if [ -f "$trace" ]; then
  check fail "$bench/kernel_trace_summary.py" "$trace" --calls '('
  check fail "$bench/kernel_trace_summary.py" "$trace" --kernels -2
  check fail "$bench/kernel_trace_summary.py" "$trace" --kernels x
  check fail "$bench/kernel_trace_summary.py" "$trace" --ncu notext.bin
  check fail "$bench/kernel_trace_summary.py" "$trace" --against notext.bin
  check fail "$bench/kernel_trace_summary.py" "$trace" --step 99
  check fail "$bench/ncu_sass_top.py" "$trace" --top -1
fi
check fail "$bench/resnet50_floors.py" --bw 0
check fail "$bench/resnet50_floors.py" --peak nan
check fail "$bench/resnet50_floors.py" --ncu notext.bin
check fail "$bench/wgrad3x3_parts_model.py" --batch 0
check fail "$bench/wgrad3x3_parts_model.py" --sms 0
check fail "$bench/smi_phases.py" notext.bin notext.bin
check fail "$bench/alloc_replay.py"

echo "python_tools: $runs runs of ${#tools[@]} tools, $failures failed"
[ "$failures" = 0 ]
