// Image decoding (stb), the header size guard, and the transforms: RandomResizedCrop's box,
// antialiased bilinear resampling, Resize + CenterCrop, normalisation.
#include <doctest/doctest.h>
#include <zlib.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <set>

#include "data/image.h"
#include "data/transforms.h"
#include "image_test_util.h"
#include "tests/test_util.h"

using namespace kiln;
using namespace kiln::data;
using kiln::testing::TempDir;
using kiln::testing::error_of;

namespace {

void put_be32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(uint8_t(x >> s));
}

// A PNG signature + IHDR chunk (valid CRC) claiming w x h RGB pixels, and nothing else.
std::vector<uint8_t> forged_png_header(uint32_t w, uint32_t h) {
  std::vector<uint8_t> v = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  put_be32(v, 13);
  std::vector<uint8_t> chunk = {'I', 'H', 'D', 'R'};
  put_be32(chunk, w);
  put_be32(chunk, h);
  chunk.insert(chunk.end(), {8, 2, 0, 0, 0});  // 8-bit, RGB, deflate, no filter, no interlace
  v.insert(v.end(), chunk.begin(), chunk.end());
  put_be32(v, uint32_t(crc32(0, chunk.data(), uInt(chunk.size()))));
  return v;
}

Image random_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  Generator g(seed);
  Image im;
  im.height = h;
  im.width = w;
  im.channels = c;
  im.pixels.resize(size_t(h * w * c));
  for (auto& p : im.pixels) p = uint8_t(g.below(256));
  return im;
}

// A kiln::Error's message without its " [file.cpp:12, ...]" suffix.
std::string cli_message(const std::string& what) { return what.substr(0, what.rfind(" [")); }

}  // namespace

TEST_CASE("PNG round trip is exact (RGB and grayscale)") {
  TempDir dir;
  const Image rgb = random_image(5, 7, 3, 1);
  write_png(dir / "rgb.png", rgb);
  const Image back = read_image(dir / "rgb.png");
  CHECK(back.height == 5);
  CHECK(back.width == 7);
  CHECK(back.channels == 3);
  CHECK(back.pixels == rgb.pixels);

  const Image gray = random_image(4, 3, 1, 2);
  write_png(dir / "gray.png", gray);
  const Image g3 = read_image(dir / "gray.png");
  REQUIRE(g3.pixels.size() == 4 * 3 * 3);
  for (size_t p = 0; p < 12; ++p)
    for (size_t c = 0; c < 3; ++c) CHECK(g3.pixels[p * 3 + c] == gray.pixels[p]);
}

TEST_CASE("JPEG decodes with the expected size and near the encoded colour") {
  TempDir dir;
  write_jpeg(dir / "a.jpg", testing::solid_image(9, 13, 200, 40, 90), 95);
  const Image im = read_image(dir / "a.jpg");
  CHECK(im.height == 9);
  CHECK(im.width == 13);
  CHECK(im.channels == 3);
  REQUIRE(im.pixels.size() == 9 * 13 * 3);
  for (size_t p = 0; p < 9 * 13; ++p) {
    CHECK(std::abs(int(im.pixels[p * 3]) - 200) <= 4);
    CHECK(std::abs(int(im.pixels[p * 3 + 1]) - 40) <= 4);
    CHECK(std::abs(int(im.pixels[p * 3 + 2]) - 90) <= 4);
  }
}

TEST_CASE("dimension guard rejects forged headers before decoding") {
  // Sides within stb's 16384 but 256 Mpixel in all: only our guard can reject it, and it must
  // do so from the header (the file has no pixel data, so decoding would fail differently).
  const std::vector<uint8_t> big = forged_png_header(16000, 16000);
  CHECK(probe_image(big.data(), big.size(), "x").width == 16000);
  const std::string e1 = error_of([&] { decode_image(big.data(), big.size(), "big.png"); });
  CHECK(e1.find("big.png") != std::string::npos);
  CHECK(e1.find("over the limit") != std::string::npos);

  const std::vector<uint8_t> huge = forged_png_header(100000, 100000);
  const std::string e2 = error_of([&] { decode_image(huge.data(), huge.size(), "huge.png"); });
  CHECK(e2.find("huge.png") != std::string::npos);
  CHECK(!e2.empty());

  const std::vector<uint8_t> wide = forged_png_header(20000, 10);
  CHECK_THROWS_AS(decode_image(wide.data(), wide.size(), "wide.png"), Error);
}

