#pragma once
// The GPU input path: an ImageFolder's JPEGs decoded by nvJPEG on the device and turned into the
// model's input by one fused kernel, ahead of the training step.
//
//   GpuJpegLoader loader(ImageFolder(root + "/train"), opts);          // ImageLoaderOptions
//   GpuJpegEpoch ep = loader.epoch(e);
//   while (std::optional<DeviceBatch> b = ep.next()) step(b->x, b->y);  // x f16 NHWC on the GPU
//
// Per batch: the ImageLoader's workers (data/image_loader.h; same order, sharding, seeds and
// bad-file rules) read each file, parse its header and draw its crop box and flip on the host,
// exactly as the CPU path does; a JPEG that nvJPEG takes (below) is kept encoded, anything else
// (PNG, progressive JPEGs on the hardware decoder, CMYK, ...) is decoded and resampled on the
// worker by the CPU path. A decode thread then runs nvjpegDecodeBatched for the encoded samples
// (full-size RGB, interleaved) into a device buffer on the loader's decode stream, uploads the
// host-decoded samples and the per-sample crop jobs, records an event and waits for it: a batch
// is handed to next() only once its device work is complete. next() then runs
// cuda::crop_resize_normalize (cuda/crop_resize.h) into a fresh x on the current stream, which
// never waits for the decode stream (so a decode stream that stops draining cannot stop the
// step: the stall guard below). So batch k + 1's file reading, decoding and uploads overlap the
// step of batch k, and consecutive nvJPEG calls never overlap one another's device work
// (without that the decode stream hung: docs/lab/input-pipeline.md, 2026-12-01). The decode
// stream has the default priority. Bitstreams stay in pageable host memory (nvJPEG
// copies them); reading them into pinned buffers is not done. Under a running step nvJPEG's
// batched call takes about a step whatever it decodes, so a share of the JPEGs is decoded by the
// workers instead (host_fraction, or the adaptive share below). KILN_JPEG_TRACE=1 prints where
// each epoch's time went.
//
// Backend: nvJPEG's hardware decoder where the GPU has one (A100, H100/H200: baseline JPEGs),
// else its default
// (hybrid) backend, whose Huffman decoding runs on the decode thread. Measured on the H200
// (tests/gpu/test_gpu_jpeg.cpp): the hardware decoder takes baseline RGB and grayscale JPEGs
// and refuses progressive ones; CMYK/YCCK never go to nvJPEG. The workers decide by the header
// alone (8-bit Huffman-coded, 1 or 3 components, not progressive on the hardware decoder): only
// the decode thread calls nvJPEG while an epoch runs. If a batched decode fails, that
// batch's encoded samples are decoded on the host instead, and a file that fails there too is
// replaced as the CPU path replaces bad files (ImageEpoch::redo). Not caught: corrupt scan data
// behind a valid header, which the H200's hardware decoder decodes to garbage without an error
// (the CPU path rejects such files).
//
// Output: x (B, 3, S, S) channels-last, f16 (or f32), normalised with `stats`; y i64 (B); both
// fresh tensors on the loader's device, written on the current stream. One epoch at a time per
// loader (they share the decode buffers); use it from one thread, on the loader's device.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "data/device_batches.h"
#include "data/image_loader.h"

namespace kiln::data {

// Built with nvJPEG and a CUDA device present.
bool gpu_jpeg_available();
// Whether a GPU JPEG loader of this process has failed over (GpuJpegLoader::set_failover). Its
// decode stream may still hold work that never runs, so anything that waits for the whole device
// would wait for ever: freeing device or pinned memory, allocating pinned memory, the CUDA
// context's teardown at exit. A program then leaks what it would free and leaves with _Exit.
bool gpu_jpeg_failed_over();

class GpuJpegEpoch;

class GpuJpegLoader {
 public:
  // opts as for ImageLoader (its defer_jpeg is set here); batches land on `device` (which must
  // be the current device when epochs are consumed); dtype f16 or f32. Throws kiln::Error when
  // nvJPEG is not built in or the device is missing, and for ImageLoader's bad options.
  // host_fraction in [0, 1]: that fraction of the JPEGs nvJPEG would take is decoded by the
  // CPU path on the workers instead (chosen per file by a hash of its bytes, so batches stay the
  // same for any worker count), to share the decoding between GPU and CPU when the GPU decoder
  // cannot keep up with the step alone. kAdaptiveHostShare: the share is steered while batches
  // are consumed (below), which is fastest but makes which decoder a file meets depend on timing
  // (the two decoders' pixels differ by about one level on average; boxes and flips never do).
  GpuJpegLoader(ImageFolder folder, ImageLoaderOptions opts, Device device,
                DType dtype = DType::f16, NormalizeStats stats = {}, double host_fraction = 0.0);

