// DTypes: sizes and names, f16/bf16 bit-exact rounding, conversions between all dtypes, bool.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/tensor.h"

using namespace kiln;

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint16_t bf16_bits(float f) { return BFloat16(f).bits; }
float bf16_value(uint16_t b) {
  BFloat16 h;
  h.bits = b;
  return float(h);
}

const DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                      DType::i32, DType::i64, DType::u8,  DType::boolean};

}  // namespace

TEST_CASE("dtype sizes, names, floating") {
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::i32) == 4);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK(dtype_size(DType::u8) == 1);
  CHECK(dtype_size(DType::boolean) == 1);
  CHECK(std::string(dtype_name(DType::f32)) == "f32");
  CHECK(std::string(dtype_name(DType::f64)) == "f64");
  CHECK(std::string(dtype_name(DType::f16)) == "f16");
  CHECK(std::string(dtype_name(DType::bf16)) == "bf16");
  CHECK(std::string(dtype_name(DType::i32)) == "i32");
  CHECK(std::string(dtype_name(DType::i64)) == "i64");
  CHECK(std::string(dtype_name(DType::u8)) == "u8");
  CHECK(std::string(dtype_name(DType::boolean)) == "bool");
  int floating = 0;
  for (DType t : kAll) floating += is_floating(t);
  CHECK(floating == 4);
  CHECK(is_floating(DType::f16));
  CHECK(is_floating(DType::bf16));
  CHECK_FALSE(is_floating(DType::i64));
  CHECK_FALSE(is_floating(DType::boolean));
  std::ostringstream os;
  os << DType::bf16;
  CHECK(os.str() == "bf16");
  // element_size agrees with dtype_size for allocated tensors
  for (DType t : kAll) CHECK(empty({3}, t).nbytes() == 3 * dtype_size(t));
}