TEST_CASE("headers with sides stb will not read are named with their size, not 'unknown type'") {
  // Over STBI_MAX_DIMENSIONS stb's probe fails with "unknown image type"; the size is read off
  // the header instead, by probe_image and decode_image alike.
  const std::string limit = " pixels, over the limit (16384 per side, 100000000 in all)";
  const std::vector<uint8_t> png = forged_png_header(60000, 60000);
  CHECK(cli_message(error_of([&] { decode_image(png.data(), png.size(), "huge.png"); })) ==
        "image 'huge.png': header claims 60000x60000" + limit);
  CHECK(cli_message(error_of([&] { probe_image(png.data(), png.size(), "huge.png"); })) ==
        "image 'huge.png': header claims 60000x60000" + limit);
  const std::vector<uint8_t> tall = forged_png_header(8, 4000000000u);
  CHECK(cli_message(error_of([&] { decode_image(tall.data(), tall.size(), "tall.png"); })) ==
        "image 'tall.png': header claims 8x4000000000" + limit);

  // A JPEG: SOI, an APP0 segment to step over, then a baseline frame header of 60000 x 50000.
  const std::vector<uint8_t> jpeg = {0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x04, 0x00, 0x00, 0xFF,
                                     0xC0, 0x00, 0x11, 0x08, 0xC3, 0x50, 0xEA, 0x60, 0x03,
                                     0x01, 0x22, 0x00, 0x02, 0x11, 0x01, 0x03, 0x11, 0x01};
  CHECK(cli_message(error_of([&] { decode_image(jpeg.data(), jpeg.size(), "huge.jpg"); })) ==
        "image 'huge.jpg': header claims 60000x50000" + limit);

  // Within stb's sides, stb's own reason stays (here: no pixel data after the header).
  const std::vector<uint8_t> small = forged_png_header(64, 64);
  const std::string e = error_of([&] { decode_image(small.data(), small.size(), "s.png"); });
  CHECK(e.find("image 's.png': decoding failed (") == 0);
}

// stb grows its IDAT buffer to a chunk's claimed length before reading it: a fuzzed 834-byte
// PNG made it ask for 2 GiB (docs/lab/input-pipeline.md, 2026-12-05). A chunk that does not fit
// in the file is refused first, naming the chunk.
TEST_CASE("a PNG chunk that claims more bytes than the file holds is refused before stb") {
  std::vector<uint8_t> png = encode_png(random_image(6, 5, 3, 4));
  size_t idat = 0;
  for (size_t i = 8; i + 8 <= png.size(); i += 12 + (size_t(png[i]) << 24 | size_t(png[i + 1]) << 16 |
                                                      size_t(png[i + 2]) << 8 | png[i + 3]))
    if (std::memcmp(png.data() + i + 4, "IDAT", 4) == 0) idat = i;
  REQUIRE(idat > 0);
  CHECK(decode_image(png.data(), png.size(), "ok.png").width == 5);
  png[idat] = 0x40;  // IDAT now claims over a gigabyte
  for (auto* f : {&decode_image, &decode_image_stb}) {
    const std::string e = error_of([&] { (void)f(png.data(), png.size(), "big-idat.png"); });
    CHECK(e.find("image 'big-idat.png': corrupt PNG (chunk 'IDAT' at byte " +
                 std::to_string(idat) + " claims 10") == 0);
  }
  CHECK(error_of([&] { (void)probe_image(png.data(), png.size(), "p.png"); }).find("corrupt PNG") !=
        std::string::npos);
  // A file cut inside a chunk's data: the same refusal.
  png[idat] = 0;
  const std::vector<uint8_t> cut(png.begin(), png.begin() + std::ptrdiff_t(idat + 10));
  CHECK(error_of([&] { (void)decode_image(cut.data(), cut.size(), "cut.png"); })
            .find("corrupt PNG (chunk") != std::string::npos);
}

