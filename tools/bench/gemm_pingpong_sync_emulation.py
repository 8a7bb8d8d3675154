#!/usr/bin/env python3
"""The ping-pong schedule's synchronisation, emulated: the wgmma kernel's kPingPong form
(cuda/kernels/gemm_bn_wgmma.cu once docs/lab/norm-conv/gemm-pingpong.patch is applied).

A producer loads the CTA's tiles in order into ns slots (a slot's next load waits for its empty
barrier), two consumer warpgroups take alternate tiles (a slot's full barrier, parity waits), and
two named barriers keep their mainloops in turn. Under random interleavings and any order of the
loads' completion this checks that every parity wait finds the phase it waits for in progress
or just completed (with the barrier a phase further back the wait would pass at once, a phase
further on it would hang), that nothing deadlocks, that each warpgroup consumes its own tiles' k-steps once and in order, and
that no named barrier is left with arrivals pending. Without the named barriers the first check
fails (run with --no-order to see it). No GPU needed:
    python3 tools/bench/gemm_pingpong_sync_emulation.py [--no-order]
"""
import argparse
import random

_ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_ap.add_argument("--no-order", action="store_true", help="without the named barriers")
ORDER = not _ap.parse_args().no_order

def run(T, KT, ns, seed):
    rnd = random.Random(seed)
    full_phase = [0] * ns  # completed phases of each slot's full barrier
    empty_phase = [0] * ns
    empty_count = [0] * ns  # warpgroups arrived in the empty barrier's current phase
    named = {4: 0, 5: 0}  # arrivals (in warpgroups) of the current generation
    named_gen = {4: 0, 5: 0}
    pending_tma = []  # slots whose load is in flight
    consumed = []
    def parity_ok(phi, use):
        # try_wait.parity((use) & 1) passes iff (phi & 1) != (use & 1); correct iff phi in {use, use+1}
        assert phi in (use, use + 1), f"parity wait out of range: phi {phi} use {use}"
        return phi == use + 1
    def producer():
        j = 0
        for t in range(T):
            for kt in range(KT):
                s = j % ns
                if j >= ns:
                    use = j // ns - 1
                    while not parity_ok(empty_phase[s], use):
                        yield
                pending_tma.append(s)  # full(s) completes later
                j += 1
                yield
    def consumer(c):
        j = 0
        for local in range(T):
            if local % 2 != c:
                j += KT
                continue
            if ORDER and local > 0:  # bar.sync 4 + (1 - c)
                bid = 4 + (1 - c)
                gen = named_gen[bid]
                named[bid] += 1
                assert named[bid] <= 2
                if named[bid] == 2:
                    named[bid] = 0; named_gen[bid] += 1
                while named_gen[bid] == gen:
                    yield
            issued = []
            for kt in range(KT):
                jj = j + kt; s = jj % ns; use = jj // ns
                while not parity_ok(full_phase[s], use):
                    yield
                consumed.append((local, kt, c))
                issued.append(s)
                yield
                if kt >= 1:  # wait1, then release k-step kt-1's slot
                    sp = issued[kt - 1]
                    empty_count[sp] += 1
                    if empty_count[sp] == 1:  # 128 arrivals = one warpgroup
                        empty_count[sp] = 0; empty_phase[sp] += 1
            # wait0, release the last slot
            sp = issued[KT - 1]
            empty_count[sp] += 1
            if empty_count[sp] == 1:
                empty_count[sp] = 0; empty_phase[sp] += 1
            j += KT
            if ORDER and local + 1 < T:  # bar.arrive 4 + c
                bid = 4 + c
                named[bid] += 1
                assert named[bid] <= 2, "a second arrival before the barrier completed"
                if named[bid] == 2:
                    named[bid] = 0; named_gen[bid] += 1
            for _ in range(rnd.randint(0, 6)):  # the epilogue
                yield
    procs = {"p": producer(), "c0": consumer(0), "c1": consumer(1)}
    alive = set(procs)
    steps = 0
    while alive or pending_tma:
        steps += 1
        if steps > 10**6:
            raise AssertionError("deadlock")
        choices = list(alive) + (["tma"] if pending_tma else [])
        who = rnd.choice(choices)
        if who == "tma":
            s = pending_tma.pop(rnd.randrange(len(pending_tma)))  # any order
            full_phase[s] += 1
            continue
        try:
            next(procs[who])
        except StopIteration:
            alive.discard(who)
    want = [(l, k, l % 2) for l in range(T) for k in range(KT)]
    assert sorted(consumed) == want, "tiles consumed wrongly"
    # per warpgroup, in order
    for c in (0, 1):
        seq = [(l, k) for (l, k, cc) in consumed if cc == c]
        assert seq == sorted(seq)
    assert named == {4: 0, 5: 0}, f"named barriers left pending: {named}"
    return steps

n = 0
try:
    for T in range(1, 9):
        for KT in (1, 2, 3, 4, 8, 16):
            for ns in (3, 4, 5, 6, 7):
                for seed in range(40):
                    run(T, KT, ns, seed)
                    n += 1
except AssertionError as e:  # what --no-order shows
    raise SystemExit(f"check failed (T {T}, KT {KT}, ns {ns}, seed {seed}): {e}") from None
print("ok", n, "runs")
