#pragma once
// The Split regex of a tokenizer.json, run by PCRE2 (UTF + UCP) so that it matches what HF
// tokenizers' regex engine (Oniguruma) matches. Torch-free.
#include <string>
#include <string_view>
#include <vector>

namespace kiln::rollout {

/// `pattern` with \s, \S, \p{L}, \p{N} (and \P{L}, \P{N}) spelled out so that PCRE2 matches the
/// code points tokenizers 0.23.3 matches: its \s lacks U+180E, which PCRE2's has, and its
/// Unicode 16 tables know letters and digits that PCRE2 10.42 (Unicode 14) does not. The ranges
/// come from tests/fixtures/unicode_class_gap.py. Throws std::invalid_argument for \S, \P{L}
/// or \P{N} inside a character class (not rewritten) or a pattern ending in a lone backslash.
std::string pcre2_compatible_pattern(std::string_view pattern);

class PretokenizerRegex {
 public:
  /// Compiles `pattern` (after pcre2_compatible_pattern), or the literal string when `literal`.
  /// Throws std::invalid_argument with PCRE2's message and the offset when it cannot.
  PretokenizerRegex(std::string_view pattern, bool literal);
  PretokenizerRegex(PretokenizerRegex&& other) noexcept;
  PretokenizerRegex(const PretokenizerRegex&) = delete;
  ~PretokenizerRegex();

  /// Appends to `pieces` the matches in `text` (valid UTF-8) and the non-empty gaps between
  /// them, in order (tokenizers' Split with behavior Isolated); an empty match is a cut only.
  /// Thread-safe. Throws std::runtime_error when PCRE2 fails (e.g. its match limit).
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8
};

}  // namespace kiln::rollout