  // The adaptive share. Why it exists: the hardware decoder alone outruns a ResNet-50 step on an
  // idle GPU, but under a running step nvJPEG's batched call takes about 22 ms plus 0.1 ms per
  // image (measured on the H200, docs/lab/input-pipeline.md), where the step takes 30: nvJPEG alone
  // feeds ~6,100 images/s, and the 16 CPU workers alone ~7,000. Together they keep up when each
  // gets the share it finishes within a step, and the decode thread's cycle (wait for the
  // workers' batch, then nvJPEG's call) is shortest at the share where the workers just keep up:
  // more on the CPU makes the decode thread wait for them, more on nvJPEG lengthens its call.
  // So after each batch that made next() wait (kBlockedS), the share moves by kShareStep: up when
  // the workers had that batch ready (waited at most kWorkersBehindS), down when they did not;
  // when next() did not wait it stays. It starts at 0 and lives as long as the loader (epochs
  // continue where the last one ended), within [0, kMaxAdaptiveShare]. (The first rule, up
  // while nvJPEG's call took longer than the workers' wait, settled where the CPU was already
  // behind: 89-90% of synthetic.)
  static constexpr double kAdaptiveHostShare = -1.0;
  static constexpr double kShareStep = 0.01;
  static constexpr double kMaxAdaptiveShare = 1.0;
  static constexpr double kBlockedS = 0.5e-3;  // next() waited longer: the input path is behind
  static constexpr double kWorkersBehindS = 1e-3;  // the decode thread waited longer: CPU behind
  // One step of the adaptive share after a batch: next() was blocked `blocked_s` waiting for it;
  // its decode thread waited `workers_s` for the workers' batch. Pure, so it is tested without a
  // GPU (tests/test_image_folder.cpp).
  static double steer_share(double share, double blocked_s, double workers_s);
  // The share of JPEGs the workers decode now (fixed or adaptive).
  double host_share() const;
  ~GpuJpegLoader();

  // The stall guard. nvJPEG's batched decode on the H200's hardware decoder has hung (never
  // returned, or left work on the decode stream that never ran) in some trainings
  // (docs/lab/input-pipeline.md). When a decode thread has been inside one call that waits for
  // nvJPEG or the decode stream for `seconds`, the guard fires. Waiting for the workers or for
  // the consumer's stream never counts. A stall report goes to stderr every 60 s before that.
  //
  // Then, with failover on (the default) and the CUDA driver free (below), the loader fails over
  // to the CPU: the stuck thread is left behind (with the state it points into, leaked rather
  // than destroyed), one warning on
  // stderr says so, and the batch it held and every later batch of every epoch are decoded by
  // the CPU path (libjpeg-turbo or stb, the ImageLoader's boxes and flips) and uploaded on the
  // consumer's stream, so the run goes on. This works because the consumer's stream never waits
  // for the decode stream: the decode thread hands a batch over only once its device work is
  // complete, so a decode stream that stops draining stops only the decode thread. The batches
  // already prefetched by the workers with JPEGs left for nvJPEG are decoded on the consumer's
  // thread (a few slow batches). Every GPU JPEG loader of the process starts its later epochs
  // on the CPU path too. A thread stuck inside nvJPEG's own call can hold the CUDA driver, and
  // then no copy of the process goes through (seen on the H200): when a test copy does not return
  // within 2 s there is no failover. Then, and with failover off, next() throws kiln::Error
  // instead (after the stall handler) and the loader is wedged: every later next() throws.
  static constexpr double kStallTimeoutS = 120;
  void set_stall_timeout(double seconds);
  void set_failover(bool on);
  bool failed_over() const;  // the guard fired with failover on
  bool wedged() const;       // the guard fired with failover off
  // Called with the message on the consuming thread when the guard fires without a failover,
  // before next() throws it. A stuck decode can leave the device's queues stuck too, and then unwinding
  // (which frees pinned and device memory, and so synchronises) blocks; a program can print and
  // leave from here.
  using StallHandler = std::function<void(const std::string& message)>;
  void set_stall_handler(StallHandler handler);
  // Tests of the guard: the decode thread's call-th nvJPEG batch (from 0) stalls for `seconds`.
  // InCall: the thread sleeps inside the nvjpegDecodeBatched stage. OnStream: a host function
  // that sleeps is queued on the decode stream after the call, so the work the call left there
  // does not run (what the hangs did once consecutive calls were serialised) and anything that
  // waits for the whole device would wait with it.
  enum class TestStall { InCall, OnStream };
  void set_test_stall(int64_t call, double seconds, TestStall where = TestStall::InCall);

  const ImageLoader& host() const { return *host_; }
  int64_t num_batches() const { return host_->num_batches(); }
  // "hardware" or "default": the nvJPEG backend in use.
  const char* backend() const;
  // Epoch e from batch `first` (ImageLoader::epoch's rule; kiln::Error outside [0,
  // num_batches()]).
  GpuJpegEpoch epoch(int64_t e, int64_t first = 0) const;
  // Whether this JPEG file would be decoded by nvJPEG (false: on the host): the workers' header
  // rule, and nvjpegDecodeBatchedSupported asked. For reports and tests; not while an epoch runs.
  bool decodes_on_gpu(const std::string& path) const;

  struct Impl;  // nvJPEG handle and state, decode stream, device buffers (data/gpu_jpeg.cpp)

 private:
  std::unique_ptr<ImageLoader> host_;
  std::shared_ptr<Impl> impl_;
};

class GpuJpegEpoch {
 public:
  GpuJpegEpoch(GpuJpegEpoch&&) noexcept;
  GpuJpegEpoch& operator=(GpuJpegEpoch&&) noexcept;
  ~GpuJpegEpoch();
  // The next batch in index order, std::nullopt after the last; rethrows workers' and the
  // decode thread's errors.
  std::optional<DeviceBatch> next();
  int64_t size() const;
  int64_t bad_count() const;
  int64_t gpu_decoded() const;  // samples decoded by nvJPEG so far in this epoch
  int64_t host_decoded() const;  // samples decoded on the host (not nvJPEG's, or a failed batch)
  double host_share() const;     // the loader's current share (GpuJpegLoader::host_share)

  struct State;

 private:
  friend class GpuJpegLoader;
  explicit GpuJpegEpoch(std::unique_ptr<State> s);
  std::unique_ptr<State> state_;
};

}  // namespace kiln::data
