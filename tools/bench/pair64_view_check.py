#!/usr/bin/env python3
"""The row-pair view of KILN_DGRAD_PAIR64 (docs/lab/norm-conv/dgrad-pair64.patch), checked in f64.

An NHWC activation of 64 channels is an M x 64 matrix whose rows 2i and 2i + 1 lie side by side,
so it is also an (M/2) x 128 matrix. The patch runs kiln's 128-column data-gradient GEMM on such
views: g (M x K) as (M/2) x 2K, B = w twice on the diagonal (block_diag2_kernel), the fold's
second product a2 · m2ᵀ the same way with B packed along K as pack_split_b_kernel lays it, the
bias repeated (repeat2_kernel), and the batch norm's two sums per view column added in column
pairs c and 64 + c (fold_pair_partial_kernel). This emulates those index maps on small random
matrices and prints the largest difference from the direct computation.

    python3 tools/bench/pair64_view_check.py      (needs numpy)
"""
import sys

try:
    import numpy as np
except ImportError as e:
    sys.exit(f"pair64_view_check: needs numpy ({e}); apt-get install python3-numpy")


def block_diag2(x, r, cc):
    """block_diag2_kernel: out (2r x 2cc) = x (r x cc) on the diagonal, zeros elsewhere."""
    out = np.zeros((2 * r, 2 * cc))
    for i in range(2 * r):
        for j in range(2 * cc):
            if (i >= r) == (j >= cc):
                out[i, j] = x[i % r, j % cc]
    return out


def main():
    rng = np.random.default_rng(0)
    m, k, c, c2 = 10, 6, 4, 4  # c plays 64
    g = rng.standard_normal((m, k))
    w = rng.standard_normal((k, c))
    a2 = rng.standard_normal((m, c2))
    m2t = rng.standard_normal((c, c2))
    b = rng.standard_normal(c)
    x = rng.standard_normal((m, c))
    direct = g @ w + a2 @ m2t.T + b
    mean = x.mean(0)
    s1, s2 = direct.sum(0), (direct * (x - mean)).sum(0)

    mv = m // 2
    wp, w2p = block_diag2(w, k, c), block_diag2(m2t, c, c2)
    k1 = 2 * k
    # pack_split_b_kernel, N-major: element (k, col) is wp's below k1, else w2p (col, k - k1).
    bmat = np.array([[wp[kk, cc] if kk < k1 else w2p[cc, kk - k1] for cc in range(2 * c)]
                     for kk in range(k1 + 2 * c2)])
    a = np.concatenate([g.reshape(mv, 2 * k), a2.reshape(mv, 2 * c2)], axis=1)
    view = a @ bmat + np.tile(b, 2)
    s1v = view.sum(0)
    s2v = (view * (x.reshape(mv, 2 * c) - np.tile(mean, 2))).sum(0)
    print(f"data gradient: {np.abs(view.reshape(m, c) - direct).max():.1e}")
    print(f"sums, column pairs added: {np.abs(s1v[:c] + s1v[c:] - s1).max():.1e}, "
          f"{np.abs(s2v[:c] + s2v[c:] - s2).max():.1e}")


if __name__ == "__main__":
    main()
