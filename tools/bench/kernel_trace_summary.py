#!/usr/bin/env python3
"""Summarises kiln-bench --trace-kernels: a replayed graph step's kernels as they really ran.

    kiln-bench --model resnet50 --batches 256 --graph-only --trace-kernels trace.csv
    python3 tools/bench/kernel_trace_summary.py trace.csv [--step S] [--kernels N]
    python3 tools/bench/kernel_trace_summary.py trace.csv --ncu step.csv [--kernels N]
    python3 tools/bench/kernel_trace_summary.py trace.csv --against base.csv [--kernels N]
    python3 tools/bench/kernel_trace_summary.py trace.csv --calls REGEX [--step S]

The trace (tools/bench/kernel_trace.h) holds every kernel of a few replays, timed by CUPTI on the
GPU's clock with nothing serialised. A kernel's "exclusive" time is the part of its run after the
kernel before it ended: with programmatic dependent launch a kernel's blocks start early and wait,
so its raw duration counts its predecessor's tail too; the exclusive times add up to the step's
span less the idle time in it.

Prints, for one replay (the last by default): the span, the idle time inside it, and the time by
phase and kind as tools/bench/ncu_step_summary.py classes kernels; the calls under 5 µs of
exclusive time, and the (up to 8) kernels they are most of; then the N kernels with the most
exclusive time summed over their calls. With --against (another trace, the baseline) the
kernels whose summed exclusive time moved most between the two last replays, both ways (kiln's
GEMM under one name across v45's added template flag). With --calls REGEX each call of the
kernels whose short name matches, in order, with its exclusive time. With --ncu (an Nsight Compute CSV of one eager step,
ncu_step_summary.py's input) the same kernels' summed ncu time beside it: where ncu's
kernel-by-kernel view and the real step disagree.
"""
import argparse
import collections
import csv
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_step_summary import count, kind_of, open_text, read_kernels  # noqa: E402


def short(name):
    """One spelling for CUPTI's demangled names and ncu's: no parameters, no namespaces (in the
    template arguments too, which ncu abbreviates), integral template arguments as numbers
    ("(kiln::Activation)1", "true" and "1u" as ncu's "1"), no space between closing brackets."""
    s = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    s = re.sub(r"\([\w:]+\)(-?\d+)", r"\1", s)  # an enum's cast
    s = re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", s))
    s = re.sub(r"\b(\d+)(?:u|ul|ull|l|ll)\b", r"\1", s)  # "0u" as ncu's "0"
    s = re.sub(r"\(.*", "", s).replace("void ", "").strip()
    s = re.sub(r"\b\w+::", "", s)
    return re.sub(r">\s+(?=>)", ">", s)


def read_trace(path):
    """{step: [kernel dicts in start order]}"""
    steps = collections.defaultdict(list)
    try:
        with open_text(path) as f:
            for r in csv.DictReader(f):
                steps[int(r["step"])].append({
                    "name": r["name"], "start": float(r["start_us"]),
                    "dur": float(r["duration_us"]), "excl": float(r["exclusive_us"]),
                    "grid": r["grid"]})
    except (OSError, EOFError, UnicodeDecodeError) as e:
        sys.exit(f"{path}: cannot read it: {e}")
    except (KeyError, TypeError, ValueError) as e:
        sys.exit(f"{path}: not a kiln-bench --trace-kernels CSV (columns step, name, start_us, "
                 f"duration_us, exclusive_us, grid): {e!r}")
    if not steps:
        sys.exit(f"{path}: no kernel rows (written by kiln-bench --trace-kernels?)")
    return steps


