#!/usr/bin/env python3
"""The stem pool's backward sums two ways, in numpy (docs/lab/stem.md, "The pool's backward sums
over its outputs"): over every input pixel from g rebuilt and rounded to f16 as
max_pool2d_backward stores it (the composition, and pool_relu_sums_kernel), and over the pool's
outputs from x at each maximum (KILN_STEM_POOL_AT_MAX). Both sums in float64 here, so what
differs is only the f16 rounding of g where one pixel is the maximum of several windows.
Prints how often that happens and the relative difference of Σg and Σg·(x − mean) per channel.

  python3 docs/lab/stem/pool_sums_emu.py [--n 4] [--hw 112] [--c 64] [--seed 0]
"""
import argparse

try:
    import numpy as np
except ImportError as e:
    raise SystemExit(f"pool_sums_emu: needs numpy ({e}); apt-get install python3-numpy") from None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--hw", type=int, default=112)
    ap.add_argument("--c", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    N, C, H = a.n, a.c, a.hw
    W = H
    OH = (H - 1) // 2 + 1
    OW = (W - 1) // 2 + 1
    x = (rng.standard_normal((N, H, W, C)) + 0.3).astype(np.float16)  # NHWC, as the stem's y
    mean = x.astype(np.float64).mean(axis=(0, 1, 2)).astype(np.float32)
    invstd = (1.0 / np.sqrt(x.astype(np.float64).var(axis=(0, 1, 2)) + 1e-5)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, C).astype(np.float32)
    scale = (gamma * invstd).astype(np.float32)
    shift = (beta - mean * scale).astype(np.float32)
    # relu(x·scale + shift) rounded to f16, what the forward compares (fma as two roundings here:
    # the rare last-bit difference does not matter for this count).
    z = x.astype(np.float32) * scale + shift
    act = np.maximum(z, 0).astype(np.float16)
    # The 3x3/2 pad-1 max pool: first position wins ties (strictly greater takes over).
    pad = np.full((N, H + 2, W + 2, C), -np.inf, np.float32)
    pad[:, 1:H + 1, 1:W + 1] = act.astype(np.float32)
    best = np.full((N, OH, OW, C), -np.inf, np.float32)
    arg = np.zeros((N, OH, OW, C), np.int64)
    for k in range(9):
        kh, kw = divmod(k, 3)
        v = pad[:, kh:kh + 2 * OH - 1:2, kw:kw + 2 * OW - 1:2]
        grew = v > best
        best = np.where(grew, v, best)
        arg = np.where(grew, k, arg)
    dy = rng.standard_normal((N, OH, OW, C)).astype(np.float16)
    oh = np.arange(OH)[None, :, None, None]
    ow = np.arange(OW)[None, None, :, None]
    h = 2 * oh - 1 + arg // 3
    w = 2 * ow - 1 + arg % 3
    nn = np.arange(N)[:, None, None, None]
    cc = np.arange(C)[None, None, None, :]
    # The composition: the pool's gradient at each pixel, summed over windows then rounded to f16.
    gsum = np.zeros((N, H, W, C), np.float64)
    hits = np.zeros((N, H, W, C), np.int64)
    np.add.at(gsum, (nn, h, w, cc), dy.astype(np.float64))
    np.add.at(hits, (nn, h, w, cc), 1)
    g = gsum.astype(np.float16).astype(np.float64)
    active = z > 0
    g = np.where(active, g, 0.0)
    xm = x.astype(np.float64) - mean.astype(np.float64)
    s1_x = g.sum(axis=(0, 1, 2))
    s2_x = (g * xm).sum(axis=(0, 1, 2))
    # Over the outputs, from x at each maximum.
    at_max = x[nn, h, w, cc]
    act_o = (at_max.astype(np.float32) * scale + shift) > 0
    go = np.where(act_o, dy.astype(np.float64), 0.0)
    s1_o = go.sum(axis=(0, 1, 2))
    s2_o = (go * (at_max.astype(np.float64) - mean.astype(np.float64))).sum(axis=(0, 1, 2))
    # gpu_test_batch_norm_act's bound on the difference (check_pool_param_grads): each pixel's
    # f16 rounding is at most 2^-11 of its windows' summed |dy|.
    u = 2.0 ** -11
    dabs = np.abs(dy.astype(np.float64)).sum(axis=(0, 1, 2))
    xdev = np.abs(xm).max(axis=(0, 1, 2))
    bound1, bound2 = u * dabs, u * dabs * xdev
    shared = (hits > 1).sum() / max((hits > 0).sum(), 1)
    print(f"N {N}, {H}x{W}, C {C}: {(hits > 0).sum()} pixels are a maximum, {shared:.1%} of them of "
          f"more than one window")
    for name, p, q, b in (("sum g", s1_o, s1_x, bound1), ("sum g*(x - mean)", s2_o, s2_x, bound2)):
        scale_abs = np.abs(p).max()
        print(f"{name}: max |outputs - pixels| {np.abs(p - q).max():.3e} "
              f"(largest |sum| {scale_abs:.3e}; relative {np.abs(p - q).max() / scale_abs:.2e}); "
              f"largest share of the test's bound {(np.abs(p - q) / b).max():.3f}")


if __name__ == "__main__":
    main()
