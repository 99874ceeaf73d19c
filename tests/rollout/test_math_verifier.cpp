// The math verifier (final answers of completions, GSM8K reference answers) and text JSONL
// datasets with their task. Every expected value below is worked out by hand.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "../scratch.hpp"
#include "actors/rollout/dataset.hpp"
#include "actors/rollout/math_verifier.hpp"
#include "actors/rollout/tasks.hpp"

using namespace kiln::rollout;

TEST_CASE("math verifier: the last complete \\boxed{} wins, nested braces kept, an unclosed one skipped") {
  CHECK(last_boxed("so \\boxed{42}.") == "42");
  CHECK(last_boxed("\\boxed{1} then \\boxed{2}") == "2");
  CHECK(last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}");
  CHECK(last_boxed("\\boxed{{a}{b{c}}} x") == "{a}{b{c}}");
  CHECK(last_boxed("\\boxed {7}") == "7");
  CHECK(last_boxed("\\boxed{3} and then \\boxed{4") == "3");  // cut short: the complete one before
  CHECK(last_boxed("\\boxed{}") == "");
  CHECK_FALSE(last_boxed("boxed{5}").has_value());  // no backslash
  CHECK_FALSE(last_boxed("\\boxed 5").has_value());
  CHECK_FALSE(last_boxed("").has_value());
}

TEST_CASE("math verifier: the last number with signs, decimals and thousands separators") {
  CHECK(last_number("He has 3 apples and buys 4 more: 7.") == "7");
  CHECK(last_number("The answer is -5.") == "-5");
  CHECK(last_number("10-3") == "3");        // a minus between numbers is no sign
  CHECK(last_number("x-5") == "5");         // nor after a letter
  CHECK(last_number("(-12)") == "-12");
  CHECK(last_number("costs $1,234 in total") == "1234");
  CHECK(last_number("1,234,567") == "1234567");
  CHECK(last_number("12345,678") == "678");  // not thousands groups: two numbers
  CHECK(last_number("1,2,3") == "3");        // a list
  CHECK(last_number("1,2345") == "2345");    // a group of 4 digits is no thousands group
  CHECK(last_number("3.75 dollars") == "3.75");
  CHECK(last_number("version 1.2.3") == "3");
  CHECK(last_number("-0.5") == "-0.5");
  CHECK(last_number("1,234.5") == "1234.5");
  CHECK_FALSE(last_number("no digits here").has_value());
  CHECK_FALSE(last_number("").has_value());
}

TEST_CASE("math verifier: a final answer is the boxed one, else the last number") {
  CHECK(final_answer("3 + 4 = 7, so \\boxed{7}. Check: 8 - 1 = 7 and 99") == "7");
  CHECK(final_answer("3 + 4 = 7") == "7");
  CHECK_FALSE(final_answer("I do not know").has_value());
}

