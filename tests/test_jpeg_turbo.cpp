// The libjpeg-turbo decoder (data/jpeg_turbo.h) against stb_image, its crop-region decode against
// a whole decode, grayscale and CMYK files, bad files; the loader with it (same batches for any
// worker count, the same crops as stb) and PartedPrefetch (data/prefetch.h).
//
// Measured tolerances (this suite's images, quality 90, 4:2:0): libjpeg-turbo's whole-image
// decode differs from stb's by at most kMaxFullDiff per channel (IDCT and chroma-upsampling
// rounding) with a mean under kMeanFullDiff; the crop-region decode equals the whole decode
// bit for bit; DCT-scaled decodes followed by the antialiasing resize stay within kMeanDctDiff
// (mean over a crop) of the stb path: measured up to 3.2 levels on this suite's high-frequency
// test image (the DCT's reduction is a box filter, the resize's a triangle), 1.2-1.8 on the
// loader test's crops.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "data/image.h"
#include "data/image_loader.h"
#include "data/jpeg_turbo.h"
#include "data/prefetch.h"
#include "data/transforms.h"
#include "image_test_util.h"

#include "jpeg_test_util.h"
#include "tests/test_util.h"

using namespace kiln;
using namespace kiln::data;
using kiln::testing::TempDir;
namespace fs = std::filesystem;
using kiln::testing::error_of;

namespace {

constexpr int kMaxFullDiff = 6;
constexpr double kMeanFullDiff = 1.0;
constexpr double kMeanDctDiff = 4.0;

// A photo-like test image: smooth gradients, a few hard edges and mild noise.
Image textured(int64_t h, int64_t w, uint64_t seed) {
  Generator g(seed);
  Image im;
  im.height = h;
  im.width = w;
  im.pixels.resize(size_t(h * w * 3));
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        double v = 128 + 90 * std::sin(0.05 * double(x) * (c + 1) + 0.03 * double(y));
        if ((x / 37 + y / 23) % 3 == 0) v = 255 - v;
        v += double(g.below(16)) - 8;
        im.pixels[size_t((y * w + x) * 3 + c)] = uint8_t(std::clamp(v, 0.0, 255.0));
      }
  return im;
}

std::vector<uint8_t> jpeg_bytes(const Image& im, const TempDir& dir, const std::string& name) {
  const std::string path = dir / name;
  write_jpeg(path, im, 90);
  return read_file_bytes(path);
}

struct Diff {
  int max = 0;
  double mean = 0;
};
Diff diff(const uint8_t* a, const uint8_t* b, size_t n) {
  Diff d;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const int e = std::abs(int(a[i]) - int(b[i]));
    d.max = std::max(d.max, e);
    sum += e;
  }
  d.mean = sum / double(n);
  return d;
}


}  // namespace

TEST_CASE("libjpeg-turbo decode matches stb_image within the stated tolerance") {
  if (!jpeg_turbo_available()) {
    MESSAGE("kiln built without libjpeg-turbo: skipped");
    return;
  }
  TempDir dir;
  for (auto [h, w] : {std::pair<int64_t, int64_t>{333, 500}, {480, 353}, {17, 9}}) {
    const std::vector<uint8_t> bytes = jpeg_bytes(textured(h, w, 1), dir, "a.jpg");
    const JpegInfo info = read_jpeg_info(bytes.data(), bytes.size(), "a.jpg");
    CHECK(info.height == h);
    CHECK(info.width == w);
    CHECK(info.components == 3);
    const Image ref = decode_image_stb(bytes.data(), bytes.size(), "a.jpg");
    const Image got = decode_jpeg(bytes.data(), bytes.size(), "a.jpg");
    REQUIRE(got.height == h);
    REQUIRE(got.width == w);
    const Diff d = diff(ref.pixels.data(), got.pixels.data(), ref.pixels.size());
    MESSAGE("turbo vs stb, ", w, "x", h, ": max ", d.max, ", mean ", d.mean);
    CHECK(d.max <= kMaxFullDiff);
    CHECK(d.mean < kMeanFullDiff);
    // DCT scaling: ceil(side / denom) pixels a side.
    const Image half = decode_jpeg(bytes.data(), bytes.size(), "a.jpg", 4);
    CHECK(half.height == (h + 3) / 4);
    CHECK(half.width == (w + 3) / 4);
  }
}

