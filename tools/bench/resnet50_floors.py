#!/usr/bin/env python3
"""Roofline floors of ResNet-50's training step (batch 256, f16): kiln's GEMMs, or every call.

For each kernel class of the v28 profile that kiln owns (docs/performance.md, "Where the step's
time goes now"; per-kernel sums in docs/lab/norm-conv/calls-2026-12-05b.txt, call B), this
enumerates the calls from the architecture (torchvision's ResNet-50: the stride on the 3x3
convolution), counts each call's FLOP and the bytes it must move at least (each operand read
once, each output written once), and prints the floor max(bytes / BW, FLOP / PEAK) per call and
summed, beside the measured time. BW and PEAK are what the best kernels in the same profile
reach, not the datasheet's: 4.0 TB/s (kiln's apply passes: 3.9-4.1) and 660 TFLOP/s (cuDNN's
best 3x3 plan in situ, docs/lab/norm-conv.md v23: 673).

    python3 tools/bench/resnet50_floors.py [--bw TB/s] [--peak TFLOP/s] [--calls] [--fit] [--step]
    python3 tools/bench/resnet50_floors.py --ncu STEP.csv[.gz] [--bw TB/s] [--peak TFLOP/s] [--calls]

--ncu: kiln's GEMMs as v43 runs them (the 1x1 forward and the 3x3 data gradient from 128
channels, the tail fold in layers 1-2 with t inside bn2's GEMM, layer 1's bn2 on row pairs, the
fold's Gram in the weight gradient), measured from an ncu profile of one eager b256 step
(tools/bench/ncu_step_summary.py's input): each class's time and DRAM bytes summed over its
kernel's calls, beside the floor and the bytes the model counts (a check of the model). A
profile whose GEMM kernel names carry v45's thirteen template flags is read in v45's structure
instead (calls_v45: layer 3 folded too, layer 4's stride-1 3x3 forwards on kiln's GEMM, the
compact residual of the tails before a downsample block).

--fit: the 1x1 forward's time per 128 x 128 tile as a line in K (a fixed part plus the MMAs),
through two of v21's probe times (docs/lab/norm-conv/calls-2026-12-04b.txt, call G), and how it
predicts the other two (docs/lab/norm-conv.md, "The 1x1 forward on a ping-pong schedule").

--step: every other call of the step too, in the structure v28 runs (the stem, cuDNN's and
cuBLASLt's convolutions, the batch-norm passes, the optimizer), grouped, each group against the
same profile's kernels; kiln's GEMMs as one line; then cuDNN's convolutions by kind
(docs/performance.md, "The whole step against its floors").
"""
import argparse
import os
import re
import sys

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


