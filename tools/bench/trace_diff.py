#!/usr/bin/env python3
"""Two kernel traces of the step, kernel by kernel: what a change removed, added and moved.

    python3 tools/bench/trace_diff.py BEFORE.csv[.gz] AFTER.csv[.gz] [--replay N] [--min-us U]

For one replay (default 2, the third) of each `kiln-bench --trace-kernels` CSV
(tools/bench/kernel_trace.h), the exclusive time summed by kernel name, and the kernels whose sum
moved by more than --min-us (default 8 µs), largest saving first, with their call counts before
and after. Names are shortened: no parameter list, no `kiln::cuda::` or anonymous namespaces,
template flags true/false as 1/0, and kiln's GEMM with twelve flags (before v45) given v45's
thirteenth as 0, so that the same kernel keeps one name across versions. Traces from two boards
compare only where the kernels that did not change agree (check a few).

Used for v45's H200 trace against v43's (docs/lab/norm-conv.md, v45: "v44's layer-3 fold on the
H200, by kernel"):
    python3 tools/bench/trace_diff.py docs/lab/step-profiles/step-2026-12-06e/trace-b256.csv.gz \\
        docs/lab/step-profiles/step-2026-12-07f/trace-b256.csv.gz
"""
import argparse
import collections
import csv
import gzip
import re


def short(name):
    """The kernel's name without its parameter list and namespaces; flags as 1/0."""
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    name = re.sub(r"^void ", "", name)
    out, depth = [], 0
    for ch in name:
        if ch == "(" and depth == 0:
            break
        depth += ch == "<"
        depth -= ch == ">"
        out.append(ch)
    name = re.sub(r"kiln::(cuda::)?", "", "".join(out))
    name = name.replace("true", "1").replace("false", "0")
    m = re.match(r"(dgrad1x1_bn_sums_wgmma_kernel<)([^>]*)>", name)
    if m and m.group(2).count(",") == 11:  # before v45: no kSub2 flag
        name = f"{m.group(1)}{m.group(2)}, 0>"
    return name


def load(path, replay):
    """{short name: [calls, exclusive µs]} over one replay of a trace CSV."""
    sums = collections.defaultdict(lambda: [0, 0.0])
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for row in csv.DictReader(f):
            if int(row["step"]) != replay:
                continue
            s = sums[short(row["name"])]
            s[0] += 1
            s[1] += float(row["exclusive_us"])
    if not sums:
        raise SystemExit(f"{path}: no kernels in replay {replay}")
    return sums


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--replay", type=int, default=2, help="the replay of each trace (default 2)")
    ap.add_argument("--min-us", type=float, default=8.0,
                    help="list kernels whose sum moved by more than this (default 8)")
    a = ap.parse_args()
    before, after = load(a.before, a.replay), load(a.after, a.replay)
    none = [0, 0.0]
    rows = sorted((after.get(k, none)[1] - before.get(k, none)[1], k)
                  for k in set(before) | set(after))
    print(f"{'µs':>9}  calls  kernel (replay {a.replay}; after − before)")
    for delta, k in rows:
        if abs(delta) > a.min_us:
            print(f"{delta:9.1f}  {before.get(k, none)[0]:3d}→{after.get(k, none)[0]:<3d} {k[:120]}")
    tb = sum(v[1] for v in before.values())
    ta = sum(v[1] for v in after.values())
    print(f"exclusive sum: {tb:.1f} → {ta:.1f} µs ({ta - tb:+.1f})")


if __name__ == "__main__":
    main()
