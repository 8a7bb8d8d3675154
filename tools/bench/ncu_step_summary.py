#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV of one training step: the table behind the step profiles in
docs/performance.md and docs/lab/step-profiles.md (first for v12).

    ncu --clock-control none --cache-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,dram__bytes.sum --csv \\
        kiln-bench --model resnet50 --batches 256 --eager-only --profile > step.csv
    python3 tools/bench/ncu_step_summary.py step.csv [--kernels N] [--sequence]
    python3 tools/bench/ncu_step_summary.py a.csv --compare b.csv [--kernels N]

kiln-bench --profile runs one eager step between cudaProfilerStart/Stop, so the CSV holds that
step's kernels only. Keep --cache-control none: ncu's default empties L2 before every kernel and
inflates the kernels that read what the previous one wrote (docs/lab/step-profiles.md, v12).

Prints the step's kernels by phase (forward up to the loss kernel, backward, optimizer) and kind
(convolution or GEMM, kiln's BN, cuDNN's BN, pooling, rest), then the N kernels that take the
most time summed over their calls, with the DRAM bandwidth each reached; --sequence also lists
every kernel in launch order. --compare puts two profiles side by side (say, a switch off and
on, each from its own process): per phase and kind, then the N kernels whose summed time moved
most. In-situ kernel sums are the steadier A/B: the whole graph step moves by about ±0.3 ms
between processes as the convolution tuner picks other plans (docs/lab/convolution.md, v12-v13).
"""
import argparse
import collections
import csv
import gzip
import re
import signal
import sys

TIME = "gpu__time_duration.sum"  # ns
BYTES = "dram__bytes.sum"

KINDS = [  # first match wins
    ("cuDNN BN", r"batchnorm"),
    ("kiln GEMM+BN", r"dgrad1x1_bn"),  # cuda/kernels/gemm_bn.cu: a dgrad with BN sums
    ("kiln BN", r"apply_kernel|sums_kernel|finish_kernel|finalize_kernel"),
    ("conv/GEMM", r"xmma|nvjet|cutlass|splitKreduce|ReduceSplitK|convertTensor|nchwToNhwc"
                  r"|init_device_workspace|pad3to4|pad4"),
    ("pooling", r"pool"),
    ("optimizer", r"step_kernel|step_begin|check_kernel|scaler_update"),
]


def kind_of(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "rest"


def short(name):
    return re.sub(r"\(.*", "", name).replace("void ", "").replace("kiln::<unnamed>::", "")


def open_text(path):
    """A CSV as text, gzip-compressed or not (the lab keeps them as .csv.gz); a missing or
    unreadable file ends the program with its name, not a traceback."""
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rt", newline="")
        return open(path, newline="")
    except OSError as e:
        sys.exit(f"{path}: {e.strerror or e}")


def count(text):
    """An argparse type: a whole number, 0 or more (--kernels)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text}")
    return v


def read_kernels(path):
    """Kernels in launch order: dicts with name, grid, ns, bytes."""
    kernels = {}
    header = None
    try:
        with open_text(path) as f:
            for row in csv.reader(f):
                if row and row[0] == "ID":
                    header = row
                    continue
                if header is None or len(row) != len(header):
                    continue  # the profiled program's own output
                r = dict(zip(header, row))
                k = kernels.setdefault(int(r["ID"]), {"name": r["Kernel Name"],
                                                      "grid": r["Grid Size"], "ns": 0.0, "bytes": 0.0})
                value = float(r["Metric Value"].replace(",", ""))
                if r["Metric Name"] == TIME:
                    k["ns"] = value
                elif r["Metric Name"] == BYTES:
                    k["bytes"] = value
    except (OSError, EOFError, UnicodeDecodeError, csv.Error, KeyError, ValueError) as e:
        sys.exit(f"{path}: not an Nsight Compute CSV of kernels ({type(e).__name__}: {e})")
    if not kernels:
        sys.exit(f"{path}: no kernel rows (was ncu run with --csv and a profiler range?)")
    return [kernels[i] for i in sorted(kernels)]


def phase_of(kernels):
    """forward until the loss's first kernel, then backward; the optimizer's kernels apart."""
    loss = next((i for i, k in enumerate(kernels) if "cross_entropy" in k["name"]), len(kernels))
    return ["optimizer" if kind_of(k["name"]) == "optimizer" else
            "forward" if i < loss else "backward" for i, k in enumerate(kernels)]