TEST_CASE("crop-region decode equals whole decode + resample; DCT scaling stays close to stb") {
  if (!jpeg_turbo_available()) {
    MESSAGE("kiln built without libjpeg-turbo: skipped");
    return;
  }
  TempDir dir;
  const int64_t H = 375, W = 500, S = 64;
  const std::vector<uint8_t> bytes = jpeg_bytes(textured(H, W, 2), dir, "b.jpg");
  const Image full = decode_jpeg(bytes.data(), bytes.size(), "b.jpg");
  const Image stb = decode_image_stb(bytes.data(), bytes.size(), "b.jpg");
  Generator gen(11);
  std::vector<uint8_t> ref(size_t(S * S * 3)), got(ref.size()), via_stb(ref.size());
  int scaled = 0;
  double worst_mean = 0;
  for (int t = 0; t < 40; ++t) {
    CropBox b = random_resized_crop_box(H, W, gen);
    if (t == 0) b = {0, 0, H, W};                 // the whole image (DCT 1/4)
    if (t == 1) b = {H - 9, W - 13, 9, 13};       // a tiny box at the corner (enlarged)
    if (t == 2) b = {0, W - 200, 150, 200};       // top-right edge
    const bool flip = t % 2 == 1;
    const BoxF bf{double(b.top), double(b.left), double(b.height), double(b.width)};
    INFO("box ", b.top, ",", b.left, " ", b.height, "x", b.width);
    resized_crop(full.pixels.data(), H, W, 3, b, ref.data(), S, S, flip);
    decode_jpeg_resampled(bytes.data(), bytes.size(), "b.jpg", bf, b, S, S, flip, got.data(),
                          false);
    CHECK(got == ref);  // the region decode reproduces the whole decode exactly
    decode_jpeg_resampled(bytes.data(), bytes.size(), "b.jpg", bf, b, S, S, flip, got.data());
    resized_crop(stb.pixels.data(), H, W, 3, b, via_stb.data(), S, S, flip);
    const Diff d = diff(got.data(), via_stb.data(), got.size());
    if (jpeg_scale_denom(bf, S, S) > 1) ++scaled;
    worst_mean = std::max(worst_mean, d.mean);
    CHECK(d.mean < kMeanDctDiff);
  }
  MESSAGE("DCT-scaled crops vs stb + resample: worst mean difference ", worst_mean, " levels");
  CHECK(scaled >= 10);  // the DCT path was exercised
  // The evaluation transform (limit: the whole image).
  resize_center_crop(stb.pixels.data(), H, W, 3, 73, S, ref.data());
  decode_jpeg_resampled(bytes.data(), bytes.size(), "b.jpg", center_crop_source_box(H, W, 73, S),
                        CropBox{0, 0, H, W}, S, S, false, got.data());
  CHECK(diff(got.data(), ref.data(), got.size()).mean < kMeanDctDiff);
}

