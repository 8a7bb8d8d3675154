#include "data/gpu_jpeg.h"

#include <algorithm>

#include "core/error.h"

#ifdef KILN_WITH_NVJPEG
#include <nvjpeg.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "core/switches.h"
#include "cuda/check.h"
#include "cuda/crop_resize.h"
#include "cuda/runtime.h"
#endif

namespace kiln::data {

double GpuJpegLoader::steer_share(double share, double blocked_s, double workers_s) {
  if (blocked_s <= kBlockedS) return share;  // the input path kept up: leave it
  // The workers had the batch ready: the CPU has room, so it takes more. They did not: it has
  // too much, so nvJPEG takes more.
  const double step = workers_s <= kWorkersBehindS ? kShareStep : -kShareStep;
  return std::clamp(share + step, 0.0, kMaxAdaptiveShare);
}

#ifdef KILN_WITH_NVJPEG

namespace {

const char* nvjpeg_status_name(nvjpegStatus_t s) {
  switch (s) {
    case NVJPEG_STATUS_SUCCESS: return "success";
    case NVJPEG_STATUS_NOT_INITIALIZED: return "not initialized";
    case NVJPEG_STATUS_INVALID_PARAMETER: return "invalid parameter";
    case NVJPEG_STATUS_BAD_JPEG: return "bad JPEG";
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED: return "JPEG not supported";
    case NVJPEG_STATUS_ALLOCATOR_FAILURE: return "allocator failure";
    case NVJPEG_STATUS_EXECUTION_FAILED: return "execution failed";
    case NVJPEG_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case NVJPEG_STATUS_INTERNAL_ERROR: return "internal error";
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED: return "implementation not supported";
    default: return "unknown status";
  }
}

#define KILN_NVJPEG_CHECK(expr)                                                              \
  do {                                                                                       \
    const nvjpegStatus_t kiln_nvjpeg_status_ = (expr);                                       \
    KILN_CHECK(kiln_nvjpeg_status_ == NVJPEG_STATUS_SUCCESS, "nvJPEG: ", #expr, " failed: ", \
               nvjpeg_status_name(kiln_nvjpeg_status_));                                     \
  } while (0)

// A device buffer that grows (never shrinks); freed when the owner goes.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t cap = 0;
  // Callers make sure no queued work still uses the old block before growing.
  void ensure(size_t n) {
    if (n <= cap) return;
    if (ptr) CUDA_CHECK(cudaFree(ptr));
    ptr = nullptr;
    cap = 0;
    const size_t want = n + n / 2;
    CUDA_CHECK(cudaMalloc(&ptr, want));
    cap = want;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
};

// Where a GPU JPEG epoch's time goes (KILN_JPEG_TRACE=1 prints it when the epoch ends): host
// seconds per stage on the decode thread and in next(), and the decode stream's span per batch.
struct Trace {
  int64_t batches = 0, gpu_spans = 0;
  double host_next = 0;   // decode thread: waiting for the workers' batch
  double slot_wait = 0;   // decode thread: the slot's previous uploads and reader
  double decode_call = 0; // decode thread: nvjpegDecodeBatched (+ Initialize) on the host
  double enqueue = 0;     // decode thread: jobs, host-decoded samples, uploads queued
  double next_wait = 0;   // consumer: next() blocked on the decode thread
  double between = 0;     // consumer: from one next() return to the next next() call
  double gpu_span = 0;    // decode stream: submit start to `ready`, device time
};
using TraceClock = std::chrono::steady_clock;
double since(TraceClock::time_point t) {
  return std::chrono::duration<double>(TraceClock::now() - t).count();
}

// An nvJPEG handle: the hardware backend when the GPU has one (sets *hardware), else the default
// one. (Caching allocators for nvJPEG's buffers were tried and changed nothing under a running
// step, docs/lab/input-pipeline.md, so nvJPEG allocates with cudaMalloc as by default.)
nvjpegHandle_t create_handle(bool* hardware) {
  nvjpegHandle_t h = nullptr;
  *hardware =
      nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &h) == NVJPEG_STATUS_SUCCESS;
  if (!*hardware) KILN_NVJPEG_CHECK(nvjpegCreateEx(NVJPEG_BACKEND_DEFAULT, nullptr, nullptr, 0, &h));
  return h;
}

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Set when any GPU JPEG loader of the process has failed over: every loader's later epochs
// decode on the CPU, and no loader frees device or pinned memory any more (freeing waits for the
// whole device, stuck decode stream included), so destroying them cannot block.
std::atomic<bool> g_failed_over{false};

// The OnStream test stall: a host function on the decode stream that sleeps.
void CUDART_CB sleep_on_stream(void* seconds) {
  std::unique_ptr<double> s(static_cast<double*>(seconds));
  std::this_thread::sleep_for(std::chrono::duration<double>(*s));
}

}  // namespace

bool gpu_jpeg_available() { return cuda::is_available(); }
bool gpu_jpeg_failed_over() { return g_failed_over; }

struct GpuJpegLoader::Impl {
  int device = 0;
  DType dtype = DType::f16;
  NormalizeStats stats;
  int64_t S = 224;
  nvjpegHandle_t handle = nullptr;
  nvjpegJpegState_t state = nullptr;
  bool hardware = false;
  int initialized_for = -1;  // the batch size nvjpegDecodeBatchedInitialize last saw
  bool warned_batch_failure = false;
  cudaStream_t decode = nullptr;
  const ImageFolder* folder = nullptr;  // the host loader's (names in errors)

  // While an epoch runs, only the decode thread calls nvJPEG, and only to decode: the workers
  // decide from the header alone (takes_header), so one handle serves. nv_mu keeps
  // decodes_on_gpu's support check off the handle while the decode thread uses it.
  std::mutex nv_mu;
  nvjpegJpegStream_t parse_stream = nullptr;