TEST_CASE("unreadable files: errors name the file and stb's reason") {
  TempDir dir;
  write_png(dir / "ok.png", random_image(8, 8, 3, 3));
  std::vector<uint8_t> bytes = read_file_bytes(dir / "ok.png");
  testing::write_raw(dir / "trunc.png", std::vector<uint8_t>(bytes.begin(), bytes.begin() + 40));
  testing::write_raw(dir / "garbage.jpg", {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'});
  testing::write_raw(dir / "empty.png", {});
  for (const char* name : {"trunc.png", "garbage.jpg", "empty.png", "missing.png"}) {
    const std::string e = error_of([&] { read_image(dir / name); });
    INFO(name, ": ", e);
    CHECK(e.find(name) != std::string::npos);
  }
  CHECK(error_of([&] { read_image(dir / "garbage.jpg"); }).find("(") != std::string::npos);
  CHECK(error_of([&] { read_image(dir / "empty.png"); }).find("empty") != std::string::npos);
}

TEST_CASE("random_resized_crop_box respects the scale and ratio bounds") {
  const RandomResizedCropParams p;
  for (auto [H, W] : {std::pair<int64_t, int64_t>{375, 500}, {500, 375}, {300, 300}, {64, 96}}) {
    Generator gen(uint64_t(H * 1000 + W));
    double min_frac = 1.0, max_frac = 0.0, min_ratio = 10.0, max_ratio = 0.0;
    std::set<int64_t> tops;
    for (int t = 0; t < 400; ++t) {
      const CropBox b = random_resized_crop_box(H, W, gen, p);
      INFO(H, "x", W, " box ", b.top, " ", b.left, " ", b.height, "x", b.width);
      REQUIRE(b.height >= 1);
      REQUIRE(b.width >= 1);
      REQUIRE(b.top >= 0);
      REQUIRE(b.left >= 0);
      REQUIRE(b.top + b.height <= H);
      REQUIRE(b.left + b.width <= W);
      // Rounding of width and height moves area and ratio by at most half a pixel each.
      const double area = double(H * W), h = double(b.height), w = double(b.width);
      CHECK((w + 0.5) * (h + 0.5) >= p.scale_min * area);
      CHECK((w - 0.5) * (h - 0.5) <= p.scale_max * area);
      CHECK((w + 0.5) / (h - 0.5) >= p.ratio_min);
      CHECK((w - 0.5) / (h + 0.5) <= p.ratio_max);
      min_frac = std::min(min_frac, h * w / area);
      max_frac = std::max(max_frac, h * w / area);
      min_ratio = std::min(min_ratio, w / h);
      max_ratio = std::max(max_ratio, w / h);
      tops.insert(b.top);
    }
    // The draws cover the ranges (catches a sampler stuck at one value).
    CHECK(min_frac < 0.2);
    CHECK(max_frac > 0.7);
    CHECK(min_ratio < 0.85);
    CHECK(max_ratio > 1.15);
    CHECK(tops.size() > 20);
  }
}

TEST_CASE("random_resized_crop_box: fallback is a centred crop at the nearest ratio") {
  Generator gen(5);
  // 10 x 1000: any crop of >= 8% area and ratio <= 4/3 is taller than 10 rows, so all 10
  // attempts fail: height 10, width round(10 * 4/3) = 13, centred.
  const CropBox b = random_resized_crop_box(10, 1000, gen);
  CHECK(b.height == 10);
  CHECK(b.width == 13);
  CHECK(b.top == 0);
  CHECK(b.left == (1000 - 13) / 2);
  const CropBox t = random_resized_crop_box(1000, 10, gen);  // tall: width 10, height 13
  CHECK(t.width == 10);
  CHECK(t.height == 13);
  CHECK(t.top == (1000 - 13) / 2);
  // Same seed, same box.
  Generator g1(42), g2(42);
  const CropBox a1 = random_resized_crop_box(375, 500, g1),
                a2 = random_resized_crop_box(375, 500, g2);
  CHECK((a1.top == a2.top && a1.left == a2.left && a1.height == a2.height && a1.width == a2.width));
}

TEST_CASE("resized_crop: identity, flip, constant and hand-computed gradients") {
  const Image im = random_image(6, 5, 3, 9);
  std::vector<uint8_t> out(6 * 5 * 3), flipped(6 * 5 * 3);
  resized_crop(im.pixels.data(), 6, 5, 3, {0, 0, 6, 5}, out.data(), 6, 5, false);
  CHECK(out == im.pixels);
  resized_crop(im.pixels.data(), 6, 5, 3, {0, 0, 6, 5}, flipped.data(), 6, 5, true);
  for (int64_t y = 0; y < 6; ++y)
    for (int64_t x = 0; x < 5; ++x)
      for (int64_t c = 0; c < 3; ++c)
        CHECK(flipped[size_t((y * 5 + x) * 3 + c)] == im.pixels[size_t((y * 5 + (4 - x)) * 3 + c)]);

  const Image solid = testing::solid_image(37, 51, 17, 128, 250);
  std::vector<uint8_t> s(24 * 24 * 3);
  Generator gen(3);
  random_resized_crop_flip(solid.pixels.data(), 37, 51, 3, 24, gen, true, s.data());
  for (size_t p = 0; p < 24 * 24; ++p) {
    CHECK(s[p * 3] == 17);
    CHECK(s[p * 3 + 1] == 128);
    CHECK(s[p * 3 + 2] == 250);
  }

  // 1 x 8 gradient v = 10 x shrunk to 4: triangle of half-width 2, weights 1/4 3/4 3/4 1/4
  // (/2), the tap outside the image dropped and the rest renormalised at the ends.
  std::vector<uint8_t> g8 = {0, 10, 20, 30, 40, 50, 60, 70}, g4(4);
  resized_crop(g8.data(), 1, 8, 1, {0, 0, 1, 8}, g4.data(), 1, 4);
  CHECK(g4 == std::vector<uint8_t>{7, 25, 45, 63});  // 12.5/1.75, 25, 45, 110/1.75
  // 1 x 2 -> 1 x 4: plain bilinear at centres 0.25, 0.75, 1.25, 1.75.
  std::vector<uint8_t> g2 = {0, 100}, up(4);
  resized_crop(g2.data(), 1, 2, 1, {0, 0, 1, 2}, up.data(), 1, 4);
  CHECK(up == std::vector<uint8_t>{0, 25, 75, 100});
  // The crop box limits the taps: columns 2..5 of the gradient, unscaled, are copied exactly.
  std::vector<uint8_t> mid(4);
  resized_crop(g8.data(), 1, 8, 1, {0, 2, 1, 4}, mid.data(), 1, 4);
  CHECK(mid == std::vector<uint8_t>{20, 30, 40, 50});
  CHECK_THROWS_AS(resized_crop(g8.data(), 1, 8, 1, {0, 6, 1, 4}, mid.data(), 1, 4), Error);
}

TEST_CASE("resample_box: RGB (unrolled fixed windows) equals each channel resampled alone") {
  // The RGB passes read every output's widest window (zero weights past its own taps, windows
  // near the limit's end moved left); the one-channel passes read each window's own taps. The
  // sums must agree bit for bit: random boxes, limits (narrow ones too), sizes and flips.
  Generator gen(21);
  auto below = [&](int64_t n) { return int64_t(gen.below(uint64_t(n))); };
  for (int it = 0; it < 300; ++it) {
    const int64_t h = 1 + below(120), w = 1 + below(120);
    const Image im = random_image(h, w, 3, uint64_t(it));
    const int64_t lt = below(h), ll = below(w);
    const CropBox lim{lt, ll, 1 + below(h - lt), 1 + below(w - ll)};
    const double bh = std::max(0.5, double(lim.height) * gen.uniform());
    const double bw = std::max(0.5, double(lim.width) * gen.uniform());
    const BoxF box{double(lt) + (double(lim.height) - bh) * gen.uniform(),
                   double(ll) + (double(lim.width) - bw) * gen.uniform(), bh, bw};
    const int64_t oh = 1 + below(100), ow = 1 + below(100);
    const bool flip = gen.uniform() < 0.5;
    std::vector<uint8_t> rgb(size_t(oh * ow * 3)), plane(size_t(h * w)), one(size_t(oh * ow));
    resample_box(im.pixels.data(), h, w, 3, box, lim, rgb.data(), oh, ow, flip);
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t k = 0; k < h * w; ++k) plane[size_t(k)] = im.pixels[size_t(k * 3 + c)];
      resample_box(plane.data(), h, w, 1, box, lim, one.data(), oh, ow, flip);
      int64_t differ = 0;
      for (int64_t k = 0; k < oh * ow; ++k) differ += rgb[size_t(k * 3 + c)] != one[size_t(k)];
      INFO("case ", it, ": ", h, "x", w, " limit ", lim.top, ",", lim.left, " ", lim.height, "x",
           lim.width, " -> ", oh, "x", ow, " channel ", c);
      CHECK(differ == 0);
    }
  }
}

