// nvjpeg_under_load: how long nvJPEG's batched decode takes while another stream keeps the SMs
// busy, the situation of a training step beside the GPU JPEG path (docs/lab/input-pipeline.md).
// A second thread fills a stream with kernels whose blocks each spin for a fixed time; the
// decode stream has the device's highest priority, as in data/gpu_jpeg.cpp.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 tools/bench/nvjpeg_under_load.cu -lnvjpeg -o nvjpeg_under_load
//   ./nvjpeg_under_load FOLDER [hardware|default|gpu_hybrid|hybrid ...]
//
// FOLDER: JPEGs (searched recursively; 8 batches of 256 are read), e.g. a kiln-loader-bench
// --generate corpus. Prints ms per batch of 256 (RGBI output) for each backend and block length.
// Not built by CMake: a measurement tool for machines with nvJPEG.
#include <cuda_runtime.h>
#include <nvjpeg.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#define CHECK_OK(x)                                                               \
  do {                                                                            \
    const int e_ = int(x);                                                        \
    if (e_ != 0) {                                                                \
      std::fprintf(stderr, "%s failed: %d (line %d)\n", #x, e_, __LINE__);       \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// Every block spins for `ns` nanoseconds of the global timer.
__global__ void spin(long long ns, int* sink) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  int n = 0;
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    ++n;
  } while (t - t0 < ns);
  if (n == -1) *sink = n;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FOLDER [hardware|default|gpu_hybrid|hybrid ...]\n", argv[0]);
    return 2;
  }
  constexpr int B = 256, kBatches = 8;
  std::vector<std::vector<unsigned char>> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(argv[1])) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    files.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    if (int(files.size()) == B * kBatches) break;
  }
  if (int(files.size()) < B * kBatches) {
    std::fprintf(stderr, "%s: need %d JPEGs, found %zu\n", argv[1], B * kBatches, files.size());
    return 2;
  }
  struct Backend {
    const char* name;
    nvjpegBackend_t id;
  };
  const Backend all[] = {{"hardware", NVJPEG_BACKEND_HARDWARE},
                         {"default", NVJPEG_BACKEND_DEFAULT},
                         {"gpu_hybrid", NVJPEG_BACKEND_GPU_HYBRID},
                         {"hybrid", NVJPEG_BACKEND_HYBRID}};
  std::vector<Backend> chosen;
  for (int i = 2; i < argc; ++i)
    for (const Backend& b : all)
      if (std::strcmp(argv[i], b.name) == 0) chosen.push_back(b);
  if (chosen.empty()) chosen.push_back(all[0]);

  int least = 0, greatest = 0;
  CHECK_OK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t decode, busy;
  CHECK_OK(cudaStreamCreateWithPriority(&decode, cudaStreamNonBlocking, greatest));
  CHECK_OK(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  int* sink = nullptr;
  CHECK_OK(cudaMalloc(&sink, sizeof(int)));
  unsigned char* out = nullptr;
  CHECK_OK(cudaMalloc(&out, size_t(B) * 3 * 1024 * 1024));  // room for 256 megapixel images

  const long long block_ns[] = {0, 50000, 200000, 500000};  // 0: an idle GPU
  for (const Backend& be : chosen) {
    nvjpegHandle_t h = nullptr;
    if (nvjpegCreateEx(be.id, nullptr, nullptr, 0, &h) != NVJPEG_STATUS_SUCCESS) {
      std::printf("%-10s not available\n", be.name);
      continue;
    }
    nvjpegJpegState_t state = nullptr;
    CHECK_OK(nvjpegJpegStateCreate(h, &state));
    CHECK_OK(nvjpegDecodeBatchedInitialize(h, state, B, 1, NVJPEG_OUTPUT_RGBI));
    for (long long ns : block_ns) {
      std::atomic<bool> stop{false};
      std::thread load;
      if (ns > 0)
        load = std::thread([&] {
          CHECK_OK(cudaSetDevice(0));
          while (!stop) {
            for (int i = 0; i < 50; ++i) spin<<<132 * 8, 256, 0, busy>>>(ns, sink);
            CHECK_OK(cudaStreamSynchronize(busy));
          }
        });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      double total_ms = 0;
      for (int k = 0; k < kBatches; ++k) {
        std::vector<const unsigned char*> data(B);
        std::vector<size_t> lengths(B);
        std::vector<nvjpegImage_t> dst(B);
        size_t off = 0;
        for (int i = 0; i < B; ++i) {
          const std::vector<unsigned char>& f = files[size_t(k * B + i)];
          data[size_t(i)] = f.data();
          lengths[size_t(i)] = f.size();
          int components = 0, widths[NVJPEG_MAX_COMPONENT], heights[NVJPEG_MAX_COMPONENT];
          nvjpegChromaSubsampling_t subsampling;
          CHECK_OK(nvjpegGetImageInfo(h, f.data(), f.size(), &components, &subsampling, widths,
                                      heights));
          dst[size_t(i)] = nvjpegImage_t{};
          dst[size_t(i)].channel[0] = out + off;
          dst[size_t(i)].pitch[0] = size_t(widths[0]) * 3;
          off += (size_t(widths[0]) * size_t(heights[0]) * 3 + 255) / 256 * 256;
        }
        const auto t0 = std::chrono::steady_clock::now();
        CHECK_OK(nvjpegDecodeBatched(h, state, data.data(), lengths.data(), dst.data(), decode));
        CHECK_OK(cudaStreamSynchronize(decode));
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (k > 0) total_ms += ms;  // batch 0 warms up
      }
      stop = true;
      if (load.joinable()) load.join();
      const double per = total_ms / (kBatches - 1);
      std::printf("%-10s blocks of %6lld ns on the other stream: %8.2f ms per %d images (%.0f/s)\n",
                  be.name, ns, per, B, B * 1e3 / per);
    }
    nvjpegJpegStateDestroy(state);
    nvjpegDestroy(h);
  }
  return 0;
}