  // The stall guard (GpuJpegLoader::set_stall_timeout): a decode thread inside a device call for
  // longer than this has hung; next() then fails over to the CPU (`failed_over`) or, with
  // failover off, gives up on the loader (`wedged`).
  double stall_timeout_s =
      switches().jpeg_stall_s > 0 ? switches().jpeg_stall_s : GpuJpegLoader::kStallTimeoutS;
  bool failover = true;
  std::atomic<bool> wedged{false};
  std::atomic<bool> failed_over{false};
  GpuJpegLoader::StallHandler on_stall;
  // The hand-over between the decode thread and a failover: the decode thread holds `handoff`
  // whenever it touches a batch, a slot or nvJPEG's state outside a device call (`outside`
  // releases it around each wait); the consumer takes it to set `abandoned`, after which the
  // thread, should its call ever return, touches nothing more.
  std::mutex handoff;
  bool abandoned = false;
  int host_slot = 0;  // after a failover: the slot whose buffers the CPU-path uploads use
  // Tests: the decode thread's test_stall_batch-th call (from 0) stalls for test_stall_s first,
  // as a hang would (GpuJpegLoader::set_test_stall; KILN_JPEG_TEST_STALL sets the OnStream kind).
  int64_t test_stall_batch = switches().jpeg_test_stall_call;
  double test_stall_s = switches().jpeg_test_stall_s;
  GpuJpegLoader::TestStall test_stall_where = GpuJpegLoader::TestStall::OnStream;
  int64_t decode_calls = 0;

  // One of two alternating batches in flight.
  struct Slot {
    DeviceBuffer decoded;  // nvJPEG's outputs, one aligned block per encoded sample
    DeviceBuffer staging;  // host-decoded samples (S, S, 3) u8 at i * S * S * 3
    DeviceBuffer jobs;     // CropResizeJob[B]
    DeviceBuffer labels;   // i64[B]
    cuda::CropResizeJob* jobs_host = nullptr;  // pinned, B entries
    int64_t jobs_cap = 0;
    std::shared_ptr<ImageBatch> host;  // kept until its uploads are complete
    cudaEvent_t ready = nullptr;     // decode stream: decode + uploads done (after a failover:
                                     // the consumer's stream, the CPU-path uploads done)
    cudaEvent_t consumed = nullptr;  // current stream: the fused kernel has read this slot
    cudaEvent_t started = nullptr;   // decode stream, KILN_JPEG_TRACE only: submit began
    bool used = false;               // `ready` has been recorded at least once
    bool identity_jobs = false;      // after a failover: `jobs` holds identity jobs over staging
    int64_t count = 0, gpu = 0, cpu = 0;
    double workers_s = 0, decode_s = 0;  // decode thread: waiting for the workers, nvJPEG's call
  };
  Slot slots[2];
  const bool trace = switches().jpeg_trace;
  // The share of JPEGs the workers decode instead of nvJPEG (GpuJpegLoader's host_fraction);
  // read by the workers, steered by next() when `adaptive`.
  std::atomic<double> host_share{0.0};
  bool adaptive = false;
  Trace times;  // written by the decode thread (one at a time) and next(); read when done

  // What the decode thread is doing, for the stall report in next(): a static string and when
  // it began (steady-clock nanoseconds).
  // `on_device`: a CUDA or nvJPEG call, which the stall guard may declare hung (waiting for the
  // workers or decoding on the host may legitimately take long).
  std::atomic<const char*> stage{"idle"};
  std::atomic<int64_t> stage_since{0};
  std::atomic<bool> stage_on_device{false};
  void enter(const char* what, bool on_device = true) {
    stage_since.store(TraceClock::now().time_since_epoch().count(), std::memory_order_relaxed);
    stage_on_device.store(on_device, std::memory_order_relaxed);
    stage.store(what, std::memory_order_relaxed);
  }
  double in_stage_s() const {
    return 1e-9 * double(TraceClock::now().time_since_epoch().count() -
                         stage_since.load(std::memory_order_relaxed));
  }
  // On the decode thread, holding `lk` (handoff): runs `wait` (a call that waits for nvJPEG or the
  // decode stream when on_device, else for the consumer's stream) as stage `what` with `lk`
  // released. False when the loader failed over meanwhile: the thread then returns at once.
  template <typename F>
  bool outside(std::unique_lock<std::mutex>& lk, const char* what, bool on_device, F&& wait) {
    enter(what, on_device);
    lk.unlock();
    wait();
    lk.lock();
    return !abandoned;
  }
  // Every slot's buffers at their full size for `batch` samples, so that the CPU path after a
  // failover never allocates (an allocation could wait for the whole device).
  void reserve(int64_t batch) {
    const int64_t img = S * S * 3;
    for (Slot& sl : slots) {
      sl.staging.ensure(size_t(batch * img));
      sl.jobs.ensure(size_t(batch) * sizeof(cuda::CropResizeJob));
      sl.labels.ensure(size_t(batch) * sizeof(int64_t));
      sl.jobs_host = static_cast<cuda::CropResizeJob*>(
          cuda::alloc_pinned(size_t(batch) * sizeof(cuda::CropResizeJob)));
      sl.jobs_cap = batch;
    }
  }

