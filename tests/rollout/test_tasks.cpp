// Tasks and verifiers (pure functions), the character tokenizer and JSONL datasets.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "../scratch.hpp"
#include "actors/rollout/dataset.hpp"
#include "actors/rollout/tasks.hpp"
#include "actors/rollout/tokenizer.hpp"

using namespace kiln::rollout;

TEST_CASE("arithmetic: answers depend on the prompt and only the exact integer scores") {
  ArithmeticTask t({1, 2, "+-*"});
  std::mt19937_64 rng(5);
  std::set<std::string> answers;
  for (int i = 0; i < 200; ++i) {
    auto p = t.sample(rng);
    answers.insert(p.answer);
    CHECK(t.reward(p, p.answer) == 1.0);
    CHECK(t.reward(p, " " + p.answer + " ") == 1.0);
  }
  CHECK(answers.size() > 50);  // any constant output is right for few prompts
  Problem p{"12+7=", "19", {}, 19};
  CHECK(t.reward(p, "18") == 0.0);
  CHECK(t.reward(p, "") == 0.0);
  CHECK(t.reward(p, "19x") == 0.0);
  CHECK(t.reward(p, "-") == 0.0);
  CHECK(t.reward(p, "1 9") == 0.0);
  CHECK(t.reward(p, std::string(1000, '9')) == 0.0);
  Problem neg{"3-7=", "-4", {}, -4};
  CHECK(t.reward(neg, "-4") == 1.0);
  CHECK_THROWS_AS(ArithmeticTask({0, 2, "+"}), std::invalid_argument);
  CHECK_THROWS_AS(ArithmeticTask({1, 2, "%"}), std::invalid_argument);
}

TEST_CASE("countdown: generated problems are solvable and the verifier checks numbers and value") {
  CountdownTask t;
  std::mt19937_64 rng(9);
  for (int i = 0; i < 200; ++i) {
    auto p = t.sample(rng);
    CAPTURE(p.prompt);
    CAPTURE(p.answer);
    CHECK(t.reward(p, p.answer) == 1.0);
  }
  Problem p{"3,5,7:22=", "", {3, 5, 7}, 22};
  CHECK(t.reward(p, "3*5+7") == 1.0);
  CHECK(t.reward(p, "(7 + 5) * 3 - 14") == 0.0);  // 14 is not given
  CHECK(t.reward(p, "3+5+7") == doctest::Approx(0.1));  // well formed, wrong value
  CHECK(t.reward(p, "3*3+7") == 0.0);                    // 3 used twice
  CHECK(t.reward(p, "7/(5-5)") == 0.0);                  // 5 twice, and division by zero
  CHECK(t.reward(p, "3*5+") == 0.0);
  CHECK(t.reward(p, "((3*5)+7") == 0.0);
  CHECK(t.reward(p, "3*5+7)") == 0.0);
  CHECK(t.reward(p, "") == 0.0);
  CHECK(t.reward(p, "abc") == 0.0);
  Problem q{"", "", {6, 4, 3}, 8};
  CHECK(t.reward(q, "6/3*4") == 1.0);        // exact rationals: 6/3 = 2
  CHECK(t.reward(q, "4/3*6") == 1.0);        // 4/3 * 6 = 8 exactly
  auto c = check_countdown_expression("99999999999999999*99", {99999999999999999, 99});
  CHECK_FALSE(c.well_formed);
  CHECK(c.error.find("overflow") != std::string::npos);
  CHECK(check_countdown_expression(std::string(200, '(') + "1" + std::string(200, ')'), {1}).error.find("deep") !=
        std::string::npos);
}

TEST_CASE("tasks: longest_prompt has at least as many characters as any prompt sample draws") {
  ArithmeticTask a({1, 3, "-+"});
  CountdownTask c({4, 1, 250});
  NextDigitTask d;
  JsonlTask j({{"short", "1", 1}, {"the longest prompt", "2", 2}, {"mid one", "3", 3}});
  CHECK(a.longest_prompt() == "999-999=");
  CHECK(c.longest_prompt() == "250,250,250,250:999=");
  CHECK(j.longest_prompt() == "the longest prompt");
  std::mt19937_64 rng(3);
  for (const Task* t : std::initializer_list<const Task*>{&a, &c, &d, &j}) {
    CAPTURE(t->name());
    std::size_t longest = 0;
    for (int i = 0; i < 2000; ++i) longest = std::max(longest, t->sample(rng).prompt.size());
    CHECK(longest <= t->longest_prompt().size());
    CHECK(longest + 2 >= t->longest_prompt().size());  // a close bound (countdown's target is rarely 999)
  }
}

TEST_CASE("character tokenizer round-trips and refuses characters it does not know") {
  CharTokenizer tok;
  auto ids = tok.encode("12+7=19");
  CHECK(tok.decode(ids) == "12+7=19");
  CHECK(tok.vocab_size() <= 96);  // fits the debug flavor
  std::vector<int64_t> with_special = ids;
  with_special.push_back(tok.eos_ids()[0]);
  with_special.push_back(500);
  CHECK(tok.decode(with_special) == "12+7=19?");
  CHECK_THROWS_WITH_AS(tok.encode("12#"), doctest::Contains("character '#' at offset 2"), std::invalid_argument);
  // Half a UTF-8 character is named in hex, not echoed, with what to do about it.
  CHECK_THROWS_WITH_AS(tok.encode("h\xC3\xA9llo"), doctest::Contains("byte 0xC3 at offset 1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(tok.encode("h\xC3\xA9llo"), doctest::Contains("set task.tokenizer"), std::invalid_argument);
}

TEST_CASE("JSONL prompt datasets load, and bad lines are named") {
  std::filesystem::path path = kiln::test::scratch_path("dataset.jsonl");
  {
    std::ofstream(path) << R"({"prompt_ids": [3, 4, 5], "answer": "9", "source": "x"})" << "\n\n"
                        << R"({"prompt_ids": [7]})" << "\n";
  }
  auto recs = load_jsonl_prompts(path.string(), 96);
  REQUIRE(recs.size() == 2);
  CHECK(recs[0].prompt_ids == std::vector<int64_t>{3, 4, 5});
  CHECK(recs[0].answer == "9");
  CHECK(recs[0].extra["source"] == "x");
  {
    std::ofstream(path) << R"({"prompt_ids": [3]})" << "\n" << R"({"prompt_ids": [3, 400]})" << "\n";
  }
  CHECK_THROWS_WITH_AS(load_jsonl_prompts(path.string(), 96), doctest::Contains("line 2: token id 400"),
                       std::invalid_argument);
  {
    std::ofstream(path) << "{oops\n";
  }
  CHECK_THROWS_WITH_AS(load_jsonl_prompts(path.string(), 96), doctest::Contains("line 1: invalid JSON"),
                       std::invalid_argument);
  {
    std::ofstream(path) << R"({"answer": "1"})" << "\n";
  }
  CHECK_THROWS_WITH_AS(load_jsonl_prompts(path.string(), 96), doctest::Contains("'prompt_ids'"), std::invalid_argument);
  std::filesystem::remove(path);
}
