#pragma once
// A math verifier for word-problem datasets (GSM8K, MATH-style answers): the final answer of a
// completion against a reference answer, reward 1 or 0. Pure functions; never throws.
//
// Final answer of a completion: the content of the last complete `\boxed{...}` (nested braces
// counted), else the last number in the text. Reference answer of a dataset's answer field:
// what follows the last "####" (GSM8K writes "...reasoning...\n#### 72"), else the content of
// the last `\boxed{...}`, else the whole text; surrounding whitespace removed.
// Comparison: numerically when both parse as numbers (relative tolerance 1e-6), else as
// normalized strings. Not covered: fractions (`\frac{1}{2}` vs 0.5), units, percent signs,
// scientific notation, symbolic equivalence (`x+1` vs `1+x`).
#include <optional>
#include <string>
#include <string_view>

namespace kiln::rollout {

/// The content of the last complete `\boxed{...}` in `text` (braces nested inside it kept:
/// "\boxed{\frac{1}{2}}" -> "\frac{1}{2}"); an unclosed one (a completion cut short) is
/// skipped. nullopt when there is none.
std::optional<std::string> last_boxed(std::string_view text);

/// The last number in `text` as plain digits: an optional '-' not preceded by a digit or a
/// letter ("10-3" ends in 3, "is -5" in -5), digits with thousands separators ("1,234,567" ->
/// "1234567": a group of 1-3 digits then ",ddd" groups), an optional decimal part (".5"; a
/// period without a digit after it ends a sentence). nullopt when there is none.
std::optional<std::string> last_number(std::string_view text);

/// last_boxed, else last_number, else nullopt.
std::optional<std::string> final_answer(std::string_view completion);

/// The reference answer of a dataset's answer text (see the top of this file); may be empty.
std::string reference_answer(std::string_view answer);

/// `text` as a number when the whole of it (trimmed; a leading "$" or "\$" and a trailing "."
/// removed) is one: optional sign, digits (thousands separators allowed in correct groups),
/// optional decimal part. nullopt otherwise (also for "1e5", "1/2", "3 apples").
std::optional<double> parse_number(std::string_view text);

/// Whether `got` matches `expected`: |a - b| <= 1e-6 * max(|a|, |b|) when both parse as
/// numbers, else equal after normalization (whitespace removed, a trailing "." removed, a
/// surrounding `\text{...}` or `$...$` unwrapped).
bool answers_match(std::string_view got, std::string_view expected);

/// 1 when final_answer(completion) matches `reference` (already a reference answer), else 0.
double math_reward(std::string_view completion, std::string_view reference);

}  // namespace kiln::rollout