  Impl(int dev, DType dt, NormalizeStats st, int64_t size) : device(dev), dtype(dt), stats(st), S(size) {
    // The hardware decoder when the GPU has one, else the default backend.
    handle = create_handle(&hardware);
    KILN_NVJPEG_CHECK(nvjpegJpegStateCreate(handle, &state));
    KILN_NVJPEG_CHECK(nvjpegJpegStreamCreate(handle, &parse_stream));
    // The decode stream has the default priority. Earlier code gave it the device's highest,
    // so that nvJPEG's kernels would not queue behind a step's; it did not make the decode
    // faster (under a running step the hardware decoder's batched call waits for SM slots many
    // times per batch and takes about a step, docs/lab/input-pipeline.md, which is why the CPU
    // workers take a share), and the trainings that hung inside nvjpegDecodeBatched all ran with
    // it.
    CUDA_CHECK(cudaStreamCreateWithFlags(&decode, cudaStreamNonBlocking));
    const unsigned timing = trace ? cudaEventDefault : cudaEventDisableTiming;
    for (Slot& sl : slots) {
      CUDA_CHECK(cudaEventCreateWithFlags(&sl.ready, timing));
      CUDA_CHECK(cudaEventCreateWithFlags(&sl.consumed, cudaEventDisableTiming));
      if (trace) CUDA_CHECK(cudaEventCreate(&sl.started));
    }
  }
  // Never runs after a failover in the process (GpuJpegLoader's destructor leaks the Impl).
  ~Impl() {
    if (decode) cudaStreamSynchronize(decode);
    for (Slot& sl : slots) {
      if (sl.consumed) cudaEventSynchronize(sl.consumed);
      if (sl.ready) cudaEventDestroy(sl.ready);
      if (sl.started) cudaEventDestroy(sl.started);
      if (sl.consumed) cudaEventDestroy(sl.consumed);
      if (sl.jobs_host) {
        try {
          cuda::free_pinned(sl.jobs_host);
        } catch (const std::exception&) {
        }
      }
    }
    if (parse_stream) nvjpegJpegStreamDestroy(parse_stream);
    if (state) nvjpegJpegStateDestroy(state);
    if (handle) nvjpegDestroy(handle);
    if (decode) cudaStreamDestroy(decode);
  }

  // Whether a JPEG goes to nvJPEG, from its header alone (worker threads; no nvJPEG call):
  // 8-bit Huffman-coded gray or 3-component, and not progressive on the hardware decoder,
  // which refuses those (gpu_test_gpu_jpeg checks the rule against nvjpegDecodeBatchedSupported).
  // A file it passes that nvJPEG still fails sends its batch to the host (submit).
  bool takes_header(const JpegInfo& info) const {
    if (info.components != 1 && info.components != 3) return false;  // CMYK/YCCK: host
    if (info.arithmetic || info.precision != 8) return false;
    return !(hardware && info.progressive);
  }
  // Whether nvJPEG's batched decode takes this file, by asking it (nv_mu held).
  bool supported(const uint8_t* data, size_t size) {
    if (!hardware) return true;
    int unsupported = 1;  // nvJPEG reports 0 for "supported"
    if (nvjpegJpegStreamParseHeader(handle, data, size, parse_stream) != NVJPEG_STATUS_SUCCESS ||
        nvjpegDecodeBatchedSupported(handle, parse_stream, &unsupported) != NVJPEG_STATUS_SUCCESS)
      unsupported = 1;
    return unsupported == 0;
  }

