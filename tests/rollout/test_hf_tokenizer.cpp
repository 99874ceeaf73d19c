// HfTokenizer: the fixture's tokenizer.json as the RL loop's tokenizer. Prompt ids are checked
// against HF tokenizers' ids for the same text (tests/fixtures/bpe_tokenizer/chat.json).
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "actors/rollout/hf_tokenizer.hpp"

using namespace kiln::rollout;

namespace {
const std::string kDir = std::string(KILN_FIXTURES_DIR) + "/bpe_tokenizer/";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return nlohmann::json::parse(s.str());
}

// The fixture's tokenizer.json with the added tokens of `ids` renamed, in added_tokens and in
// model.vocab (which holds them too), so that it lacks them.
BpeTokenizer without_added_tokens(std::initializer_list<int64_t> ids) {
  auto j = read_json(kDir + "tokenizer.json");
  for (auto& t : j["added_tokens"])
    for (auto id : ids)
      if (t["id"] == id) {
        const std::string old = t["content"], renamed = "<|renamed_" + std::to_string(id) + "|>";
        t["content"] = renamed;
        auto& vocab = j["model"]["vocab"];
        if (vocab.contains(old)) {
          vocab[renamed] = vocab[old];
          vocab.erase(old);
        }
      }
  return BpeTokenizer::from_json(j.dump(), "edited tokenizer.json");
}
}  // namespace

TEST_CASE("hf tokenizer: a glm47 prompt is the user turn and the generation prompt with HF tokenizers' ids") {
  // chat.json's case 1: system + user turn, generation prompt on; HF's ids of the user's text
  // are those between <|user|> (7) and <|assistant|> (8).
  const auto c = read_json(kDir + "chat.json")["cases"][1];
  REQUIRE(c["format"] == "glm47");
  REQUIRE(c["add_generation_prompt"] == true);
  const std::string text = c["messages"][1]["content"];
  const auto all = c["ids"].get<std::vector<int64_t>>();
  const auto user = std::find(all.begin(), all.end(), 7), assistant = std::find(all.begin(), all.end(), 8);
  REQUIRE(user < assistant);
  std::vector<int64_t> expected{2, 4, 7};  // [gMASK] <sop> <|user|>
  expected.insert(expected.end(), user + 1, assistant);
  expected.insert(expected.end(), {8, 2000});  // <|assistant|> <think>
  HfTokenizer tok(BpeTokenizer::from_file(kDir + "tokenizer.json"), ChatFormat::glm47);
  CHECK(tok.encode_prompt(text) == expected);
  CHECK(tok.encode(text) == std::vector<int64_t>(user + 1, assistant));
  CHECK(tok.vocab_size() == 2005);
  CHECK(tok.eos_ids() == std::vector<int64_t>{0, 7, 9});  // <|endoftext|> <|user|> <|observation|>
  CHECK(tok.bos_id() == -1);

  HfTokenizer glm4(BpeTokenizer::from_file(kDir + "tokenizer.json"), ChatFormat::glm4);
  const auto newline = glm4.encode("\n");
  auto g = glm4.encode_prompt(text);
  std::vector<int64_t> head{2, 4, 7};  // [gMASK] <sop> <|user|> "\n" text <|assistant|> "\n"
  head.insert(head.end(), newline.begin(), newline.end());
  REQUIRE(g.size() > head.size() + 1 + newline.size());
  CHECK(std::vector<int64_t>(g.begin(), g.begin() + int64_t(head.size())) == head);
  CHECK(g[g.size() - 1 - newline.size()] == 8);

  HfTokenizer plain(BpeTokenizer::from_file(kDir + "tokenizer.json"), std::nullopt);
  CHECK(plain.encode_prompt(text) == plain.encode(text));  // the fixture has no TemplateProcessing
}

TEST_CASE("hf tokenizer: decode leaves special tokens out and turns ids that are no token into '?'") {
  HfTokenizer tok(BpeTokenizer::from_file(kDir + "tokenizer.json"), ChatFormat::glm47);
  auto ids = tok.encode_prompt("hello world");
  ids.push_back(0);  // <|endoftext|>
  CHECK(tok.decode(ids) == "hello world<think>");  // <think> is an added token but not special
  const auto hello = tok.encode("hello"), world = tok.encode(" world");
  std::vector<int64_t> padded = hello;
  padded.push_back(2005);  // past the tokenizer's vocabulary (a model's padded vocabulary)
  padded.insert(padded.end(), world.begin(), world.end());
  padded.push_back(-3);
  CHECK(tok.decode(padded) == "hello? world?");
  CHECK(tok.decode(std::vector<int64_t>{}) == "");
}

TEST_CASE("hf tokenizer: a tokenizer without GLM's end tokens or chat markers is refused by name") {
  CHECK_THROWS_WITH_AS(HfTokenizer(without_added_tokens({0, 7, 9}), std::nullopt),
                       doctest::Contains("none of GLM's end tokens"), std::invalid_argument);
  CHECK(HfTokenizer(without_added_tokens({0, 9}), std::nullopt).eos_ids() == std::vector<int64_t>{7});
  CHECK_THROWS_WITH_AS(HfTokenizer(without_added_tokens({8}), ChatFormat::glm47), doctest::Contains("<|assistant|>"),
                       std::invalid_argument);
  CHECK_NOTHROW(HfTokenizer(without_added_tokens({8}), std::nullopt));  // no chat: no markers needed
  CHECK(chat_format_from_string("glm47") == ChatFormat::glm47);
  CHECK(chat_format_from_string("glm4") == ChatFormat::glm4);
  CHECK_FALSE(chat_format_from_string("none").has_value());
  CHECK_THROWS_WITH_AS(chat_format_from_string("chatml"), doctest::Contains("'chatml' is not one of"),
                       std::invalid_argument);
}