TEST_CASE("Resize(shorter side) + CenterCrop") {
  CHECK(resize_shorter_side(375, 500, 256).height == 256);
  CHECK(resize_shorter_side(375, 500, 256).width == 341);
  CHECK(resize_shorter_side(500, 375, 256).height == 341);
  CHECK(resize_shorter_side(300, 300, 256).width == 256);

  // 8 x 16 image, v = 10 x + 2 y in every channel; Resize(4) -> 4 x 8 (scale 2), CenterCrop(2)
  // at top 1, left 3. Output (i, j) is centred on source pixel coordinates (2.5 + 2i, 6.5 + 2j),
  // inside the image, where the symmetric 2x filter reproduces a linear image exactly.
  std::vector<uint8_t> src(8 * 16 * 3);
  for (int64_t y = 0; y < 8; ++y)
    for (int64_t x = 0; x < 16; ++x)
      for (int64_t c = 0; c < 3; ++c) src[size_t((y * 16 + x) * 3 + c)] = uint8_t(10 * x + 2 * y);
  std::vector<uint8_t> out(2 * 2 * 3);
  resize_center_crop(src.data(), 8, 16, 3, 4, 2, out.data());
  const uint8_t want[2][2] = {{70, 90}, {74, 94}};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      for (int c = 0; c < 3; ++c) CHECK(out[size_t((i * 2 + j) * 3 + c)] == want[i][j]);

  // No scaling: the crop is an exact copy of the centre (offset round((8 - 4) / 2) = 2).
  std::vector<uint8_t> same(4 * 4 * 3);
  std::vector<uint8_t> s48(4 * 8 * 3);
  for (size_t k = 0; k < s48.size(); ++k) s48[k] = uint8_t(k);
  resize_center_crop(s48.data(), 4, 8, 3, 4, 4, same.data());
  for (int64_t y = 0; y < 4; ++y)
    for (int64_t x = 0; x < 4; ++x)
      for (int64_t c = 0; c < 3; ++c)
        CHECK(same[size_t((y * 4 + x) * 3 + c)] == s48[size_t((y * 8 + x + 2) * 3 + c)]);
  // Python's round: (9 - 4) / 2 = 2.5 rounds to 2 (half to even).
  std::vector<uint8_t> s49(4 * 9 * 3);
  for (size_t k = 0; k < s49.size(); ++k) s49[k] = uint8_t(k);
  resize_center_crop(s49.data(), 4, 9, 3, 4, 4, same.data());
  CHECK(same[0] == s49[2 * 3]);
  CHECK_THROWS_AS(resize_center_crop(s49.data(), 4, 9, 3, 4, 5, same.data()), Error);
}

TEST_CASE("normalize_nhwc_to_nchw") {
  const std::vector<uint8_t> px = {0, 255, 51, 102, 204, 153};  // (1, 1, 2, 3)
  std::vector<float> out(6, NAN);
  normalize_nhwc_to_nchw(px.data(), 1, 1, 2, kImageNetMean, kImageNetStd, out.data());
  for (int c = 0; c < 3; ++c)
    for (int w = 0; w < 2; ++w) {
      const double want = (px[size_t(w * 3 + c)] / 255.0 - kImageNetMean[c]) / kImageNetStd[c];
      CHECK(out[size_t(c * 2 + w)] == doctest::Approx(want).epsilon(1e-6));
    }
}
