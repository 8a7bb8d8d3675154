// The fused crop + resize + flip + normalise kernel (cuda/crop_resize.h) against its CPU
// reference, data::resample_box + the normalisation, on random boxes: whole images, boxes at the
// edges and corners, one-pixel boxes (enlarged ~100x), and a huge source shrunk ~60x.
// Tolerance: the reference rounds to u8 before normalising and the kernel does not, so
// |difference| <= 0.5 / 255 / min(stddev) (+ the output dtype's rounding).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/crop_resize.h"
#include "data/transforms.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;
using namespace kiln::data;

namespace {

struct Case {
  int64_t h, w;
  BoxF box;
  CropBox limit;
  bool flip;
};

}  // namespace

TEST_CASE("crop_resize_normalize matches resample_box + normalise on random boxes") {
  const float mean[3] = {0.485f, 0.456f, 0.406f}, sd[3] = {0.229f, 0.224f, 0.225f};
  Generator g(21);
  std::vector<Case> cases;
  const int64_t sizes[][2] = {{37, 53}, {300, 451}, {500, 333}, {2000, 1500}, {1, 1}, {5, 300}};
  for (auto [h, w] : sizes)
    for (int t = 0; t < 6; ++t) {
      RandomResizedCropParams p;
      if (t == 1) p.scale_min = p.scale_max = 0.0005;  // tiny boxes (enlarged)
      CropBox b = random_resized_crop_box(h, w, g, p);
      if (t == 2) b = {0, 0, h, w};                                      // whole image
      if (t == 3) b = {h - std::max<int64_t>(1, h / 3), w - std::max<int64_t>(1, w / 4),
                       std::max<int64_t>(1, h / 3), std::max<int64_t>(1, w / 4)};  // corner
      if (t == 4) b = {0, 0, 1, 1};                                      // one pixel
      Case c{h, w, BoxF{double(b.top), double(b.left), double(b.height), double(b.width)}, b,
             g.uniform() < 0.5};
      if (t == 5 && h >= 8 && w >= 8) {  // evaluation: fractional box, taps over the whole image
        c.box = center_crop_source_box(h, w, 73, 64);
        c.limit = {0, 0, h, w};
        c.flip = false;
      }
      cases.push_back(c);
    }
  for (DType dt : {DType::f32, DType::f16}) {
    for (int64_t S : {64, 224}) {
      const auto n = int64_t(cases.size());
      std::vector<Tensor> srcs;
      std::vector<cuda::CropResizeJob> jobs;
      Tensor ref_u8 = empty({n, S, S, 3}, DType::u8);
      for (int64_t i = 0; i < n; ++i) {
        const Case& c = cases[size_t(i)];
        Tensor src = empty({c.h, c.w, 3}, DType::u8);
        for (int64_t k = 0; k < src.numel(); ++k) src.data<uint8_t>()[k] = uint8_t(g.below(256));
        resample_box(src.data<uint8_t>(), c.h, c.w, 3, c.box, c.limit,
                     ref_u8.data<uint8_t>() + i * S * S * 3, S, S, c.flip);
        srcs.push_back(src.to(kGpu));
        cuda::CropResizeJob j;
        j.src = static_cast<const uint8_t*>(srcs.back().raw_data());
        j.pitch = c.w * 3;
        j.box_top = float(c.box.top);
        j.box_left = float(c.box.left);
        j.box_height = float(c.box.height);
        j.box_width = float(c.box.width);
        j.lim_top = int32_t(c.limit.top);
        j.lim_left = int32_t(c.limit.left);
        j.lim_height = int32_t(c.limit.height);
        j.lim_width = int32_t(c.limit.width);
        j.flip = c.flip;
        jobs.push_back(j);
      }
      Tensor jobs_dev = empty({int64_t(jobs.size() * sizeof(cuda::CropResizeJob))},
                              gpu_opts(DType::u8));
      CUDA_CHECK(cudaMemcpy(jobs_dev.raw_data(), jobs.data(),
                            jobs.size() * sizeof(cuda::CropResizeJob), cudaMemcpyHostToDevice));
      Tensor out = nan_output({n, 3, S, S}, dt, MemoryFormat::ChannelsLast);
      cuda::crop_resize_normalize(out,
                                  static_cast<const cuda::CropResizeJob*>(jobs_dev.raw_data()), n,
                                  mean, sd);
      Tensor ref = empty({n, 3, S, S}, DType::f32);
      normalize_nhwc_to_nchw(ref_u8.data<uint8_t>(), n, S, S, mean, sd, ref.data<float>());
      const double atol = 0.5 / 255.0 / 0.224 + 1e-4;
      check_close(host_f64(out), ref.to(DType::f64),
                  Tol{atol, dt == DType::f16 ? 2e-3 : 1e-5},
                  std::string("crop_resize ") + dtype_name(dt) + " S=" + std::to_string(S));
    }
  }
  // Validation at the edge.
  Tensor bad = nan_output({2, 3, 8, 8}, DType::f32);  // NCHW
  CHECK_THROWS_AS(cuda::crop_resize_normalize(bad, nullptr, 2, mean, sd), Error);
}
