#include "actors/rollout/pretokenizer_regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <utility>

#include "actors/rollout/byte_level.hpp"

namespace kiln::rollout {

namespace {

// Oniguruma's \s in tokenizers: Unicode White_Space (PCRE2's \s adds U+180E).
constexpr std::string_view kSpaceSet = R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

struct Range { uint32_t first, last; };
// Letters (\p{L}) and numbers (\p{N}) of Unicode 15.0-16.0 that tokenizers 0.23.3 knows and
// PCRE2 10.42 does not: tests/fixtures/unicode_class_gap.py printed them.
constexpr Range kUnicodeLettersAfter14[] = {
    {0x1C89, 0x1C8A}, {0xA7CB, 0xA7CD}, {0xA7DA, 0xA7DC}, {0x105C0, 0x105F3}, {0x10D4A, 0x10D65}, {0x10D6F, 0x10D85},
    {0x10EC2, 0x10EC4}, {0x1123F, 0x11240}, {0x11380, 0x11389}, {0x1138B, 0x1138B}, {0x1138E, 0x1138E}, {0x11390, 0x113B5},
    {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0}, {0x11F02, 0x11F02}, {0x11F04, 0x11F10},
    {0x11F12, 0x11F33}, {0x1342F, 0x1342F}, {0x13441, 0x13446}, {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D40, 0x16D6C},
    {0x18CFF, 0x18CFF}, {0x1B132, 0x1B132}, {0x1B155, 0x1B155}, {0x1DF25, 0x1DF2A}, {0x1E030, 0x1E06D}, {0x1E4D0, 0x1E4EB},
    {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0}, {0x2B739, 0x2B739}, {0x2EBF0, 0x2EE5D}, {0x31350, 0x323AF},
};
constexpr Range kUnicodeNumbersAfter14[] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x11F50, 0x11F59}, {0x16130, 0x16139},
    {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9}, {0x1D2C0, 0x1D2D3}, {0x1E4F0, 0x1E4F9}, {0x1E5F1, 0x1E5FA},
};

template <std::size_t N>
std::string class_body(std::string_view property, const Range (&extra)[N]) {
  std::string s(property);
  char buf[40];
  for (const auto& r : extra) {
    std::snprintf(buf, sizeof buf, "\\x{%X}-\\x{%X}", unsigned(r.first), unsigned(r.last));
    s += buf;
  }
  return s;
}

}  // namespace

std::string pcre2_compatible_pattern(std::string_view p) {
  static const std::string letters = class_body(R"(\p{L})", kUnicodeLettersAfter14);
  static const std::string numbers = class_body(R"(\p{N})", kUnicodeNumbersAfter14);
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c != '\\') {
      if (!in_class && c == '[') {
        in_class = true;
        out += c;
        // A ']' right after '[' or '[^' is a literal member, not the end of the class.
        if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
        if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
        continue;
      }
      if (in_class && c == ']') in_class = false;
      out += c;
      continue;
    }
    if (i + 1 >= p.size()) throw std::invalid_argument("regex " + std::string(p) + " ends in a lone backslash");
    char e = p[i + 1];
    std::string_view rest = p.substr(i + 1);
    auto replace = [&](std::string_view body, bool negated, std::size_t consumed) {
      if (in_class && negated)
        throw std::invalid_argument("regex " + std::string(p) + ": \\" + std::string(p.substr(i + 1, consumed - 1)) +
                                    " inside a character class is not supported (kiln cannot spell it out for PCRE2)");
      if (in_class) out += body;
      else out += (negated ? "[^" : "[") + std::string(body) + "]";
      i += consumed - 1;
    };
    if (e == 's' || e == 'S') replace(kSpaceSet, e == 'S', 2);
    else if (rest.starts_with("p{L}") || rest.starts_with("P{L}")) replace(letters, e == 'P', 5);
    else if (rest.starts_with("p{N}") || rest.starts_with("P{N}")) replace(numbers, e == 'P', 5);
    else out += p.substr(i, 2), ++i;
  }
  return out;
}

PretokenizerRegex::PretokenizerRegex(std::string_view pattern, bool literal) {
  std::string compiled = literal ? std::string(pattern) : pcre2_compatible_pattern(pattern);
  int err = 0;
  PCRE2_SIZE at = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), options, &err, &at, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::invalid_argument("PCRE2 cannot compile it: " + std::string(reinterpret_cast<const char*>(msg)) +
                                " (offset " + std::to_string(at) + " of the rewritten pattern " + compiled + ")");
  }
  // The JIT is only faster; where it is unavailable the interpreter gives the same matches.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

PretokenizerRegex::PretokenizerRegex(PretokenizerRegex&& o) noexcept : code_(std::exchange(o.code_, nullptr)) {}
PretokenizerRegex::~PretokenizerRegex() {
  if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

void PretokenizerRegex::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  if (!md) throw std::bad_alloc();
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t pos = 0, last = 0;
  int rc = 0;
  while (pos <= text.size()) {
    rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    std::size_t s = ov[0], e = ov[1];
    if (e == s) {
      // An empty match cuts the text there, as tokenizers' Split does; the search goes on one
      // character later (as Oniguruma's and Rust's match iterators do).
      if (s > last) pieces.push_back(text.substr(last, s - last));
      last = s;
      if (s >= text.size()) break;
      pos = s + byte_level::utf8_step(text, s).length;
      continue;
    }
    if (s > last) pieces.push_back(text.substr(last, s - last));
    pieces.push_back(text.substr(s, e - s));
    last = pos = e;
  }
  pcre2_match_data_free(md);
  if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw std::runtime_error("the pre-tokenizer regex failed on a " + std::to_string(text.size()) +
                             "-byte piece: " + reinterpret_cast<const char*>(msg));
  }
  if (last < text.size()) pieces.push_back(text.substr(last));
}

}  // namespace kiln::rollout
