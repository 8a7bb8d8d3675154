#!/usr/bin/env python3
# Emulates the index math of the stem forward with A read from the patch by descriptor
# (docs/lab/stem/stem-forms.patch, KILN_STEM_A_SMEM): the no-swizzle K-major descriptor (core
# matrix (m/8, k/8) at start + (m/8)·stride + (k/8)·leading, its row m%8 at 16 bytes a row; the
# convention tools/bench/wgmma_desc_probe.cu confirmed on an H100, overlapping core matrices
# included), the two wgmmas per k16 step, wgmma's accumulator fragments, and the accessor that
# hands them to store_tile. Checks, for tiles with and without borders: every A read lies inside
# the patch; the result equals a direct convolution; and store_tile receives each (pixel,
# channel) value at the same (mi, j, q) slot of the same thread as from the register form, so
# it rounds, sums and writes in the same order. Hardware semantics are modelled, not run.
try:
    import numpy as np
except ImportError as e:
    raise SystemExit(f"stem_a_smem_emu: needs numpy ({e}); apt-get install python3-numpy") from None

rng = np.random.default_rng(1)
kTileH, kTileW, kPatchH, kPatchW, kK = 8, 16, 21, 38, 224
kSteps = kK // 16
kARowPairBytes = 2 * kPatchW * 8  # the descriptor's stride: 608


def tile_case(H, W, oh0, ow0):
    x = rng.standard_normal((H, W, 3))
    w = rng.standard_normal((64, 3, 7, 7))
    patch = np.zeros((kPatchH * kPatchW, 4))
    for i in range(kPatchH * kPatchW):
        ih, iw = 2 * oh0 - 3 + i // kPatchW, 2 * ow0 - 3 + i % kPatchW
        if 0 <= ih < H and 0 <= iw < W:
            patch[i, :3] = x[ih, iw]
    halves = patch.reshape(-1)  # pixel p at halves 4p..4p+3 (8 bytes)
    ref = np.zeros((kTileH, kTileW, 64))
    for r in range(kTileH):
        for c in range(kTileW):
            for kh in range(7):
                for kw in range(7):
                    ih, iw = 2 * (oh0 + r) - 3 + kh, 2 * (ow0 + c) - 3 + kw
                    if 0 <= ih < H and 0 <= iw < W:
                        ref[r, c] += w[:, :, kh, kw] @ x[ih, iw]
    # B of step s, K-major (the weight's k = kh·32 + kw·4 + c): as the kernel's boxes hold it.
    def B(s):
        out = np.zeros((16, 64))
        for kk in range(16):
            k = 16 * s + kk
            kh, kw, c = k >> 5, (k >> 2) & 7, k & 3
            if k < kK and kw < 7 and c < 3:
                out[kk] = w[:, c, kh, kw]
        return out

    max_byte = 0

    def A_desc(start):  # 64 × 16 from a no-swizzle K-major descriptor, leading 16, stride 608
        nonlocal max_byte
        A = np.zeros((64, 16))
        for m in range(64):
            for k in range(16):
                byte = start + (m // 8) * kARowPairBytes + (k // 8) * 16 + (m % 8) * 16 + (k % 8) * 2
                assert byte % 2 == 0 and byte >= 0
                max_byte = max(max_byte, byte + 2)
                A[m, k] = halves[byte // 2]
        return A

    D = [np.zeros((64, 64)), np.zeros((64, 64))]
    for s in range(kSteps):
        kh, kw0 = s >> 1, (s & 1) * 4
        for mi in range(2):
            start = (kh * kPatchW + 16 * mi + kw0) * 8
            assert start % 16 == 0, "a descriptor's start is a 16-byte multiple"
            D[mi] += A_desc(start) @ B(s)
    assert max_byte <= kPatchH * kPatchW * 8, "A reads past the patch"

    # The register form's accumulators, as the kernel has them: wgmma mi of warp w holds output
    # row 2w + mi, columns 0-15 in its rows 16w.. (docs/lab/stem/stem_wgmma_emu.py checks that).
    def rs_value(warp, mi, j, q, lane):
        gq, tq = lane >> 2, lane & 3
        row, col, ch = 2 * warp + mi, gq + 8 * (q >> 1), 8 * j + 2 * tq + (q & 1)
        return ref[row, col, ch], (row, col, ch)

    # The descriptor form's fragments: d[mi][4j + q] is D[mi] row 16w + gq + 8(q>>1), column
    # 8j + 2tq + (q&1); A row m is output row m // 8, column 8·mi + m % 8.
    def smem_frag(warp, lane, mi, idx):
        gq, tq = lane >> 2, lane & 3
        j, q = idx >> 2, idx & 3
        m = 16 * warp + gq + 8 * (q >> 1)
        return D[mi][m, 8 * j + 2 * tq + (q & 1)], (m // 8, 8 * mi + m % 8, 8 * j + 2 * tq + (q & 1))

    for warp in range(4):
        for lane in range(32):
            for r in range(2):  # store_tile's mi: output row 2w + r
                for j in range(8):
                    for q in range(4):  # store_tile's q: column half q >> 1, channel pair q & 1
                        # the accessor of the patch: d[q >> 1][4j + 2r + (q & 1)]
                        v, where = smem_frag(warp, lane, q >> 1, 4 * j + 2 * r + (q & 1))
                        want, want_where = rs_value(warp, r, j, q, lane)
                        assert where == want_where, (warp, lane, r, j, q, where, want_where)
                        assert abs(v - want) < 1e-9 * max(1.0, abs(want)), (v, want)
    err = max(np.abs(D[mi][m, :] - ref[m // 8, 8 * mi + m % 8]).max()
              for mi in range(2) for m in range(64))
    return err, max_byte


for H, W, oh0, ow0 in [(24, 40, 0, 16), (32, 32, 8, 0), (224, 224, 104, 96), (31, 63, 8, 16)]:
    err, top = tile_case(H, W, oh0, ow0)
    print(f"input {H}x{W}, tile ({oh0}, {ow0}): max |D - direct convolution| {err:.2e}; "
          f"A reads bytes 0..{top} of the patch's {kPatchH * kPatchW * 8}; store_tile's slots match")
