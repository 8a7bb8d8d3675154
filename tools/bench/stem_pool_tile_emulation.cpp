// The stem pool's two CUDA kernels' comparison logic, emulated on the CPU (docs/lab/stem.md, v28):
// relu_max_pool_k3s2_kernel's per-channel compare (a strictly greater f16 key takes over, the
// first valid position starts) against relu_max_pool_k3s2_tiled_kernel's two channels a word
// (max.u16x2 and the "grew" lane mask), on random images with ties, ±0, ±inf and NaN and
// negative, zero and positive scales. Prints how many output vectors differ (0 expected). Not
// built by CMake:
//   g++ -O2 -std=c++20 -ffp-contract=off tools/bench/stem_pool_tile_emulation.cpp -o /tmp/spe
//   /tmp/spe
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
static uint16_t f2h(float a) { _Float16 h = (_Float16)a; uint16_t b; memcpy(&b, &h, 2); return b; }
static float relu_keep_nan(float v) { return v < 0.f ? 0.f : v; }
static unsigned vmaxu2(unsigned a, unsigned b) {
  unsigned lo = std::max(a & 0xffff, b & 0xffff), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
static unsigned nonzero_lanes(unsigned d) { return (((d + 0x7fff7fffu) & 0x80008000u) >> 15) * 0xffffu; }
static unsigned byte_perm(unsigned x, unsigned y, unsigned s) {
  uint8_t b[8]; memcpy(b, &x, 4); memcpy(b + 4, &y, 4);
  unsigned r = 0; for (int i = 0; i < 4; ++i) r |= unsigned(b[(s >> (4 * i)) & 7]) << (8 * i);
  return r;
}
int main() {
  uint32_t state = 7;
  auto next = [&] { state = state * 1664525u + 1013904223u; return state >> 8; };
  const float special[] = {0.f, -0.f, INFINITY, -INFINITY, NAN, 1.f, -1.f, 0.5f};
  int bad = 0, total = 0;
  for (int trial = 0; trial < 200; ++trial) {
    int H = 1 + next() % 20, W = 1 + next() % 20, C = 8 * (1 + next() % 3);
    int OH = (H - 1) / 2 + 1, OW = (W - 1) / 2 + 1;
    std::vector<float> x(H * W * C), sc(C), sh(C);
    for (auto& v : x) { uint32_t r = next(); v = r % 16 == 0 ? special[(r / 16) % 8] : float(int(r % 9) - 4) * 0.25f; }
    for (int c = 0; c < C; ++c) { uint32_t r = next(); sc[c] = c % 5 == 0 ? 0.f : (c % 3 == 0 ? -1.f : 1.f) * (0.5f + float(r % 7) / 4); sh[c] = float(int(r % 5) - 2) * 0.125f; }
    auto norm = [&](int h, int w, int c) { return f2h(relu_keep_nan(fmaf(x[(h * W + w) * C + c], sc[c], sh[c]))); };
    for (int oh = 0; oh < OH; ++oh) for (int ow = 0; ow < OW; ++ow) for (int g = 0; g < C / 8; ++g) {
      // per-output
      int key[8]; unsigned bits[8], arg[8];
      for (int j = 0; j < 8; ++j) { key[j] = -1; bits[j] = 0xfc00; arg[j] = 0xff; }
      for (int k = 0; k < 9; ++k) {
        int h = 2 * oh - 1 + k / 3, w = 2 * ow - 1 + k % 3;
        if (!(h >= 0 && h < H && w >= 0 && w < W)) continue;
        for (int j = 0; j < 8; ++j) { unsigned hb = norm(h, w, g * 8 + j); int kk = hb & 0x7fff; if (kk > key[j]) { key[j] = kk; bits[j] = hb; arg[j] = k; } }
      }
      // tiled
      auto word = [&](int h, int w, int j) { return unsigned(norm(h, w, g * 8 + 2 * j)) | (unsigned(norm(h, w, g * 8 + 2 * j + 1)) << 16); };
      int kh0 = oh == 0 ? 1 : 0, kw0 = ow == 0 ? 1 : 0;
      bool row2 = 2 * oh + 1 < H, col2 = 2 * ow + 1 < W;
      unsigned b2[4], k2[4], a2[4];
      for (int j = 0; j < 4; ++j) { b2[j] = word(2 * oh - 1 + kh0, 2 * ow - 1 + kw0, j); k2[j] = b2[j] & 0x7fff7fffu; a2[j] = unsigned(kh0 * 3 + kw0) * 0x00010001u; }
      for (int k = 0; k < 9; ++k) {
        int kh = k / 3, kw = k % 3;
        if (kh < kh0 || kw < kw0 || k == kh0 * 3 + kw0) continue;
        if ((kh == 2 && !row2) || (kw == 2 && !col2)) continue;
        for (int j = 0; j < 4; ++j) {
          unsigned hh = word(2 * oh - 1 + kh, 2 * ow - 1 + kw, j), kk = hh & 0x7fff7fffu;
          unsigned m = vmaxu2(kk, k2[j]), grew = nonzero_lanes(m ^ k2[j]);
          k2[j] = m; b2[j] = (hh & grew) | (b2[j] & ~grew); a2[j] = (unsigned(k) * 0x00010001u & grew) | (a2[j] & ~grew);
        }
      }
      unsigned ob[4], op[2] = {0, 0};
      for (int j = 0; j < 4; ++j) ob[j] = bits[2 * j] | (bits[2 * j + 1] << 16);
      for (int j = 0; j < 8; ++j) op[j / 4] |= arg[j] << (8 * (j % 4));
      unsigned tp0 = byte_perm(a2[0], a2[1], 0x6420), tp1 = byte_perm(a2[2], a2[3], 0x6420);
      ++total;
      if (memcmp(ob, b2, 16) || op[0] != tp0 || op[1] != tp1) { if (bad++ < 5) printf("mismatch H%d W%d oh%d ow%d\n", H, W, oh, ow); }
    }
  }
  printf("%d of %d output vectors differ\n", bad, total);
}