TEST_CASE("f16 encode: exact values and round-to-nearest-even") {
  CHECK(float_to_half_bits(0.0f) == 0x0000);
  CHECK(float_to_half_bits(-0.0f) == 0x8000);
  CHECK(float_to_half_bits(1.0f) == 0x3c00);
  CHECK(float_to_half_bits(-2.0f) == 0xc000);
  CHECK(float_to_half_bits(0.5f) == 0x3800);
  CHECK(float_to_half_bits(65504.0f) == 0x7bff);  // largest finite half
  CHECK(float_to_half_bits(0.333251953125f) == 0x3555);
  // ties between 1 and 1 + 2^-10: to the even mantissa
  CHECK(float_to_half_bits(1.0f + 0x1p-11f) == 0x3c00);                 // tie -> even (down)
  CHECK(float_to_half_bits(1.0f + 3 * 0x1p-11f) == 0x3c02);             // tie -> even (up)
  CHECK(float_to_half_bits(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01);      // above tie -> up
  CHECK(float_to_half_bits(1.0f + 0x1p-11f - 0x1p-20f) == 0x3c00);      // below tie -> down
  CHECK(float_to_half_bits(-(1.0f + 3 * 0x1p-11f)) == 0xbc02);
  // rounding carries into the exponent: 2 - 2^-11 is the tie above 0x3fff (odd) -> 2.0
  CHECK(float_to_half_bits(2.0f - 0x1p-11f) == 0x4000);
  CHECK(float_to_half_bits(2.0f - 0x1p-10f) == 0x3fff);  // exactly representable
  // overflow: 65520 is the tie between 65504 and 65536 (inf); odd mantissa -> inf
  CHECK(float_to_half_bits(65519.996f) == 0x7bff);
  CHECK(float_to_half_bits(65520.0f) == 0x7c00);
  CHECK(float_to_half_bits(-65520.0f) == 0xfc00);
  CHECK(float_to_half_bits(1e6f) == 0x7c00);
  CHECK(float_to_half_bits(std::numeric_limits<float>::max()) == 0x7c00);
  // inf and nan
  CHECK(float_to_half_bits(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(float_to_half_bits(-std::numeric_limits<float>::infinity()) == 0xfc00);
  uint16_t n = float_to_half_bits(std::numeric_limits<float>::quiet_NaN());
  CHECK((n & 0x7c00) == 0x7c00);
  CHECK((n & 0x03ff) != 0);
  uint16_t sn = float_to_half_bits(from_bits(0x7f800001u));  // signalling nan stays a nan
  CHECK((sn & 0x7c00) == 0x7c00);
  CHECK((sn & 0x03ff) != 0);
}

TEST_CASE("f16 encode: subnormals and underflow") {
  CHECK(float_to_half_bits(0x1p-14f) == 0x0400);        // smallest normal
  CHECK(float_to_half_bits(0x1p-24f) == 0x0001);        // smallest subnormal
  CHECK(float_to_half_bits(1023 * 0x1p-24f) == 0x03ff); // largest subnormal
  CHECK(float_to_half_bits(-3 * 0x1p-24f) == 0x8003);
  CHECK(float_to_half_bits(0x1p-25f) == 0x0000);          // tie between 0 and 1 -> 0
  CHECK(float_to_half_bits(0x1p-25f + 0x1p-40f) == 0x0001);
  CHECK(float_to_half_bits(3 * 0x1p-25f) == 0x0002);      // 1.5 ulp: tie 1|2 -> 2
  CHECK(float_to_half_bits(5 * 0x1p-25f) == 0x0002);      // 2.5 ulp: tie 2|3 -> 2
  CHECK(float_to_half_bits(7 * 0x1p-25f) == 0x0004);      // 3.5 ulp: tie 3|4 -> 4
  CHECK(float_to_half_bits(-0x1p-26f) == 0x8000);         // underflow keeps the sign
  CHECK(float_to_half_bits(1e-10f) == 0x0000);
  CHECK(float_to_half_bits(from_bits(0x00000001u)) == 0x0000);  // float subnormal
  // 1023.5 ulp is a tie between 0x03ff (odd) and 0x0400: rounds up into the normals
  CHECK(float_to_half_bits(1023.5f * 0x1p-24f) == 0x0400);
  // just below the smallest normal, above the tie
  CHECK(float_to_half_bits(0x1p-14f - 0x1p-30f) == 0x0400);
}

TEST_CASE("f16 decode and exhaustive round trip") {
  CHECK(half_bits_to_float(0x0001) == 0x1p-24f);
  CHECK(half_bits_to_float(0x03ff) == 1023 * 0x1p-24f);
  CHECK(half_bits_to_float(0x0400) == 0x1p-14f);
  CHECK(half_bits_to_float(0x7bff) == 65504.0f);
  CHECK(half_bits_to_float(0x3c01) == 1.0f + 0x1p-10f);
  CHECK(half_bits_to_float(0xc000) == -2.0f);
  CHECK(half_bits_to_float(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(half_bits_to_float(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(half_bits_to_float(0x7e00)));
  CHECK(std::isnan(half_bits_to_float(0xfc01)));
  float nz = half_bits_to_float(0x8000);
  CHECK(nz == 0.0f);
  CHECK(std::signbit(nz));
  CHECK(half_bits_to_float(0x8001) == -0x1p-24f);
  // Every non-nan half survives half -> float -> half, and decoding is monotonic.
  int bad = 0;
  float prev = -std::numeric_limits<float>::infinity();
  for (uint32_t b = 0; b < 0x10000; ++b) {
    uint16_t h = uint16_t(b);
    float f = half_bits_to_float(h);
    bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    if (is_nan) {
      bad += !std::isnan(f);
      continue;
    }
    bad += float_to_half_bits(f) != h;
    if (b >= 0x0001 && b <= 0x7c00) {  // positive range increases strictly
      bad += !(f > prev);
      prev = f;
    }
  }
  CHECK(bad == 0);
  // Half struct wraps the same functions
  Half h(1.5f);
  CHECK(h.bits == 0x3e00);
  CHECK(float(h) == 1.5f);
}

TEST_CASE("bf16 encode/decode with round-to-nearest-even") {
  CHECK(bf16_bits(1.0f) == 0x3f80);
  CHECK(bf16_bits(-2.0f) == 0xc000);
  CHECK(bf16_bits(0.0f) == 0x0000);
  CHECK(bf16_bits(-0.0f) == 0x8000);
  CHECK(bf16_bits(1.0f + 0x1p-8f) == 0x3f80);            // tie -> even (down)
  CHECK(bf16_bits(1.0f + 3 * 0x1p-8f) == 0x3f82);        // tie -> even (up)
  CHECK(bf16_bits(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81); // above tie
  CHECK(bf16_bits(1.0f + 0x1p-8f - 0x1p-20f) == 0x3f80); // below tie
  CHECK(bf16_bits(0.1f) == 0x3dcd);                      // 0x3dcccccd rounds up
  CHECK(bf16_value(0x3dcd) == 0.10009765625f);
  CHECK(bf16_bits(2.0f - 0x1p-8f) == 0x4000);            // tie above odd 0x3fff -> carry
  CHECK(bf16_bits(2.0f - 0x1p-7f) == 0x3fff);            // exactly representable
  // overflow to inf: 0x7f7f8000 is a tie above odd 0x7f7f
  CHECK(bf16_bits(from_bits(0x7f7f7fffu)) == 0x7f7f);
  CHECK(bf16_bits(from_bits(0x7f7f8000u)) == 0x7f80);
  CHECK(bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(bf16_bits(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(bf16_bits(-std::numeric_limits<float>::infinity()) == 0xff80);
  // nan stays nan (quiet), even a signalling one whose payload sits in the dropped bits
  CHECK(std::isnan(bf16_value(bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(bf16_value(bf16_bits(from_bits(0x7f800001u)))));
  CHECK(std::isnan(bf16_value(bf16_bits(from_bits(0xff800001u)))));
  // float subnormals round like everything else
  CHECK(bf16_bits(from_bits(0x00008000u)) == 0x0000);  // tie -> even 0
  CHECK(bf16_bits(from_bits(0x00018000u)) == 0x0002);  // tie -> even 2
  CHECK(bf16_bits(from_bits(0x00010001u)) == 0x0001);
  // decode is the top half of a float
  CHECK(to_bits(bf16_value(0x4049)) == 0x40490000u);
  CHECK(bf16_value(0xc000) == -2.0f);
  // every non-nan pattern round-trips
  int bad = 0;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = bf16_value(uint16_t(b));
    if (std::isnan(f)) continue;
    bad += bf16_bits(f) != b;
  }
  CHECK(bad == 0);
}

TEST_CASE("to(dtype) between all eight dtypes") {
  const std::vector<double> vals = {0, 1, 2, 5, 100, 3};
  for (DType src : kAll) {
    Tensor a = from_vector<double>(vals, {2, 3}, src);
    REQUIRE(a.dtype() == src);
    std::vector<double> in = a.to_vector<double>();
    std::vector<double> want_in = vals;
    if (src == DType::boolean) want_in = {0, 1, 1, 1, 1, 1};
    CHECK(in == want_in);
    for (DType dst : kAll) {
      CAPTURE(std::string(dtype_name(src)));
      CAPTURE(std::string(dtype_name(dst)));
      Tensor b = a.to(dst);
      CHECK(b.dtype() == dst);
      CHECK(b.shape() == Shape{2, 3});
      if (src == dst) CHECK(b.is_same(a));
      std::vector<double> want = want_in;
      if (dst == DType::boolean)
        for (double& w : want) w = w != 0;
      CHECK(b.to_vector<double>() == want);
    }
  }
}

TEST_CASE("to(dtype) rounds and truncates like C++ casts") {
  Tensor x = from_vector<double>({2.7, -2.7, 0.1, 65520.0, 1e-8}, {5}, DType::f64);
  CHECK(x.to(DType::i32).to_vector<int>() == std::vector<int>{2, -2, 0, 65520, 0});
  CHECK(x.to(DType::i64).to_vector<int64_t>() == std::vector<int64_t>{2, -2, 0, 65520, 0});
  auto h = x.to(DType::f16).to_vector<double>();
  CHECK(h[0] == 2.69921875);             // 0x4166
  CHECK(h[2] == 0.0999755859375);        // 0x2e66
  CHECK(std::isinf(h[3]));
  CHECK(h[4] == 0.0);                    // below half the smallest subnormal
  auto bf = x.to(DType::bf16).to_vector<double>();
  CHECK(bf[0] == 2.703125);              // 0x402d
  CHECK(bf[2] == 0.10009765625);
  CHECK(bf[3] == 65536.0);
  CHECK(bf[4] == doctest::Approx(1e-8).epsilon(1e-2));  // bf16 keeps f32's exponent range
  // f16 -> bf16 -> f32 goes through exact floats
  Tensor t = from_vector<float>({1.0f + 0x1p-10f}, {1}, DType::f16);
  CHECK(t.to(DType::f32).item() == 1.0 + 0x1p-10);
  CHECK(t.to(DType::bf16).item() == 1.0);  // below bf16's half ulp
  // u8 holds 0..255
  CHECK(from_vector<int>({255, 7}, {2}, DType::u8).to(DType::f32).to_vector<float>() ==
        std::vector<float>{255, 7});
  // to() keeps a channels-last layout
  Tensor cl = empty({1, 3, 2, 2}, TensorOptions(DType::f32).with_memory_format(MemoryFormat::ChannelsLast));
  cl.fill_(1.0);
  CHECK(cl.to(DType::f16).is_contiguous(MemoryFormat::ChannelsLast));
}

TEST_CASE("bool conversion") {
  Tensor x = from_vector<double>({0.0, -0.0, 0.5, -3.0, std::nan(""), 1e-50}, {6}, DType::f64);
  Tensor b = x.to(DType::boolean);
  CHECK(b.dtype() == DType::boolean);
  CHECK(b.to_vector<int>() == std::vector<int>{0, 0, 1, 1, 1, 1});
  CHECK(b.to_vector<bool>() == std::vector<bool>{false, false, true, true, true, true});
  // stored as 0/1 bytes
  const uint8_t* raw = static_cast<const uint8_t*>(b.raw_data());
  for (int i = 0; i < 6; ++i) CHECK((raw[i] == 0 || raw[i] == 1));
  CHECK(b.to(DType::f32).to_vector<float>() == std::vector<float>{0, 0, 1, 1, 1, 1});
  CHECK(b.to(DType::f16).to_vector<float>() == std::vector<float>{0, 0, 1, 1, 1, 1});
  CHECK(b.to(DType::u8).to_vector<int>() == std::vector<int>{0, 0, 1, 1, 1, 1});
  // f16 / bf16 / integers to bool
  CHECK(from_vector<double>({0, 0x1p-24, -0.0}, {3}, DType::f16).to(DType::boolean).to_vector<int>() ==
        std::vector<int>{0, 1, 0});
  CHECK(from_vector<double>({0, 1e-30}, {2}, DType::bf16).to(DType::boolean).to_vector<int>() ==
        std::vector<int>{0, 1});
  CHECK(from_vector<int>({0, 256, -1}, {3}, DType::i32).to(DType::boolean).to_vector<int>() ==
        std::vector<int>{0, 1, 1});
  CHECK(from_vector<int64_t>({int64_t(1) << 40, 0}, {2}, DType::i64).to(DType::boolean).to_vector<int>() ==
        std::vector<int>{1, 0});
  CHECK(from_vector<bool>({true, false}, {2}, DType::boolean).to_vector<double>() ==
        std::vector<double>{1, 0});
  CHECK(convert<bool>(0.25f));
  CHECK_FALSE(convert<bool>(int64_t(0)));
  CHECK(convert<bool>(Half(0x1p-24f)));
  CHECK(convert<float>(true) == 1.0f);
}
