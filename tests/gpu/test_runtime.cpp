// Runtime context, streams, pinned memory, copies between devices/dtypes/layouts, fill, and
// the profiler.
#include <doctest/doctest.h>

#include <thread>
#include <vector>

#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/profiler.h"
#include "cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {
const DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                      DType::i32, DType::i64, DType::u8,  DType::boolean};
// Exactly representable in every dtype except where conversion truncates (2.5, 0.25), which
// the CPU reference truncates the same way.
const std::vector<double> kValues = {0, 1, 2.5, 3, 100, 0.25, 7, 64, 0, 5, 9, 2};
}  // namespace

TEST_CASE("context: streams, handles, workspace") {
  REQUIRE(cuda::device_count() > 0);
  CHECK(cuda::is_available());
  cuda::Context& ctx = cuda::context();
  CHECK(&ctx == &cuda::context(cuda::current_device()));
  CHECK(ctx.compute != nullptr);
  CHECK(ctx.copy != nullptr);
  CHECK(ctx.compute != ctx.copy);
  unsigned flags = 0;
  CUDA_CHECK(cudaStreamGetFlags(ctx.compute, &flags));
  CHECK(flags == cudaStreamNonBlocking);
  CUDA_CHECK(cudaStreamGetFlags(ctx.copy, &flags));
  CHECK(flags == cudaStreamNonBlocking);
  cudaStream_t s = nullptr;
  CUDNN_CHECK(cudnnGetStream(ctx.cudnn, &s));
  CHECK(s == ctx.compute);
  CHECK(ctx.lt != nullptr);
  CHECK(ctx.lt_workspace != nullptr);
  CHECK(ctx.lt_workspace_bytes == size_t(32) << 20);
  CHECK(ctx.props.multiProcessorCount > 0);
  CHECK_THROWS_AS(cuda::context(cuda::device_count()), Error);
  CHECK_THROWS_AS(cuda::set_device(-1), Error);
}

TEST_CASE("current stream: StreamGuard nests and is thread-local") {
  cudaStream_t compute = cuda::context().compute;
  CHECK(cuda::current_stream() == compute);
  cudaStream_t a = nullptr, b = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  {
    cuda::StreamGuard ga(a);
    CHECK(cuda::current_stream() == a);
    {
      cuda::StreamGuard gb(b);
      CHECK(cuda::current_stream() == b);
      cudaStream_t seen = nullptr;
      std::thread([&] { seen = cuda::current_stream(); }).join();
      CHECK(seen == compute);
    }
    CHECK(cuda::current_stream() == a);
    {
      cuda::StreamGuard g0(nullptr);  // the legacy default stream is a valid choice
      CHECK(cuda::current_stream() == nullptr);
    }
    CHECK(cuda::current_stream() == a);
  }
  CHECK(cuda::current_stream() == compute);
  CUDA_CHECK(cudaStreamDestroy(a));
  CUDA_CHECK(cudaStreamDestroy(b));
}

TEST_CASE("work on a guarded stream is ordered and visible after synchronize") {
  cudaStream_t a = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  {
    cuda::StreamGuard g(a);
    Tensor t = empty({1000}, gpu_opts(DType::f32));
    t.fill_(3.0);
    t.add_(1.5);
    cuda::synchronize();
    auto v = t.to_vector<double>();
    CHECK(v.front() == 4.5);
    CHECK(v.back() == 4.5);
  }
  CUDA_CHECK(cudaStreamDestroy(a));
}

