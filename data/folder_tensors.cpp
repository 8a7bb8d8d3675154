#include "data/folder_tensors.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#include "core/error.h"
#include "data/image.h"
#include "data/jpeg_turbo.h"
#include "data/transforms.h"

namespace kiln::data {

namespace {

// Decodes `path` into dst (3, S, S) u8; kiln::Error naming the file when it cannot.
void decode_into(const std::string& path, int64_t S, bool stb, std::vector<uint8_t>& bytes,
                 std::vector<uint8_t>& hwc, uint8_t* dst) {
  read_file_into(path, bytes);
  const Image im = stb ? decode_image_stb(bytes.data(), bytes.size(), path)
                      : decode_image(bytes.data(), bytes.size(), path);
  const uint8_t* src = im.pixels.data();
  if (im.height != S || im.width != S) {
    hwc.resize(size_t(S * S * 3));
    resize_center_crop(src, im.height, im.width, 3, S, S, hwc.data());
    src = hwc.data();
  }
  const int64_t hw = S * S;
  for (int64_t p = 0; p < hw; ++p)
    for (int64_t c = 0; c < 3; ++c) dst[c * hw + p] = src[p * 3 + c];
}

}  // namespace

FolderTensors decode_image_folder(const ImageFolder& folder, const FolderTensorsOptions& o) {
  KILN_CHECK(o.size >= 1 && o.size <= kMaxImageSide, "decode_image_folder: size ", o.size,
             " outside 1..", kMaxImageSide);
  KILN_CHECK(o.threads >= 1, "decode_image_folder: threads must be >= 1, got ", o.threads);
  const int64_t n = folder.size(), S = o.size, per_image = 3 * S * S;
  Tensor all = empty({n, 3, S, S}, DType::u8);
  uint8_t* pixels = n > 0 ? all.data<uint8_t>() : nullptr;
  std::vector<std::string> why(static_cast<size_t>(n));  // empty: decoded
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::exception_ptr fatal;  // not a file's fault (out of memory): rethrown after the join
  auto work = [&] {
    std::vector<uint8_t> bytes, hwc;
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      try {
        decode_into(folder[i].path, S, o.stb, bytes, hwc, pixels + i * per_image);
      } catch (const IoError& e) {
        why[size_t(i)] = e.what();
      } catch (const Error& e) {
        why[size_t(i)] = strip_location(e.what());
      } catch (...) {
        std::lock_guard lk(mu);
        if (!fatal) fatal = std::current_exception();
        next.store(n);
      }
    }
  };
  std::vector<std::thread> threads;
  try {
    for (int t = 1; t < o.threads && t < n; ++t) threads.emplace_back(work);
  } catch (const std::system_error&) {
    // Out of threads: the ones that started, and this one, decode everything.
  }
  work();
  for (std::thread& t : threads) t.join();
  if (fatal) std::rethrow_exception(fatal);

  FolderTensors out;
  for (int64_t i = 0; i < n; ++i)
    if (!why[size_t(i)].empty()) out.unreadable.push_back(why[size_t(i)]);
  const int64_t bad = int64_t(out.unreadable.size()), good = n - bad;
  if (o.warn)
    for (size_t k = 0; k < out.unreadable.size() && k < 10; ++k)
      std::fprintf(stderr, "kiln: warning: skipping unreadable sample: %s%s\n",
                   out.unreadable[k].c_str(),
                   k == 9 && bad > 10 ? " (further unreadable samples are skipped and counted "
                                        "without a warning)"
                                      : "");
  const double limit = std::max(o.max_bad_fraction * double(n), double(o.min_bad_files));
  if (good == 0 || double(bad) > limit) {
    std::string list;
    for (size_t k = 0; k < out.unreadable.size() && k < 3; ++k)
      list += (k ? "; " : "") + out.unreadable[k];
    KILN_IO_FAIL("'", folder.root(), "': ", bad, " of its ", n, " image files cannot be read",
                 good == 0 ? "" : ", more than the limit of max(max_bad_fraction x files, "
                                  "min_bad_files)",
                 ": ", list, bad > 3 ? "; ..." : "");
  }

  std::vector<int64_t> labels;
  labels.reserve(size_t(good));
  if (bad == 0) {
    out.images = all;
    for (int64_t i = 0; i < n; ++i) labels.push_back(folder[i].label);
  } else {
    out.images = empty({good, 3, S, S}, DType::u8);
    uint8_t* dst = out.images.data<uint8_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (!why[size_t(i)].empty()) continue;
      std::memcpy(dst + int64_t(labels.size()) * per_image, pixels + i * per_image,
                  size_t(per_image));
      labels.push_back(folder[i].label);
    }
  }
  out.labels = from_vector(labels, {good}, DType::i64);
  return out;
}

int64_t small_image_side(const ImageFolder& folder, int64_t max_side, int64_t probe) {
  const int64_t n = folder.size(), k = std::min(n, std::max<int64_t>(probe, 1));
  int64_t side = 0;
  std::vector<uint8_t> bytes;
  for (int64_t j = 0; j < k; ++j) {
    const std::string& path = folder[j * n / k].path;
    ImageInfo info;
    try {
      read_file_into(path, bytes);
      info = probe_image(bytes.data(), bytes.size(), path);
    } catch (const Error&) {
      continue;  // an unreadable file says nothing about the others' size
    }
    if (info.height > max_side || info.width > max_side) return 0;
    side = std::max({side, info.height, info.width});
  }
  return side;
}

void channel_stats(const Tensor& images, std::vector<float>* mean, std::vector<float>* stddev) {
  KILN_CHECK(images.dtype() == DType::u8 && images.dim() == 4 && images.is_cpu() &&
                 images.numel() > 0,
             "channel_stats: expected non-empty u8 (N, C, H, W) on the CPU, got ", images.desc());
  const Tensor x = images.contiguous();
  const int64_t N = x.size(0), C = x.size(1), hw = x.size(2) * x.size(3);
  const uint8_t* p = x.data<uint8_t>();
  // Integer sums: exact, so the statistics do not depend on the order or the machine.
  std::vector<uint64_t> sum(size_t(C), 0), sq(size_t(C), 0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* q = p + (i * C + c) * hw;
      uint64_t s = 0, s2 = 0;
      for (int64_t j = 0; j < hw; ++j) {
        s += q[j];
        s2 += uint64_t(q[j]) * q[j];
      }
      sum[size_t(c)] += s;
      sq[size_t(c)] += s2;
    }
  mean->assign(size_t(C), 0.0f);
  stddev->assign(size_t(C), 0.0f);
  const double count = double(N) * double(hw);
  for (int64_t c = 0; c < C; ++c) {
    const double m = double(sum[size_t(c)]) / count / 255.0;
    const double m2 = double(sq[size_t(c)]) / count / (255.0 * 255.0);
    (*mean)[size_t(c)] = float(m);
    (*stddev)[size_t(c)] = float(std::sqrt(std::max(m2 - m * m, 1e-12)));
  }
}

}  // namespace kiln::data