TEST_CASE("math verifier: GSM8K references are what follows ####") {
  CHECK(reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72") == "72");
  CHECK(reference_answer("#### 1,000") == "1,000");
  CHECK(reference_answer("a #### 5\n#### 6 ") == "6");  // the last ####
  CHECK(reference_answer("so the answer is \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}");
  CHECK(reference_answer("  18 \n") == "18");
  CHECK(reference_answer("####   ") == "");
}

TEST_CASE("math verifier: numbers compare numerically within 1e-6 relative, other answers as normalized text") {
  CHECK(parse_number("72") == 72.0);
  CHECK(parse_number(" -3.5 ") == -3.5);
  CHECK(parse_number("$1,234.") == 1234.0);
  CHECK(parse_number("\\$5") == 5.0);
  CHECK(parse_number("+4") == 4.0);
  CHECK_FALSE(parse_number("1e5").has_value());
  CHECK_FALSE(parse_number("1/2").has_value());
  CHECK_FALSE(parse_number("3 apples").has_value());
  CHECK_FALSE(parse_number("12,34").has_value());  // not thousands groups
  CHECK(parse_number("5.") == 5.0);  // a sentence's period
  CHECK_FALSE(parse_number("").has_value());
  CHECK(answers_match("72", "72.0"));
  CHECK(answers_match("1,000", "1000"));
  CHECK(answers_match("0.3333333", "0.33333333"));  // 9e-8 relative
  CHECK_FALSE(answers_match("0.333", "0.3333333"));  // 1e-3 relative
  CHECK(answers_match("1000000", "1000000.5"));      // 5e-7 relative
  CHECK_FALSE(answers_match("1000000", "1000002"));  // 2e-6 relative
  CHECK(answers_match("0", "0"));
  CHECK(answers_match("-0", "0"));
  CHECK_FALSE(answers_match("-7", "7"));
  CHECK(answers_match("\\frac{1}{2}", " \\frac{1} {2} "));
  CHECK(answers_match("\\text{Tuesday}", "Tuesday."));
  CHECK(answers_match("$x+1$", "x + 1"));
  CHECK_FALSE(answers_match("x+1", "1+x"));  // no symbolic equivalence
  CHECK_FALSE(answers_match("", ""));        // an empty answer never matches
}

TEST_CASE("math verifier: rewards are 1 for the right final answer and 0 otherwise") {
  CHECK(math_reward("She pays 3 * $4 = $12. \\boxed{12}", "12") == 1.0);
  CHECK(math_reward("3 * 4 = 12", "12") == 1.0);
  CHECK(math_reward("3 * 4 = 12, so 12 - 2 = 10", "12") == 0.0);  // the last number is 10
  CHECK(math_reward("\\boxed{12} is wrong, it is 13", "12") == 1.0);  // the boxed one wins
  CHECK(math_reward("The total is 1,234 dollars", "1234") == 1.0);
  CHECK(math_reward("-5", "-5") == 1.0);
  CHECK(math_reward("5", "-5") == 0.0);
  CHECK(math_reward("", "5") == 0.0);
  CHECK(math_reward("\\boxed{", "5") == 0.0);
  CHECK(math_reward(std::string(100000, '9'), "5") == 0.0);  // a huge number: no crash, no match
}

TEST_CASE("text JSONL datasets: fields by name, bad lines and empty files refused with the line") {
  const auto path = kiln::test::scratch_path("text.jsonl");
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  write(R"({"question": "2 + 3?", "answer": "2 + 3 = 5\n#### 5", "id": 1})" "\n\n"
        R"({"question": "Ten minus four?", "answer": "#### 6"})" "\n");
  auto recs = load_jsonl_text(path, "question", "answer");
  REQUIRE(recs.size() == 2);
  CHECK(recs[0].prompt == "2 + 3?");
  CHECK(recs[1].line == 3);
  write(R"({"problem": "p", "solution": "\\boxed{4}"})" "\n");
  CHECK(load_jsonl_text(path, "problem", "solution").at(0).answer == "\\boxed{4}");
  auto refused = [&](const std::string& text, const std::string& why) {
    write(text);
    CHECK_THROWS_WITH_AS(load_jsonl_text(path, "question", "answer"), doctest::Contains(why.c_str()), std::invalid_argument);
  };
  refused(R"({"question": "a", "answer": "#### 1"})" "\n{oops\n", "dataset '" + path + "' line 2: invalid JSON");
  refused("[1, 2]\n", "line 1: expected a JSON object, got array");
  refused(R"({"answer": "#### 1"})" "\n", "line 1: field 'question' is missing");
  refused(R"({"question": "a"})" "\n", "line 1: field 'answer' is missing");
  refused(R"({"question": 5, "answer": "#### 1"})" "\n", "line 1: field 'question' must be a string, got number");
  refused(R"({"question": "a", "answer": 72})" "\n", "line 1: field 'answer' must be a string, got number");
  refused(R"({"question": " \n", "answer": "#### 1"})" "\n", "line 1: field 'question' is empty");
  refused(R"({"question": "a", "answer": "text ####  "})" "\n", "line 1: field 'answer' holds no final answer");
  refused("", "holds no records");
  refused("\n  \n", "holds no records");
  CHECK_THROWS_WITH_AS(load_jsonl_text(path + ".missing", "question", "answer"), doctest::Contains("cannot open"),
                       std::invalid_argument);
}

TEST_CASE("jsonl task: samples cover the records with the prompt RNG and rewards use the reference answer") {
  JsonlTask task({{"one?", "#### 1", 1}, {"two?", "1 + 1 = 2\n#### 2", 2}, {"three?", "#### 3", 3}});
  std::mt19937_64 rng(7);
  std::set<std::string> seen;
  for (int i = 0; i < 60; ++i) {
    auto p = task.sample(rng);
    seen.insert(p.prompt);
    CHECK(task.reward(p, "The answer is " + p.answer + ".") == 1.0);
  }
  CHECK(seen == std::set<std::string>{"one?", "two?", "three?"});
  std::mt19937_64 a(3), b(3);
  CHECK(task.sample(a).prompt == task.sample(b).prompt);  // the same RNG state draws the same record
  Problem two{"two?", "2", {}, 0};
  CHECK(task.reward(two, "\\boxed{2}") == 1.0);
  CHECK(task.reward(two, "1 + 1 = 2, then 3") == 0.0);
  CHECK_THROWS_AS(JsonlTask({}), std::invalid_argument);
}
