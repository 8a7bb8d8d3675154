#!/usr/bin/env python3
# Emulates the index math of cuda/kernels/stem_conv_wgmma.cu (one tile of each kernel) with numpy:
# ldmatrix row addresses, fragment placement, the swizzled weight / dy addressing, the K mapping
# and the partial layout, against a direct convolution. Hardware semantics are modelled, not run.
try:
    import numpy as np
except ImportError as e:
    raise SystemExit(f"stem_wgmma_emu: needs numpy ({e}); apt-get install python3-numpy") from None
rng = np.random.default_rng(0)
kCout, kKh, kTileH, kTileW, kPatchH, kPatchW, kK = 64, 7, 8, 16, 21, 38, 224
H, W = 24, 40; OH, OW = (H - 1)//2 + 1, (W - 1)//2 + 1
x = rng.standard_normal((H, W, 3)).astype(np.float32)
w = rng.standard_normal((64, 3, 7, 7)).astype(np.float32)
oh0, ow0 = 0, 16  # tile with a border
patch = np.zeros((kPatchH * kPatchW, 4), np.float32)
for i in range(kPatchH * kPatchW):
    ih, iw = 2*oh0 - 3 + i // kPatchW, 2*ow0 - 3 + i % kPatchW
    if 0 <= ih < H and 0 <= iw < W: patch[i, :3] = x[ih, iw]
patch_flat = patch.reshape(-1)  # halves; pixel p at halves 4p..4p+3 (8 bytes)
def ld8(byte_addr):  # 8 halves at a byte address of the patch
    h = byte_addr // 2; return patch_flat[h:h+8]
# reference conv for the tile
ref = np.zeros((kTileH, kTileW, 64), np.float32)
for r in range(kTileH):
    for c in range(kTileW):
        for kh in range(7):
            for kw in range(7):
                ih, iw = 2*(oh0+r) - 3 + kh, 2*(ow0+c) - 3 + kw
                if 0 <= ih < H and 0 <= iw < W: ref[r, c] += w[:, :, kh, kw] @ x[ih, iw]
# ---- forward: weight smem, swizzled boxes
wsm = np.zeros(4 * 8192 // 2, np.float32)
for n in range(64):
    for k in range(256):
        kh, kw, c = k >> 5, (k >> 2) & 7, k & 3
        v = w[n, c, kh, kw] if (k < kK and kw < 7 and c < 3) else 0.0
        addr = (k >> 6)*8192 + n*128 + ((((k & 63) >> 3) ^ (n & 7)) << 4) + (k & 7)*2
        wsm[addr // 2] = v
def swz(addr): return addr ^ (((addr >> 7) & 7) << 4)
def B_kmajor(s):  # 16 x 64 from the descriptor at box s>>2, +32 bytes per (s&3)
    B = np.zeros((16, 64), np.float32)
    for k in range(16):
        for n in range(64):
            addr = (s >> 2)*8192 + n*128 + (s & 3)*32 + k*2
            B[k, n] = wsm[swz(addr) // 2]
    return B
out = np.zeros((kTileH, kTileW, 64), np.float32)
for warp in range(4):
    for mi in range(2):
        D = np.zeros((16, 64), np.float32)
        for s in range(kK // 16):
            A = np.zeros((16, 16), np.float32)
            for lane in range(32):
                lj, lr = lane >> 3, lane & 7
                kh, kw0 = s >> 1, (s & 1)*4 + 2*(lj >> 1)
                row, col = 2*(warp*2 + mi) + kh, 2*(lr + 8*(lj & 1)) + kw0
                vals = ld8((row*kPatchW + col)*8)
                # matrix lj row lr: m0 rows0-7 k0-7, m1 rows8-15 k0-7, m2 rows0-7 k8-15, m3 rows8-15 k8-15
                rr = lr + 8*(lj & 1); kk = 8*(lj >> 1)
                A[rr, kk:kk+8] = vals
            D += A @ B_kmajor(s)
        out[warp*2 + mi] = D  # warp's 16 rows = output row 2w+mi, columns 0..15
print("forward max err", np.abs(out - ref).max())
# ---- weight gradient: dW (64, 224) partial for this tile
dy = rng.standard_normal((kTileH*kTileW, 64)).astype(np.float32)  # pixel p = r*16 + c
refw = np.zeros((64, kK), np.float32)
for p in range(128):
    r, c = p >> 4, p & 15
    for kh in range(7):
        for kw in range(8):
            pix = (2*r + kh)*kPatchW + 2*c + kw
            for ch in range(4):
                refw[:, kh*32 + kw*4 + ch] += dy[p] * patch[pix, ch]
sdy = np.zeros(128*64, np.float32)
for pix in range(128):
    for chunk in range(8):
        for e in range(8): sdy[(pix*128 + ((chunk ^ (pix & 7)) << 4) + e*2)//2] = dy[pix, chunk*8 + e]
def B_nmajor(r):
    B = np.zeros((16, 64), np.float32)
    for k in range(16):
        for n in range(64):
            B[k, n] = sdy[swz(r*2048 + k*128 + n*2)//2]
    return B
part = np.full((64, kK), np.nan, np.float32)
for warp in range(4):
    for t in range(4):
        k0 = 64*t + 16*warp; kh = min(k0 >> 5, kKh - 1); kw0 = (k0 & 31) >> 2
        D = np.zeros((16, 64), np.float32)
        for r in range(kTileH):
            A = np.zeros((16, 16), np.float32)  # rows = K (kernel pos) of the warp, cols = pixels
            for lane in range(32):
                lj, lr = lane >> 3, lane & 7
                a_off = kh*kPatchW + 2*(lr + 8*(lj >> 1)) + kw0 + 2*(lj & 1)
                vals = ld8((a_off + 2*r*kPatchW)*8)  # stored row: pixel lr + 8(lj>>1), 8 halves = M
                # .trans: fragment A[m][k] = stored[k][m]; matrix lj: m0 M0-7 K0-7, m1 M8-15 K0-7, m2 M0-7 K8-15, m3 M8-15 K8-15
                mm = 8*(lj & 1); kk = 8*(lj >> 1) + lr
                A[mm:mm+8, kk] = vals
            D += A @ B_nmajor(r)
        for m in range(16):
            k = 64*t + 16*warp + m
            if k < kK: part[:, k] = D[m]
print("wgrad max err", np.nanmax(np.abs(part - refw)), "unset", np.isnan(part).sum())