def tail_call(bl, i):
    """Block i's tail: the next block's conv1 data gradient (4C -> its width) with the tail's sums:
    read dy1, r, x, the mask bits (and the downsample's u in the dual form); write g (4C
    channels). The next block's conv1 is stride 1 and runs at this block's output size."""
    l, b, c, st, _, side = bl[i]
    nc, m = bl[i + 1][2], N * (side // st) ** 2
    cls = "dual tail data gradient + sums" if b == 0 else "tail data gradient + sums"
    reads = m * nc + 2 * m * 4 * c + (m * 4 * c if b == 0 else 0)  # dy1, r, x (, u)
    byt = 2 * (reads + m * 4 * c) + m * 4 * c // 8 + 2 * 4 * c * nc
    return cls, f"L{l}b{b} (next conv1 {4 * c}->{nc})", 2 * m * nc * 4 * c, byt


def forward_1x1_calls(fwd):
    """The 1x1 forward with the output's statistics: read x and w, write y."""
    return [("1x1 forward + statistics", lab, 2 * m * k * n, 2 * (m * k + m * n + k * n))
            for lab, m, k, n in fwd]


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
        out += forward_1x1_calls(fwd)
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
        if i + 1 < len(bl):
            out.append(tail_call(bl, i))
    return out


# --step: the rest of v28's step, measured in the same profile (call B), by group. Each group's
# measured time is the sum of the kernels named beside it, or of the profile's phase.
MEASURED_STEP = {
    "stem convolution + statistics": (0.376, 1),  # stem_conv_stats_kernel
    "stem weight gradient": (0.295, 1),  # stem_wgrad_kernel
    "stem BN + ReLU + max pool, forward": (0.233, 1),  # relu_max_pool_k3s2_tiled_kernel<8>
    "stem BN + ReLU + max pool, backward": (0.260 + 0.306, 2),  # pool_relu_sums, pool_relu_apply
    "forward convolutions on cuDNN / cuBLASLt": (2.887, 26),  # the phase "forward conv/GEMM"
    "gradient convolutions on cuDNN / cuBLASLt": (4.530, 37),  # the phase "backward conv/GEMM"
    # apply_kernel<1, 0> (28), cuDNN's batchnorm_fwtr (4), apply_kernel<1, 1> (12), dual_apply (4)
    "batch-norm passes, forward": (0.737 + 0.257 + 1.560 + 0.587, 48),
    # backward_apply_kernel<0, 0> (31) and <1, 0> (8), backward_sums_kernel<1> (8),
    # dual_backward_apply_kernel (4), cuDNN's batchnorm_relu_bwtr (4)
    "batch-norm passes, backward": (1.863 + 0.640 + 0.444 + 1.032 + 0.324, 55),
    "optimizer": (0.148, 1),  # step_kernel<0>
}
# cuDNN's convolutions split by kind. The profile names kernels, not calls, so the split is
# inferred from the kernels' names and call counts: xmma wgrad (19 calls) and one nvjet TNT GEMM
# for the 20 weight gradients; xmma dgrad (12) for the 3x3 and stride-2 downsample data
# gradients; nvjet NNT (4) and the one "badd" NNT for the 1x1 data gradients of layer 1; GenStats
# (22) for the 3x3 and layer 1-2 conv1 forwards (23 calls by the architecture) and nvjet TNN (3)
# for the stride-2 downsample forwards.
CUDNN_SPLIT = [  # (group, label predicate, what, measured ms)
    ("forward convolutions on cuDNN / cuBLASLt", lambda lab: "downsample/2" not in lab,
     "3x3 and layers 1-2's conv1 (GenStats)", 2.622),
    ("forward convolutions on cuDNN / cuBLASLt", lambda lab: "downsample/2" in lab,
     "stride-2 downsample (nvjet TNN)", 0.205),
    ("gradient convolutions on cuDNN / cuBLASLt", lambda lab: "wgrad" in lab,
     "weight gradients (xmma wgrad, nvjet TNT)", 2.236 + 0.052),
    ("gradient convolutions on cuDNN / cuBLASLt",
     lambda lab: "dgrad" in lab and ("conv2" in lab or ("downsample" in lab and lab[1] != "1")),
     "3x3 and stride-2 data gradients (xmma dgrad)", 1.576),
    ("gradient convolutions on cuDNN / cuBLASLt",
     lambda lab: "dgrad" in lab and not ("conv2" in lab or ("downsample" in lab and lab[1] != "1")),
     "layer 1's 1x1 data gradients (nvjet NNT)", 0.494 + 0.086),
]
# The GenStats kernel's calls split further by an older profile pair: v23's call U
# (docs/lab/norm-conv/calls-2026-12-04d.txt) profiled the step with KILN_CONV3X3 off (GenStats:
# 22 calls, 2.420 ms) and on (13 calls, 1.485 ms; kiln's GEMM: 10 calls). The switch moves the ten
# stride-1 3x3 forwards of layers 2-4, so the 13 left are exactly the others (layer 1's 3x3s, the
# stride-2 3x3s, layers 1-2's conv1): 1.485 ms. With the switch off, 9 of the ten were GenStats
# calls (22 - 13) and took 2.420 - 1.485 ms; the tenth ran on another kernel of that process.
def _stride1_3x3_l234(lab):
    return "conv2 3x3/1" in lab and lab[1] in "234" and lab[3] != "0"


GENSTATS_SPLIT_V23 = [  # (predicate, what, calls measured, measured ms)
    (_stride1_3x3_l234, "the ten stride-1 3x3s of layers 2-4 (9 measured)", 9, 2.420 - 1.485),
    (lambda lab: not _stride1_3x3_l234(lab) and "downsample" not in lab,
     "layer 1's 3x3s, the stride-2 3x3s, layers 1-2's conv1", 13, 1.485),
]
STEP_NCU_MS = 25.985  # the profile's 466 kernels summed
SMALL_MS = 0.605  # its 164 kernels under 5 µs (finalize and finish kernels, counters)
PARAMS = 25_557_032  # torchvision's ResNet-50


def step_calls():
    """The step's other calls, as kiln runs them in v28: (group, label, FLOP, bytes)."""
    out = []
    m0 = N * 112 * 112  # the stem's output pixels
    x_bytes = 2 * N * 224 * 224 * 3
    y0 = 2 * m0 * 64
    stem_flop = 2 * m0 * 64 * 147
    out.append(("stem convolution + statistics", "7x7/2 3->64", stem_flop, x_bytes + y0))
    out.append(("stem weight gradient", "7x7/2 3->64", stem_flop, x_bytes + y0 + 4 * 64 * 147))
    out.append(("stem BN + ReLU + max pool, forward", "read y, write the pooled", 0, y0 + y0 // 4))
    out.append(("stem BN + ReLU + max pool, backward", "sums: read dp, y", 0, y0 + y0 // 4))
    out.append(("stem BN + ReLU + max pool, backward", "apply: read dp, y; write dy", 0,
                2 * y0 + y0 // 4))
    fwd, grad = "forward convolutions on cuDNN / cuBLASLt", "gradient convolutions on cuDNN / cuBLASLt"
    fpass, bpass = "batch-norm passes, forward", "batch-norm passes, backward"
    for l, b, c, st, cin, side in blocks():
        mi, mo = N * side * side, N * (side // st) ** 2
        tag = f"L{l}b{b}"
        f3 = 2 * mo * 9 * c * c
        # conv2 (3x3): forward with GenStats on cuDNN; weight gradient on cuDNN; data gradient
        # on cuDNN except kiln's stride-1 C >= 256 calls (the class above).
        out.append((fwd, f"{tag} conv2 3x3/{st} {c}", f3, 2 * (mi * c + mo * c + 9 * c * c)))
        out.append((grad, f"{tag} conv2 wgrad", f3, 2 * (mi * c + mo * c) + 4 * 9 * c * c))
        if not (c >= 256 and st == 1):
            out.append((grad, f"{tag} conv2 dgrad", f3, 2 * (mi * c + mo * c + 9 * c * c)))
        # conv1 (1x1, at the input's size): forward on cuDNN where C < 256.
        if c < 256:
            out.append((fwd, f"{tag} conv1 {cin}->{c}", 2 * mi * cin * c,
                        2 * (mi * cin + mi * c + cin * c)))
        if cin == 64:  # layer 1's first conv1: both gradients on cuDNN
            f1 = 2 * mi * 64 * c
            out.append((grad, f"{tag} conv1 wgrad", f1, 4 * mi * 64 + 4 * 64 * c))
            out.append((grad, f"{tag} conv1 dgrad", f1, 4 * mi * 64 + 2 * 64 * c))
        if c < 128:  # layer 1's conv3 data gradient (bn2 has C = 64: no inner form)
            out.append((grad, f"{tag} conv3 dgrad", 2 * mo * 4 * c * c,
                        2 * (mo * 4 * c + mo * c + 4 * c * c)))
        if b == 0:  # the downsample (1x1, stride st)
            fd = 2 * mo * cin * 4 * c
            if st == 2:
                out.append((fwd, f"{tag} downsample/2", fd, 2 * (mo * cin + mo * 4 * c + cin * 4 * c)))
                out.append((grad, f"{tag} downsample wgrad", fd, 2 * (mo * cin + mo * 4 * c) + 4 * cin * 4 * c))
            out.append((grad, f"{tag} downsample dgrad", fd, 2 * (mo * 4 * c + mo * cin + cin * 4 * c)))
        # Batch-norm passes (2 bytes an element). Forward: bn1 and bn2 read y and write
        # relu(bn(y)); the tail reads y3 and x (or the downsample's u), writes the block's output
        # and its mask bits.
        t4 = mo * 4 * c
        out.append((fpass, f"{tag} bn1 + ReLU", 0, 4 * mi * c))
        out.append((fpass, f"{tag} bn2 + ReLU", 0, 4 * mo * c))
        out.append((fpass, f"{tag} tail", 0, 6 * t4 + t4 // 8))
        # Backward: where a GEMM gave the sums, one apply (read g and y, write dy); else a sums
        # pass (read g and y) and the apply. The identity tail reads g, y3 and the mask and
        # writes dy3; the dual tail also reads u and writes du.
        out.append((bpass, f"{tag} tail", 0, (10 if b == 0 else 6) * t4 + t4 // 8))
        out.append((bpass, f"{tag} bn2", 0, (6 if c >= 128 else 10) * mo * c))
        out.append((bpass, f"{tag} bn1", 0, (6 if c >= 256 and st == 1 else 10) * mi * c))
    sgd = PARAMS * (4 + 2 + 4 + 4 + 4 + 2)  # read master, grad, momentum; write them and the f16
    out.append(("optimizer", "SGD, f32 master and momentum, f16 gradient and copy", 0, sgd))
    return out


def pattern_share(group, lab):
    """The share of a batch-norm pass's floor that the rest of the NormConvolution pattern removes
    at most (docs/lab/norm-conv.md, "What is left"), counted in tensors moved:
    - forward bn1 / bn2 apply (read y, write a): all of it, a prologue on the next convolution
      (its weight gradient then reads y where it read a: the same bytes);
    - a backward apply after sums from a GEMM's epilogue (read g and y, write dy; two GEMMs read
      dy: 5 tensors) with dy formed in both GEMMs' loads instead (they read g and y: 4): 1 of its
      3, and 1 of the dual tail's 5 (it also reads u and writes du);
    - a backward sums pass + apply (10 bytes an element) whose sums move into the data gradient's
      epilogue as well: 4 + 2 of 10.
    The block tails' forward stays: it is the pattern's ScaleBiasAddRelu."""
    if group == "batch-norm passes, forward":
        return 0.0 if "tail" in lab else 1.0
    if group != "batch-norm passes, backward":
        return 0.0
    l, b = int(lab[1]), int(lab[3])
    if "tail" in lab:
        return 1 / 5 if b == 0 else 1 / 3
    if "bn2" in lab:
        return 1 / 3 if l >= 2 else 0.6
    return 1 / 3 if l >= 3 and b >= 1 else 0.6  # bn1: kiln's 3x3 dgrad gives its sums there


def selected(bw, peak, keep):
    """(calls, FLOP, floor ms) of the step's other calls (step_calls) for which keep(group, label)."""
    sel = [(flop, byt) for g, lab, flop, byt in step_calls() if keep(g, lab)]
    return (len(sel), sum(f for f, _ in sel),
            sum(max(byt / bw, flop / peak) for flop, byt in sel) * 1e3)


def split_line(what, n, flop, floor, ms):
    print(f"  {what:52s} {n:3d} calls {flop / 1e9:6.0f} GFLOP  floor {floor:6.3f}  "
          f"measured {ms:6.3f}  above {ms - floor:6.3f}  {flop / (ms * 1e-3) / 1e12:4.0f} TFLOP/s")


def floor_rows(call_list, bw, peak, list_calls, widths, bound=True):
    """{group: [calls, FLOP, bytes, floor s]} of (group, label, FLOP, bytes) calls, in first-seen
    order; with list_calls each call's line too (group and label padded to widths)."""
    rows = {}
    for grp, lab, flop, byt in call_list:
        t = max(byt / bw, flop / peak)
        r = rows.setdefault(grp, [0, 0.0, 0.0, 0.0])
        r[0] += 1
        r[1] += flop
        r[2] += byt
        r[3] += t
        if list_calls:
            note = (" (memory)" if byt / bw > flop / peak else " (FLOP)") if bound else ""
            print(f"  {grp:{widths[0]}s} {lab:{widths[1]}s} {flop / 1e9:6.1f} GFLOP "
                  f"{byt / 1e6:7.1f} MB {t * 1e3:6.3f} ms{note}")
    return rows


def step_table(bw, peak, list_calls):
    """Every group of v28's step against its floor; kiln's GEMMs as one line."""
    groups = floor_rows(step_calls(), bw, peak, list_calls, (42, 28), bound=False)
    gemm_floor = sum(max(byt / bw, flop / peak) for _, _, flop, byt in calls())
    gemm_ms = sum(ms for ms, _ in MEASURED.values())
    print(f"the step's groups against their floors at {bw / 1e12:g} TB/s and {peak / 1e12:g} "
          f"TFLOP/s, batch {N}; measured: v28, one eager step under ncu")
    print(f"{'group':42s} {'calls':>5s} {'GFLOP':>6s} {'GB':>6s} {'floor ms':>8s} "
          f"{'measured':>8s} {'above':>6s}")
    print(f"{'kiln GEMMs with the BN (the table above)':42s} {'':5s} {'':6s} {'':6s} "
          f"{gemm_floor * 1e3:8.3f} {gemm_ms:8.3f} {gemm_ms - gemm_floor * 1e3:6.3f}")
    tf, tm = gemm_floor * 1e3, gemm_ms
    for grp, (n, flop, byt, t) in groups.items():
        ms, mc = MEASURED_STEP[grp]
        tf += t * 1e3
        tm += ms
        note = "" if mc == n else f"  (profile: {mc} calls)"
        print(f"{grp:42s} {n:5d} {flop / 1e9:6.0f} {byt / 1e9:6.2f} {t * 1e3:8.3f} {ms:8.3f} "
              f"{ms - t * 1e3:6.3f}{note}")
    rest = STEP_NCU_MS - tm - SMALL_MS
    print(f"{'kernels under 5 µs (no floor counted)':42s} {164:5d} {'':6s} {'':6s} {SMALL_MS:8.3f} "
          f"{SMALL_MS:8.3f} {0:6.3f}")
    print(f"{'the rest (loss, counters, others; as measured)':42s} {'':5s} {'':6s} {'':6s} "
          f"{rest:8.3f} {rest:8.3f} {0:6.3f}")
    tf += SMALL_MS + rest
    tm += SMALL_MS + rest
    print(f"{'the step':42s} {'':5s} {'':6s} {'':6s} {tf:8.3f} {tm:8.3f} {tm - tf:6.3f}")
    fwd = sum(max(byt / bw, flop / peak) * pattern_share(g, lab)
              for g, lab, flop, byt in step_calls() if g.endswith("forward")) * 1e3
    bwd = sum(max(byt / bw, flop / peak) * pattern_share(g, lab)
              for g, lab, flop, byt in step_calls() if g.endswith("backward")) * 1e3
    print(f"the rest of the NormConvolution pattern, at most and free of cost to the GEMMs: "
          f"forward prologues -{fwd:.3f}, backward -{bwd:.3f}; the step's floor then "
          f"{tf - fwd - bwd:.3f} ms")
    print("cuDNN's convolutions by kind (the kernels' mapping to calls inferred: see CUDNN_SPLIT)")
    for grp, pred, what, ms in CUDNN_SPLIT:
        split_line(what, *selected(bw, peak, lambda g, lab: g == grp and pred(lab)), ms)
    print("the GenStats calls split by v23's call U (KILN_CONV3X3 off and on; see GENSTATS_SPLIT_V23)")
    fwd_group = "forward convolutions on cuDNN / cuBLASLt"
    for pred, what, n, ms in GENSTATS_SPLIT_V23:
        count, flop, floor = selected(bw, peak, lambda g, lab: g == fwd_group and pred(lab))
        # Fewer calls measured than the group has (all of one shape): the floor scaled.
        share = n / count
        split_line(what, n, flop * share, floor * share, ms)


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


# v43's kiln GEMM classes and the kernel each runs on (ncu's short names: the
# dgrad1x1_bn_sums_wgmma_kernel template's twelve flags, or wgrad1x1_wgmma_kernel's four).
V43_KERNELS = {
    "1x1 forward + statistics": r"dgrad1x1_bn_sums_wgmma_kernel<1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0>",
    "1x1 weight gradient": r"wgrad1x1_wgmma_kernel<(64|128), 0, 0, 0>",
    "1x1 weight gradient + the fold's Gram and sums": r"wgrad1x1_wgmma_kernel<(64|128), 0, 1, 1>",
    "tail data gradient + sums": r"dgrad1x1_bn_sums_wgmma_kernel<1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0>",
    "dual tail data gradient + sums": r"dgrad1x1_bn_sums_wgmma_kernel<1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 0>",
    "inner bn2 data gradient + sums": r"dgrad1x1_bn_sums_wgmma_kernel<1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0>",
    "inner bn2, folded: t inside": r"dgrad1x1_bn_sums_wgmma_kernel<1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1>",
    "3x3 data gradient + bn1 sums": r"dgrad1x1_bn_sums_wgmma_kernel<1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0>",
}
FOLD_MIN = 20_000_000  # KILN_TAIL_FOLD_MIN's default: elements of conv3's input


def calls_v43(fold_min=FOLD_MIN):
    """calls() as v43 runs them at batch 256: (class, label, FLOP executed, bytes); fold_min is
    KILN_TAIL_FOLD_MIN."""
    out = []
    bl = list(blocks())
    for i, (l, b, c, st, cin, side) in enumerate(bl):
        m_in, m_out = N * side * side, N * (side // st) ** 2
        tag = f"L{l}b{b}"
        folded = m_out * c >= fold_min  # conv3's input, M x C
        fwd = [(f"{tag} conv3 {c}->{4 * c}", m_out, c, 4 * c)]
        if c >= 128:  # KILN_STATS_MIN_C=128 since v33: layer 2's conv1s too
            fwd.append((f"{tag} conv1 {cin}->{c}", m_in, cin, c))
        if b == 0 and st == 1:
            fwd.append((f"{tag} downsample {cin}->{4 * c}", m_out, cin, 4 * c))
        out += forward_1x1_calls(fwd)
        # Weight gradients: where conv3 folds (and layer 1's stride-1 shortcut with it), the
        # kernel also forms x's Gram (K x K) and its sums from the same loads.
        wg = [(f"{tag} conv1", m_in, cin, c, False)] if cin > 64 else []
        wg.append((f"{tag} conv3", m_out, c, 4 * c, folded))
        if b == 0 and st == 1:
            wg.append((f"{tag} downsample", m_out, cin, 4 * c, folded))
        for lab, m, k, n, gram in wg:
            cls = "1x1 weight gradient + the fold's Gram and sums" if gram else "1x1 weight gradient"
            out.append((cls, lab, 2 * m * k * n + (2 * m * k * k if gram else 0),
                        2 * m * (k + n) + 4 * k * n + (4 * k * k if gram else 0)))
        # bn2's data gradient with its sums: unfolded, conv3's data gradient (read dy3 and y2,
        # write g); folded, A = (g | a2) against (a * w3 ; m2^T) with y2 read for the mask and
        # the sums. Layer 1 (C = 64) runs on row pairs: (M/2) x 128 with B block-diagonal, so
        # twice the FLOP for the same bytes.
        if folded:
            pairs = 2 if c == 64 else 1
            out.append(("inner bn2, folded: t inside", tag, 2 * m_out * 5 * c * c * pairs,
                        2 * (m_out * 4 * c + 3 * m_out * c) + 2 * 5 * c * c * pairs * pairs))
        elif c >= 128:
            out.append(("inner bn2 data gradient + sums", tag, 2 * m_out * 4 * c * c,
                        2 * (m_out * 4 * c + 2 * m_out * c) + 2 * 4 * c * c))
        if c >= 128 and st == 1:
            out.append(("3x3 data gradient + bn1 sums", tag, 2 * m_out * 9 * c * c,
                        2 * (3 * m_out * c + 9 * c * c)))
        if i + 1 < len(bl):
            out.append(tail_call(bl, i))
    return out


# v45's: the GEMM template took a thirteenth flag (kSub2), kiln's 3x3 forward with statistics runs
# on the stride-1 3x3 forwards of at most 12,544 rows (v44: layer 4's two at b256), and the tails
# before a downsample block read the shortcut's compact data gradient (kSub2, v45).
V45_KERNELS = {cls: pat[:-1] + ", 0>" if pat.startswith("dgrad1x1") else pat
               for cls, pat in V43_KERNELS.items()}
V45_KERNELS["tail data gradient + sums, r compact"] = (
    r"dgrad1x1_bn_sums_wgmma_kernel<1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1>")
V45_KERNELS["3x3 forward + statistics"] = (
    r"dgrad1x1_bn_sums_wgmma_kernel<1, 0, 0, 1, 0, [01], 0, 1, 0, [01], 0, 0, 0>")
# Where conv3's input has neither 64 nor 128 channels (layer 3's 256, folded since v44), x's Gram
# does not fit the weight gradient's one β-tile: that kernel takes Σx alone (kSumB, no kGram) and
# the Gram is a plain 1x1 weight gradient of x against itself (cuda/kernels/tail_fold.cu).
V45_KERNELS["1x1 weight gradient + the fold's sums"] = r"wgrad1x1_wgmma_kernel<(64|128), 0, 1, 0>"
FOLD_MIN_V44 = 10_000_000  # KILN_TAIL_FOLD_MIN's default since v44
CONV3X3_ROWS_V44 = 12_544  # KILN_CONV3X3_ROWS's default since v44


def calls_v45():
    """calls_v43() as v45 runs them at batch 256: layer 3 folds too (10^7), layer 4's stride-1 3x3
    forwards on kiln's implicit GEMM, and the tails before a downsample block read r compact,
    (N, H/2, W/2, 4C): a quarter of r's bytes."""
    base = calls_v43(FOLD_MIN_V44)
    bl = list(blocks())
    at = {f"L{l}b{b}": i for i, (l, b, *_) in enumerate(bl)}
    out = []
    for cls, lab, flop, byt in base:
        if cls == "1x1 weight gradient + the fold's Gram and sums":
            _, _, c, st, cin, side = bl[at[lab.split()[0]]]
            m = N * (side // st) ** 2
            k, n = (cin, 4 * c) if lab.endswith("downsample") else (c, 4 * c)
            if k not in (64, 128):
                out.append(("1x1 weight gradient + the fold's sums", lab, 2 * m * k * n,
                            2 * m * (k + n) + 4 * k * n))
                out.append(("1x1 weight gradient", f"{lab} x's Gram", 2 * m * k * k,
                            2 * m * 2 * k + 4 * k * k))
                continue
        if cls == "tail data gradient + sums":
            i = at[lab.split()[0]]
            if bl[i + 1][1] == 0:  # the next block is a downsample block: its shortcut's r
                _, _, c, st, _, side = bl[i]
                m = N * (side // st) ** 2
                cls, byt = "tail data gradient + sums, r compact", byt - 2 * (m * 4 * c * 3 // 4)
        out.append((cls, lab, flop, byt))
    for l, b, c, st, cin, side in bl:
        m = N * (side // st) ** 2
        if st == 1 and m <= CONV3X3_ROWS_V44:
            # read x and w, write y (the statistics' partials are small)
            out.append(("3x3 forward + statistics", f"L{l}b{b} conv2 {c}->{c}", 2 * m * 9 * c * c,
                        2 * (2 * m * c + 9 * c * c)))
    return out


def ncu_table(path, bw, peak, list_calls):
    """kiln's GEMM classes against their floors, measured from an ncu step profile: v43's
    structure, or v45's where the profile's GEMM kernel names carry thirteen template flags."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ncu_step_summary import read_kernels  # noqa: E402
    kernels = read_kernels(path)
    v45 = any(re.search(r"dgrad1x1_bn_sums_wgmma_kernel<(\d, ){12}\d>", k["name"])
              for k in kernels)
    table, structure, version = (V45_KERNELS, calls_v45, "v45") if v45 else (
        V43_KERNELS, calls_v43, "v43")
    measured = {}
    for cls, pat in table.items():
        ks = [k for k in kernels if re.search(pat, k["name"])]
        measured[cls] = (len(ks), sum(k["ns"] for k in ks) * 1e-6,
                         sum(k["bytes"] or 0.0 for k in ks))
    rows = floor_rows(structure(), bw, peak, list_calls, (46, 30))
    print(f"{version}'s kiln GEMMs: floors at {bw / 1e12:g} TB/s and {peak / 1e12:g} TFLOP/s, batch {N}; "
          f"measured: {os.path.basename(path)}")
    print(f"{'class':46s} {'calls':>5s} {'GFLOP':>6s} {'GB':>6s} {'DRAM GB':>7s} {'floor ms':>8s} "
          f"{'measured':>8s} {'above':>6s} {'TFLOP/s':>7s} {'TB/s':>5s}")
    tf = tm = 0.0
    for cls, (n, flop, byt, t) in rows.items():
        mc, ms, mb = measured[cls]
        tf += t * 1e3
        tm += ms
        note = "" if mc == n else f"  (profile: {mc} calls)"
        rate = f"{flop / (ms * 1e-3) / 1e12:7.0f} {byt / (ms * 1e-3) / 1e12:5.2f}" if ms else ""
        print(f"{cls:46s} {n:5d} {flop / 1e9:6.0f} {byt / 1e9:6.2f} {mb / 1e9:7.2f} "
              f"{t * 1e3:8.3f} {ms:8.3f} {ms - t * 1e3:6.3f} {rate}{note}")
    print(f"{'all':46s} {'':5s} {'':6s} {'':6s} {'':7s} {tf:8.3f} {tm:8.3f} {tm - tf:6.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bw", type=float, default=4.0, help="TB/s (default 4.0)")
    ap.add_argument("--peak", type=float, default=660.0, help="TFLOP/s (default 660)")
    ap.add_argument("--calls", action="store_true", help="also list every call")
    ap.add_argument("--fit", action="store_true", help="the 1x1 forward's per-tile line only")
    ap.add_argument("--step", action="store_true", help="the whole step's groups, kiln's GEMMs as one")
    ap.add_argument("--ncu", metavar="CSV", help="v43's kiln GEMMs, measured from this ncu profile")
    a = ap.parse_args()
    if not (a.bw > 0 and a.peak > 0):  # NaN too
        ap.error(f"--bw and --peak must be positive (got {a.bw:g} and {a.peak:g})")
    if a.ncu:
        ncu_table(a.ncu, a.bw * 1e12, a.peak * 1e12, a.calls)
        return
    if a.fit:
        tile_fit()
        return
    bw, peak = a.bw * 1e12, a.peak * 1e12
    if a.step:
        step_table(bw, peak, a.calls)
        return
    rows = floor_rows(calls(), bw, peak, a.calls, (32, 34))
    print(f"floors at {a.bw:g} TB/s and {a.peak:g} TFLOP/s, batch {N}; measured: v28, in situ")
    print(f"{'class':32s} {'calls':>5s} {'GFLOP':>6s} {'GB':>6s} {'floor ms':>8s} "
          f"{'measured':>8s} {'above':>6s} {'TFLOP/s':>7s} {'TB/s':>5s}")
    tf = tm = 0.0
    for cls, (n, flop, byt, t) in rows.items():
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
