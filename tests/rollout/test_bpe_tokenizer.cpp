// The byte-level BPE tokenizer and GLM's chat format against Hugging Face `tokenizers`: the
// goldens are written by tests/fixtures/make_bpe_tokenizer_fixture.py (tokenizers 0.23.3).
#include <doctest/doctest.h>
#include <zlib.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <atomic>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "actors/rollout/bpe_tokenizer.hpp"
#include "actors/rollout/chat_template.hpp"
#include "actors/rollout/pretokenizer_regex.hpp"

using kiln::rollout::BpeTokenizer;
using json = nlohmann::json;

namespace {

const std::string kDir = std::string(KILN_FIXTURES_DIR) + "/bpe_tokenizer/";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Row {
  std::string text;
  std::vector<int64_t> ids;
  std::string decoded, decoded_skip;
};

const std::vector<Row>& corpus() {
  static const std::vector<Row> rows = [] {
    std::string path = kDir + "corpus.jsonl.gz";
    gzFile f = gzopen(path.c_str(), "rb");
    REQUIRE_MESSAGE(f != nullptr, "cannot open " << path);
    std::string all;
    char buf[1 << 16];
    int n;
    while ((n = gzread(f, buf, sizeof buf)) > 0) all.append(buf, std::size_t(n));
    gzclose(f);
    REQUIRE_MESSAGE(n == 0, "cannot decompress " << path);
    std::vector<Row> out;
    std::istringstream lines(all);
    for (std::string line; std::getline(lines, line);) {
      auto j = json::parse(line);
      Row r{j["text"], j["ids"].get<std::vector<int64_t>>(), "", ""};
      r.decoded = j.value("decoded", r.text);
      r.decoded_skip = j.value("decoded_skip", r.text);
      out.push_back(std::move(r));
    }
    return out;
  }();
  return rows;
}

const BpeTokenizer& fixture_tokenizer() {
  static const BpeTokenizer t = BpeTokenizer::from_file(kDir + "tokenizer.json");
  return t;
}

std::string shown(const std::vector<int64_t>& ids) {
  std::string s = "[";
  for (auto id : ids) s += std::to_string(id) + " ";
  return s + "]";
}

// from_json on the fixture's tokenizer.json after `edit`; returns the error message ("" if none).
template <class Edit>
std::string refusal(Edit edit) {
  auto j = json::parse(read_text(kDir + "tokenizer.json"));
  edit(j);
  try {
    BpeTokenizer::from_json(j.dump(), "edited.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("bpe tokenizer gives the ids of HF tokenizers on every corpus string") {
  const auto& rows = corpus();
  REQUIRE(rows.size() >= 10000);
  const auto& tok = fixture_tokenizer();
  std::size_t wrong = 0, tokens = 0;
  for (const auto& r : rows) {
    auto ids = tok.encode(r.text);
    tokens += ids.size();
    if (ids != r.ids && ++wrong <= 5)
      MESSAGE("text " << json(r.text).dump() << "\n  kiln " << shown(ids) << "\n  HF   " << shown(r.ids));
  }
  MESSAGE(rows.size() << " strings, " << tokens << " tokens");
  CHECK(wrong == 0);
}

TEST_CASE("bpe tokenizer encodes from four threads at once with one shared cache") {
  // A fresh tokenizer: the threads fill its BPE cache together.
  auto tok = BpeTokenizer::from_file(kDir + "tokenizer.json");
  const auto& rows = corpus();
  std::atomic<std::size_t> wrong{0};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (std::size_t i = t; i < rows.size() + t; ++i) {
        const auto& r = rows[(i * 7) % rows.size()];
        if (tok.encode(r.text) != r.ids) ++wrong;
      }
    });
  for (auto& th : threads) th.join();
  CHECK(wrong == 0);
}

TEST_CASE("bpe tokenizer decode gives back every corpus string and matches HF decode") {
  const auto& tok = fixture_tokenizer();
  std::size_t round_trip = 0, decode = 0, decode_skip = 0;
  for (const auto& r : corpus()) {
    round_trip += tok.decode(tok.encode(r.text)) != r.text;
    decode += tok.decode(r.ids) != r.decoded;
    decode_skip += tok.decode(r.ids, /*skip_special_tokens=*/true) != r.decoded_skip;
  }
  CHECK(round_trip == 0);
  CHECK(decode == 0);
  CHECK(decode_skip == 0);
}

TEST_CASE("bpe tokenizer decodes invalid UTF-8 as tokenizers does: one U+FFFD per maximal invalid subpart") {
  auto cases = json::parse(read_text(kDir + "chat.json"))["decode_cases"];
  REQUIRE(cases.size() >= 10);
  for (const auto& c : cases) {
    auto ids = c["ids"].get<std::vector<int64_t>>();
    CHECK_MESSAGE(fixture_tokenizer().decode(ids) == c["decoded"].get<std::string>(), "bytes " << c["bytes"].dump());
  }
}

TEST_CASE("bpe tokenizer reads merges in the left-space-right string form as in the list form") {
  auto j = json::parse(read_text(kDir + "tokenizer.json"));
  REQUIRE(j["model"]["merges"][0].is_array());
  for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  auto tok = BpeTokenizer::from_json(j.dump(), "string-merges.json");
  std::size_t wrong = 0, n = 0;
  for (const auto& r : corpus())
    if (n++ % 5 == 0) wrong += tok.encode(r.text) != r.ids;
  CHECK(wrong == 0);
}

TEST_CASE("GLM chat format renders system user and assistant turns with the ids of HF tokenizers") {
  auto cases = json::parse(read_text(kDir + "chat.json"))["cases"];
  REQUIRE(cases.size() >= 7);
  for (const auto& c : cases) {
    std::vector<kiln::rollout::ChatMessage> messages;
    for (const auto& m : c["messages"]) messages.push_back({m["role"], m["content"]});
    kiln::rollout::ChatOptions opt;
    opt.format = c["format"] == "glm4" ? kiln::rollout::ChatFormat::glm4 : kiln::rollout::ChatFormat::glm47;
    opt.add_generation_prompt = c["add_generation_prompt"];
    opt.enable_thinking = c["enable_thinking"];
    opt.clear_thinking = c.value("clear_thinking", true);
    INFO("case " << c["format"].get<std::string>() << " " << json(c["text"]).dump());
    CHECK(kiln::rollout::render_chat(messages, opt) == c["text"].get<std::string>());
    auto ids = kiln::rollout::encode_chat(fixture_tokenizer(), messages, opt);
    CHECK(ids == c["ids"].get<std::vector<int64_t>>());
    // The markers are single ids: [gMASK] <sop> first, then the first turn's role.
    REQUIRE(ids.size() > 3);
    CHECK(ids[0] == fixture_tokenizer().token_to_id("[gMASK]"));
    CHECK(ids[1] == fixture_tokenizer().token_to_id("<sop>"));
    CHECK(ids[2] == fixture_tokenizer().token_to_id("<|" + messages[0].role + "|>"));
  }
  std::vector<kiln::rollout::ChatMessage> bad{{"user", "hi"}, {"tool", "x"}};
  CHECK_THROWS_WITH_AS(kiln::rollout::render_chat(bad), doctest::Contains("message 1 has role \"tool\""), std::invalid_argument);
}

TEST_CASE("bpe tokenizer adds the ids of a TemplateProcessing post-processor when asked as HF encode does") {
  auto tp = json::parse(read_text(kDir + "chat.json"))["template_processing"];
  auto j = json::parse(read_text(kDir + "tokenizer.json"));
  j["post_processor"] = tp["post_processor"];
  auto tok = BpeTokenizer::from_json(j.dump(), "template.json");
  REQUIRE(tp["cases"].size() >= 3);
  for (const auto& c : tp["cases"]) {
    INFO("text " << c["text"].dump());
    CHECK(tok.encode(c["text"].get<std::string>(), /*add_special_tokens=*/true) == c["ids_with_special"].get<std::vector<int64_t>>());
    CHECK(tok.encode(c["text"].get<std::string>()) == c["ids"].get<std::vector<int64_t>>());
  }
  j["post_processor"]["processors"][1]["special_tokens"].erase("<sop>");
  CHECK_THROWS_WITH_AS(BpeTokenizer::from_json(j.dump(), "template.json"),
                       doctest::Contains("has no ids for \"<sop>\" (used by post_processor.processors[1].single[1])"),
                       std::invalid_argument);
  j["post_processor"] = {{"type", "RobertaProcessing"}};
  CHECK_THROWS_WITH_AS(BpeTokenizer::from_json(j.dump(), "template.json"),
                       doctest::Contains("post_processor.type = \"RobertaProcessing\""), std::invalid_argument);
}

TEST_CASE("bpe tokenizer refuses unsupported or broken tokenizer.json inputs by name") {
  CHECK(refusal([](json&) {}).empty());
  CHECK_MESSAGE(refusal([](json& j) { j["model"]["type"] = "WordPiece"; }).find("model.type = \"WordPiece\"") != std::string::npos,
                refusal([](json& j) { j["model"]["type"] = "WordPiece"; }));
  auto merge = refusal([](json& j) { j["model"]["merges"][7] = json::array({"Ġt", "zzz_not_a_token"}); });
  CHECK_MESSAGE(merge.find("model.merges[7]") != std::string::npos, merge);
  CHECK_MESSAGE(merge.find("\"zzz_not_a_token\" is not in model.vocab") != std::string::npos, merge);
  auto regex = refusal([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(\\p{L}+"; });
  CHECK_MESSAGE(regex.find("pre_tokenizer.pretokenizers[0].pattern.Regex = \"(\\\\p{L}+\"") != std::string::npos, regex);
  CHECK_MESSAGE(regex.find("PCRE2 cannot compile it") != std::string::npos, regex);
  auto behavior = refusal([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; });
  CHECK_MESSAGE(behavior.find("pre_tokenizer.pretokenizers[0].behavior = \"Removed\"") != std::string::npos, behavior);
  auto norm = refusal([](json& j) { j["normalizer"] = {{"type", "NFC"}}; });
  CHECK_MESSAGE(norm.find("edited.json: normalizer = {\"type\":\"NFC\"}") != std::string::npos, norm);
  auto lstrip = refusal([](json& j) { j["added_tokens"][2]["lstrip"] = true; });
  CHECK_MESSAGE(lstrip.find("added_tokens[2].lstrip = true") != std::string::npos, lstrip);
  auto unknown = refusal([](json& j) { j["model"]["frobnicate"] = 1; });
  CHECK_MESSAGE(unknown.find("model.frobnicate = 1") != std::string::npos, unknown);
  auto prefix = refusal([](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; });
  CHECK_MESSAGE(prefix.find("pre_tokenizer.pretokenizers[1].add_prefix_space = true") != std::string::npos, prefix);
  // Ids past any model's vocabulary are refused before the id tables are sized by them (an
  // added token of id 999999999 once ended in std::bad_alloc).
  auto huge_added = refusal([](json& j) { j["added_tokens"][0]["id"] = 999999999; });
  CHECK_MESSAGE(huge_added.find("added_tokens[0].id = 999999999") != std::string::npos, huge_added);
  CHECK_MESSAGE(huge_added.find("expected an id in [0, 4194303]") != std::string::npos, huge_added);
  auto huge_vocab = refusal([](json& j) { j["model"]["vocab"]["Ġt"] = int64_t(1) << 40; });
  CHECK_MESSAGE(huge_vocab.find("model.vocab[\"Ġt\"] = 1099511627776") != std::string::npos, huge_vocab);
  auto negative = refusal([](json& j) { j["model"]["vocab"]["Ġt"] = -1; });
  CHECK_MESSAGE(negative.find("expected an id in [0, 4194303]") != std::string::npos, negative);
  auto byte = refusal([](json& j) { j["model"]["vocab"].erase("Ā"); });
  CHECK_MESSAGE(byte.find("byte 0 is missing") != std::string::npos, byte);
  CHECK_THROWS_WITH_AS(BpeTokenizer::from_json("{not json", "broken.json"), doctest::Contains("broken.json: not valid JSON"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(BpeTokenizer::from_file(kDir + "no_such_tokenizer.json"), doctest::Contains("no_such_tokenizer.json"),
                       std::runtime_error);
}

TEST_CASE("bpe tokenizer refuses text that is not UTF-8 and ids it does not know") {
  const auto& tok = fixture_tokenizer();
  CHECK_THROWS_WITH_AS(tok.encode("ab\xC3("), doctest::Contains("not valid UTF-8 at byte 2"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(tok.encode("\xED\xA0\x80"), doctest::Contains("at byte 0"), std::invalid_argument);
  std::vector<int64_t> ids{5, tok.vocab_size()};
  std::string expected = "id " + std::to_string(tok.vocab_size()) + " at position 1";
  CHECK_THROWS_WITH_AS(tok.decode(ids), doctest::Contains(expected.c_str()), std::out_of_range);
}

TEST_CASE("pre-tokenizer regex splits as tokenizers does and spells out the classes PCRE2 and tokenizers disagree on") {
  using kiln::rollout::pcre2_compatible_pattern;
  // U+180E is \s for PCRE2 but not for tokenizers; U+2EBF0 (Unicode 15.1) a letter only for tokenizers.
  kiln::rollout::PretokenizerRegex re(R"(\s+|\p{L}+|[^\s\p{L}]+)", false);
  std::vector<std::string_view> pieces;
  re.split("a \xE1\xA0\x8E\xF0\xAE\xAF\xB0" "b", pieces);
  REQUIRE(pieces.size() == 4);
  CHECK(pieces[0] == "a");
  CHECK(pieces[1] == " ");
  CHECK(pieces[2] == "\xE1\xA0\x8E");
  CHECK(pieces[3] == "\xF0\xAE\xAF\xB0" "b");
  auto split_cases = json::parse(read_text(kDir + "chat.json"))["split_cases"];
  REQUIRE(split_cases.size() >= 9);
  for (const auto& c : split_cases) {
    kiln::rollout::PretokenizerRegex r(c["pattern"].get<std::string>(), false);
    std::vector<std::string_view> got;
    auto text = c["text"].get<std::string>();
    r.split(text, got);
    CHECK_MESSAGE(std::vector<std::string>(got.begin(), got.end()) == c["pieces"].get<std::vector<std::string>>(),
                  "pattern " << c["pattern"].dump() << " on " << c["text"].dump());
  }
  CHECK(pcre2_compatible_pattern(R"([]\s])") == R"([]\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}])");
  CHECK(pcre2_compatible_pattern(R"(\\s\d)") == R"(\\s\d)");
  CHECK_THROWS_WITH_AS(pcre2_compatible_pattern(R"([^\S])"), doctest::Contains("\\S inside a character class"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(pcre2_compatible_pattern("a\\"), doctest::Contains("lone backslash"), std::invalid_argument);
}
