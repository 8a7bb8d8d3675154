#!/usr/bin/env python3
"""How the replays of one kernel trace differ, by kind of kernel: a clock that moves shows here.

    python3 tools/bench/trace_replay_drift.py trace.csv[.gz] [trace.csv[.gz] ...]

For each replay of a `kiln-bench --trace-kernels` CSV (tools/bench/kernel_trace.h) the exclusive
time summed over three kinds of kernel: matrix products (cuDNN's and cuBLASLt's convolutions and
GEMMs, kiln's wgmma kernels), kiln's memory-bound passes (batch-norm apply and sums, pooling),
and the rest; then each replay's sums against the last replay's. Where the products slow down
and the passes do not, the SM clock moved and the memory clock did not (the H200's trace of
v43 at b256, 2026-12-06: its first replay after the timed windows, products +2.0%, passes
+0.5%; docs/performance.md, "The timed step is 0.9 ms longer than the traced one").
"""
import argparse
import collections
import csv
import gzip
import sys


def kind(name):
    low = name.lower()
    if any(k in low for k in ("xmma", "gmma", "nvjet", "gemm")):
        return "products"
    if any(k in low for k in ("apply", "sums", "pool")):
        return "passes"
    return "rest"


KINDS = ("products", "passes", "rest")


def read_trace(path):
    """{step: {kind: exclusive µs}} of one trace; exits with a message naming the file on bad input."""
    by_step = collections.defaultdict(lambda: collections.defaultdict(float))
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", newline="") as f:
            for r in csv.DictReader(f):
                by_step[int(r["step"])][kind(r["name"])] += float(r["exclusive_us"])
    except (OSError, EOFError, UnicodeDecodeError) as e:
        sys.exit(f"trace_replay_drift: cannot read {path}: {e}")
    except (KeyError, TypeError, ValueError) as e:
        sys.exit(f"trace_replay_drift: {path} is not a kiln-bench --trace-kernels CSV "
                 f"(columns step, name, exclusive_us): {e!r}")
    return by_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="kiln-bench --trace-kernels CSVs (.gz too)")
    args = ap.parse_args()
    for path in args.traces:
        by_step = read_trace(path)
        steps = sorted(by_step)
        if not steps:
            sys.exit(f"trace_replay_drift: no kernels in {path}")
        last = by_step[steps[-1]]
        print(f"{path}: exclusive ms by kind, and against replay {steps[-1]}")
        for s in steps:
            cur = by_step[s]
            cells = "  ".join(
                f"{k} {cur[k] / 1e3:7.3f} ({(cur[k] / last[k] - 1) * 100 if last[k] else 0.0:+5.2f}%)"
                for k in KINDS)
            print(f"  replay {s}: {cells}")


if __name__ == "__main__":
    main()