  // On the decode thread, holding `lk` (handoff): decode + upload `batch` into `sl` and wait until
  // that device work is complete. False when the loader failed over meanwhile (nothing touched
  // after that).
  bool submit(Slot& sl, const std::shared_ptr<ImageBatch>& batch, ImageEpoch& ep,
              std::unique_lock<std::mutex>& lk) {
    CUDA_CHECK(cudaSetDevice(device));
    // The kernel that read the slot's previous batch must be complete before its buffers are
    // reused (that batch's decode and uploads are: it was handed over only then).
    auto t = TraceClock::now();
    if (sl.used &&
        !outside(lk, "cudaEventSynchronize on the step's read of the slot's previous batch", false,
                 [&] { CUDA_CHECK(cudaEventSynchronize(sl.consumed)); }))
      return false;
    if (trace) {
      times.slot_wait += since(t);
      CUDA_CHECK(cudaEventRecord(sl.started, decode));
    }
    sl.host.reset();
    sl.decode_s = 0;
    ImageBatch& b = *batch;
    const int64_t B = b.images.size(0), img = S * S * 3;
    std::vector<EncodedSample>& enc = *b.encoded;
    uint8_t* host_px = b.images.data<uint8_t>();
    std::vector<int64_t> gpu_idx;
    size_t total = 0;
    for (int64_t i = 0; i < B; ++i)
      if (!enc[size_t(i)].bytes.empty()) {
        gpu_idx.push_back(i);
        total += align_up(size_t(enc[size_t(i)].info.height * enc[size_t(i)].info.width * 3));
      }
    std::lock_guard nv(nv_mu);
    sl.decoded.ensure(std::max<size_t>(total, 1));
    KILN_CHECK(B <= sl.jobs_cap, "GpuJpegLoader: a batch of ", B, " samples, over the ",
               sl.jobs_cap, " its buffers were sized for");
    auto* staging = static_cast<uint8_t*>(sl.staging.ptr);
    auto* decoded = static_cast<uint8_t*>(sl.decoded.ptr);
    std::vector<bool> on_host(size_t(B), true);
    // nvJPEG's batched decode of the encoded samples. The decode stream is idle here: the last
    // batch's work on it was complete before that batch was handed over. (Without this order the
    // decode stream stopped draining mid-epoch, under a running step, in 7 of 8 nine-epoch
    // trainings; with it in none of 4, docs/lab/input-pipeline.md. Why is not known; a guess:
    // nvJPEG's hardware path has been reported (torchcodec PR 1634) not to order its writes
    // against the caller's stream, so a call that starts while the last one's work is still
    // queued may disturb it.)
    bool gpu_ok = false;
    if (!gpu_idx.empty()) {
      std::vector<const unsigned char*> data;
      std::vector<size_t> lengths;
      std::vector<nvjpegImage_t> dest(gpu_idx.size());
      size_t off = 0;
      for (size_t j = 0; j < gpu_idx.size(); ++j) {
        const EncodedSample& e = enc[size_t(gpu_idx[j])];
        data.push_back(e.bytes.data());
        lengths.push_back(e.bytes.size());
        dest[j] = nvjpegImage_t{};
        dest[j].channel[0] = decoded + off;
        dest[j].pitch[0] = size_t(e.info.width * 3);
        off += align_up(size_t(e.info.height * e.info.width * 3));
      }
      const int n = int(gpu_idx.size());
      const auto call = TraceClock::now();
      nvjpegStatus_t st = NVJPEG_STATUS_SUCCESS;
      const bool stall = decode_calls++ == test_stall_batch;
      if (!outside(lk, "nvjpegDecodeBatchedInitialize", true, [&] {
            if (initialized_for != n) {
              st = nvjpegDecodeBatchedInitialize(handle, state, n, 1, NVJPEG_OUTPUT_RGBI);
              initialized_for = st == NVJPEG_STATUS_SUCCESS ? n : -1;
            }
            enter("nvjpegDecodeBatched");
            if (stall && test_stall_where == GpuJpegLoader::TestStall::InCall)
              std::this_thread::sleep_for(std::chrono::duration<double>(test_stall_s));
            if (st == NVJPEG_STATUS_SUCCESS)
              st = nvjpegDecodeBatched(handle, state, data.data(), lengths.data(), dest.data(),
                                       decode);
            // The work the call left on the decode stream "never runs" (for test_stall_s).
            if (stall && test_stall_where == GpuJpegLoader::TestStall::OnStream)
              CUDA_CHECK(cudaLaunchHostFunc(decode, sleep_on_stream, new double(test_stall_s)));
          }))
        return false;
      gpu_ok = st == NVJPEG_STATUS_SUCCESS;
      sl.decode_s = since(call);
      if (trace) times.decode_call += sl.decode_s;
      if (!gpu_ok && !warned_batch_failure) {
        warned_batch_failure = true;
        std::fprintf(stderr,
                     "kiln: warning: nvJPEG batched decode failed (%s); that batch is decoded on "
                     "the host (reported once per loader)\n",
                     nvjpeg_status_name(st));
      }
      if (!gpu_ok) {
        initialized_for = -1;  // reset the state before the next batch
        if (!outside(lk, "cudaStreamSynchronize after a failed batched decode", true,
                     [&] { CUDA_CHECK(cudaStreamSynchronize(decode)); }))
          return false;
        enter("decoding a failed batch on the host", false);
      }
      off = 0;
      for (size_t j = 0; j < gpu_idx.size(); ++j) {
        const int64_t i = gpu_idx[j];
        const EncodedSample& e = enc[size_t(i)];
        if (gpu_ok) {
          cuda::CropResizeJob& job = sl.jobs_host[i];
          job = cuda::CropResizeJob{};
          job.src = decoded + off;
          job.pitch = e.info.width * 3;
          job.box_top = float(e.box.top);
          job.box_left = float(e.box.left);
          job.box_height = float(e.box.height);
          job.box_width = float(e.box.width);
          job.lim_top = int32_t(e.limit.top);
          job.lim_left = int32_t(e.limit.left);
          job.lim_height = int32_t(e.limit.height);
          job.lim_width = int32_t(e.limit.width);
          job.flip = e.flip ? 1 : 0;
          on_host[size_t(i)] = false;
        } else {
          // The host path for this sample: same box and flip; a file the host cannot decode
          // either is replaced (and its label with it).
          uint8_t* dst = host_px + i * img;
          try {
            decode_on_host(e, dst);
          } catch (const Error& err) {
            b.labels.data<int64_t>()[i] = ep.redo(e, reason_of(err), dst);
          }
        }
        off += align_up(size_t(e.info.height * e.info.width * 3));
      }
    }
    // Host-decoded samples: identity jobs over their uploaded (S, S, 3) pixels.
    enter("queueing the uploads");
    const auto enq = TraceClock::now();
    int64_t n_host = 0;
    for (int64_t i = 0; i < B; ++i) {
      if (!on_host[size_t(i)]) continue;
      ++n_host;
      set_identity_job(sl.jobs_host[i], staging + i * img);
    }
    if (n_host * 4 > B) {
      CUDA_CHECK(cudaMemcpyAsync(staging, host_px, size_t(B * img), cudaMemcpyHostToDevice, decode));
    } else {
      for (int64_t i = 0; i < B; ++i)
        if (on_host[size_t(i)])
          CUDA_CHECK(cudaMemcpyAsync(staging + i * img, host_px + i * img, size_t(img),
                                     cudaMemcpyHostToDevice, decode));
    }
    CUDA_CHECK(cudaMemcpyAsync(sl.jobs.ptr, sl.jobs_host, size_t(B) * sizeof(cuda::CropResizeJob),
                               cudaMemcpyHostToDevice, decode));
    CUDA_CHECK(cudaMemcpyAsync(sl.labels.ptr, b.labels.data<int64_t>(), size_t(B) * sizeof(int64_t),
                               cudaMemcpyHostToDevice, decode));
    CUDA_CHECK(cudaEventRecord(sl.ready, decode));
    if (trace) times.enqueue += since(enq);
    // The batch is handed over only once its device work is complete: the consumer's stream
    // never waits for the decode stream.
    if (!outside(lk, "cudaEventSynchronize on the batch's decode and uploads", true,
                 [&] { CUDA_CHECK(cudaEventSynchronize(sl.ready)); }))
      return false;
    if (trace) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, sl.started, sl.ready));
      times.gpu_span += 1e-3 * ms;
      ++times.gpu_spans;
      ++times.batches;
    }
    sl.used = true;
    sl.identity_jobs = false;
    sl.count = B;
    sl.gpu = B - n_host;
    sl.cpu = n_host;
    sl.host = batch;  // pinned pixels and labels stay alive until the slot is reused
    enter("idle", false);
    return true;
  }

  // A crop job that copies the (S, S, 3) pixels at src as they are.
  void set_identity_job(cuda::CropResizeJob& job, const uint8_t* src) const {
    job = cuda::CropResizeJob{};
    job.src = src;
    job.pitch = S * 3;
    job.box_height = job.box_width = float(S);
    job.lim_height = job.lim_width = int32_t(S);
  }

  // After a failover, on the consumer's thread: the samples of `b` left encoded for nvJPEG are
  // decoded by the CPU path into its pixels (a file that fails is replaced as the workers would).
  void decode_deferred(ImageBatch& b, ImageEpoch& ep) const {
    if (!b.encoded) return;
    const int64_t img = S * S * 3;
    uint8_t* px = b.images.data<uint8_t>();
    for (size_t i = 0; i < b.encoded->size(); ++i) {
      const EncodedSample& e = (*b.encoded)[i];
      if (e.bytes.empty()) continue;
      uint8_t* dst = px + int64_t(i) * img;
      try {
        decode_on_host(e, dst);
      } catch (const Error& err) {
        b.labels.data<int64_t>()[i] = ep.redo(e, reason_of(err), dst);
      }
    }
  }

  // After a failover, on the consumer's thread: `b`'s host pixels (all decoded) uploaded through
  // the host slot's buffers and normalised, all on the current stream, which therefore orders
  // each batch's upload after the previous batch's kernel; the pinned pixels live until the
  // next batch's turn. No allocation but x and y, which the step's allocator serves from its
  // cache as for every batch.
  DeviceBatch upload_host(std::shared_ptr<ImageBatch> b) {
    Slot& sl = slots[host_slot];
    cudaStream_t stream = cuda::current_stream();
    if (sl.host) CUDA_CHECK(cudaEventSynchronize(sl.ready));  // the previous batch's uploads ran
    sl.host.reset();
    const int64_t B = b->images.size(0), img = S * S * 3;
    auto* staging = static_cast<uint8_t*>(sl.staging.ptr);
    if (!sl.identity_jobs) {
      for (int64_t i = 0; i < sl.jobs_cap; ++i) set_identity_job(sl.jobs_host[i], staging + i * img);
      CUDA_CHECK(cudaMemcpyAsync(sl.jobs.ptr, sl.jobs_host,
                                 size_t(sl.jobs_cap) * sizeof(cuda::CropResizeJob),
                                 cudaMemcpyHostToDevice, stream));
      sl.identity_jobs = true;
    }
    CUDA_CHECK(cudaMemcpyAsync(staging, b->images.data<uint8_t>(), size_t(B * img),
                               cudaMemcpyHostToDevice, stream));
    DeviceBatch out;
    out.index = b->index;
    const Device dev = Device::cuda(device);
    out.x = empty({B, 3, S, S}, TensorOptions(dtype).with_device(dev).with_memory_format(
                                    MemoryFormat::ChannelsLast));
    cuda::crop_resize_normalize(out.x, static_cast<const cuda::CropResizeJob*>(sl.jobs.ptr), B,
                                stats.mean, stats.stddev);
    out.y = empty({B}, TensorOptions(DType::i64).with_device(dev));
    CUDA_CHECK(cudaMemcpyAsync(out.y.raw_data(), b->labels.data<int64_t>(),
                               size_t(B) * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaEventRecord(sl.ready, stream));
    sl.host = std::move(b);
    return out;
  }

  // The CPU path's pixels for an encoded sample: same box, limit and flip.
  void decode_on_host(const EncodedSample& e, uint8_t* dst) const {
    const std::string& name = (*folder)[e.index].path;
    if (jpeg_turbo_available()) {
      decode_jpeg_resampled(e.bytes.data(), e.bytes.size(), name, e.box, e.limit, S, S, e.flip,
                            dst);
      return;
    }
    const Image im = decode_image(e.bytes.data(), e.bytes.size(), name);
    resample_box(im.pixels.data(), im.height, im.width, 3, e.box, e.limit, dst, S, S, e.flip);
  }
  static std::string reason_of(const std::exception& e) { return strip_location(e.what()); }
};

