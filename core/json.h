#pragma once
// A small JSON reader and string quoting: enough for safetensors headers and kiln's logs.
// Numbers are doubles; a number written as a plain integer literal (no '.', no exponent) that
// fits in 64 bits is also kept exactly (Value::integer). Duplicate keys in an object are an error.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kiln::json {

class Value {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Value() = default;
  Kind kind() const { return kind_; }
  bool is_object() const { return kind_ == Kind::Object; }
  // Accessors throw kiln::Error when the kind is different or a key is missing.
  double number() const;
  // The exact value of a plain integer literal ("12", "-3"); throws for "1.5", "1e3", "1.0" and
  // literals outside [-2^63, 2^64).
  bool is_integer() const { return kind_ == Kind::Number && int_kind_ != IntKind::None; }
  uint64_t unsigned_integer() const;  // throws for negative integers too
  bool boolean() const;
  const std::string& str() const;
  const std::vector<Value>& array() const;
  const std::map<std::string, Value>& object() const;
  const Value& at(const std::string& key) const;
  bool contains(const std::string& key) const;

 private:
  friend class Parser;
  Kind kind_ = Kind::Null;
  double num_ = 0;
  enum class IntKind { None, Unsigned, Negative };
  IntKind int_kind_ = IntKind::None;
  uint64_t int_ = 0;  // magnitude of the integer literal
  bool b_ = false;
  std::string s_;
  std::vector<Value> arr_;
  std::map<std::string, Value> obj_;
};

// Throws kiln::Error with the byte position on malformed input and on duplicate keys. A \u
// escape must have four hex digits; a surrogate pair becomes one code point, a lone surrogate
// is an error (so escapes always decode to valid UTF-8). Raw bytes are taken as they are.
Value parse(const std::string& text);
// `s` as a JSON string literal: '"' and '\\' escaped, control characters below U+0020 as \n,
// \t, \r or \u00XX, everything else as it is. JSON text is UTF-8 (RFC 8259), so a string that
// is not valid UTF-8 is refused: kiln::Error naming the first bad byte's offset. The result
// is always valid UTF-8 JSON.
std::string quote(const std::string& s);

// One JSON object written key by key, in the order given (kiln-train's logs):
//   json::ObjectWriter o;
//   o.integer("epoch", 3).number("loss", 0.25).string("arch", "resnet18");
//   o.str() == R"({"epoch": 3, "loss": 0.25, "arch": "resnet18"})"
// number(): %.6g by default, NaN and infinities as null (JSON has neither); strings through quote().
class ObjectWriter {
 public:
  ObjectWriter& number(const std::string& key, double v, int significant_digits = 6);
  ObjectWriter& integer(const std::string& key, int64_t v);
  ObjectWriter& string(const std::string& key, const std::string& v);
  ObjectWriter& boolean(const std::string& key, bool v);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  ObjectWriter& raw(const std::string& key, const std::string& value);
  std::string body_;
};

// A number as ObjectWriter writes it: "%.<digits>g", or null when not finite.
std::string number(double v, int significant_digits = 6);

}  // namespace kiln::json

