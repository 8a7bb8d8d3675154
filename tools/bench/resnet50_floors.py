#!/usr/bin/env python3
"""Roofline floors of kiln's own GEMM kernels in ResNet-50's training step (batch 256, f16).

For each kernel class of the v28 profile that kiln owns (docs/performance.md, "Where the step's
time goes now"; per-kernel sums in docs/lab/norm-conv/calls-2026-12-05b.txt, call B), this
enumerates the calls from the architecture (torchvision's ResNet-50: the stride on the 3x3
convolution), counts each call's FLOP and the bytes it must move at least (each operand read
once, each output written once), and prints the floor max(bytes / BW, FLOP / PEAK) per call and
summed, beside the measured time. BW and PEAK are what the best kernels in the same profile
reach, not the datasheet's: 4.0 TB/s (kiln's apply passes: 3.9-4.1) and 660 TFLOP/s (cuDNN's
best 3x3 plan in situ, docs/lab/norm-conv.md v23: 673).

    python3 tools/bench/resnet50_floors.py [--bw TB/s] [--peak TFLOP/s] [--calls] [--fit]

--fit: the 1x1 forward's time per 128 x 128 tile as a line in K (a fixed part plus the MMAs),
through two of v21's probe times (docs/lab/norm-conv/calls-2026-12-04b.txt, call G), and how it
predicts the other two (docs/lab/norm-conv.md, "The 1x1 forward on a ping-pong schedule").
"""
import argparse

N = 256
LAYERS = [(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)]  # blocks, width, first stride

# Measured in situ (ms summed, calls): v28's profile, call B of calls-2026-12-05b.txt.
MEASURED = {
    "1x1 forward + statistics": (2.123, 26),  # dgrad1x1_bn_sums_wgmma_kernel<1,0,0,1,...>
    "1x1 weight gradient": (1.451 + 0.778, 26 + 6),  # wgrad1x1_wgmma_kernel<128|64, 0>
    "tail data gradient + sums": (1.809, 11),  # <1,1,1,0,1,1,...>
    "dual tail data gradient + sums": (0.886, 4),  # <...,1> (kDual)
    "inner bn2 data gradient + sums": (0.847, 13),  # <1,0,0,0,1,1,...>
    "3x3 data gradient + bn1 sums": (0.696, 7),  # <1,0,0,0,1,1,0,1,...> (kIm2col)
}


def blocks():
    """(layer, block, width, stride, input channels, input side) of each bottleneck."""
    side, cin = 56, 64
    for li, (nb, c, s) in enumerate(LAYERS):
        for b in range(nb):
            st = s if b == 0 else 1
            yield li + 1, b, c, st, cin, side
            cin, side = 4 * c, side // st


