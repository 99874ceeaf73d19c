#include "actors/rollout/byte_level.hpp"

#include <cassert>
#include <vector>

namespace kiln::rollout::byte_level {

namespace {

struct Table {
  std::array<std::string, 256> chars;
  std::vector<int> bytes;  // indexed by code point, up to U+0143
  Table() {
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    bytes.assign(0x144, -1);
    uint32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      uint32_t cp = printable(b) ? uint32_t(b) : next++;
      append_utf8(chars[std::size_t(b)], cp);
      bytes[cp] = b;
    }
    // 256 - 188 printable bytes = 68 others, so the last one stands for U+0143.
    assert(next == 0x144);
  }
};

const Table& table() {
  static const Table t;
  return t;
}

}  // namespace

const std::string& char_of_byte(uint8_t b) { return table().chars[b]; }

int byte_of_char(uint32_t code_point) {
  const auto& t = table();
  return code_point < t.bytes.size() ? t.bytes[code_point] : -1;
}

Utf8Step utf8_step(std::string_view s, std::size_t i) {
  auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return {1, true};
  std::size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c == 0xE0) need = 2, lo = 0xA0;                                     // no overlongs
  else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
  else if (c == 0xED) need = 2, hi = 0x9F;                                     // no surrogates
  else if (c == 0xF0) need = 3, lo = 0x90;                                     // no overlongs
  else if (c >= 0xF1 && c <= 0xF3) need = 3;
  else if (c == 0xF4) need = 3, hi = 0x8F;                                     // <= U+10FFFF
  else return {1, false};
  for (std::size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {k, false};
    auto d = static_cast<unsigned char>(s[i + k]);
    bool ok = k == 1 ? (d >= lo && d <= hi) : (d >= 0x80 && d <= 0xBF);
    if (!ok) return {k, false};
  }
  return {need + 1, true};
}

std::size_t first_invalid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) { ++i; continue; }
    auto step = utf8_step(s, i);
    if (!step.valid) return i;
    i += step.length;
  }
  return s.size();
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    auto step = utf8_step(bytes, i);
    if (step.valid) out.append(bytes.substr(i, step.length));
    else out += "\xEF\xBF\xBD";  // U+FFFD
    i += step.length;
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  assert(cp <= 0x10FFFF);  // callers pass code points of the byte table only
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

}  // namespace kiln::rollout::byte_level
