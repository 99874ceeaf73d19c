#pragma once
// A config value as error messages show it ("..., got 0"): integers in full, doubles as the
// shortest text that reads back to the same double (1e-07, 0.5, inf); text by printable().
#include <charconv>
#include <cstdio>
#include <string>
#include <type_traits>

namespace kiln {

/// Text as an error message shows it, on one line and nothing hidden: line breaks, tabs and the
/// other control characters (C0, DEL, C1) and the no-break space written as escapes (\n, \r, \t,
/// \u001B, \u0085, \u00A0), bytes that are not UTF-8 as \xFF; everything else as it is (a
/// backslash too: the message is read, not parsed).
inline std::string printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  auto hex = [&out](const char* format, unsigned value) {
    char esc[8];
    std::snprintf(esc, sizeof esc, format, value);
    out += esc;
  };
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out += "\\t";
      else if (c < 0x20 || c == 0x7f) hex("\\u%04X", c);
      else out += char(c);
      ++i;
      continue;
    }
    // A UTF-8 sequence: its length by the lead byte, then continuation bytes (no overlong forms,
    // surrogates or code points past U+10FFFF).
    const std::size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    bool ok = n > 0 && i + n <= text.size();
    for (std::size_t j = 1; ok && j < n; ++j) ok = (static_cast<unsigned char>(text[i + j]) & 0xC0) == 0x80;
    if (ok && n == 3) {
      const auto c1 = static_cast<unsigned char>(text[i + 1]);
      ok = !(c == 0xE0 && c1 < 0xA0) && !(c == 0xED && c1 >= 0xA0);
    }
    if (ok && n == 4) {
      const auto c1 = static_cast<unsigned char>(text[i + 1]);
      ok = !(c == 0xF0 && c1 < 0x90) && !(c == 0xF4 && c1 >= 0x90);
    }
    if (!ok) {
      hex("\\x%02X", c);
      ++i;
      continue;
    }
    const auto c1 = static_cast<unsigned char>(text[i + 1]);
    if (n == 2 && c == 0xC2 && (c1 <= 0x9F || c1 == 0xA0)) hex("\\u%04X", c1);  // C1 controls, no-break space
    else out.append(text, i, n);
    i += n;
  }
  return out;
}

template <class T>
std::string shown(T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, double(value)).ptr);
  } else {
    return std::to_string(value);
  }
}

}  // namespace kiln
