#!/usr/bin/env python3
"""What the 3x3 weight gradient's split model predicts for ResNet-50's stride-1 3x3s at a batch.

The model is `wgrad3x3_parts` in cuda/kernels/wgrad1x1_wgmma.cu once
docs/lab/norm-conv/wgrad3x3.patch is applied: over 1..min(KT, 64) parts per 128 x 128 tile, the
rounds of CTAs times each CTA's k-steps at an SM's share of 600 TFLOP/s, plus the partial rows'
traffic (written, then read by the finish) at 3 TB/s. Prints, per layer, the parts it picks, the
waves, its time and cuDNN's at 486 TFLOP/s (the weight gradients' rate in v28's profile,
docs/performance.md). Arithmetic on the host code's formula, not a measurement:
    python3 tools/bench/wgrad3x3_parts_model.py [--batch 256] [--sms 132]
"""
import argparse


def parts(tiles, kt, bn, sms):
    kstep = 2.0 * 128 * bn * 64 / (600e12 / sms)
    part = 2.0 * 128 * bn * 4 / 3e12
    best = None
    for p in range(1, min(kt, 64) + 1):
        ctas = tiles * p
        t = -(-ctas // sms) * -(-kt // p) * kstep + ctas * part
        if best is None or t < best[1]:
            best = (p, t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sms", type=int, default=132)
    a = ap.parse_args()
    if a.batch < 1 or a.sms < 1:
        ap.error(f"--batch and --sms must be 1 or more (got {a.batch} and {a.sms})")
    net = 0.0
    for name, c, hw, calls in (("layer 2", 128, 28, 3), ("layer 3", 256, 14, 5), ("layer 4", 512, 7, 2)):
        m = a.batch * hw * hw
        kt = -(-m // 64)
        tiles = (c // 128) * (9 * c // 128)
        p, t = parts(tiles, kt, 128, a.sms)
        cudnn = 2.0 * m * c * 9 * c / 486e12
        net += calls * (t - cudnn)
        print(f"{name}: {calls} calls, {tiles} tiles, {kt} k-steps; {p} parts, "
              f"{-(-tiles * p // a.sms)} waves: {t * 1e6:.0f} us a call (cuDNN at 486: {cudnn * 1e6:.0f})")
    print(f"net over the ten calls: {net * 1e3:+.3f} ms")


if __name__ == "__main__":
    main()
