#!/usr/bin/env python3
"""Replays a KILN_ALLOC_TRACE log (cuda/allocator.cpp) through allocator policies and prints
the device memory each would reserve: the measurement behind the allocator's policy
(docs/lab/allocator.md).

    KILN_ALLOC_TRACE=/tmp/a.txt kiln-bench --model resnet50 --batches 256 --graph-only
    python3 tools/bench/alloc_replay.py /tmp/a.txt[.gz]

Policies: "whole" (kiln before the split/merge allocator of 2026-12-01: size buckets, a cached
block reused whole when it is at most twice the request), "split" (blocks carved from
cudaMalloc'd segments and split, best fit, free neighbours merged) and "split+release" (split,
and before growing outside a capture, the stream's wholly free segments are returned when they
add up to the new segment: what cuda/allocator.cpp does since 2026-12-01, less its cross-stream
take-over). All keep kiln's stream and private-pool rules: a block is reused on its own stream
only; during a capture on a stream its allocations come from the pool, then from the stream's
general cache, and blocks it frees join the pool. (Here a split pool block's rest goes to the
general cache; the allocator keeps it in the pool.)
"""
import bisect
import gzip
import sys

MiB = 1 << 20
SMALL = 1 * MiB


def round_whole(n):
    return (n + 511) // 512 * 512 if n <= SMALL else (n + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)


class Whole:
    def __init__(self):
        self.free = {}  # (stream, pool) -> sorted list of sizes
        self.reserved = 0
        self.peak = 0

    def take(self, key, size):
        lst = self.free.get(key, [])
        i = bisect.bisect_left(lst, size)
        if i < len(lst) and lst[i] <= 2 * size:
            return lst.pop(i)
        return None

    def alloc(self, n, stream, pool):
        size = round_whole(n)
        got = None
        if pool:
            got = self.take((stream, pool), size) or self.take((stream, 0), size)
        else:
            got = self.take((stream, 0), size)
        if got is None:
            got = size
            self.reserved += size
            self.peak = max(self.peak, self.reserved)
        return (got, pool)

    def free_(self, blk, stream, pool_now):
        size, pool = blk
        if pool == 0 and pool_now:
            pool = pool_now
        bisect.insort(self.free.setdefault((stream, pool), []), size)
        return pool

    def release(self, pool):
        for (s, p), lst in list(self.free.items()):
            if p == pool:
                for x in lst:
                    bisect.insort(self.free.setdefault((s, 0), []), x)
                del self.free[(s, p)]


