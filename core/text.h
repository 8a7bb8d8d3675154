#pragma once
// UTF-8 checks and terminal-safe display for text that comes from users' files (class names,
// paths, metadata values): json::quote refuses what is not UTF-8, model_metadata and the
// classes.txt reader refuse class names holding control characters, kiln-predict prints paths
// and names through printable().
#include <cstddef>
#include <string>
#include <string_view>

namespace kiln::text {

// The byte offset of the first byte that does not begin a well-formed UTF-8 sequence (a stray
// continuation byte, a truncated sequence, an overlong form, a surrogate, a code point past
// U+10FFFF), or std::string_view::npos when all of `s` is well-formed.
size_t invalid_utf8_at(std::string_view s);
inline bool is_valid_utf8(std::string_view s) {
  return invalid_utf8_at(s) == std::string_view::npos;
}

// Code points a terminal acts on instead of showing: the C0 controls (U+0000-U+001F), DEL, the
// C1 controls (U+0080-U+009F) and the bidirectional embeddings, overrides and isolates
// (U+202A-U+202E, U+2066-U+2069), which reorder what follows them on the line.
bool is_control(char32_t cp);

// Unicode's White_Space code points (space, no-break spaces, the U+2000 block, ideographic
// space ...) other than the controls above.
bool is_space(char32_t cp);

// Decodes the code point at byte `i` of `s` into *cp: its length in bytes (1-4), or 0 when the
// bytes there are not well-formed UTF-8 or `i` is at the end.
size_t decode_utf8(std::string_view s, size_t i, char32_t* cp);

// `s` safe to print on a terminal or in a one-line message: valid UTF-8 is kept except the
// control code points (is_control), written "\x1b" (below U+0080) or "\u202e"; each byte that
// is not valid UTF-8 is written "\xff". Not reversible (a backslash stays a backslash): for
// showing, not for storing.
std::string printable(std::string_view s);

}  // namespace kiln::text