TEST_CASE("pinned memory") {
  const size_t n = size_t(1) << 20;
  auto* p = static_cast<float*>(cuda::alloc_pinned(n * sizeof(float)));
  REQUIRE(p != nullptr);
  cudaPointerAttributes attr{};
  CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  CHECK(attr.type == cudaMemoryTypeHost);
  for (size_t i = 0; i < n; ++i) p[i] = float(i % 1000);
  // Round trip through the device with async copies from and to pinned memory.
  void* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(float)));
  cudaStream_t s = cuda::context().copy;
  CUDA_CHECK(cudaMemcpyAsync(d, p, n * sizeof(float), cudaMemcpyHostToDevice, s));
  std::vector<float> back(n);
  CUDA_CHECK(cudaMemcpyAsync(back.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  CHECK(back[999] == 999.0f);
  CHECK(back[n - 1] == float((n - 1) % 1000));
  CUDA_CHECK(cudaFree(d));
  cuda::free_pinned(p);
  CHECK(cuda::alloc_pinned(0) == nullptr);
  cuda::free_pinned(nullptr);
}

TEST_CASE("copy round trip, every dtype, same dtype") {
  for (DType t : kAll) {
    CAPTURE(dtype_name(t));
    Tensor h = from_vector(kValues, {3, 4}, TensorOptions(t));
    Tensor d = h.to(kGpu);
    CHECK(d.is_cuda());
    CHECK(d.to(Device::cpu()).to_vector<double>() == h.to_vector<double>());
  }
}

TEST_CASE("copy with conversion: all 64 dtype pairs on the device, host<->device") {
  for (DType s : kAll) {
    for (DType t : kAll) {
      CAPTURE(dtype_name(s));
      CAPTURE(dtype_name(t));
      Tensor hs = from_vector(kValues, {2, 6}, TensorOptions(s));
      std::vector<double> want = hs.to(t).to_vector<double>();  // CPU conversion
      Tensor ds = hs.to(kGpu);
      CHECK(ds.to(t).to_vector<double>() == want);  // device kernel, then same-dtype D2H
      // H2D with conversion on the host
      Tensor dt = empty({2, 6}, gpu_opts(t));
      dt.copy_(hs);
      CHECK(dt.to_vector<double>() == want);
      // D2H with conversion staged on the device
      Tensor ht = empty({2, 6}, TensorOptions(t));
      ht.copy_(ds);
      CHECK(ht.to_vector<double>() == want);
    }
  }
}

TEST_CASE("copy: NHWC, transposed, sliced and broadcast layouts") {
  const Shape shape{2, 3, 4, 5};
  std::vector<double> v = uniform_values(shape_numel(shape), -4, 4, 11);
  Tensor h = from_vector(v, shape, TensorOptions(DType::f32));
  for (DType t : {DType::f32, DType::f16, DType::f64}) {
    std::string dtype = dtype_name(t);
    CAPTURE(dtype);
    // from_vector rounds the doubles straight to t (f64 keeps them exactly).
    std::vector<double> want = from_vector(v, shape, TensorOptions(t)).to_vector<double>();
    // NHWC on the device (H2D into channels-last), back to contiguous host
    Tensor nhwc = from_vector(v, shape, gpu_opts(t, MemoryFormat::ChannelsLast));
    CHECK(nhwc.is_contiguous(MemoryFormat::ChannelsLast));
    std::vector<double> got = nhwc.to_vector<double>();
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i]) {
        std::string where = "first mismatch at " + std::to_string(i) + ": got " +
                            std::to_string(got[i]) + " want " + std::to_string(want[i]);
        CAPTURE(where);
        CHECK(got[i] == want[i]);
        break;
      }
    CHECK(got == want);
    Tensor back = empty(shape, TensorOptions(t));
    back.copy_(nhwc);  // D2H, NHWC -> NCHW, staged on the device
    CHECK(back.to_vector<double>() == want);
    // NCHW device -> NHWC device (strided kernel)
    Tensor nchw = from_vector(v, shape, TensorOptions(t)).to(kGpu);
    CHECK(nchw.contiguous(MemoryFormat::ChannelsLast).to_vector<double>() == want);
    // transposed and stepped views
    Tensor tr = nchw.transpose(1, 3);
    CHECK(tr.to_vector<double>() == nchw.to(Device::cpu()).transpose(1, 3).to_vector<double>());
    Tensor sl = nchw.slice(3, 1, 5, 2);
    CHECK(sl.to_vector<double>() == nchw.to(Device::cpu()).slice(3, 1, 5, 2).to_vector<double>());
    // a broadcast (zero-stride) source
    Tensor row = nchw.select(0, 1).select(0, 2).select(0, 3);  // (5)
    Tensor big = empty({3, 5}, gpu_opts(t));
    big.copy_(row);
    std::vector<double> r = row.to_vector<double>();
    std::vector<double> bigv = big.to_vector<double>();
    for (int i = 0; i < 15; ++i) CHECK(bigv[size_t(i)] == r[size_t(i % 5)]);
  }
}