TEST_CASE("grayscale and CMYK JPEGs become RGB") {
  if (!jpeg_turbo_available()) {
    MESSAGE("kiln built without libjpeg-turbo: skipped");
    return;
  }
  TempDir dir;
  Image gray;
  gray.height = 40;
  gray.width = 30;
  gray.channels = 1;
  for (int64_t i = 0; i < 1200; ++i) gray.pixels.push_back(uint8_t(i % 200 + 20));
#ifdef KILN_WITH_LIBJPEG
  const std::vector<uint8_t> g = testing::libjpeg_encode(gray, 95, false);  // one component
#else
  write_jpeg(dir / "g.jpg", gray, 95);  // stb writes three components
  const std::vector<uint8_t> g = read_file_bytes(dir / "g.jpg");
#endif
#ifdef KILN_WITH_LIBJPEG
  CHECK(read_jpeg_info(g.data(), g.size(), "g").components == 1);
#endif
  const Image gi = decode_jpeg(g.data(), g.size(), "g");
  REQUIRE(gi.pixels.size() == 1200 * 3);
  for (size_t p = 0; p < 1200; ++p) {
    CHECK(gi.pixels[p * 3] == gi.pixels[p * 3 + 1]);
    CHECK(gi.pixels[p * 3] == gi.pixels[p * 3 + 2]);
  }
  const Image gs = decode_image_stb(g.data(), g.size(), "g");
  CHECK(diff(gs.pixels.data(), gi.pixels.data(), gi.pixels.size()).max <= kMaxFullDiff);
#ifdef KILN_WITH_LIBJPEG
  Image rgb = testing::solid_image(24, 40, 0, 0, 128);
  for (int64_t i = 0; i < 24 * 40; ++i) {
    rgb.pixels[size_t(i * 3)] = uint8_t(60 + i % 150);
    rgb.pixels[size_t(i * 3 + 1)] = uint8_t(200 - (i / 40) % 100);
  }
  const std::vector<uint8_t> c = testing::libjpeg_encode(rgb, 95, false, true);
  const JpegInfo ci = read_jpeg_info(c.data(), c.size(), "c");
  CHECK(ci.cmyk);
  CHECK(ci.components == 4);
  const Image cm = decode_jpeg(c.data(), c.size(), "c");
  const Image cs = decode_image_stb(c.data(), c.size(), "c");
  REQUIRE(cm.pixels.size() == 24 * 40 * 3);
  const Diff d = diff(cm.pixels.data(), cs.pixels.data(), cm.pixels.size());
  MESSAGE("CMYK turbo vs stb: max ", d.max, ", mean ", d.mean);
  CHECK(d.max <= kMaxFullDiff);
  // C = 60 (stored inverted), K = 230: R = 60 * 230 / 255 = 54 at the first pixel.
  CHECK(std::abs(int(cm.pixels[0]) - 54) <= 3);
  // A progressive file decodes like the baseline one (same encoder, same quality).
  const Image tex = textured(120, 90, 4);
  const std::vector<uint8_t> prog = testing::libjpeg_encode(tex, 90, true);
  const std::vector<uint8_t> base = testing::libjpeg_encode(tex, 90, false);
  CHECK(read_jpeg_info(prog.data(), prog.size(), "p").progressive);
  CHECK_FALSE(read_jpeg_info(base.data(), base.size(), "b").progressive);
  const Image pi = decode_jpeg(prog.data(), prog.size(), "p");
  const Image bi = decode_jpeg(base.data(), base.size(), "b");
  CHECK(diff(pi.pixels.data(), bi.pixels.data(), pi.pixels.size()).max <= 2);
  std::vector<uint8_t> a(24 * 24 * 3), b(a.size());
  const CropBox box{30, 20, 70, 50};
  const BoxF bf{30, 20, 70, 50};
  decode_jpeg_resampled(prog.data(), prog.size(), "p", bf, box, 24, 24, true, a.data(), false);
  resized_crop(pi.pixels.data(), 120, 90, 3, box, b.data(), 24, 24, true);
  CHECK(a == b);  // crop-region decode of a progressive file
#endif
}

