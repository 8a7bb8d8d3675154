#pragma once
// A small JSON reader and string quoting: enough for safetensors headers and kiln's logs.
// Numbers are doubles (exact for integers below 2^53, which covers tensor offsets we accept).
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
  bool b_ = false;
  std::string s_;
  std::vector<Value> arr_;
  std::map<std::string, Value> obj_;
};

// Throws kiln::Error with the byte position on malformed input.
Value parse(const std::string& text);
// "text" with JSON escapes.
std::string quote(const std::string& s);

}  // namespace kiln::json
