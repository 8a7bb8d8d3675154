#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction: ncu's source page (SASS) as CSV.

Collect and export (tools/device/resnet_check.sh does both with NCU_SASS=1):
    ncu -k regex:KERNEL --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats -o rep -f BINARY ARGS...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
then
    python3 tools/bench/ncu_sass_top.py rep.csv [--top 25]   (rep.csv.gz too)
    python3 tools/bench/ncu_sass_top.py rep.csv --range 0x7f8a2025ef00 0x7f8a2025f0f0
      (also the share of the samples at the addresses from the first to the second, inclusive:
      a stretch of code read off the listing, such as one inlined helper)

Prints the warp-state samples summed by opcode (the SASS mnemonic without its modifiers, so
LDG.E.128 and LDG.E count as LDG) and the instructions with the most samples, each with its
share of the kernel's samples and, where the CSV has a column per stall reason, its two largest
reasons. A sample is one warp at one instruction on one sampling cycle: the instruction a warp
sits at while it waits, which is usually the *consumer* of the value it waits for (an HGMMA
waiting on the LDSM before it shows the LDSM's latency at the HGMMA).
"""
import argparse
import csv
import gzip
import re
import sys
from collections import defaultdict

ALL = re.compile(r"warp stall sampling \(all", re.I)


def number(text):
    text = (text or "").strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return 0.0


def opcode(sass):
    # "@!P0 LDG.E.128 R4, desc[UR6][R2.64] ;" -> "LDG"
    tokens = sass.strip().split()
    while tokens and tokens[0].startswith("@"):
        tokens = tokens[1:]
    return tokens[0].split(".")[0] if tokens else "?"


def read(stream):
    rows = list(csv.reader(stream))
    # ncu may print lines before the table ("==PROF==", the kernel's name): the header is the
    # first row with an "Address" column and a samples column.
    for h, row in enumerate(rows):
        names = [c.strip() for c in row]
        if any(ALL.search(c) for c in names) and any("address" in c.lower() for c in names):
            return names, rows[h + 1 :]
    raise SystemExit("ncu_sass_top: no header with 'Address' and 'Warp Stall Sampling (All "
                     "Samples)' in the CSV (was it exported with --page source --print-source sass?)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--range", nargs=2, action="append", default=[], metavar=("FIRST", "LAST"),
                    help="also print the share of samples at addresses FIRST..LAST (hex)")
    args = ap.parse_args()
    if args.top < 0:
        ap.error(f"--top must be 0 or more (got {args.top})")
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt", newline="") as f:
        names, rows = read(f)
    col = {n: i for i, n in enumerate(names)}
    i_all = next(i for i, n in enumerate(names) if ALL.search(n))
    i_addr = next(i for i, n in enumerate(names) if "address" in n.lower())
    i_src = col.get("Source", i_addr + 1)
    # Per-reason columns, where this ncu version exports them (names with "stall" that are not
    # the two totals, nor the not-issued share of each reason).
    reasons = [i for i, n in enumerate(names) if "stall" in n.lower()
               and "sampling" not in n.lower() and "not issued" not in n.lower()]
    insts = []
    for r in rows:
        if len(r) <= max(i_all, i_src):
            continue
        insts.append((r[i_addr].strip(), r[i_src].strip(), number(r[i_all]),
                      [(number(r[i]), names[i]) for i in reasons]))
    total = sum(s for _, _, s, _ in insts)
    if total <= 0:
        raise SystemExit("ncu_sass_top: no samples in the CSV")
    by_op = defaultdict(float)
    for _, src, s, _ in insts:
        by_op[opcode(src)] += s
    print(f"{len(insts)} instructions, {int(total)} samples; by opcode:")
    for op, s in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {100 * s / total:5.1f}%  {op}")
    for first, last in args.range:
        lo, hi = int(first, 16), int(last, 16)
        inside = [(a, s) for a, _, s, _ in insts if lo <= int(a, 16) <= hi]
        print(f"{first}..{last}: {len(inside)} instructions, "
              f"{100 * sum(s for _, s in inside) / total:.1f}% of the samples")
    print(f"the {args.top} instructions with the most samples:")
    for addr, src, s, rs in sorted(insts, key=lambda t: -t[2])[: args.top]:
        why = ", ".join(f"{n} {100 * v / s:.0f}%" for v, n in sorted(rs, reverse=True)[:2]
                        if v >= 0.05 * s)
        print(f"  {100 * s / total:5.1f}%  {addr:>6}  {src[:70]}" + (f"  ({why})" if why else ""))


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        sys.exit(f"ncu_sass_top: cannot read the CSV: {e}")
    except (StopIteration, ValueError, IndexError) as e:
        sys.exit(f"ncu_sass_top: not an ncu source page export (--page source --csv "
                 f"--print-source sass): {e!r}")