def phases(kernels):
    """forward until the loss's first kernel, then backward; the optimizer's kernels apart."""
    loss = next((i for i, k in enumerate(kernels) if "cross_entropy" in k["name"]), len(kernels))
    out = []
    for i, k in enumerate(kernels):
        kind = kind_of(k["name"])
        out.append("optimizer" if kind == "optimizer" else ("forward" if i < loss else "backward"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, help="which replay (default: the last)")
    ap.add_argument("--kernels", type=count, default=25, help="how many kernels to list (25)")
    ap.add_argument("--ncu", help="an Nsight Compute CSV of one eager step, set beside")
    ap.add_argument("--against", help="a baseline trace: the kernels that moved most")
    ap.add_argument("--calls", metavar="REGEX",
                    help="list each call of the kernels whose short name matches, in order")
    a = ap.parse_args()
    if a.calls:
        try:
            re.compile(a.calls)
        except re.error as e:
            ap.error(f"--calls {a.calls!r}: not a regular expression ({e})")
    if a.against:
        return against(a.trace, a.against, a.kernels)
    steps = read_trace(a.trace)
    s = a.step if a.step is not None else max(steps)
    if s not in steps:
        sys.exit(f"{a.trace}: no replay {s} (replays {sorted(steps)})")
    ks = steps[s]
    if a.calls:
        print(f"replay {s}: position, exclusive µs, kernel")
        for i, k in enumerate(ks):
            name = across_versions(short(k["name"]))
            if re.search(a.calls, name):
                print(f"{i:5d} {k['excl']:9.1f}  {name[:110]}")
        return None
    span = max(k["start"] + k["dur"] for k in ks) - min(k["start"] for k in ks)
    excl = sum(k["excl"] for k in ks)
    print(f"replay {s} of {len(steps)}: {len(ks)} kernels, span {span / 1e3:.3f} ms, "
          f"exclusive sum {excl / 1e3:.3f} ms, idle inside the span {(span - excl) / 1e3:.3f} ms, "
          f"raw durations summed {sum(k['dur'] for k in ks) / 1e3:.3f} ms")
    for other in sorted(steps):
        if other != s:
            o = steps[other]
            print(f"  replay {other}: {len(o)} kernels, span "
                  f"{(max(k['start'] + k['dur'] for k in o) - min(k['start'] for k in o)) / 1e3:.3f} ms")
    print()
    by_phase = collections.Counter()
    for k, ph in zip(ks, phases(ks)):
        by_phase[(ph, kind_of(k["name"]))] += k["excl"]
    print(f"{'phase':10s} {'kind':14s} {'ms':>8s}")
    for (ph, kind), us in by_phase.most_common():
        print(f"{ph:10s} {kind:14s} {us / 1e3:8.3f}")
    small = [k for k in ks if k["excl"] < 5]
    print(f"\n{len(small)} kernels under 5 us exclusive: {sum(k['excl'] for k in small) / 1e3:.3f} ms")
    by_small = collections.defaultdict(lambda: [0, 0.0])
    for k in small:
        e = by_small[short(k["name"])]
        e[0] += 1
        e[1] += k["excl"]
    for name, (n, e) in sorted(by_small.items(), key=lambda kv: -kv[1][1])[:min(8, a.kernels)]:
        print(f"{n:5d} {e / 1e3:8.3f}  {e / n:4.1f} us a call  {name[:90]}")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in ks:
        e = agg[short(k["name"])]
        e[0] += 1
        e[1] += k["excl"]
        e[2] += k["dur"]
    ncu = None
    if a.ncu:
        ncu = collections.defaultdict(lambda: [0, 0.0])
        for k in read_kernels(a.ncu):
            e = ncu[short(k["name"])]
            e[0] += 1
            e[1] += k["ns"] / 1e3
    print(f"\n{'calls':>5s} {'excl ms':>8s} {'raw ms':>8s}" +
          (f" {'ncu calls':>9s} {'ncu ms':>7s}" if ncu is not None else "") + "  kernel")
    for name, (n, e, d) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:a.kernels]:
        line = f"{n:5d} {e / 1e3:8.3f} {d / 1e3:8.3f}"
        if ncu is not None:
            nc, nus = ncu.get(name, [0, 0.0])
            line += f" {nc:9d} {nus / 1e3:7.3f}"
        print(line + "  " + name[:110])


def across_versions(name):
    """kiln's GEMM as v45 names it: before v45 its template had twelve flags, no kSub2, so a
    trace of v43 and one of v45 give the same kernel one name with the thirteenth as 0."""
    m = re.match(r"(dgrad1x1_bn_sums_wgmma_kernel<)([^>]*)>", name)
    return f"{m.group(1)}{m.group(2)}, 0>" if m and m.group(2).count(",") == 11 else name


def by_kernel(path):
    """{short name: [calls, exclusive us]} over the trace's last replay."""
    steps = read_trace(path)
    out = collections.defaultdict(lambda: [0, 0.0])
    for k in steps[max(steps)]:
        e = out[across_versions(short(k["name"]))]
        e[0] += 1
        e[1] += k["excl"]
    return out


def against(path, base_path, n):
    new, base = by_kernel(path), by_kernel(base_path)
    rows = []
    for name in set(new) | set(base):
        (nc, nt), (bc, bt) = new.get(name, [0, 0.0]), base.get(name, [0, 0.0])
        rows.append((nt - bt, bc, nc, bt, nt, name))
    rows.sort()
    total = sum(r[0] for r in rows)
    print(f"{path} against {base_path}: exclusive time {total / 1e3:+.3f} ms "
          f"({sum(r[2] for r in rows)} kernels against {sum(r[1] for r in rows)})")
    print(f"{'ms':>8s} {'calls':>9s} {'base ms':>8s} {'ms':>8s}  kernel")
    shown = rows[:n] + [r for r in (rows[-n:] if n else []) if r not in rows[:n]]
    for d, bc, nc, bt, nt, name in shown:
        print(f"{d / 1e3:+8.3f} {bc:4d}>{nc:<4d} {bt / 1e3:8.3f} {nt / 1e3:8.3f}  {name[:100]}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a closed pipe (| head) ends it quietly
    main()
