// Eigen's GEMM with and without cpuid (docs/lab/ci.md, 2026-12-05): the cache sizes Eigen blocks
// for, a hash of one long-K product's bits (which the block over K decides), and the time of the
// CPU backend's GEMM shapes. Not built by CMake; compile it both ways and run each natively and
// under qemu's emulated CPUs:
//   for d in "" -DEIGEN_NO_CPUID; do
//     g++ -O3 -DNDEBUG -ffp-contract=off $d -I/usr/include/eigen3 \
//       tools/bench/eigen_gemm_blocking.cpp -o /tmp/egb$d
//   done
//   /tmp/egb; qemu-x86_64 -cpu Conroe /tmp/egb --hash; qemu-x86_64 -cpu max /tmp/egb --hash
// (--hash: skip the timings, which mean nothing under emulation; add -march=native for the
// native build's kernels.)
#include <Eigen/Dense>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

int main(int argc, char** argv) {
  const bool hash_only = argc > 1 && std::strcmp(argv[1], "--hash") == 0;
  Eigen::setNbThreads(1);
  std::ptrdiff_t l1 = 0, l2 = 0, l3 = 0;
  Eigen::internal::manage_caching_sizes(Eigen::GetAction, &l1, &l2, &l3);

  // A conv weight gradient's shape: 8 outputs, 72 = 8·3·3 columns, K = 32 images · 28 · 28.
  uint32_t state = 1;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return float(int(state >> 9) - (1 << 22)) / float(1 << 22);
  };
  Mat a(8, 25088), b(72, 25088), c = Mat::Zero(8, 72);
  for (Eigen::Index i = 0; i < a.size(); ++i) a.data()[i] = next();
  for (Eigen::Index i = 0; i < b.size(); ++i) b.data()[i] = next();
  c.noalias() += a * b.transpose();
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the result's bits
  for (Eigen::Index i = 0; i < c.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &c.data()[i], 4);
    h = (h ^ u) * 1099511628211ull;
  }
  std::printf("blocking for L1 %td, L2 %td, L3 %td bytes; product hash %016llx\n", l1, l2, l3,
              static_cast<unsigned long long>(h));
  if (hash_only) return 0;

  struct Shape {
    int m, k, n;
    bool bt;
    const char* what;
  };
  const Shape shapes[] = {{32, 288, 784, false, "fwd 3x3 32@28"},
                          {32, 784, 288, true, "wgrad 3x3 32@28"},
                          {64, 576, 196, false, "fwd 3x3 64@14"},
                          {64, 196, 576, true, "wgrad 3x3 64@14"},
                          {128, 1152, 49, false, "fwd 3x3 128@7"},
                          {288, 32, 784, false, "dgrad 32@28"},
                          {256, 2304, 784, false, "fwd 3x3 256@28"},
                          {512, 4608, 196, false, "fwd 3x3 512@14"}};
  for (const Shape& s : shapes) {
    Mat x = Mat::Random(s.m, s.k), y = s.bt ? Mat::Random(s.n, s.k) : Mat::Random(s.k, s.n);
    Mat z = Mat::Zero(s.m, s.n);
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {  // best of 7 rounds of 20 products
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 20; ++i) {
        if (s.bt) z.noalias() += x * y.transpose();
        else z.noalias() += x * y;
      }
      best = std::min(
          best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20);
    }
    std::printf("%-16s %9.1f us %7.1f GFLOP/s\n", s.what, best * 1e6,
                2.0 * s.m * s.k * s.n / best / 1e9);
  }
  return 0;
}
