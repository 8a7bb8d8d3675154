#!/usr/bin/env bash
# compute-sanitizer over the GPU suites (after tools/device/check.sh built build-gpu).
# API errors are not reported: kiln turns every failed CUDA call into an exception, and the
# allocator suite provokes out-of-memory on purpose.
# Usage: bash tools/device/sanitize.sh TOOL SUITE [doctest args...]
set -uo pipefail
OUT=${OUT:-/tmp/kiln-out}
tool=$1; suite=$2; shift 2
log="$OUT/sanitize-$tool-$suite.log"
timeout 240 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 "./build-gpu/$suite" "$@" > "$log" 2>&1
rc=$?
echo "compute-sanitizer $tool $suite: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) $(grep -E 'test cases:' "$log" | tail -1)"
return $rc 2>/dev/null || exit $rc
