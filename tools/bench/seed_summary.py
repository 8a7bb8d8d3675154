#!/usr/bin/env python3
"""Final top-1 of tools/device/r50_seeds.sh's runs, by configuration and seed.

Reads the summary lines ("seed 3 default: rc 0, 31 s; final test top-1 80.94% ...") from the
files named (or stdin), and prints for each configuration its runs, mean and sample standard
deviation; then each configuration against the first one, over the seeds both ran: the mean of
the per-seed differences and its standard error (sd of the differences / sqrt(n)).

    python3 tools/bench/seed_summary.py docs/lab/step-profiles/calls-2026-12-05c.txt
"""
import re
import statistics
import sys

LINE = re.compile(r"^seed (\d+) (\S+): rc (\d+),.*?top-1 ([0-9.]+)%")


def read(lines):
    runs = {}  # configuration -> {seed: top-1}
    for line in lines:
        m = LINE.match(line.strip())
        if m and m.group(3) == "0":
            runs.setdefault(m.group(2), {})[int(m.group(1))] = float(m.group(4))
    return runs


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    lines = []
    for name in sys.argv[1:] or ["-"]:
        lines += (sys.stdin if name == "-" else open(name)).readlines()
    runs = read(lines)
    if not runs:
        sys.exit("seed_summary: no 'seed N CONFIG: rc 0, ... top-1 X%' lines found")
    for cfg, by_seed in runs.items():
        v = [by_seed[s] for s in sorted(by_seed)]
        sd = statistics.stdev(v) if len(v) > 1 else float("nan")
        print(f"{cfg}: n {len(v)}, mean {statistics.mean(v):.2f}, sd {sd:.2f}; "
              + " / ".join(f"{x:.2f}" for x in v))
    base, *others = list(runs)
    for cfg in others:
        seeds = sorted(set(runs[base]) & set(runs[cfg]))
        d = [runs[cfg][s] - runs[base][s] for s in seeds]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        print(f"{cfg} - {base}: {len(d)} seeds, mean difference {statistics.mean(d):+.2f} "
              f"(standard error {se:.2f})")


if __name__ == "__main__":
    try:
        main()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"seed_summary: {e}")
