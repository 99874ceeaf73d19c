#include "actors/rollout/math_verifier.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

namespace kiln::rollout {

namespace {
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Length of the digits-with-thousands-separators run at s[i] (s[i] is a digit): "1,234,567"
// whole when the first group has 1-3 digits and every later group exactly 3; else the plain
// digit run ("12345,678": 12345).
std::size_t integer_part(std::string_view s, std::size_t i) {
  std::size_t j = i;
  while (j < s.size() && is_digit(s[j])) ++j;
  if (j - i > 3) return j - i;
  while (j + 3 < s.size() && s[j] == ',' && is_digit(s[j + 1]) && is_digit(s[j + 2]) && is_digit(s[j + 3]) &&
         (j + 4 >= s.size() || !is_digit(s[j + 4])))
    j += 4;
  return j - i;
}

std::string without_commas(std::string_view s) {
  std::string out;
  for (char c : s)
    if (c != ',') out += c;
  return out;
}
}  // namespace

std::optional<std::string> last_boxed(std::string_view text) {
  static constexpr std::string_view kBoxed = "\\boxed";
  std::optional<std::string> last;
  for (std::size_t at = text.find(kBoxed); at != std::string_view::npos; at = text.find(kBoxed, at + 1)) {
    std::size_t i = at + kBoxed.size();
    while (i < text.size() && text[i] == ' ') ++i;
    if (i >= text.size() || text[i] != '{') continue;
    int depth = 0;
    for (std::size_t j = i; j < text.size(); ++j) {
      if (text[j] == '{') ++depth;
      else if (text[j] == '}' && --depth == 0) {
        last = std::string(text.substr(i + 1, j - i - 1));
        break;
      }
    }
  }
  return last;
}

std::optional<std::string> last_number(std::string_view text) {
  std::optional<std::string> last;
  for (std::size_t i = 0; i < text.size();) {
    if (!is_digit(text[i])) {
      ++i;
      continue;
    }
    const std::size_t start = i;
    i += integer_part(text, i);
    if (i + 1 < text.size() && text[i] == '.' && is_digit(text[i + 1])) {
      ++i;
      while (i < text.size() && is_digit(text[i])) ++i;
    }
    // A sign: '-' right before the digits, itself not after a digit or letter ("10-3", "x-5").
    const bool negative = start >= 1 && text[start - 1] == '-' &&
                          (start < 2 || !std::isalnum(static_cast<unsigned char>(text[start - 2])));
    std::string number = without_commas(text.substr(start, i - start));
    if (negative) number.insert(number.begin(), '-');
    last = std::move(number);
  }
  return last;
}

std::optional<std::string> final_answer(std::string_view completion) {
  if (auto b = last_boxed(completion)) return b;
  return last_number(completion);
}

std::string reference_answer(std::string_view answer) {
  if (auto hashes = answer.rfind("####"); hashes != std::string_view::npos)
    return std::string(trim(answer.substr(hashes + 4)));
  if (auto b = last_boxed(answer)) return std::string(trim(*b));
  return std::string(trim(answer));
}

std::optional<double> parse_number(std::string_view text) {
  auto s = trim(text);
  if (s.starts_with("\\$")) s.remove_prefix(2);
  else if (s.starts_with("$")) s.remove_prefix(1);
  if (s.ends_with(".")) s.remove_suffix(1);
  s = trim(s);
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
  if (i >= s.size() || !is_digit(s[i])) return std::nullopt;
  i += integer_part(s, i);
  if (i < s.size() && s[i] == '.') {
    if (i + 1 >= s.size() || !is_digit(s[i + 1])) return std::nullopt;
    ++i;
    while (i < s.size() && is_digit(s[i])) ++i;
  }
  if (i != s.size()) return std::nullopt;
  const std::string plain = without_commas(s);
  const double v = std::strtod(plain.c_str(), nullptr);
  if (!std::isfinite(v)) return std::nullopt;
  return v;
}

namespace {
std::string normalize(std::string_view text) {
  auto s = trim(text);
  if (s.size() >= 2 && s.front() == '$' && s.back() == '$') s = trim(s.substr(1, s.size() - 2));
  if (s.starts_with("\\text{") && s.ends_with("}")) s = trim(s.substr(6, s.size() - 7));
  std::string out;
  for (char c : s)
    if (!is_space(c)) out += c;
  if (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}
}  // namespace

bool answers_match(std::string_view got, std::string_view expected) {
  const auto a = parse_number(got), b = parse_number(expected);
  if (a && b) return std::fabs(*a - *b) <= 1e-6 * std::max(std::fabs(*a), std::fabs(*b));
  const auto x = normalize(got);
  return !x.empty() && x == normalize(expected);
}

double math_reward(std::string_view completion, std::string_view reference) {
  const auto answer = final_answer(completion);
  return answer && answers_match(*answer, reference) ? 1.0 : 0.0;
}

}  // namespace kiln::rollout