TEST_CASE("copy into non-dense destinations leaves the rest untouched") {
  Tensor h = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  // device destination: a column of a (3, 2) device tensor, source f64 host -> f16 device
  Tensor d = full({3, 3}, -1.0, gpu_opts(DType::f16));
  d.slice(1, 1, 3).copy_(h.t());  // (3, 2) view with row stride 3
  CHECK(d.to_vector<double>() == std::vector<double>{-1, 1, 4, -1, 2, 5, -1, 3, 6});
  // host destination: a strided view of a host tensor, from a device tensor of another dtype
  Tensor hd = full({2, 6}, 9.0, TensorOptions(DType::f32));
  hd.slice(1, 0, 6, 2).copy_(h.to(DType::f16).to(kGpu));
  CHECK(hd.to_vector<double>() == std::vector<double>{1, 9, 2, 9, 3, 9, 4, 9, 5, 9, 6, 9});
  // device -> device into a stepped view, same dtype
  Tensor e = zeros({6}, gpu_opts(DType::f32));
  e.slice(0, 0, 6, 2).copy_(from_vector<double>({7, 8, 9}, {3}, gpu_opts(DType::f32)));
  CHECK(e.to_vector<double>() == std::vector<double>{7, 0, 8, 0, 9, 0});
  // storage offsets: copy from a narrowed device tensor
  Tensor f = arange(10, gpu_opts(DType::i64));
  CHECK(f.narrow(0, 3, 4).to_vector<double>() == std::vector<double>{3, 4, 5, 6});
}

TEST_CASE("fill: every dtype, dense and strided, zero and non-zero") {
  for (DType t : kAll) {
    CAPTURE(dtype_name(t));
    // What 3 and 2 become in this dtype (bool: 1), converted on the host.
    const double three = tensor({3.0}, TensorOptions(t)).to_vector<double>()[0];
    const double two = tensor({2.0}, TensorOptions(t)).to_vector<double>()[0];
    Tensor d = empty({4, 6}, gpu_opts(t));
    d.fill_(3.0);
    CHECK(d.to_vector<double>() == std::vector<double>(24, three));
    d.zero_();
    CHECK(d.to_vector<double>() == std::vector<double>(24, 0.0));
    d.slice(1, 1, 6, 2).fill_(1.0);  // non-dense: the kernel path
    std::vector<double> want(24, 0.0);
    for (int r = 0; r < 4; ++r)
      for (int c = 1; c < 6; c += 2) want[size_t(r * 6 + c)] = 1.0;
    CHECK(d.to_vector<double>() == want);
    d.slice(1, 1, 6, 2).zero_();  // zero into a non-dense view must not memset the rest
    d.slice(1, 0, 6, 2).fill_(2.0);
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 6; ++c) want[size_t(r * 6 + c)] = c % 2 == 0 ? two : 0.0;
    CHECK(d.to_vector<double>() == want);
  }
  Tensor h = empty({3}, gpu_opts(DType::f16));
  h.fill_(0.1);
  CHECK(h.to_vector<double>()[0] == double(float(Half(0.1f))));
  Tensor e = empty({0, 3}, gpu_opts(DType::f32));
  e.fill_(1.0);  // no elements: nothing to do, no error
  CHECK(e.to(Device::cpu()).numel() == 0);
}