class Split:
    """Segments split into blocks; free neighbours with the same owner merge."""

    def __init__(self, small_seg=2 * MiB, mid_seg=20 * MiB, mid_limit=10 * MiB, min_rest=MiB):
        self.small_seg, self.mid_seg, self.mid_limit, self.min_rest = small_seg, mid_seg, mid_limit, min_rest
        self.reserved = 0
        self.peak = 0
        self.blocks = {}  # id -> [seg, off, size, free, stream, pool]
        self.by_pos = {}  # (seg, off) -> id
        self.free = {}  # (stream, pool) -> sorted list of (size, id)
        self.next = 0
        self.nseg = 0

    def round(self, n):
        return max(512, (n + 511) // 512 * 512)

    def add_free(self, bid):
        b = self.blocks[bid]
        bisect.insort(self.free.setdefault((b[4], b[5]), []), (b[2], bid))

    def rm_free(self, bid):
        b = self.blocks[bid]
        lst = self.free[(b[4], b[5])]
        lst.pop(bisect.bisect_left(lst, (b[2], bid)))

    def new_block(self, seg, off, size, stream, pool, free):
        bid = self.next
        self.next += 1
        self.blocks[bid] = [seg, off, size, free, stream, pool]
        self.by_pos[(seg, off)] = bid
        return bid

    def take(self, key, size):
        lst = self.free.get(key, [])
        i = bisect.bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        # small requests only from small segments' blocks, large never from small segments
        bsize, bid = lst[i]
        if size > SMALL and bsize <= SMALL:
            return None
        return bid

    def alloc(self, n, stream, pool):
        size = self.round(n)
        bid = None
        if pool:
            bid = self.take((stream, pool), size)
            if bid is None:
                bid = self.take((stream, 0), size)
        else:
            bid = self.take((stream, 0), size)
        if bid is None:
            if size <= SMALL:
                seg_size = self.small_seg
            else:
                seg_size = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
                if size < self.mid_limit:
                    seg_size = max(seg_size, self.mid_seg)
            self.reserved += seg_size
            self.last_segment = seg_size
            self.peak = max(self.peak, self.reserved)
            seg = self.nseg
            self.nseg += 1
            bid = self.new_block(seg, 0, seg_size, stream, pool, True)
            self.add_free(bid)
        self.rm_free(bid)
        b = self.blocks[bid]
        b[5] = pool  # joins the pool if it came from the general cache
        rest = b[2] - size
        limit = 512 if size <= SMALL else self.min_rest
        if rest >= limit:
            b[2] = size
            # the rest goes to the general cache (see the docstring)
            r = self.new_block(b[0], b[1] + size, rest, stream, 0, True)
            self.add_free(r)
        b[3] = False
        return bid

    def free_(self, bid, stream, pool_now):
        b = self.blocks[bid]
        if b[5] == 0 and pool_now:
            b[5] = pool_now
        b[3] = True
        self.coalesce(bid)
        return b[5]

    def coalesce(self, bid):
        b = self.blocks[bid]
        nid = self.by_pos.get((b[0], b[1] + b[2]))
        if nid is not None:
            nb = self.blocks[nid]
            if nb[3] and nb[4] == b[4] and nb[5] == b[5]:
                self.rm_free(nid)
                b[2] += nb[2]
                del self.by_pos[(nb[0], nb[1])]
                del self.blocks[nid]
        # previous neighbour: the block whose end is b's start
        pid = self.prev_of(b)
        if pid is not None:
            pb = self.blocks[pid]
            if pb[3] and pb[4] == b[4] and pb[5] == b[5]:
                self.rm_free(pid)
                pb[2] += b[2]
                del self.by_pos[(b[0], b[1])]
                del self.blocks[bid]
                bid = pid
        self.add_free(bid)

    def prev_of(self, b):
        if b[1] == 0:
            return None
        # linear in the segment's blocks; segments hold few blocks
        for (seg, off), k in self.by_pos.items():
            if seg == b[0] and off + self.blocks[k][2] == b[1]:
                return k
        return None

    def release(self, pool):
        for bid, b in list(self.blocks.items()):
            if bid in self.blocks and b[5] == pool:
                if b[3]:
                    self.rm_free(bid)
                    b[5] = 0
                    self.coalesce(bid)
                else:
                    b[5] = 0


class SplitRelease(Split):
    """Split, plus: before growing outside a capture, wholly free general segments of the stream
    are returned when together they hold at least the request."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.segs = {}  # segment -> size

    def alloc(self, n, stream, pool):
        size = self.round(n)
        found = (self.take((stream, pool), size) if pool else None) or self.take((stream, 0), size)
        if found is None and not pool:
            whole = []
            for seg, seg_size in self.segs.items():
                k = self.by_pos.get((seg, 0))
                b = self.blocks.get(k)
                if b and b[3] and b[2] == seg_size and b[5] == 0 and b[4] == stream:
                    whole.append((seg, k, seg_size))
            if sum(w[2] for w in whole) >= size:
                for seg, k, seg_size in whole:
                    self.rm_free(k)
                    del self.by_pos[(seg, 0)]
                    del self.blocks[k]
                    del self.segs[seg]
                    self.reserved -= seg_size
        before = self.nseg
        bid = super().alloc(n, stream, pool)
        if self.nseg != before:
            self.segs[self.nseg - 1] = self.last_segment
        return bid


def replay(path, policy):
    op = gzip.open if path.endswith(".gz") else open
    live = {}  # ptr -> (block, stream)
    pools = {}  # stream -> pool open on it
    events = 0
    with op(path, "rt") as f:
        for ln in f:
            t = ln.split()
            if not t or t[0] not in ("a", "f", "o", "c", "r"):
                continue
            events += 1
            if t[0] == "a":
                s = int(t[3])
                live[t[1]] = (policy.alloc(int(t[2]), s, pools.get(s, 0)), s)
            elif t[0] == "f":
                blk, s = live.pop(t[1])
                policy.free_(blk, s, pools.get(s, 0))
            elif t[0] == "o":
                pools[int(t[2])] = int(t[1])
            elif t[0] == "c":
                pools = {k: v for k, v in pools.items() if v != int(t[1])}
            elif t[0] == "r":
                policy.release(int(t[1]))
    if not events:
        raise ValueError(f"{path}: no allocation events (a, f, o, c, r lines)")
    return policy


def main():
    GiB = float(1 << 30)
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if sys.argv[1:] else 2)
    for path in sys.argv[1:]:
        print(path)
        w = replay(path, Whole())
        print("  whole (before 2026-12-01)     reserved %.2f GiB" % (w.reserved / GiB))
        for mid_seg in (20 * MiB,):
            for min_rest in (MiB, 2 * MiB, 8 * MiB):
                s = replay(path, Split(mid_seg=mid_seg, min_rest=min_rest))
                print("  split, min remainder %4.0f MiB  reserved %.2f GiB" % (min_rest / MiB, s.reserved / GiB))
        r = replay(path, SplitRelease())
        print("  split+release                 reserved %.2f GiB (peak %.2f)" % (r.reserved / GiB, r.peak / GiB))


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        sys.exit(f"alloc_replay: {e}")
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, EOFError) as e:
        sys.exit(f"alloc_replay: not an allocation log: {e!r}")
