#!/usr/bin/env python3
"""The look-ahead's synchronisation, emulated: the 1x1 forward's kLook form of kiln's wgmma GEMM
(cuda/kernels/gemm_bn_wgmma.cu once docs/lab/norm-conv/gemm-lookahead.patch is applied).

A producer loads the CTA's k-steps in order into ns slots (a slot's next load waits for its
empty barrier, which both consumer warpgroups arrive on), and each consumer warpgroup runs the
kernel's schedule, transcribed below from its lambdas (`rest`, `turn`): issue a k-step once its
slot's full barrier has the phase it waits for, commit it as a wgmma group, wait until at most N
groups are pending, release slots in order, run a tile's epilogue. The tensor cores complete each
warpgroup's groups in order, at random moments; the loads complete in any order. Under random
interleavings this checks that:
  - every parity wait finds the phase it waits for in progress or just completed;
  - a slot is released only once every group that reads it is complete (so the next load into
    it cannot overwrite operands still being read);
  - a tile's epilogue reads its accumulators only once all of the tile's groups are complete,
    and a set of accumulators is zeroed only when no group still writes it;
  - nothing deadlocks, and every k-step is consumed once, in order.
With --too-deep the depth is ns (one more than the host allows) and the emulation deadlocks at
once, which shows the bound kLook <= ns - 1 is needed. No GPU needed:
    python3 tools/bench/gemm_lookahead_sync_emulation.py [--too-deep]
"""
import argparse
import random
import sys

_ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_ap.add_argument("--too-deep", action="store_true", help="depth ns: shows the deadlock")
TOO_DEEP = _ap.parse_args().too_deep


class Deadlock(Exception):
    pass


def depth(KT, ns):
    # The host's choice (conv1x1_stats_wgmma): min(KT, ns - 1, 3); --too-deep: min(KT, ns).
    return min(KT, ns) if TOO_DEEP else min(KT, ns - 1, 3)


def consumer_program(T, KT, look):
    """The kernel's consumer schedule as a list of operations, transcribed from its lambdas.
    ("issue", acc, tile, kt), ("wait", n), ("release",), ("epilogue", acc, tile), ("zero", acc)."""
    ops = []

    def issue_into(acc, tile, kt):
        ops.append(("issue", acc, tile, kt))

    def rest(acc, tile, k_from):
        if k_from == 0:
            issue_into(acc, tile, 0)
        elif k_from > 1:
            ops.append(("wait", 1))
            for _ in range(1, k_from):
                ops.append(("release",))
        for kt in range(1 if k_from == 0 else k_from, KT):
            issue_into(acc, tile, kt)
            ops.append(("wait", 1))
            ops.append(("release",))

    def turn(acc, nacc, tile):
        if tile + 1 < T:
            ops.append(("zero", nacc))
            for j in range(look):
                issue_into(nacc, tile + 1, j)
            ops.append(("wait", look))
            ops.append(("release",))
            ops.append(("epilogue", acc, tile))
            rest(nacc, tile + 1, look)
            return True
        ops.append(("wait", 0))
        ops.append(("release",))
        ops.append(("epilogue", acc, tile))
        return False

    if T > 0:
        ops.append(("zero", 0))
        rest(0, 0, 0)
        tile = 0
        while True:
            if not turn(0, 1, tile) or not turn(1, 0, tile + 1):
                break
            tile += 2
    return ops


def run(T, KT, ns, seed):
    rnd = random.Random(seed)
    look = depth(KT, ns)
    full_phase = [0] * ns
    empty_phase = [0] * ns
    empty_count = [0] * ns
    loaded = [None] * ns  # the global k-step whose operands the slot holds
    in_flight = []  # loads whose full barrier has not completed yet: (slot, j)

    def parity_ok(phi, use):
        # try_wait.parity(use & 1) passes iff phi's parity differs; right iff phi in {use, use + 1}
        assert phi in (use, use + 1), f"parity wait out of range: phase {phi}, waits for {use}"
        return phi == use + 1

    def producer():
        for j in range(T * KT):
            s = j % ns
            if j >= ns:
                while not parity_ok(empty_phase[s], j // ns - 1):
                    yield False
            in_flight.append((s, j))
            yield True

    groups = [[], []]  # per warpgroup: pending groups (acc, tile, kt, slot), oldest first
    consumed = [[], []]

    def consumer(c):
        got = 0  # next global k-step to wait for
        done = 0  # next global k-step to release
        for op in consumer_program(T, KT, look):
            if op[0] == "zero":
                assert all(g[0] != op[1] for g in groups[c]), "accumulators zeroed under MMAs"
            elif op[0] == "issue":
                _, acc, tile, kt = op
                assert got == tile * KT + kt, "k-steps out of order"
                s = got % ns
                while not parity_ok(full_phase[s], got // ns):
                    yield False
                assert loaded[s] == got, "slot holds another k-step"
                groups[c].append((acc, tile, kt, s, got))
                consumed[c].append(got)
                got += 1
            elif op[0] == "wait":
                while len(groups[c]) > op[1]:
                    yield False
            elif op[0] == "release":
                s = done % ns
                assert all(g[4] != done for g in groups[c]), "slot released under its MMAs"
                empty_count[s] += 1
                if empty_count[s] == 2:
                    empty_count[s] = 0
                    empty_phase[s] += 1
                done += 1
            elif op[0] == "epilogue":
                _, acc, tile = op
                assert all(not (g[0] == acc and g[1] == tile) for g in groups[c]), \
                    "epilogue before its tile's MMAs completed"
            yield True
        assert done == T * KT and got == T * KT, "k-steps left unreleased or unconsumed"

    agents = [producer(), consumer(0), consumer(1)]
    alive = [True, True, True]
    idle = 0
    while any(alive) or in_flight or groups[0] or groups[1]:
        progressed = False
        # Loads and MMAs complete at random moments.
        if in_flight and rnd.random() < 0.5:
            s, j = in_flight.pop(rnd.randrange(len(in_flight)))
            loaded[s] = j
            full_phase[s] += 1
            progressed = True
        for c in (0, 1):
            if groups[c] and rnd.random() < 0.3:
                groups[c].pop(0)  # the oldest group completes first
                progressed = True
        i = rnd.randrange(3)
        if alive[i]:
            try:
                progressed |= next(agents[i])
            except StopIteration:
                alive[i] = False
                progressed = True
        idle = 0 if progressed else idle + 1
        if idle > 2000:
            raise Deadlock(f"T {T} KT {KT} ns {ns} look {look}")
    assert consumed[0] == consumed[1] == list(range(T * KT))


def main():
    runs = 0
    for T in range(1, 8):
        for KT in range(1, 9):
            # The kernel's slot counts: B resident where K <= 256 (8 - KT slots of A), else 4.
            for ns in sorted({4, 8 - KT if KT <= 4 else 4}):
                for seed in range(40):
                    run(T, KT, ns, seed)
                    runs += 1
    print(f"look-ahead synchronisation: {runs} runs (1-7 tiles, 1-8 k-steps, 4-7 slots), "
          "every check held, no deadlock")


if __name__ == "__main__":
    try:
        main()
    except Deadlock as e:
        print(f"deadlock: {e}")
        sys.exit(1)
    except AssertionError as e:
        sys.exit(f"check failed: {e}")
