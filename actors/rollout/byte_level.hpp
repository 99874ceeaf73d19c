#pragma once
// The byte-level pieces of a byte-level BPE tokenizer: GPT-2's byte <-> character table and
// the UTF-8 rules tokenizers (Rust) applies. Torch-free, header + byte_level.cpp.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::rollout::byte_level {

/// GPT-2's byte-to-unicode table: bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for the
/// code point of the same value; the other 68 bytes, in increasing order, for U+0100.. U+0143.
/// Returns the UTF-8 encoding of the character that stands for byte `b`.
const std::string& char_of_byte(uint8_t b);
/// The byte a code point stands for, or -1 when it is not one of the 256 characters above.
int byte_of_char(uint32_t code_point);

/// One UTF-8 step at `s[i]` (i < s.size()): the length of the valid sequence there (valid =
/// true), or of the maximal invalid subpart (>= 1, valid = false), by Unicode's Table 3-7
/// (no overlongs, no surrogates, nothing above U+10FFFF), as Rust's str and from_utf8_lossy.
struct Utf8Step {
  std::size_t length;
  bool valid;
};
Utf8Step utf8_step(std::string_view s, std::size_t i);
/// Byte offset of the first invalid UTF-8 sequence in `s`, or s.size() when it is valid.
std::size_t first_invalid_utf8(std::string_view s);
/// `bytes` as UTF-8, each maximal invalid subpart replaced by U+FFFD (Rust's
/// String::from_utf8_lossy, which tokenizers' ByteLevel decoder ends with).
std::string utf8_lossy(std::string_view bytes);
/// Appends the UTF-8 encoding of `code_point` (<= U+10FFFF) to `out`.
void append_utf8(std::string& out, uint32_t code_point);

}  // namespace kiln::rollout::byte_level
