#include "actors/rollout/tasks.hpp"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <stdexcept>

#include "actors/rollout/math_verifier.hpp"

namespace kiln::rollout {

namespace {
std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

int64_t random_number(std::mt19937_64& rng, int digits) {
  int64_t lo = digits == 1 ? 0 : 1;
  for (int i = 1; i < digits; ++i) lo *= 10;
  int64_t hi = 1;
  for (int i = 0; i < digits; ++i) hi *= 10;
  return lo + int64_t(rng() % uint64_t(hi - lo));
}

// Exact rational with overflow detection.
struct Rational {
  int64_t n = 0, d = 1;
};
bool normalize(Rational& r) {
  if (r.d == 0) return false;
  if (r.d < 0) {
    if (r.n == INT64_MIN || r.d == INT64_MIN) return false;
    r.n = -r.n;
    r.d = -r.d;
  }
  int64_t g = std::gcd(r.n < 0 ? -r.n : r.n, r.d);
  if (g > 1) {
    r.n /= g;
    r.d /= g;
  }
  return true;
}
bool mul(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

struct Parser {
  std::string_view s;
  std::size_t i = 0;
  std::vector<int64_t> used;
  std::string error;
  int depth = 0;

  void skip() {
    while (i < s.size() && s[i] == ' ') ++i;
  }
  bool fail(const std::string& e) {
    if (error.empty()) error = e + " at position " + std::to_string(i);
    return false;
  }
  bool combine(Rational& a, char op, const Rational& b) {
    Rational r;
    int64_t x, y;
    switch (op) {
      case '+':
      case '-':
        if (!mul(a.n, b.d, x) || !mul(b.n, a.d, y) || !mul(a.d, b.d, r.d)) return fail("overflow");
        if (op == '+' ? __builtin_add_overflow(x, y, &r.n) : __builtin_sub_overflow(x, y, &r.n)) return fail("overflow");
        break;
      case '*':
        if (!mul(a.n, b.n, r.n) || !mul(a.d, b.d, r.d)) return fail("overflow");
        break;
      case '/':
        if (b.n == 0) return fail("division by zero");
        if (!mul(a.n, b.d, r.n) || !mul(a.d, b.n, r.d)) return fail("overflow");
        break;
    }
    if (!normalize(r)) return fail("overflow");
    a = r;
    return true;
  }
  bool expr(Rational& out) {  // expr := term (('+'|'-') term)*
    if (!term(out)) return false;
    for (skip(); i < s.size() && (s[i] == '+' || s[i] == '-'); skip()) {
      char op = s[i++];
      Rational rhs;
      if (!term(rhs) || !combine(out, op, rhs)) return false;
    }
    return true;
  }
  bool term(Rational& out) {  // term := factor (('*'|'/') factor)*
    if (!factor(out)) return false;
    for (skip(); i < s.size() && (s[i] == '*' || s[i] == '/'); skip()) {
      char op = s[i++];
      Rational rhs;
      if (!factor(rhs) || !combine(out, op, rhs)) return false;
    }
    return true;
  }
  bool factor(Rational& out) {  // factor := number | '(' expr ')'
    skip();
    if (i >= s.size()) return fail("expression ends early");
    if (s[i] == '(') {
      if (++depth > 64) return fail("nesting too deep");
      ++i;
      if (!expr(out)) return false;
      skip();
      if (i >= s.size() || s[i] != ')') return fail("missing ')'");
      ++i;
      --depth;
      return true;
    }
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return fail(std::string("unexpected '") + s[i] + "'");
    int64_t v = 0;
    std::size_t start = i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      if (i - start >= 18) return fail("number too long");
      v = v * 10 + (s[i++] - '0');
    }
    used.push_back(v);
    out = Rational{v, 1};
    return true;
  }
};
}  // namespace

ExpressionCheck check_countdown_expression(std::string_view text, const std::vector<int64_t>& numbers) {
  ExpressionCheck c;
  Parser p{trim(text)};
  if (p.s.empty()) {
    c.error = "empty expression";
    return c;
  }
  Rational v;
  if (!p.expr(v)) {
    c.error = p.error;
    return c;
  }
  p.skip();
  if (p.i != p.s.size()) {
    c.error = "trailing characters at position " + std::to_string(p.i);
    return c;
  }
  std::vector<int64_t> avail = numbers;
  for (auto u : p.used) {
    auto it = std::find(avail.begin(), avail.end(), u);
    if (it == avail.end()) {
      c.error = "uses " + std::to_string(u) + ", which is not given or already used";
      return c;
    }
    avail.erase(it);
  }
  c.well_formed = true;
  c.num = v.n;
  c.den = v.d;
  return c;
}

ArithmeticTask::ArithmeticTask(ArithmeticOptions o) : o_(std::move(o)) {
  if (o_.min_digits < 1 || o_.max_digits < o_.min_digits || o_.max_digits > 9)
    throw std::invalid_argument("arithmetic: digits must satisfy 1 <= min_digits <= max_digits <= 9, got " +
                                std::to_string(o_.min_digits) + " and " + std::to_string(o_.max_digits));
  if (o_.operators.empty() || o_.operators.find_first_not_of("+-*") != std::string::npos)
    throw std::invalid_argument("arithmetic: operators must be a non-empty subset of \"+-*\", got \"" + o_.operators + "\"");
}

Problem ArithmeticTask::sample(std::mt19937_64& rng) const {
  auto digits = [&] { return o_.min_digits + int(rng() % uint64_t(o_.max_digits - o_.min_digits + 1)); };
  int64_t a = random_number(rng, digits()), b = random_number(rng, digits());
  char op = o_.operators[rng() % o_.operators.size()];
  int64_t r = op == '+' ? a + b : op == '-' ? a - b : a * b;
  return Problem{std::to_string(a) + op + std::to_string(b) + "=", std::to_string(r), {}, r};
}

std::string ArithmeticTask::longest_prompt() const {
  const std::string n(std::size_t(o_.max_digits), '9');
  return n + o_.operators[0] + n + "=";
}

double ArithmeticTask::reward(const Problem& problem, std::string_view completion) const {
  auto t = trim(completion);
  if (t.empty() || t.size() > 20) return 0.0;
  std::size_t start = t[0] == '-' ? 1 : 0;
  if (start == t.size()) return 0.0;
  for (std::size_t i = start; i < t.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(t[i]))) return 0.0;
  return t == problem.answer ? 1.0 : 0.0;
}