TEST_CASE("bad JPEG data: a kiln::Error naming the file, never a crash") {
  if (!jpeg_turbo_available()) {
    MESSAGE("kiln built without libjpeg-turbo: skipped");
    return;
  }
  TempDir dir;
  const std::vector<uint8_t> good = jpeg_bytes(textured(64, 80, 3), dir, "c.jpg");
  std::vector<uint8_t> out(16 * 16 * 3);
  const BoxF box{0, 0, 64, 80};
  const CropBox lim{0, 0, 64, 80};
  auto decode = [&](const std::vector<uint8_t>& b) {
    return error_of([&] {
      decode_jpeg_resampled(b.data(), b.size(), "bad/x.jpg", box, lim, 16, 16, false, out.data());
    });
  };
  const std::vector<uint8_t> empty;
  const std::vector<uint8_t> truncated(good.begin(), good.begin() + std::ptrdiff_t(good.size() / 2));
  const std::vector<uint8_t> header_only(good.begin(), good.begin() + 200);
  std::vector<uint8_t> garbage = {0xFF, 0xD8, 0xFF, 0xE0, 0, 0x10, 'J', 'F', 'I', 'F', 0};
  garbage.resize(300, 0x5A);
  std::vector<uint8_t> corrupt = good;  // scan data overwritten
  for (size_t i = corrupt.size() / 3; i < corrupt.size() - 2; ++i) corrupt[i] = uint8_t(i * 7);
  const std::vector<uint8_t> png = encode_png(testing::solid_image(4, 4, 1, 2, 3));
  const std::vector<const std::vector<uint8_t>*> all = {&empty,   &truncated, &header_only,
                                                        &garbage, &corrupt,   &png};
  for (const std::vector<uint8_t>* b : all) {
    const std::string e = decode(*b);
    INFO(e);
    CHECK(e.find("bad/x.jpg") != std::string::npos);
  }
  CHECK(decode(empty).find("empty") != std::string::npos);
  CHECK(decode(png).find("not a JPEG") != std::string::npos);
  CHECK(decode(truncated).find("Premature end") != std::string::npos);
  CHECK(decode(good).empty());
  // A forged header over the size guard.
  std::vector<uint8_t> forged = good;
  for (size_t i = 0; i + 8 < forged.size(); ++i)
    if (forged[i] == 0xFF && forged[i + 1] == 0xC0) {  // SOF0: length, precision, height, width
      forged[i + 5] = 0x7F;  // 32752 rows: under libjpeg's own limit (65500), over ours
      forged[i + 6] = 0xF0;
      break;
    }
  CHECK(error_of([&] { read_jpeg_info(forged.data(), forged.size(), "f.jpg"); })
            .find("over the limit") != std::string::npos);
}

// stb_image's JPEG decoder reads out of bounds on some corrupt files (fuzzing, 2026-12-05), so
// decode_image and probe_image hand JPEGs to libjpeg-turbo where kiln has it. Seen from outside
// with an arithmetic-coded file, which stb cannot read and libjpeg-turbo can.
TEST_CASE("decode_image reads JPEGs with libjpeg-turbo, stb only when asked for by name") {
#ifdef KILN_WITH_LIBJPEG
  const Image tex = textured(40, 56, 5);
  const std::vector<uint8_t> arith = testing::libjpeg_encode(tex, 90, false, false, true);
  CHECK(read_jpeg_info(arith.data(), arith.size(), "a.jpg").arithmetic);
  CHECK_FALSE(error_of([&] { (void)decode_image_stb(arith.data(), arith.size(), "a.jpg"); }).empty());
  const Image got = decode_image(arith.data(), arith.size(), "a.jpg");
  const Image ref = decode_jpeg(arith.data(), arith.size(), "a.jpg");
  CHECK(got.height == 40);
  CHECK(got.width == 56);
  CHECK(got.pixels == ref.pixels);
  const ImageInfo info = probe_image(arith.data(), arith.size(), "a.jpg");
  CHECK(info.height == 40);
  CHECK(info.width == 56);
  CHECK(info.channels == 3);
  // Grayscale stays one channel in the probe, as stb's says; decoded, it is RGB.
  Image gray = tex;
  gray.channels = 1;
  gray.pixels.resize(size_t(40 * 56));
  const std::vector<uint8_t> g = testing::libjpeg_encode(gray, 90, false);
  CHECK(probe_image(g.data(), g.size(), "g.jpg").channels == 1);
  CHECK(probe_image_stb(g.data(), g.size(), "g.jpg").channels == 1);
  CHECK(decode_image(g.data(), g.size(), "g.jpg").channels == 3);
  // stb also takes a JPEG behind leading 0xFF bytes; libjpeg-turbo, and so decode_image, do not.
  std::vector<uint8_t> filled(16, 0xFF);
  filled.insert(filled.end(), g.begin(), g.end());
  CHECK(error_of([&] { (void)decode_image(filled.data(), filled.size(), "f.jpg"); })
            .find("image 'f.jpg': not a readable JPEG/PNG (unknown image type)") == 0);
  CHECK(error_of([&] { (void)probe_image(filled.data(), filled.size(), "f.jpg"); })
            .find("unknown image type") != std::string::npos);
#else
  MESSAGE("kiln built without libjpeg-turbo: decode_image reads JPEGs with stb (not tested here)");
#endif
}