struct GpuJpegEpoch::State {
  std::shared_ptr<GpuJpegLoader::Impl> impl;
  const ImageLoader* host_loader = nullptr;
  ImageEpoch host;
  int cur = 0;
  bool primed = false;
  // From the decode threads (detached: a future of std::async would block in its destructor
  // on a decode thread that never returns); true: the slot holds a batch.
  std::future<bool> submitted[2];
  // The batch each decode thread took from the workers (under impl->handoff): a failover takes
  // the stuck one's from here.
  std::shared_ptr<ImageBatch> inflight[2];
  // After a failover (or in an epoch begun after one): batches come from the workers through the
  // CPU path on the consumer's thread; `pending` is the batch the stuck thread held.
  bool host_mode = false;
  std::shared_ptr<ImageBatch> pending;
  // A decode thread of this epoch was left behind (stuck) by a failover or a wedge: the State is
  // leaked, not destroyed (GpuJpegEpoch's destructor), since that thread still points into it.
  bool left_behind = false;
  int64_t gpu = 0, cpu = 0;
  std::atomic<int64_t> fetched{0};  // batches the decode thread took from the workers
  TraceClock::time_point returned{};  // when next() last returned a batch (trace)

  State(std::shared_ptr<GpuJpegLoader::Impl> i, ImageEpoch h) : impl(std::move(i)), host(std::move(h)) {}
  // A decode thread uses this State until it has set its promise, so the State waits for it.
  ~State() {
    for (auto& f : submitted)
      if (f.valid()) {
        try {
          f.get();
        } catch (...) {
        }
      }
    if (impl->trace) report();
  }

  // KILN_JPEG_TRACE: the epoch's mean milliseconds per batch, by stage; then the counters reset.
  void report() {
    Trace& t = impl->times;
    if (t.batches == 0) return;
    const double n = double(t.batches), ms = 1e3;
    std::fprintf(stderr,
                 "kiln: jpeg trace: %ld batches, ms per batch: decode thread [workers' batch %.2f, "
                 "slot wait %.2f, nvjpegDecodeBatched %.2f, enqueue %.2f] | next() blocked %.2f, "
                 "consumer between next() calls %.2f | decode stream span %.2f (%ld spans) | "
                 "%ld nvJPEG + %ld host samples, host share %.2f\n",
                 long(t.batches), ms * t.host_next / n, ms * t.slot_wait / n,
                 ms * t.decode_call / n, ms * t.enqueue / n, ms * t.next_wait / n,
                 ms * t.between / std::max(1.0, n - 1), ms * t.gpu_span / double(std::max<int64_t>(1, t.gpu_spans)),
                 long(t.gpu_spans), long(gpu), long(cpu), impl->host_share.load());
    t = Trace{};
  }

