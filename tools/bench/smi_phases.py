#!/usr/bin/env python3
"""nvidia-smi samples grouped by the phases of a device script (tools/device/step_clocks.sh).

    python3 tools/bench/smi_phases.py smi.csv marks.txt [--tail S]

smi.csv: `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 100`. marks.txt: lines
"EPOCH_SECONDS start NAME" and "EPOCH_SECONDS end NAME" (date +%s.%N). For each phase: the SM
clock (MHz), power (W) and temperature (C), min / median / max, over the whole phase and over its
last S seconds (default 1.5: where kiln-bench times its windows and traces, after setup and
tuning), and the clock-event reasons seen, with how many samples had each (nvidia-smi's bit mask:
0x4 software power cap, 0x20 software thermal slowdown, 0x40 hardware thermal slowdown, 0x80
hardware power brake, 0x1 idle).
"""
import argparse
import datetime
import statistics
import sys

REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "sw power cap", 0x8: "hw slowdown",
           0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake",
           0x100: "display clocks"}


def lines_of(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"smi_phases: cannot read {path}: {e}")


def read_samples(path):
    out = []
    for line in lines_of(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) < 6:
            continue
        try:
            # "2026/12/06 23:46:20.123": nvidia-smi prints local time, which is UTC on the machine.
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f")
            t = t.replace(tzinfo=datetime.timezone.utc).timestamp()
            out.append((t, float(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5], 16)))
        except ValueError:
            continue
    return out


def read_phases(path):
    starts, phases = {}, []
    for n, line in enumerate(lines_of(path), 1):
        f = line.split()
        if not f:
            continue
        try:
            t, what, name = float(f[0]), f[1], f[2]
        except (IndexError, ValueError):
            sys.exit(f"smi_phases: {path}, line {n}: expected 'SECONDS start|end NAME', got {line!r}")
        if what == "start":
            starts[name] = t
        elif name in starts:
            phases.append((name, starts.pop(name), t))
    return phases


def spread(xs):
    return f"{min(xs):.0f} / {statistics.median(xs):.0f} / {max(xs):.0f}" if xs else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("smi")
    ap.add_argument("marks")
    ap.add_argument("--tail", type=float, default=1.5, help="seconds at the end of each phase")
    a = ap.parse_args()
    samples = read_samples(a.smi)
    if not samples:
        sys.exit(f"smi_phases: no samples read from {a.smi}")
    phases = read_phases(a.marks)
    print("phase            samples  SM MHz min/med/max   power W          temp C     "
          "| last %.1f s: SM MHz         power W" % a.tail)
    for name, t0, t1 in phases:
        ph = [s for s in samples if t0 <= s[0] <= t1]
        tail = [s for s in ph if s[0] >= t1 - a.tail]
        reasons = {}
        for s in tail:
            for bit, what in REASONS.items():
                if s[5] & bit:
                    reasons[what] = reasons.get(what, 0) + 1
        print(f"{name:16s} {len(ph):7d}  {spread([s[1] for s in ph]):20s} "
              f"{spread([s[3] for s in ph]):16s} {spread([s[4] for s in ph]):10s} | "
              f"{spread([s[1] for s in tail]):18s} {spread([s[3] for s in tail]):16s} "
              + (", ".join(f"{k} {v}/{len(tail)}" for k, v in reasons.items()) or "no reasons"))


if __name__ == "__main__":
    main()
