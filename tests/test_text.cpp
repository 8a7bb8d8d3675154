// Text from users' files: UTF-8 validation, terminal-safe printing (core/text.h), JSON strings
// written and read as valid UTF-8 (core/json.h), safetensors headers kept UTF-8, class names.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "core/json.h"
#include "core/serialization.h"
#include "core/text.h"
#include "optim/model_file.h"

using namespace kiln;

namespace {

// A kiln::Error's message without its " [file.cpp:12, ...]" suffix.
template <typename F>
std::string message_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string w = e.what();
    return w.substr(0, w.rfind(" ["));
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("UTF-8: well-formed sequences pass, every kind of ill-formed one is found") {
  CHECK(text::is_valid_utf8(""));
  CHECK(text::is_valid_utf8("plain ASCII"));
  CHECK(text::is_valid_utf8("Ünïcode 日本 \xF0\x9F\x98\x80"));  // 2, 3 and 4 bytes
  CHECK(text::invalid_utf8_at("ab\xFF") == 2);                  // never a UTF-8 byte
  CHECK(text::invalid_utf8_at("a\x80") == 1);                   // a stray continuation byte
  CHECK(text::invalid_utf8_at("ab\xC3") == 2);                  // truncated
  CHECK(text::invalid_utf8_at("\xE6\x97x") == 0);               // continuation missing
  CHECK(text::invalid_utf8_at("\xC0\xAF") == 0);                // overlong '/'
  CHECK(text::invalid_utf8_at("\xE0\x80\xAF") == 0);            // overlong, 3 bytes
  CHECK(text::invalid_utf8_at("x\xED\xA0\x80") == 1);           // a surrogate (U+D800)
  CHECK(text::invalid_utf8_at("\xF4\x90\x80\x80") == 0);        // past U+10FFFF
  char32_t cp = 0;
  CHECK(text::decode_utf8("\xE2\x80\xAE", 0, &cp) == 3);
  CHECK(cp == 0x202E);
}

TEST_CASE("printable: controls and bad bytes escaped, the rest kept") {
  CHECK(text::printable("cat Ünïcode back\\slash") == "cat Ünïcode back\\slash");
  CHECK(text::printable("\x1b[31mred\x07") == "\\x1b[31mred\\x07");
  CHECK(text::printable("a\nb\tc\x7f") == "a\\x0ab\\x09c\\x7f");
  CHECK(text::printable(std::string("\xC2\x9B") + "2J") == "\\u009b2J");  // C1 CSI
  CHECK(text::printable(std::string("abc\xE2\x80\xAE") + "def") ==
        "abc\\u202edef");  // right-to-left override
  CHECK(text::printable("bad \xFF\xC3") == "bad \\xff\\xc3");
  CHECK(text::printable(std::string("nul\0x", 5)) == "nul\\x00x");
}

TEST_CASE("json::quote writes valid UTF-8 JSON or refuses; parse decodes \\u escapes to UTF-8") {
  CHECK(json::quote("a\"b") == "\"a\\\"b\"");
  CHECK(json::quote(std::string("tab\tnl\ncr\resc\x1b") + "bs\\") ==
        "\"tab\\tnl\\ncr\\resc\\u001bbs\\\\\"");
  CHECK(json::quote("日本") == "\"日本\"");
  CHECK(message_of([] { json::quote("ok \xFF then"); }) ==
        "json: cannot write a string that is not UTF-8 (byte 0xff at offset 3 of 'ok \\xff "
        "then')");
  CHECK(message_of([] { json::quote("\xC0\xAF"); }).find("byte 0xc0 at offset 0") !=
        std::string::npos);
  // Every string quote accepts comes back unchanged.
  for (const std::string s : {"", "x", "\x01\x1f\x7f", "Ünï \xF0\x9F\x98\x80", "\"\\/"})
    CHECK(json::parse(json::quote(s)).str() == s);

  CHECK(json::parse("\"\\u00fc\\u65e5\"").str() == "ü日");
  CHECK(json::parse("\"\\ud83d\\ude00\"").str() == "\xF0\x9F\x98\x80");  // a surrogate pair
  CHECK(json::parse("\"\\uD83D\\uDE00\"").str() == "\xF0\x9F\x98\x80");
  CHECK(message_of([] { json::parse("\"ab\\ud83d\""); }) ==
        "json: unpaired surrogate escape at byte 3");
  CHECK(message_of([] { json::parse("\"\\ude00\""); }) ==
        "json: unpaired surrogate escape at byte 1");
  CHECK(message_of([] { json::parse("\"\\ud83d\\u0041\""); }) ==
        "json: unpaired surrogate escape at byte 1");
  CHECK(message_of([] { json::parse("\"\\u00zz\""); }) == "json: bad \\u escape at byte 3");
  CHECK(message_of([] { json::parse("\"\\u00"); }) == "json: short \\u escape at byte 3");
}

TEST_CASE("save_safetensors refuses names and metadata that are not UTF-8, naming the file") {
  const std::string path =
      (std::filesystem::temp_directory_path() / "kiln_test_text.safetensors").string();
  CHECK(message_of([&] {
          save_safetensors(path, {{"w", zeros({1})}}, {{"note", "a\xFF"}});
        }) == "save_safetensors '" + path +
                  "': metadata 'note' is not UTF-8 (a safetensors header is UTF-8 JSON)");
  CHECK(message_of([&] {
          save_safetensors(path, {{"w\xC3", zeros({1})}});
        }) == "save_safetensors '" + path +
                  "': tensor name 'w\\xc3' is not UTF-8 (a safetensors header is UTF-8 JSON)");
  CHECK_FALSE(std::filesystem::exists(path));
  // Control characters are escaped, so the header stays valid JSON and reads back.
  save_safetensors(path, {{"w", zeros({1})}}, {{"note", "bell\x07 tab\t"}});
  CHECK(load_safetensors(path).metadata.at("note") == "bell\x07 tab\t");
  std::filesystem::remove(path);
}

TEST_CASE("class names: blank, whitespace-only, control characters, bad UTF-8, duplicates") {
  CHECK(class_name_problem("T-shirt/top") == "");
  CHECK(class_name_problem("Ünïcode 日本 \xF0\x9F\x98\x80") == "");
  CHECK(class_name_problem(" padded ") == "");
  CHECK(class_name_problem("") == "is empty");
  CHECK(class_name_problem("   ") == "is only whitespace");
  CHECK(class_name_problem("\xC2\xA0\xE3\x80\x80") == "is only whitespace");  // NBSP, U+3000
  CHECK(class_name_problem("a\tb") == "holds control character U+0009");
  CHECK(class_name_problem("\x1b[31mred") == "holds control character U+001B");
  CHECK(class_name_problem("x\xC2\x85") == "holds control character U+0085");
  CHECK(class_name_problem("abc\xE2\x80\xAE") == "holds control character U+202E");
  CHECK(class_name_problem("caf\xE9") == "is not valid UTF-8 (byte 0xe9 at offset 3)");

  check_class_names({"a", "b", "c"}, "src");
  CHECK(message_of([] {
          check_class_names({"a", "b", "a"}, "src");
        }) == "src: class 2 'a' repeats class 0");
  CHECK(message_of([] {
          check_class_names({"a", "\x1b]0;x\x07"}, "src");
        }) == "src: class 1 '\\x1b]0;x\\x07' holds control character U+001B");
  CHECK(message_of([] {
          check_class_names({"ok", " "}, "src");
        }) == "src: class 1 ' ' is only whitespace");
}