def by_part_and_name(kernels):
    """({(phase, kind): ms}, {kernel name: [calls, ns, bytes]}) of one profile."""
    by_part = collections.defaultdict(float)
    by_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k, ph in zip(kernels, phase_of(kernels)):
        by_part[(ph, kind_of(k["name"]))] += k["ns"] / 1e6
        e = by_name[short(k["name"])[:100]]
        e[0] += 1
        e[1] += k["ns"]
        e[2] += k["bytes"]
    return by_part, by_name


def compare(path_a, path_b, n):
    ka, kb = read_kernels(path_a), read_kernels(path_b)
    (pa, na), (pb, nb) = by_part_and_name(ka), by_part_and_name(kb)
    ta, tb = (sum(k["ns"] for k in ks) / 1e6 for ks in (ka, kb))
    print(f"A {path_a}: {len(ka)} kernels, {ta:.3f} ms summed")
    print(f"B {path_b}: {len(kb)} kernels, {tb:.3f} ms summed (B - A {tb - ta:+.3f} ms)")
    print(f"\n{'phase':10s} {'kind':10s} {'A ms':>8s} {'B ms':>8s} {'B - A':>8s}")
    for key in sorted(set(pa) | set(pb), key=lambda k: -max(pa.get(k, 0), pb.get(k, 0))):
        a, b = pa.get(key, 0.0), pb.get(key, 0.0)
        print(f"{key[0]:10s} {key[1]:10s} {a:8.3f} {b:8.3f} {b - a:+8.3f}")
    names = set(na) | set(nb)
    moved = sorted(names, key=lambda s: -abs(nb.get(s, [0, 0.0])[1] - na.get(s, [0, 0.0])[1]))
    print(f"\n{'A calls':>7s} {'A ms':>8s} {'B calls':>7s} {'B ms':>8s} {'B - A':>8s}  kernel")
    for name in moved[:n]:
        ca, sa = na.get(name, [0, 0.0])[:2]
        cb, sb = nb.get(name, [0, 0.0])[:2]
        print(f"{ca:7d} {sa / 1e6:8.3f} {cb:7d} {sb / 1e6:8.3f} {(sb - sa) / 1e6:+8.3f}  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernels", type=count, default=25, help="how many kernels to list (25)")
    ap.add_argument("--sequence", action="store_true", help="every kernel in launch order")
    ap.add_argument("--compare", metavar="B_CSV", help="a second profile to set against the first")
    a = ap.parse_args()
    if a.compare:
        compare(a.csv, a.compare, a.kernels)
        return
    kernels = read_kernels(a.csv)
    phases = phase_of(kernels)
    total = sum(k["ns"] for k in kernels) / 1e6
    print(f"{len(kernels)} kernels, {total:.3f} ms summed")
    by_part, by_name = by_part_and_name(kernels)
    print(f"\n{'phase':10s} {'kind':10s} {'ms':>8s} {'share':>7s}")
    for (ph, kind), ms in sorted(by_part.items(), key=lambda kv: -kv[1]):
        print(f"{ph:10s} {kind:10s} {ms:8.3f} {100 * ms / total:6.1f}%")
    small = [k for k in kernels if k["ns"] < 5000]
    print(f"\n{len(small)} kernels under 5 us: {sum(k['ns'] for k in small) / 1e6:.3f} ms")
    print(f"\n{'calls':>5s} {'ms':>8s} {'GB/s':>7s}  kernel")
    for name, (calls, ns, nbytes) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.kernels]:
        print(f"{calls:5d} {ns / 1e6:8.3f} {nbytes / ns if ns else 0:7.0f}  {name}")
    if a.sequence:
        print(f"\n{'#':>4s} {'phase':9s} {'us':>8s} {'MB':>8s} {'grid':>16s}  kernel")
        for i, (k, ph) in enumerate(zip(kernels, phases)):
            print(f"{i:4d} {ph:9s} {k['ns'] / 1e3:8.1f} {k['bytes'] / 1e6:8.1f} {k['grid']:>16s}  "
                  f"{short(k['name'])[:90]}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a closed pipe (| head) ends it quietly
    main()
