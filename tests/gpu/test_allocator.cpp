// The caching allocator: reuse without cudaMalloc, statistics, stream ordering, OOM message,
// empty_cache, thread safety.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>

#include "cuda/allocator.h"
#include "cuda/check.h"
#include "cuda/profiler.h"
#include "cuda/runtime.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

TEST_CASE("a freed block is reused: no new cudaMalloc for the same size") {
  Allocator* a = cuda::caching_allocator(0);
  for (size_t bytes : {size_t(1000), size_t(5) << 20, size_t(3)}) {
    CAPTURE(bytes);
    void* p = a->allocate(bytes);
    REQUIRE(p != nullptr);
    a->deallocate(p, bytes);
    const cuda::AllocatorStats before = cuda::allocator_stats(0);
    void* q = a->allocate(bytes);
    const cuda::AllocatorStats after = cuda::allocator_stats(0);
    CHECK(q == p);
    CHECK(after.num_cuda_mallocs == before.num_cuda_mallocs);
    CHECK(after.num_allocs == before.num_allocs + 1);
    a->deallocate(q, bytes);
  }
  // The same through tensors, as a training step does it.
  { Tensor t = empty({1 << 18}, gpu_opts(DType::f32)); }
  const uint64_t mallocs = cuda::allocator_stats(0).num_cuda_mallocs;
  for (int i = 0; i < 10; ++i) {
    Tensor t = empty({1 << 18}, gpu_opts(DType::f32));
    t.fill_(1.0);
  }
  CHECK(cuda::allocator_stats(0).num_cuda_mallocs == mallocs);
  CHECK(a->allocate(0) == nullptr);
  a->deallocate(nullptr, 0);
}

TEST_CASE("statistics: allocated, reserved, peak and its reset") {
  Allocator* a = cuda::caching_allocator(0);
  const cuda::AllocatorStats s0 = cuda::allocator_stats(0);
  CHECK(s0.reserved_bytes >= s0.allocated_bytes);
  void* small = a->allocate(1000);  // rounds to 1024
  cuda::AllocatorStats s1 = cuda::allocator_stats(0);
  CHECK(s1.allocated_bytes == s0.allocated_bytes + 1024);
  CHECK(s1.reserved_bytes >= s1.allocated_bytes);
  const size_t big_bytes = (size_t(64) << 20) + 1;  // rounds to 64 MiB + 512
  void* big = a->allocate(big_bytes);
  cuda::AllocatorStats s2 = cuda::allocator_stats(0);
  CHECK(s2.allocated_bytes == s1.allocated_bytes + (size_t(64) << 20) + 512);
  CHECK(s2.peak_reserved_bytes >= s2.reserved_bytes);
  CHECK(s2.peak_allocated_bytes >= s2.allocated_bytes);
  a->deallocate(big, big_bytes);
  cuda::AllocatorStats s3 = cuda::allocator_stats(0);
  CHECK(s3.allocated_bytes == s1.allocated_bytes);
  CHECK(s3.peak_allocated_bytes == s2.peak_allocated_bytes);  // the peak survives the free
  CHECK(s3.reserved_bytes == s2.reserved_bytes);              // cached, not returned
  cuda::reset_peak_stats(0);
  CHECK(cuda::allocator_stats(0).peak_allocated_bytes == s3.allocated_bytes);
  a->deallocate(small, 1000);
  CHECK(cuda::allocator_stats(0).allocated_bytes == s0.allocated_bytes);
}

TEST_CASE("empty_cache returns every wholly free segment") {
  Allocator* a = cuda::caching_allocator(0);
  void* p = a->allocate(size_t(8) << 20);  // in a 20 MiB segment of its own
  a->deallocate(p, size_t(8) << 20);
  const cuda::AllocatorStats before = cuda::allocator_stats(0);
  CHECK(before.reserved_bytes >= before.allocated_bytes + (size_t(20) << 20));
  cuda::empty_cache(0);
  const cuda::AllocatorStats after = cuda::allocator_stats(0);
  CHECK(after.reserved_bytes + (size_t(20) << 20) <= before.reserved_bytes);
  CHECK(after.allocated_bytes == before.allocated_bytes);
}

TEST_CASE("a cached block is split for a smaller request and merged again when both are free") {
  Allocator* a = cuda::caching_allocator(0);
  const size_t MiB = size_t(1) << 20;
  cuda::empty_cache(0);               // no other case's cached blocks can serve what follows
  void* big = a->allocate(96 * MiB);
  a->deallocate(big, 96 * MiB);
  uint64_t mallocs = cuda::allocator_stats(0).num_cuda_mallocs;
  void* head = a->allocate(30 * MiB);  // carved from the front of big's segment
  void* rest = a->allocate(66 * MiB);  // the rest of it
  CHECK(head == big);
  CHECK(rest == static_cast<char*>(big) + 30 * MiB);
  CHECK(cuda::allocator_stats(0).num_cuda_mallocs == mallocs);
  void* tiny = a->allocate(1000);  // small requests never come from large segments
  CHECK((tiny < big || tiny >= static_cast<char*>(big) + 96 * MiB));
  a->deallocate(tiny, 1000);
  a->deallocate(head, 30 * MiB);
  a->deallocate(rest, 66 * MiB);
  mallocs = cuda::allocator_stats(0).num_cuda_mallocs;
  void* again = a->allocate(96 * MiB);  // the two pieces merged back into one block
  CHECK(again == big);
  CHECK(cuda::allocator_stats(0).num_cuda_mallocs == mallocs);
  a->deallocate(again, 96 * MiB);
}