TEST_CASE("copy across devices") {
  if (cuda::device_count() < 2) return;
  Tensor a = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3}, gpu_opts(DType::f32));
  Tensor b = empty({3, 2}, TensorOptions(DType::f16).with_device(Device::cuda(1)));
  b.copy_(a.t());
  CHECK(b.to_vector<double>() == std::vector<double>{1, 4, 2, 5, 3, 6});
}

TEST_CASE("profiler: op table and NVTX ranges") {
  cuda::profiler_reset();
  Tensor t = empty({1 << 20}, gpu_opts(DType::f32));
  {
    KILN_PROFILE_OP("not_recorded", t.shape_str());  // disabled: no entry
    t.fill_(1.0);
  }
  cuda::enable_profiler(true);
  CHECK(cuda::profiler_enabled());
  Tensor u = empty({1 << 10}, gpu_opts(DType::f32));
  for (int i = 0; i < 3; ++i) {
    cuda::NvtxRange range("fill step");
    KILN_PROFILE_OP("test_fill", t.shape_str());
    t.fill_(double(i));
  }
  {
    KILN_PROFILE_OP("test_fill", u.shape_str());
    u.fill_(1.0);
  }
  cuda::enable_profiler(false);
  std::string report = cuda::profiler_report();
  MESSAGE(report);
  CHECK(report.find("test_fill") != std::string::npos);
  CHECK(report.find("not_recorded") == std::string::npos);
  // the row reads: name, 4 calls (both inputs)
  size_t at = report.find("test_fill");
  CHECK(report.substr(at, 60).find(" 4 ") != std::string::npos);
  // By input: a row for each shape, 3 calls and 1.
  const std::string by_input = cuda::profiler_report(true);
  MESSAGE(by_input);
  at = by_input.find("test_fill  " + t.shape_str());
  REQUIRE(at != std::string::npos);
  CHECK(by_input.substr(at, 80).find(" 3 ") != std::string::npos);
  at = by_input.find("test_fill  " + u.shape_str());
  REQUIRE(at != std::string::npos);
  CHECK(by_input.substr(at, 80).find(" 1 ") != std::string::npos);
  cuda::profiler_reset();
  CHECK(cuda::profiler_report().find("test_fill") == std::string::npos);
  CHECK(cuda::profiler_report(true).find("test_fill") == std::string::npos);
}

TEST_CASE(
    "programmatic dependent launch: each kernel still sees all of the previous one's writes") {
  const cudaDeviceProp& props = cuda::context().props;
  if (props.major < 9) CHECK_FALSE(cuda::pdl_enabled());
  const bool was = cuda::pdl_enabled();
  cuda::set_pdl_enabled(true);
  CHECK(cuda::pdl_enabled() == (props.major >= 9));
  // 64 dependent passes over 96 MB (more than L2) alternating between two buffers, with a
  // one-block kernel (the minimum of the whole buffer) after every eighth: one element read
  // before its producer finished leaves a value below 64, or a minimum below the pass count.
  const int64_t n = int64_t(24) << 20;
  const TensorOptions f32 = TensorOptions().with_device(Device::cuda(0));
  Tensor a = zeros({n}, f32), b = empty({n}, f32);
  std::vector<Tensor> mins;
  for (int i = 0; i < 64; ++i) {
    const Tensor& out = (i % 2) ? a : b;
    cuda::unary(UnaryOp::AddScalar, out, (i % 2) ? b : a, 1.0);
    if (i % 8 == 7) {
      mins.push_back(empty({1}, f32));
      cuda::reduce_rows(ReduceOp::Min, mins.back(), out, 1, n);
    }
  }
  cuda::synchronize();
  Tensor host = a.to(Device::cpu());
  const float* p = host.data<float>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += p[i] != 64.f;
  CHECK(wrong == 0);
  for (size_t k = 0; k < mins.size(); ++k)
    CHECK(mins[k].to(Device::cpu()).item<float>() == float(8 * (k + 1)));
  cuda::set_pdl_enabled(was);
}
