// One large f32 GEMM split over OpenMP threads two ways (docs/lab/ci.md, 2026-12-05, the thread
// count): by Eigen itself, whose block over K (and so the bits) follows the thread count, or as
// ops/cpu/matmul.cpp does it, fixed tiles of the output, each a single-threaded Eigen GEMM. Not
// built by CMake; compile both and run each at the thread counts of interest:
//   g++ -O3 -DNDEBUG -ffp-contract=off -fopenmp -DEIGEN_NO_CPUID -I/usr/include/eigen3 \
//     tools/bench/eigen_gemm_tiles.cpp -o /tmp/egt-eigen
//   g++ -O3 -DNDEBUG -ffp-contract=off -fopenmp -DEIGEN_NO_CPUID -DEIGEN_DONT_PARALLELIZE \
//     -I/usr/include/eigen3 tools/bench/eigen_gemm_tiles.cpp -o /tmp/egt-tiles
//   for t in 1 2; do OMP_NUM_THREADS=$t /tmp/egt-eigen; OMP_NUM_THREADS=$t /tmp/egt-tiles; done
// The tiled build takes the tile as two arguments (rows, columns; default 128 256). Each line:
// the best of 5 runs, and a hash of the product's bits.
#include <Eigen/Dense>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

int main(int argc, char** argv) {
  const int64_t tile_rows = argc > 2 ? std::atoll(argv[1]) : 128;
  const int64_t tile_cols = argc > 2 ? std::atoll(argv[2]) : 256;
#ifdef EIGEN_DONT_PARALLELIZE
  std::printf("fixed %lld x %lld tiles, %d threads\n", (long long)tile_rows, (long long)tile_cols,
              omp_get_max_threads());
#else
  std::printf("Eigen's own split, %d threads\n", Eigen::nbThreads());
#endif
  // (n, k, m): square, a ViT-B MLP's and attention projection's shapes, a skinny product.
  const int64_t shapes[][3] = {
      {1024, 1024, 1024}, {256, 768, 3072}, {4096, 768, 768}, {32, 4096, 4096}, {1576, 768, 2304}};
  for (const auto& s : shapes) {
    const int64_t n = s[0], k = s[1], m = s[2];
    Mat a = Mat::Random(n, k), b = Mat::Random(k, m), c(n, m);
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
#ifdef EIGEN_DONT_PARALLELIZE
      const int64_t tr = (n + tile_rows - 1) / tile_rows, tc = (m + tile_cols - 1) / tile_cols;
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < tr * tc; ++t) {
        const int64_t r0 = t / tc * tile_rows, c0 = t % tc * tile_cols;
        const int64_t rn = std::min(tile_rows, n - r0), cn = std::min(tile_cols, m - c0);
        c.block(r0, c0, rn, cn).noalias() = a.middleRows(r0, rn) * b.middleCols(c0, cn);
      }
#else
      c.noalias() = a * b;
#endif
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                                .count());
    }
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the product's bytes
    const auto* p = reinterpret_cast<const unsigned char*>(c.data());
    for (int64_t i = 0; i < n * m * int64_t(sizeof(float)); ++i) h = (h ^ p[i]) * 1099511628211ull;
    std::printf("%5lld x %5lld x %5lld: %7.2f ms, %5.1f GFLOP/s, bits %016llx\n", (long long)n,
                (long long)k, (long long)m, best * 1e3, 2.0 * double(n * k * m) / best / 1e9,
                (unsigned long long)h);
  }
}
