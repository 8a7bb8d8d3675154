#include "core/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/text.h"

namespace kiln::json {

namespace {
std::string hex_byte(char c) {
  char buf[4];
  std::snprintf(buf, sizeof buf, "%02x", unsigned(static_cast<unsigned char>(c)));
  return buf;
}
}  // namespace

double Value::number() const {
  KILN_CHECK(kind_ == Kind::Number, "json: expected a number");
  return num_;
}
uint64_t Value::unsigned_integer() const {
  KILN_CHECK(kind_ == Kind::Number, "json: expected a number");
  KILN_CHECK(int_kind_ == IntKind::Unsigned, "json: expected a non-negative integer, got ", num_);
  return int_;
}
bool Value::boolean() const {
  KILN_CHECK(kind_ == Kind::Bool, "json: expected a boolean");
  return b_;
}
const std::string& Value::str() const {
  KILN_CHECK(kind_ == Kind::String, "json: expected a string");
  return s_;
}
const std::vector<Value>& Value::array() const {
  KILN_CHECK(kind_ == Kind::Array, "json: expected an array");
  return arr_;
}
const std::map<std::string, Value>& Value::object() const {
  KILN_CHECK(kind_ == Kind::Object, "json: expected an object");
  return obj_;
}
const Value& Value::at(const std::string& key) const {
  auto it = object().find(key);
  KILN_CHECK(it != obj_.end(), "json: missing key '", key, "'");
  return it->second;
}
bool Value::contains(const std::string& key) const {
  return kind_ == Kind::Object && obj_.count(key) > 0;
}

class Parser {
 public:
  explicit Parser(const std::string& t) : t_(t) {}
  Value parse_document() {
    Value v = parse_value(0);
    skip_ws();
    KILN_CHECK(i_ == t_.size(), "json: trailing characters at byte ", i_);
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  void skip_ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\t' || t_[i_] == '\r'))
      ++i_;
  }
  char peek() {
    skip_ws();
    KILN_CHECK(i_ < t_.size(), "json: unexpected end of input");
    return t_[i_];
  }
  void expect(char c) {
    KILN_CHECK(peek() == c, "json: expected '", c, "' at byte ", i_);
    ++i_;
  }
  Value parse_value(int depth) {
    KILN_CHECK(depth < kMaxDepth, "json: nesting deeper than ", kMaxDepth);
    Value v;
    char c = peek();
    if (c == '{') {
      v.kind_ = Value::Kind::Object;
      ++i_;
      if (peek() == '}') { ++i_; return v; }
      while (true) {
        KILN_CHECK(peek() == '"', "json: expected a key at byte ", i_);
        std::string k = parse_string();
        expect(':');
        const size_t key_at = i_;
        Value item = parse_value(depth + 1);
        KILN_CHECK(v.obj_.emplace(k, std::move(item)).second, "json: duplicate key '", k,
                   "' at byte ", key_at);
        if (peek() == ',') { ++i_; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind_ = Value::Kind::Array;
      ++i_;
      if (peek() == ']') { ++i_; return v; }
      while (true) {
        v.arr_.push_back(parse_value(depth + 1));
        if (peek() == ',') { ++i_; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind_ = Value::Kind::String;
      v.s_ = parse_string();
      return v;
    }
    if (t_.compare(i_, 4, "true") == 0) { i_ += 4; v.kind_ = Value::Kind::Bool; v.b_ = true; return v; }
    if (t_.compare(i_, 5, "false") == 0) { i_ += 5; v.kind_ = Value::Kind::Bool; return v; }
    if (t_.compare(i_, 4, "null") == 0) { i_ += 4; return v; }
    const char* start = t_.c_str() + i_;
    char* end = nullptr;
    double d = std::strtod(start, &end);
    KILN_CHECK(end != start, "json: unexpected character '", c, "' at byte ", i_);
    v.kind_ = Value::Kind::Number;
    v.num_ = d;
    // A plain integer literal: optional '-', then digits only.
    const std::string lit(start, size_t(end - start));
    const bool neg = lit[0] == '-';
    if (lit.size() > size_t(neg) && lit.find_first_not_of("0123456789", neg) == std::string::npos) {
      errno = 0;
      char* iend = nullptr;
      const unsigned long long m = std::strtoull(lit.c_str() + neg, &iend, 10);
      if (errno == 0 && *iend == '\0' && (!neg || m <= (1ull << 63))) {
        v.int_ = m;
        v.int_kind_ = neg && m != 0 ? Value::IntKind::Negative : Value::IntKind::Unsigned;
      }
    }
    i_ += size_t(end - start);
    return v;
  }
  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      KILN_CHECK(i_ < t_.size(), "json: unterminated string");
      char c = t_[i_++];
      if (c == '"') return out;
      if (c != '\\') { out += c; continue; }
      KILN_CHECK(i_ < t_.size(), "json: unterminated escape");
      char e = t_[i_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          const size_t at = i_ - 2;  // where the escape starts
          char32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF && t_.compare(i_, 2, "\\u") == 0) {
            i_ += 2;
            const char32_t lo = parse_hex4();
            KILN_CHECK(lo >= 0xDC00 && lo <= 0xDFFF, "json: unpaired surrogate escape at byte ",
                       at);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          KILN_CHECK(cp < 0xD800 || cp > 0xDFFF, "json: unpaired surrogate escape at byte ", at);
          append_utf8(out, cp);
          break;
        }
        default: out += e;
      }
    }
  }
  // The four hex digits of a \u escape.
  char32_t parse_hex4() {
    KILN_CHECK(i_ + 4 <= t_.size(), "json: short \\u escape at byte ", i_);
    char32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = t_[i_ + size_t(k)];
      const int d = h >= '0' && h <= '9'   ? h - '0'
                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                    : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                           : -1;
      KILN_CHECK(d >= 0, "json: bad \\u escape at byte ", i_);
      v = (v << 4) | char32_t(d);
    }
    i_ += 4;
    return v;
  }
  static void append_utf8(std::string& out, char32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }
  const std::string& t_;
  size_t i_ = 0;
};

Value parse(const std::string& text) { return Parser(text).parse_document(); }

std::string quote(const std::string& s) {
  const size_t bad = text::invalid_utf8_at(s);
  KILN_CHECK(bad == std::string::npos, "json: cannot write a string that is not UTF-8 (byte 0x",
             hex_byte(s[bad]), " at offset ", bad, " of '", text::printable(s.substr(0, 80)), "')");
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

std::string number(double v, int significant_digits) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", significant_digits, v);
  return buf;
}

ObjectWriter& ObjectWriter::raw(const std::string& key, const std::string& value) {
  if (!body_.empty()) body_ += ", ";
  body_ += quote(key) + ": " + value;
  return *this;
}

ObjectWriter& ObjectWriter::number(const std::string& key, double v, int significant_digits) {
  return raw(key, json::number(v, significant_digits));
}

ObjectWriter& ObjectWriter::integer(const std::string& key, int64_t v) {
  return raw(key, std::to_string(v));
}

ObjectWriter& ObjectWriter::string(const std::string& key, const std::string& v) {
  return raw(key, quote(v));
}

ObjectWriter& ObjectWriter::boolean(const std::string& key, bool v) {
  return raw(key, v ? "true" : "false");
}

}  // namespace kiln::json

