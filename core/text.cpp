#include "core/text.h"

#include <cstdio>

namespace kiln::text {

size_t decode_utf8(std::string_view s, size_t i, char32_t* cp) {
  if (i >= s.size()) return 0;
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  // Lead byte: sequence length and the smallest code point it may encode (no overlong forms).
  size_t n;
  char32_t v, min;
  if ((c & 0xE0) == 0xC0)
    n = 2, v = c & 0x1F, min = 0x80;
  else if ((c & 0xF0) == 0xE0)
    n = 3, v = c & 0x0F, min = 0x800;
  else if ((c & 0xF8) == 0xF0)
    n = 4, v = c & 0x07, min = 0x10000;
  else
    return 0;  // a continuation byte, or 0xF8-0xFF
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  *cp = v;
  return n;
}

size_t invalid_utf8_at(std::string_view s) {
  char32_t cp;
  for (size_t i = 0; i < s.size();) {
    const size_t n = decode_utf8(s, i, &cp);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

bool is_control(char32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F) || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

bool is_space(char32_t cp) {
  return cp == 0x20 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  char buf[12];
  char32_t cp;
  for (size_t i = 0; i < s.size();) {
    const size_t n = decode_utf8(s, i, &cp);
    if (n == 0) {  // one byte that is not UTF-8
      std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(static_cast<unsigned char>(s[i])));
      out += buf;
      ++i;
      continue;
    }
    if (is_control(cp)) {
      std::snprintf(buf, sizeof buf, cp < 0x80 ? "\\x%02x" : "\\u%04x", unsigned(cp));
      out += buf;
    } else {
      out.append(s.substr(i, n));
    }
    i += n;
  }
  return out;
}

}  // namespace kiln::text