def calls():
    """Each kernel class's calls: (class, label, FLOP, bytes)."""
    out = []
    bl = list(blocks())
    for i, (l, b, c, st, cin, side) in enumerate(bl):
        m_in, m_out = N * side * side, N * (side // st) ** 2
        tag = f"L{l}b{b}"
        # Forward 1x1 with the output's statistics: kiln runs it where the output has >= 256
        # channels at stride 1 (conv3, layers 3-4's conv1, layer 1's downsample).
        fwd = [(f"{tag} conv3 {c}->{4 * c}", m_out, c, 4 * c)]
        if c >= 256:
            fwd.append((f"{tag} conv1 {cin}->{c}", m_in, cin, c))
        if b == 0 and st == 1:
            fwd.append((f"{tag} downsample {cin}->{4 * c}", m_out, cin, 4 * c))
        for lab, m, k, n in fwd:
            out.append(("1x1 forward + statistics", lab, 2 * m * k * n, 2 * (m * k + m * n + k * n)))
        # Weight gradients of the stride-1 1x1 convolutions (conv1, conv3, layer 1's downsample):
        # read dy and x, write dw (f32).
        # Layer 1's first conv1 (64 -> 64) is left to cuDNN.
        wg = [(f"{tag} conv1", m_in, cin, c)] if cin > 64 else []
        wg.append((f"{tag} conv3", m_out, c, 4 * c))
        if b == 0 and st == 1:
            wg.append((f"{tag} downsample", m_out, cin, 4 * c))
        for lab, m, k, n in wg:
            out.append(("1x1 weight gradient", lab, 2 * m * k * n, 2 * m * (k + n) + 4 * k * n))
        # conv3's data gradient with bn2's backward sums (layers 2-4): read dy3 and y2, write g.
        if c >= 128:
            m = m_out
            out.append(("inner bn2 data gradient + sums", f"{tag}", 2 * m * 4 * c * c,
                        2 * (m * 4 * c + 2 * m * c) + 2 * 4 * c * c))
        # conv2's data gradient (3x3, stride 1, C >= 256: the calls the profile shows) with bn1's
        # backward sums: read dy2, x (y1) and w, write g.
        if c >= 256 and st == 1:
            m = m_out
            out.append(("3x3 data gradient + bn1 sums", tag, 2 * m * 9 * c * c,
                        2 * (3 * m * c + 9 * c * c)))
        # The block's tail: the next block's conv1 data gradient (4C -> its width) with the
        # tail's sums: read dy1, r, x, the mask bits; write g (4C channels).
        # (The next block's conv1 is stride 1 and runs at this block's output size.)
        if i + 1 < len(bl):
            nc, m = bl[i + 1][2], m_out
            cls = "dual tail data gradient + sums" if b == 0 else "tail data gradient + sums"
            reads = m * nc + 2 * m * 4 * c + (m * 4 * c if b == 0 else 0)  # dy1, r, x (, u)
            byt = 2 * (reads + m * 4 * c) + m * 4 * c // 8 + 2 * 4 * c * nc
            out.append((cls, f"{tag} (next conv1 {4 * c}->{nc})", 2 * m * nc * 4 * c, byt))
    return out


# v21's probe (call G), kiln's 1x1 forward with statistics alone at batch 256: (K, C, side) -> ms.
PROBE_V21 = {(256, 1024, 14): 0.068, (512, 2048, 7): 0.060, (1024, 256, 14): 0.054,
             (2048, 512, 7): 0.050}
SMS = 132


def tile_fit():
    """Per-tile time = fixed + K * slope, through the K = 256 and K = 2048 shapes."""
    def per_tile(shape, ms):
        k, c, side = shape
        tiles = -(-N * side * side // 128) * (c // 128)
        return ms * 1e3 * SMS / tiles  # µs a tile on each SM
    pts = {shape: per_tile(shape, ms) for shape, ms in PROBE_V21.items()}
    (k0, y0), (k1, y1) = [(s[0], pts[s]) for s in ((256, 1024, 14), (2048, 512, 7))]
    slope = (y1 - y0) / (k1 - k0)
    fixed = y0 - slope * k0
    rate = 2 * 128 * 128 / slope / 1e6 * SMS  # TFLOP/s of the MMAs over all SMs
    print(f"per 128 x 128 tile: {fixed:.2f} µs fixed + MMAs at {rate:.0f} TFLOP/s "
          f"(through K = {k0} and {k1})")
    for shape, y in pts.items():
        pred = fixed + slope * shape[0]
        print(f"  {shape[0]:5d} -> {shape[1]:5d} @{shape[2]:<3d} measured {y:6.2f} µs a tile, "
              f"line {pred:6.2f} ({(pred / y - 1) * 100:+.1f}%), fixed part {fixed / y:.0%}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bw", type=float, default=4.0, help="TB/s (default 4.0)")
    ap.add_argument("--peak", type=float, default=660.0, help="TFLOP/s (default 660)")
    ap.add_argument("--calls", action="store_true", help="also list every call")
    ap.add_argument("--fit", action="store_true", help="the 1x1 forward's per-tile line only")
    a = ap.parse_args()
    if a.fit:
        tile_fit()
        return
    bw, peak = a.bw * 1e12, a.peak * 1e12
    rows = {}
    for cls, lab, flop, byt in calls():
        t = max(byt / bw, flop / peak)
        r = rows.setdefault(cls, [0, 0.0, 0.0, 0.0, 0.0])
        r[0] += 1
        r[1] += flop
        r[2] += byt
        r[3] += t
        r[4] += byt / bw if byt / bw > flop / peak else 0.0
        if a.calls:
            bound = "memory" if byt / bw > flop / peak else "FLOP"
            print(f"  {cls:32s} {lab:34s} {flop / 1e9:6.1f} GFLOP {byt / 1e6:7.1f} MB "
                  f"{t * 1e3:6.3f} ms ({bound})")
    print(f"floors at {a.bw:g} TB/s and {a.peak:g} TFLOP/s, batch {N}; measured: v28, in situ")
    print(f"{'class':32s} {'calls':>5s} {'GFLOP':>6s} {'GB':>6s} {'floor ms':>8s} "
          f"{'measured':>8s} {'above':>6s} {'TFLOP/s':>7s} {'TB/s':>5s}")
    tf = tm = 0.0
    for cls, (n, flop, byt, t, _) in rows.items():
        ms, mc = MEASURED[cls]
        tf += t * 1e3
        tm += ms
        note = "" if mc == n else f"  (profile: {mc} calls)"
        print(f"{cls:32s} {n:5d} {flop / 1e9:6.0f} {byt / 1e9:6.2f} {t * 1e3:8.3f} {ms:8.3f} "
              f"{ms - t * 1e3:6.3f} {flop / (ms * 1e-3) / 1e12:7.0f} {byt / (ms * 1e-3) / 1e12:5.2f}"
              f"{note}")
    print(f"{'all':32s} {'':5s} {'':6s} {'':6s} {tf:8.3f} {tm:8.3f} {tm - tf:6.3f}")


if __name__ == "__main__":
    main()