TEST_CASE("ImageLoader with libjpeg-turbo: same batches for 0, 1 and 4 workers; stb's crops") {
  if (!jpeg_turbo_available()) {
    MESSAGE("kiln built without libjpeg-turbo: skipped");
    return;
  }
  TempDir dir;
  Generator g(5);
  for (int i = 0; i < 23; ++i) {
    const Image im = textured(60 + int64_t(g.below(90)), 60 + int64_t(g.below(90)), uint64_t(i));
    const fs::path p = dir.path() / ("c" + std::to_string(i % 2)) / (std::to_string(i) + ".jpg");
    fs::create_directories(p.parent_path());
    write_jpeg(p.string(), im, 90);
  }
  testing::write_raw(dir / "c0/bad_zero.jpg", {});
  const std::vector<uint8_t> one = read_file_bytes(dir / "c1/1.jpg");
  testing::write_raw(dir / "c1/bad_trunc.jpg", std::vector<uint8_t>(one.begin(), one.begin() + 400));
  const ImageFolder folder(dir.path().string());
  for (Augment aug : {Augment::Train, Augment::Eval}) {
    std::vector<uint8_t> ref, stb;
    for (int w : {0, 1, 4, -1}) {
      ImageLoaderOptions o;
      o.batch_size = 5;
      o.image_size = 24;
      o.resize_size = 28;
      o.augment = aug;
      o.seed = 9;
      o.workers = std::max(w, 0);
      o.decoder = w < 0 ? JpegDecoder::Stb : JpegDecoder::Turbo;
      o.max_bad_fraction = 0.2;
      o.warn = false;
      const ImageLoader loader(folder, o);
      ImageEpoch ep = loader.epoch(1);
      std::vector<uint8_t> all;
      while (std::optional<ImageBatch> b = ep.next())
        all.insert(all.end(), b->images.data<uint8_t>(),
                   b->images.data<uint8_t>() + b->images.numel());
      CHECK(ep.bad_count() == 2);
      if (w == 0)
        ref = all;
      else if (w > 0)
        CHECK(all == ref);
      else
        stb = all;
    }
    // Same boxes and flips as the stb path: only decoder rounding and DCT scaling differ.
    REQUIRE(stb.size() == ref.size());
    const Diff d = diff(stb.data(), ref.data(), ref.size());
    MESSAGE("loader turbo vs stb (", std::string(aug == Augment::Train ? "train" : "eval"), "): max ", d.max,
            ", mean ", d.mean);
    CHECK(d.mean < kMeanDctDiff);
  }
}

TEST_CASE("PartedPrefetch: items in order, parts filled in parallel, errors after earlier items") {
  for (int workers : {0, 1, 5}) {
    PartedPrefetch<std::vector<int64_t>> q(
        9, workers, 2, [](int64_t k) { return 1 + k % 4; },
        [](int64_t k) { return std::vector<int64_t>(size_t(1 + k % 4), -1); },
        [](std::vector<int64_t>& v, int64_t k, int64_t part) { v[size_t(part)] = k * 10 + part; });
    for (int64_t k = 0; k < 9; ++k) {
      std::optional<std::vector<int64_t>> v = q.next();
      REQUIRE(v);
      REQUIRE(v->size() == size_t(1 + k % 4));
      for (size_t p = 0; p < v->size(); ++p) CHECK((*v)[p] == k * 10 + int64_t(p));
    }
    CHECK_FALSE(q.next().has_value());
  }
  for (int workers : {0, 3}) {
    PartedPrefetch<int64_t> q(
        20, workers, 3, [](int64_t) { return 3; }, [](int64_t k) { return k; },
        [](int64_t&, int64_t k, int64_t part) {
          if (k == 6 && part == 2) KILN_FAIL("part 2 of item 6");
        });
    for (int64_t k = 0; k < 6; ++k) CHECK(q.next() == k);
    CHECK(error_of([&] { q.next(); }).find("part 2 of item 6") != std::string::npos);
  }
  {  // destroyed early, with workers blocked on a full ring
    PartedPrefetch<int64_t> q(
        1000, 4, 2, [](int64_t) { return 8; }, [](int64_t k) { return k; },
        [](int64_t&, int64_t, int64_t) {});
    CHECK(q.next() == 0);
  }
}