  // Waits for the decode thread's batch; true when it came. Every kStallReportS it is late, says
  // on stderr where the decode thread is (a hang then names the call it hangs in). When the
  // decode thread has been inside one device call for the loader's stall timeout, the guard
  // fires: a failover (returns false) or, with failover off, a wedge (throws).
  static constexpr double kStallReportS = 60;
  bool await(std::future<bool>& f) {
    const auto t0 = TraceClock::now();
    double next_report = kStallReportS;
    while (f.wait_for(std::chrono::milliseconds(250)) != std::future_status::ready) {
      const double late = since(t0), in_stage = impl->in_stage_s();
      const char* stage = impl->stage.load(std::memory_order_relaxed);
      if (impl->stage_on_device.load(std::memory_order_relaxed) &&
          in_stage >= impl->stall_timeout_s) {
        left_behind = true;
        const bool driver_held = impl->failover && !driver_free();
        if (impl->failover && !driver_held) {
          fail_over(stage, in_stage);
          return false;
        }
        impl->wedged = true;
        const std::string msg = detail::str_cat(
            "GPU JPEG loader: its decode thread has been in \"", stage, "\" for ",
            int64_t(in_stage), " s (stall timeout ", impl->stall_timeout_s, " s), so it has hung",
            driver_held ? ", and it holds the CUDA driver (a copy on this thread did not go "
                          "through), so the CPU decoder cannot take over either"
                        : "",
            "; the loader cannot go on (", fetched.load(), " of the epoch's ", host.size(),
            " batches came from the workers). Decode on the CPU instead: kiln-train "
            "--decoder cpu (--resume PATH continues from the last checkpoint)");
        if (impl->on_stall) impl->on_stall(msg);
        KILN_FAIL(msg);
      }
      if (late >= next_report) {
        next_report += kStallReportS;
        std::fprintf(stderr,
                     "kiln: GPU JPEG loader: the next batch is %.0f s late; its decode thread has "
                     "been in \"%s\" for %.0f s (%ld of the epoch's %ld batches came from the "
                     "workers)\n",
                     late, stage, in_stage, long(fetched.load()), long(host.size()));
      }
    }
    return true;
  }

  // Whether a CUDA copy from this thread still goes through. A thread stuck inside nvJPEG's call
  // can hold the CUDA driver's context lock, and then every copy of the process waits with it
  // (seen on the H200 when the decode stream stopped draining during nvjpegDecodeBatched: the
  // CPU path's first upload waited inside cuMemcpyHtoDAsync until the call returned). So before
  // a failover, one 8-byte copy on the current stream, into the host slot's labels (unused in
  // host mode), must return within kDriverProbeS; a copy that does not is left behind.
  static constexpr double kDriverProbeS = 2;
  bool driver_free() {
    GpuJpegLoader::Impl::Slot& sl = impl->slots[cur ^ 1];
    void* dst = sl.labels.ptr;
    const void* src = sl.jobs_host;
    const cudaStream_t stream = cuda::current_stream();
    const int dev = impl->device;
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> f = done->get_future();
    std::thread([done, dst, src, stream, dev] {
      cudaSetDevice(dev);
      cudaMemcpyAsync(dst, src, 8, cudaMemcpyHostToDevice, stream);
      done->set_value();
    }).detach();
    return f.wait_for(std::chrono::duration<double>(kDriverProbeS)) == std::future_status::ready;
  }

  // The guard fired with failover on: the stuck thread is abandoned (should its call return, it
  // touches nothing more), the batch it held and every later one go through the CPU path, and
  // the workers decode every JPEG from now on (epochs begun later too, in every loader).
  void fail_over(const char* stage, double in_stage) {
    {
      std::lock_guard lk(impl->handoff);
      impl->abandoned = true;
      pending = inflight[cur];
    }
    impl->host_slot = cur ^ 1;
    impl->host_share.store(1.0);
    impl->adaptive = false;
    impl->failed_over = true;
    cuda::mark_stream_stuck();  // from here nothing that would wait for the stuck stream
    host_mode = true;
    if (!g_failed_over.exchange(true))
      std::fprintf(stderr,
                   "kiln: warning: GPU JPEG loader: nvJPEG's decode thread has been in \"%s\" for "
                   "%.0f s (stall timeout %g s), so it has hung; it is left behind, and from batch "
                   "%ld of this epoch on every JPEG is decoded on the CPU (every GPU JPEG loader "
                   "of this process), so the run goes on\n",
                   stage, in_stage, impl->stall_timeout_s,
                   long(pending ? pending->index : fetched.load()));
  }

  // Fetches the next host batch and submits it into slot s, on a decode thread of its own.
  void schedule(int s) {
    auto done = std::make_shared<std::promise<bool>>();
    submitted[s] = done->get_future();
    std::thread([this, s, done] {
      try {
        const auto t = TraceClock::now();
        impl->enter("waiting for the workers' batch", false);
        std::optional<ImageBatch> b = host.next();
        if (b) ++fetched;
        const double waited = since(t);
        if (impl->trace) impl->times.host_next += waited;
        bool delivered = false;
        if (b) {
          auto batch = std::make_shared<ImageBatch>(std::move(*b));
          std::unique_lock lk(impl->handoff);
          inflight[s] = batch;
          impl->slots[s].workers_s = waited;
          delivered = !impl->abandoned && impl->submit(impl->slots[s], batch, host, lk);
          if (delivered) inflight[s].reset();
        }
        done->set_value(delivered);  // the last use of this State
      } catch (...) {
        done->set_exception(std::current_exception());
      }
    }).detach();
  }

