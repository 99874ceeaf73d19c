#pragma once
// Verifiable tasks: a problem generator and a pure reward function each. Rewards are in
// [0, 1]; malformed completions get 0 (never an exception).
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "actors/rollout/dataset.hpp"

namespace kiln::rollout {

struct Problem {
  std::string prompt;             ///< text the policy sees
  std::string answer;             ///< reference answer (text)
  std::vector<int64_t> numbers;   ///< countdown: the numbers that may be used
  int64_t target = 0;             ///< countdown: the value to reach
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  virtual Problem sample(std::mt19937_64& rng) const = 0;
  /// Reward of `completion` (decoded text, end tokens removed) for `problem`.
  virtual double reward(const Problem& problem, std::string_view completion) const = 0;
  /// A prompt of the most characters `sample` can draw (the largest numbers in every place), so
  /// that a run can check before its first step that every prompt fits the engine's cache with
  /// its completion: exact in tokens for the character tokenizer, a close bound for a BPE one.
  virtual std::string longest_prompt() const = 0;
};

/// "a OP b =" with a, b of min..max digits and OP from `operators`; the answer is the integer
/// result. Reward 1 for exactly that integer (surrounding spaces allowed), else 0.
struct ArithmeticOptions {
  int min_digits = 1, max_digits = 2;
  std::string operators = "+-*";
};
class ArithmeticTask : public Task {
 public:
  explicit ArithmeticTask(ArithmeticOptions o = {});
  std::string name() const override { return "arithmetic"; }
  Problem sample(std::mt19937_64& rng) const override;
  double reward(const Problem& problem, std::string_view completion) const override;
  std::string longest_prompt() const override;

 private:
  ArithmeticOptions o_;
};

/// Countdown: reach `target` from the given numbers with + - * / and parentheses, each number
/// used at most once. Prompt "3,5,7:22=". Reward 1 for an expression whose exact (rational)
/// value is the target, 0.1 (format credit) for a well-formed expression that uses only
/// allowed numbers but misses, 0 for anything else (bad syntax, a number not given or used
/// too often, division by zero, overflow).
struct CountdownOptions {
  int count = 3;              ///< numbers per problem
  int min_value = 1, max_value = 9;
};
class CountdownTask : public Task {
 public:
  explicit CountdownTask(CountdownOptions o = {});
  std::string name() const override { return "countdown"; }
  Problem sample(std::mt19937_64& rng) const override;
  double reward(const Problem& problem, std::string_view completion) const override;
  std::string longest_prompt() const override;

 private:
  CountdownOptions o_;
};

/// "d=" for a random digit d; the answer is the next digit, (d + 1) mod 10. Reward 1 for
/// exactly that digit, else 0; a constant output scores 0.1 on average. The default
/// experiment's task: small enough to learn from random weights on a CPU in minutes, while the
/// answer still depends on the prompt.
class NextDigitTask : public Task {
 public:
  std::string name() const override { return "next_digit"; }
  Problem sample(std::mt19937_64& rng) const override;
  double reward(const Problem& problem, std::string_view completion) const override;
  std::string longest_prompt() const override;
};

/// Word problems from a text dataset (dataset.hpp's load_jsonl_text): a sample is a record
/// drawn uniformly with the run's prompt RNG; its answer the record's reference answer
/// (math_verifier.hpp). Reward 1 when the completion's final answer (the last \boxed{...}, else
/// the last number) matches it, else 0.
class JsonlTask : public Task {
 public:
  /// Throws std::invalid_argument for no records.
  explicit JsonlTask(std::vector<TextRecord> records);
  std::string name() const override { return "jsonl"; }
  Problem sample(std::mt19937_64& rng) const override;
  double reward(const Problem& problem, std::string_view completion) const override;
  std::string longest_prompt() const override;
  std::size_t size() const { return records_.size(); }

 private:
  std::vector<TextRecord> records_;
  std::vector<std::string> references_;  ///< reference_answer of each record's answer
};

/// Result of checking a countdown expression (exposed for tests).
struct ExpressionCheck {
  bool well_formed = false;   ///< parsed, numbers allowed, no division by zero, no overflow
  int64_t num = 0, den = 1;   ///< exact value num/den (den > 0, reduced)
  std::string error;          ///< why it is not well formed
};
ExpressionCheck check_countdown_expression(std::string_view text, const std::vector<int64_t>& numbers);

/// Builds a built-in task by name ("next_digit", "arithmetic", "countdown"); throws
/// std::invalid_argument listing the names (a "jsonl" task needs its dataset: JsonlTask).
std::unique_ptr<Task> make_task(const std::string& name);

}  // namespace kiln::rollout