CountdownTask::CountdownTask(CountdownOptions o) : o_(o) {
  if (o_.count < 2 || o_.count > 6)
    throw std::invalid_argument("countdown: count must be in [2, 6], got " + std::to_string(o_.count));
  if (o_.min_value < 1 || o_.max_value < o_.min_value || o_.max_value > 1000)
    throw std::invalid_argument("countdown: values must satisfy 1 <= min_value <= max_value <= 1000, got " +
                                std::to_string(o_.min_value) + " and " + std::to_string(o_.max_value));
}

Problem CountdownTask::sample(std::mt19937_64& rng) const {
  // Build a solvable problem: combine a random subset (>= 2 numbers) left to right with
  // random operators, keeping every intermediate a positive integer.
  for (;;) {
    Problem p;
    for (int i = 0; i < o_.count; ++i)
      p.numbers.push_back(o_.min_value + int64_t(rng() % uint64_t(o_.max_value - o_.min_value + 1)));
    std::vector<int64_t> order = p.numbers;
    std::shuffle(order.begin(), order.end(), rng);
    int use = 2 + int(rng() % uint64_t(o_.count - 1));
    int64_t v = order[0];
    std::string expr = std::to_string(v);
    bool ok = true;
    for (int i = 1; i < use && ok; ++i) {
      int64_t x = order[i];
      switch (rng() % 4) {
        case 0: v += x; expr = "(" + expr + "+" + std::to_string(x) + ")"; break;
        case 1: if (v - x > 0) { v -= x; expr = "(" + expr + "-" + std::to_string(x) + ")"; } else ok = false; break;
        case 2: v *= x; expr = "(" + expr + "*" + std::to_string(x) + ")"; break;
        case 3: if (x != 0 && v % x == 0) { v /= x; expr = "(" + expr + "/" + std::to_string(x) + ")"; } else ok = false; break;
      }
    }
    if (!ok || v <= 0 || v > 999) continue;
    p.target = v;
    p.answer = expr;
    std::string nums;
    for (auto n : p.numbers) {
      if (!nums.empty()) nums += ',';
      nums += std::to_string(n);
    }
    p.prompt = nums + ":" + std::to_string(v) + "=";
    return p;
  }
}

std::string CountdownTask::longest_prompt() const {
  std::string nums;
  for (int i = 0; i < o_.count; ++i) nums += (i ? "," : "") + std::to_string(o_.max_value);
  return nums + ":999=";  // targets are at most 999
}

double CountdownTask::reward(const Problem& problem, std::string_view completion) const {
  auto c = check_countdown_expression(completion, problem.numbers);
  if (!c.well_formed) return 0.0;
  return (c.den == 1 && c.num == problem.target) ? 1.0 : 0.1;
}

std::string NextDigitTask::longest_prompt() const { return "9="; }

Problem NextDigitTask::sample(std::mt19937_64& rng) const {
  int64_t d = int64_t(rng() % 10);
  return Problem{std::to_string(d) + "=", std::to_string((d + 1) % 10), {}, (d + 1) % 10};
}

double NextDigitTask::reward(const Problem& problem, std::string_view completion) const {
  return trim(completion) == problem.answer ? 1.0 : 0.0;
}

JsonlTask::JsonlTask(std::vector<TextRecord> records) : records_(std::move(records)) {
  if (records_.empty()) throw std::invalid_argument("jsonl task: the dataset holds no records");
  for (const auto& r : records_) references_.push_back(reference_answer(r.answer));
}

Problem JsonlTask::sample(std::mt19937_64& rng) const {
  const std::size_t i = std::size_t(rng() % uint64_t(records_.size()));
  return Problem{records_[i].prompt, references_[i], {}, 0};
}

std::string JsonlTask::longest_prompt() const {
  return std::max_element(records_.begin(), records_.end(),
                          [](const TextRecord& a, const TextRecord& b) { return a.prompt.size() < b.prompt.size(); })
      ->prompt;
}

double JsonlTask::reward(const Problem& problem, std::string_view completion) const {
  return math_reward(completion, problem.answer);
}

std::unique_ptr<Task> make_task(const std::string& name) {
  if (name == "next_digit") return std::make_unique<NextDigitTask>();
  if (name == "arithmetic") return std::make_unique<ArithmeticTask>();
  if (name == "countdown") return std::make_unique<CountdownTask>();
  throw std::invalid_argument("unknown task '" + name + "' (tasks: next_digit, arithmetic, countdown)");
}

}  // namespace kiln::rollout