  // After a failover: the next batch through the CPU path, on this thread.
  std::optional<DeviceBatch> next_on_host() {
    std::shared_ptr<ImageBatch> b = std::move(pending);
    if (!b) {
      std::optional<ImageBatch> nb = host.next();
      if (!nb) return std::nullopt;
      ++fetched;
      b = std::make_shared<ImageBatch>(std::move(*nb));
    }
    impl->decode_deferred(*b, host);
    cpu += b->images.size(0);
    return impl->upload_host(std::move(b));
  }

  std::optional<DeviceBatch> next() {
    KILN_CHECK(cuda::current_device() == impl->device, "GpuJpegEpoch::next: the loader's device ",
               impl->device, " is not the current device (", cuda::current_device(), ")");
    if (host_mode) return next_on_host();
    if (!primed) {
      primed = true;
      schedule(0);
    }
    if (!submitted[cur].valid()) return std::nullopt;
    const auto t = TraceClock::now();
    if (impl->trace && returned != TraceClock::time_point{})
      impl->times.between += std::chrono::duration<double>(t - returned).count();
    if (!await(submitted[cur])) return next_on_host();  // failed over
    const bool has = submitted[cur].get();  // rethrows the decode thread's error
    const double blocked = since(t);
    if (impl->trace) impl->times.next_wait += blocked;
    if (!has) return std::nullopt;
    if (impl->adaptive) {
      const GpuJpegLoader::Impl::Slot& done = impl->slots[cur];
      impl->host_share.store(
          GpuJpegLoader::steer_share(impl->host_share.load(std::memory_order_relaxed), blocked,
                                     done.workers_s),
          std::memory_order_relaxed);
    }
    // Batch k + 1 starts reading, decoding and uploading while k is consumed.
    schedule(cur ^ 1);
    GpuJpegLoader::Impl::Slot& sl = impl->slots[cur];
    // sl's decode and uploads are complete (the decode thread waited for them): the current
    // stream does not wait for the decode stream.
    cudaStream_t stream = cuda::current_stream();
    const int64_t B = sl.count, S = impl->S;
    DeviceBatch out;
    out.index = sl.host->index;
    const Device dev = Device::cuda(impl->device);
    out.x = empty({B, 3, S, S}, TensorOptions(impl->dtype).with_device(dev).with_memory_format(
                                    MemoryFormat::ChannelsLast));
    cuda::crop_resize_normalize(out.x, static_cast<const cuda::CropResizeJob*>(sl.jobs.ptr), B,
                                impl->stats.mean, impl->stats.stddev);
    out.y = empty({B}, TensorOptions(DType::i64).with_device(dev));
    CUDA_CHECK(cudaMemcpyAsync(out.y.raw_data(), sl.labels.ptr, size_t(B) * sizeof(int64_t),
                               cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaEventRecord(sl.consumed, stream));
    gpu += sl.gpu;
    cpu += sl.cpu;
    cur ^= 1;
    if (impl->trace) returned = TraceClock::now();
    return out;
  }
};

namespace {
// A fixed pseudo-random number in [0, 1) for a file's bytes (FNV-1a over its size and up to 64
// bytes from its middle): which files host_fraction sends to the host.
double file_fraction(const uint8_t* data, size_t size) {
  uint64_t h = 1469598103934665603ULL ^ uint64_t(size);
  const size_t from = size / 2, to = std::min(size, from + 64);
  for (size_t i = from; i < to; ++i) h = (h ^ data[i]) * 1099511628211ULL;
  return double(h >> 11) * 0x1.0p-53;
}
}  // namespace

GpuJpegLoader::GpuJpegLoader(ImageFolder folder, ImageLoaderOptions opts, Device device,
                             DType dtype, NormalizeStats stats, double host_fraction) {
  KILN_CHECK((host_fraction >= 0.0 && host_fraction <= 1.0) || host_fraction == kAdaptiveHostShare,
             "GpuJpegLoader: host_fraction must be in [0, 1] or kAdaptiveHostShare, got ",
             host_fraction);
  KILN_CHECK(device.is_cuda() && device.index >= 0 && device.index < cuda::device_count(),
             "GpuJpegLoader: ", device.str(), " is not a present CUDA device");
  KILN_CHECK(dtype == DType::f16 || dtype == DType::f32,
             "GpuJpegLoader: output dtype must be f16 or f32, got ", dtype_name(dtype));
  for (int c = 0; c < 3; ++c)
    KILN_CHECK(stats.stddev[c] > 0.0f, "GpuJpegLoader: stddev[", c, "] must be > 0");
  // nvJPEG's handle and the decode stream belong to `device`.
  const int prev = cuda::current_device();
  cuda::set_device(device.index);
  try {
    impl_ = std::make_shared<Impl>(device.index, dtype, stats, opts.image_size);
    impl_->reserve(std::max<int64_t>(opts.batch_size, 1));
  } catch (...) {
    cuda::set_device(prev);
    throw;
  }
  cuda::set_device(prev);
  Impl* impl = impl_.get();
  impl->adaptive = host_fraction == kAdaptiveHostShare;
  impl->host_share = impl->adaptive ? 0.0 : host_fraction;
  opts.defer_jpeg = [impl](const uint8_t* d, size_t n, const JpegInfo& info) {
    const double share = impl->host_share.load(std::memory_order_relaxed);
    if (share > 0.0 && file_fraction(d, n) < share) return false;
    return impl->takes_header(info);
  };
  host_ = std::make_unique<ImageLoader>(std::move(folder), std::move(opts));
  impl_->folder = &host_->folder();
}

// After a wedge or a failover a decode thread is stuck inside nvJPEG with pointers into the
// loader's state (the host loader's folder and epoch, the Impl's buffers); if it ever returns it
// must find them alive, so the loader and its epoch are leaked instead of destroyed. After a
// failover anywhere in the process every loader is leaked: freeing device or pinned memory waits
// for the whole device, stuck decode stream included.
GpuJpegLoader::~GpuJpegLoader() {
  if (impl_ && (impl_->wedged || g_failed_over)) {
    (void)host_.release();
    new std::shared_ptr<Impl>(std::move(impl_));
  }
}

void GpuJpegLoader::set_stall_timeout(double seconds) {
  KILN_CHECK(seconds > 0, "GpuJpegLoader::set_stall_timeout: seconds must be > 0, got ", seconds);
  impl_->stall_timeout_s = seconds;
}
void GpuJpegLoader::set_failover(bool on) { impl_->failover = on; }
void GpuJpegLoader::set_test_stall(int64_t call, double seconds, TestStall where) {
  impl_->test_stall_batch = call;
  impl_->test_stall_s = seconds;
  impl_->test_stall_where = where;
}
bool GpuJpegLoader::wedged() const { return impl_->wedged; }
bool GpuJpegLoader::failed_over() const { return impl_->failed_over; }
void GpuJpegLoader::set_stall_handler(StallHandler h) { impl_->on_stall = std::move(h); }

const char* GpuJpegLoader::backend() const { return impl_->hardware ? "hardware" : "default"; }
double GpuJpegLoader::host_share() const { return impl_->host_share.load(); }

bool GpuJpegLoader::decodes_on_gpu(const std::string& path) const {
  const std::vector<uint8_t> bytes = read_file_bytes(path);
  if (!looks_like_jpeg(bytes.data(), bytes.size())) return false;
  const JpegInfo info = read_jpeg_info(bytes.data(), bytes.size(), path);
  KILN_CHECK(!impl_->wedged, "GpuJpegLoader::decodes_on_gpu: the loader is wedged");
  if (g_failed_over) return false;  // and the stuck thread may hold nv_mu for ever
  std::lock_guard nv(impl_->nv_mu);
  return impl_->takes_header(info) && impl_->supported(bytes.data(), bytes.size());
}

GpuJpegEpoch GpuJpegLoader::epoch(int64_t e, int64_t first) const {
  // After a failover in the process: the workers decode every JPEG (set before they start).
  const bool on_host = g_failed_over;
  if (on_host) {
    impl_->host_share.store(1.0);
    impl_->adaptive = false;
  }
  auto s = std::make_unique<GpuJpegEpoch::State>(impl_, host_->epoch(e, first));
  s->host_loader = host_.get();
  s->host_mode = on_host;
  return GpuJpegEpoch(std::move(s));
}

GpuJpegEpoch::GpuJpegEpoch(std::unique_ptr<State> s) : state_(std::move(s)) {}
GpuJpegEpoch::GpuJpegEpoch(GpuJpegEpoch&&) noexcept = default;
GpuJpegEpoch& GpuJpegEpoch::operator=(GpuJpegEpoch&& other) noexcept {
  if (this != &other) {
    if (state_ && state_->left_behind) (void)state_.release();  // see ~GpuJpegLoader
    state_ = std::move(other.state_);
  }
  return *this;
}
GpuJpegEpoch::~GpuJpegEpoch() {
  if (state_ && state_->left_behind) (void)state_.release();  // see ~GpuJpegLoader
}

std::optional<DeviceBatch> GpuJpegEpoch::next() {
  KILN_CHECK(state_, "GpuJpegEpoch::next on a moved-from epoch");
  KILN_CHECK(!state_->impl->wedged, "GpuJpegEpoch::next: the loader is wedged (an earlier next() "
             "said why)");
  return state_->next();
}
int64_t GpuJpegEpoch::size() const { return state_ ? state_->host.size() : 0; }
int64_t GpuJpegEpoch::bad_count() const { return state_ ? state_->host.bad_count() : 0; }
int64_t GpuJpegEpoch::gpu_decoded() const { return state_ ? state_->gpu : 0; }
int64_t GpuJpegEpoch::host_decoded() const { return state_ ? state_->cpu : 0; }
double GpuJpegEpoch::host_share() const { return state_ ? state_->impl->host_share.load() : 0.0; }

#else  // built without nvJPEG

bool gpu_jpeg_available() { return false; }
bool gpu_jpeg_failed_over() { return false; }

struct GpuJpegLoader::Impl {};
struct GpuJpegEpoch::State {};

GpuJpegLoader::GpuJpegLoader(ImageFolder, ImageLoaderOptions, Device, DType, NormalizeStats,
                             double) {
  KILN_FAIL("GpuJpegLoader: kiln was built without nvJPEG (CUDA builds find it in the toolkit)");
}
GpuJpegLoader::~GpuJpegLoader() = default;
void GpuJpegLoader::set_stall_timeout(double) {}
void GpuJpegLoader::set_failover(bool) {}
void GpuJpegLoader::set_test_stall(int64_t, double, TestStall) {}
bool GpuJpegLoader::wedged() const { return false; }
bool GpuJpegLoader::failed_over() const { return false; }
void GpuJpegLoader::set_stall_handler(StallHandler) {}
const char* GpuJpegLoader::backend() const { return "none"; }
double GpuJpegLoader::host_share() const { return 0.0; }
GpuJpegEpoch GpuJpegLoader::epoch(int64_t, int64_t) const {
  KILN_FAIL("GpuJpegLoader: built without nvJPEG");
}
bool GpuJpegLoader::decodes_on_gpu(const std::string&) const { return false; }
GpuJpegEpoch::GpuJpegEpoch(std::unique_ptr<State> s) : state_(std::move(s)) {}
GpuJpegEpoch::GpuJpegEpoch(GpuJpegEpoch&&) noexcept = default;
GpuJpegEpoch& GpuJpegEpoch::operator=(GpuJpegEpoch&&) noexcept = default;
GpuJpegEpoch::~GpuJpegEpoch() = default;
std::optional<DeviceBatch> GpuJpegEpoch::next() { KILN_FAIL("GpuJpegLoader: built without nvJPEG"); }
int64_t GpuJpegEpoch::size() const { return 0; }
int64_t GpuJpegEpoch::bad_count() const { return 0; }
int64_t GpuJpegEpoch::gpu_decoded() const { return 0; }
int64_t GpuJpegEpoch::host_decoded() const { return 0; }
double GpuJpegEpoch::host_share() const { return 0.0; }

#endif

}  // namespace kiln::data
