#include "core/dtype.h"

namespace kiln {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::boolean: return 1;
  }
  KILN_FAIL("bad dtype ", int(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
  }
  return "?";
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

static uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

float half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    if (mant == 0) return u2f(sign);
    // subnormal: value = mant * 2^-24
    float v = float(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return u2f(sign | 0x7f800000u | (mant << 13));
  return u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_half_bits(float f) {
  uint32_t x = f2u(f);
  uint16_t sign = uint16_t((x >> 16) & 0x8000);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00 : 0x7c00);  // nan / inf
  if (ax >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {
    // subnormal half (or zero): round(|f| / 2^-24) with ties to even
    float a = u2f(ax);
    float scaled = a * 16777216.0f;  // 2^24, exact
    uint32_t m = uint32_t(scaled);
    float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1))) ++m;
    return sign | uint16_t(m);
  }
  uint32_t exp = (ax >> 23) - 112;
  uint32_t mant = ax & 0x7fffff;
  uint32_t h = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // may carry into exponent: correct
  return sign | uint16_t(h);
}

Half::Half(float f) : bits(float_to_half_bits(f)) {}
Half::operator float() const { return half_bits_to_float(bits); }

BFloat16::BFloat16(float f) {
  uint32_t x = f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    bits = uint16_t((x >> 16) | 0x40);  // quiet nan
  } else {
    uint32_t lsb = (x >> 16) & 1;
    bits = uint16_t((x + 0x7fff + lsb) >> 16);
  }
}
BFloat16::operator float() const { return u2f(uint32_t(bits) << 16); }

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    // Digits only: std::stoi alone would also take " 1" and "+1".
    const std::string num = s.substr(5);
    bool digits = !num.empty() && num.size() <= 9;
    for (char c : num) digits = digits && c >= '0' && c <= '9';
    if (digits) return cuda(std::stoi(num));
  }
  KILN_FAIL("bad device string '", s, "' (expected cpu, cuda or cuda:N)");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
std::ostream& operator<<(std::ostream& os, Device d) { return os << d.str(); }

}  // namespace kiln