TEST_CASE("stream order: a block freed on one stream reaches another only after a device sync") {
  Allocator* a = cuda::caching_allocator(0);
  const size_t bytes = size_t(18) << 20;
  cuda::empty_cache(0);  // no other case's cached blocks can serve what follows
  cudaStream_t other = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  // The compute stream is held up by a host function; a block freed there while that work is
  // pending reaches `other` only once the device is synchronised (the stream has finished).
  void* p = a->allocate(bytes);
  cudaStream_t compute = cuda::current_stream();
  CUDA_CHECK(cudaLaunchHostFunc(
      compute, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); },
      nullptr));
  a->deallocate(p, bytes);
  const uint64_t before = cuda::allocator_stats(0).cross_stream_reuses;
  {
    cuda::StreamGuard g(other);
    void* q = a->allocate(bytes);  // nothing cached on `other`: p's block, taken over
    CHECK(q == p);
    CHECK(cudaStreamQuery(compute) == cudaSuccess);  // the sleeping host function has run
    CHECK(cuda::allocator_stats(0).cross_stream_reuses == before + 1);
    a->deallocate(q, bytes);
    void* r = a->allocate(bytes);  // now `other`'s own: reused without another take-over
    CHECK(r == p);
    CHECK(cuda::allocator_stats(0).cross_stream_reuses == before + 1);
    a->deallocate(r, bytes);
  }
  cuda::synchronize();
  CUDA_CHECK(cudaStreamDestroy(other));
}

TEST_CASE("out of memory: OutOfMemoryError names the request and the allocator's bytes") {
  Allocator* a = cuda::caching_allocator(0);
  void* keep = a->allocate(1 << 20);
  const size_t pib = size_t(1) << 50;
  std::string msg;
  try {
    a->allocate(pib);
    FAIL("1 PiB allocation did not throw");
  } catch (const OutOfMemoryError& e) {
    msg = e.what();
  }
  MESSAGE(msg);
  cuda::AllocatorStats s = cuda::allocator_stats(0);
  CHECK(msg.find(std::to_string(pib)) != std::string::npos);
  CHECK(msg.find("cuda:0") != std::string::npos);
  CHECK(msg.find(std::to_string(s.allocated_bytes) + " bytes allocated") != std::string::npos);
  CHECK(msg.find(std::to_string(s.reserved_bytes) + " bytes reserved") != std::string::npos);
  // The allocator and the device still work afterwards.
  Tensor t = full({16}, 2.0, gpu_opts(DType::f32));
  CHECK(t.to_vector<double>()[15] == 2.0);
  a->deallocate(keep, 1 << 20);
  CHECK_THROWS_AS(empty({int64_t(1) << 48}, gpu_opts(DType::f32)), OutOfMemoryError);
}

TEST_CASE("out of memory inside an op names the op; outside any op it names none") {
  // (2^20, 1) x (1, 2^20) f32: a 4 TiB product, refused when matmul allocates its output.
  Tensor a = full({int64_t(1) << 20, 1}, 1.0, gpu_opts(DType::f32));
  Tensor b = full({1, int64_t(1) << 20}, 1.0, gpu_opts(DType::f32));
  std::string msg;
  try {
    F::matmul(a, b);
    FAIL("a 4 TiB matmul did not throw");
  } catch (const OutOfMemoryError& e) {
    msg = e.what();
  }
  MESSAGE(msg);
  CHECK(msg.find("in op matmul (input f32[1048576, 1] cuda:0)") != std::string::npos);
  CHECK(msg.find("4.0 TiB") == std::string::npos);  // sizes are named in GiB
  CHECK(msg.find("4096.0 GiB") != std::string::npos);
  CHECK(msg.find(" cached, ") != std::string::npos);
  CHECK(cuda::current_op() == nullptr);  // the op's scope was left while unwinding
  try {
    empty({int64_t(1) << 48}, gpu_opts(DType::f32));
    FAIL("a 1 PiB tensor did not throw");
  } catch (const OutOfMemoryError& e) {
    msg = e.what();
  }
  CHECK(msg.find("in op") == std::string::npos);
  // Still usable afterwards.
  CHECK(F::matmul(a.narrow(0, 0, 4).contiguous(), b.narrow(1, 0, 4).contiguous()).to_vector<double>()[15] == 1.0);
}

TEST_CASE("foreign pointers are refused") {
  int x = 0;
  CHECK_THROWS_AS(cuda::caching_allocator(0)->deallocate(&x, 4), Error);
}

TEST_CASE("thread safety: concurrent allocate/free balance out") {
  Allocator* a = cuda::caching_allocator(0);
  const size_t before = cuda::allocator_stats(0).allocated_bytes;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([a, t] {
      std::vector<void*> ps;
      for (int i = 0; i < 500; ++i) {
        ps.push_back(a->allocate(size_t(512) * size_t(1 + (i + t) % 7)));
        if (ps.size() > 8) {
          a->deallocate(ps.front(), 0);
          ps.erase(ps.begin());
        }
      }
      for (void* p : ps) a->deallocate(p, 0);
    });
  }
  for (auto& th : threads) th.join();
  CHECK(cuda::allocator_stats(0).allocated_bytes == before);
}
