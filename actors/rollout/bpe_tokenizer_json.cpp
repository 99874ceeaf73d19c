// Reading a tokenizer.json into BpeTokenizer's tables: every key is either used or checked, and
// anything unsupported is refused with the JSON path and value (docs/tokenizer.md has the table).
#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "actors/rollout/bpe_tokenizer_impl.hpp"
#include "actors/rollout/byte_level.hpp"

namespace kiln::rollout {

namespace {

using json = nlohmann::json;

// GPT-2's pattern: what ByteLevel with use_regex = true splits with (tokenizers' byte_level.rs).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

[[noreturn]] void refuse(std::string_view source, const std::string& path, const json& value, std::string_view why) {
  std::string shown = value.dump();
  if (shown.size() > 120) shown = shown.substr(0, 117) + "...";
  throw std::invalid_argument(std::string(source) + ": " + path + " = " + shown + ": " + std::string(why));
}

// Refuses keys of `obj` outside `allowed`, so that no setting is silently ignored.
void expect_keys(std::string_view source, const std::string& path, const json& obj, std::initializer_list<std::string_view> allowed) {
  if (!obj.is_object()) refuse(source, path, obj, "expected a JSON object");
  for (const auto& [key, value] : obj.items())
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end())
      refuse(source, path + "." + key, value, "is not a setting kiln's tokenizer knows (not supported)");
}

// A field that must be absent, null or equal to `expected`.
void expect_value(std::string_view source, const std::string& path, const json& obj, const std::string& key, const json& expected) {
  if (!obj.contains(key) || obj[key].is_null()) return;
  if (obj[key] != expected) refuse(source, path + "." + key, obj[key], "is not supported (only " + expected.dump() + ")");
}

const json& field(std::string_view source, const std::string& path, const json& obj, const char* key) {
  if (!obj.is_object() || !obj.contains(key)) refuse(source, path, obj, std::string("has no \"") + key + "\"");
  return obj[key];
}


void add_split(BpeTokenizer::Impl& t, std::string_view src, const std::string& path, const std::string& pattern, bool literal) {
  try {
    t.splits.emplace_back(pattern, literal);
  } catch (const std::invalid_argument& e) {
    refuse(src, path, pattern, e.what());
  }
}

void load_pre_tokenizer(BpeTokenizer::Impl& t, std::string_view src, const json& pre) {
  std::vector<std::pair<std::string, const json*>> steps;
  if (pre.is_null()) refuse(src, "pre_tokenizer", pre, "a byte-level BPE needs a ByteLevel pre-tokenizer");
  std::string type = field(src, "pre_tokenizer", pre, "type").is_string() ? pre["type"].get<std::string>() : "";
  if (type == "Sequence") {
    const json& list = field(src, "pre_tokenizer", pre, "pretokenizers");
    expect_keys(src, "pre_tokenizer", pre, {"type", "pretokenizers"});
    if (!list.is_array() || list.empty()) refuse(src, "pre_tokenizer.pretokenizers", list, "expected a non-empty list");
    for (std::size_t i = 0; i < list.size(); ++i) steps.emplace_back("pre_tokenizer.pretokenizers[" + std::to_string(i) + "]", &list[i]);
  } else {
    steps.emplace_back("pre_tokenizer", &pre);
  }
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& [path, step] = steps[i];
    const json& ty = field(src, path, *step, "type");
    if (ty == "Split") {
      expect_keys(src, path, *step, {"type", "pattern", "behavior", "invert"});
      const json& behavior = field(src, path, *step, "behavior");
      if (behavior != "Isolated") refuse(src, path + ".behavior", behavior, "is not supported (only \"Isolated\")");
      if (step->value("invert", false)) refuse(src, path + ".invert", (*step)["invert"], "is not supported (only false)");
      const json& pattern = field(src, path, *step, "pattern");
      if (pattern.contains("Regex") && pattern["Regex"].is_string())
        add_split(t, src, path + ".pattern.Regex", pattern["Regex"].get<std::string>(), false);
      else if (pattern.contains("String") && pattern["String"].is_string())
        add_split(t, src, path + ".pattern.String", pattern["String"].get<std::string>(), true);
      else
        refuse(src, path + ".pattern", pattern, "expected {\"Regex\": ...} or {\"String\": ...}");
    } else if (ty == "ByteLevel") {
      expect_keys(src, path, *step, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
      if (i + 1 != steps.size()) refuse(src, path, *step, "ByteLevel must be the last pre-tokenizer (kiln maps bytes last)");
      if (step->value("add_prefix_space", false)) refuse(src, path + ".add_prefix_space", (*step)["add_prefix_space"], "is not supported (only false)");
      if (step->value("use_regex", true)) add_split(t, src, path + ".use_regex (GPT-2's pattern)", kGpt2Pattern, false);
    } else {
      refuse(src, path + ".type", ty, "is not supported (Split and ByteLevel are)");
    }
  }
  if (steps.back().second->at("type") != "ByteLevel") refuse(src, steps.back().first, *steps.back().second, "a byte-level BPE needs ByteLevel as the last pre-tokenizer");
}

// A token id: an integer below the largest vocabulary kiln's models accept (config.json's
// vocab_size bound, model/config_json.cpp), so that the id tables (one entry per id up to the
// largest) stay small; an id of 10^9 would otherwise allocate gigabytes before any check.
constexpr int64_t kMaxTokenIds = int64_t(1) << 22;
constexpr const char* kIdRange = "expected an id in [0, 4194303] (kiln's models have at most 4194304 ids)";
bool valid_id(const json& id) {
  return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxTokenIds;
}

void load_model(BpeTokenizer::Impl& t, std::string_view src, const json& model) {
  expect_keys(src, "model", model, {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                                    "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  const json& type = field(src, "model", model, "type");
  if (type != "BPE") refuse(src, "model.type", type, "is not supported (only \"BPE\")");
  expect_value(src, "model", model, "dropout", json(nullptr));
  expect_value(src, "model", model, "continuing_subword_prefix", json(""));
  expect_value(src, "model", model, "end_of_word_suffix", json(""));
  expect_value(src, "model", model, "byte_fallback", json(false));
  t.ignore_merges = model.value("ignore_merges", false);
  const json& vocab = field(src, "model", model, "vocab");
  if (!vocab.is_object()) refuse(src, "model.vocab", vocab, "expected an object token -> id");
  int64_t max_id = -1;
  for (const auto& [tok, id] : vocab.items()) {
    if (!valid_id(id)) refuse(src, "model.vocab[\"" + tok + "\"]", id, kIdRange);
    max_id = std::max(max_id, id.get<int64_t>());
    t.vocab.emplace(tok, id.get<int64_t>());
  }
  t.tokens.assign(std::size_t(max_id + 1), "");
  t.known.assign(std::size_t(max_id + 1), 0);
  for (const auto& [tok, id] : t.vocab) {
    if (t.known[std::size_t(id)]) refuse(src, "model.vocab[\"" + tok + "\"]", id, "this id also names \"" + t.tokens[std::size_t(id)] + "\"");
    t.tokens[std::size_t(id)] = tok;
    t.known[std::size_t(id)] = 1;
  }
  if (model.contains("unk_token") && !model["unk_token"].is_null() &&
      (!model["unk_token"].is_string() || !t.vocab.contains(model["unk_token"].get<std::string>())))
    refuse(src, "model.unk_token", model["unk_token"], "is not in model.vocab");
  for (int b = 0; b < 256; ++b) {
    auto it = t.vocab.find(byte_level::char_of_byte(uint8_t(b)));
    if (it == t.vocab.end())
      refuse(src, "model.vocab", json(byte_level::char_of_byte(uint8_t(b))),
             "the byte-level character of byte " + std::to_string(b) + " is missing (kiln needs all 256)");
    t.byte_id[std::size_t(b)] = int32_t(it->second);
  }
  const json& merges = field(src, "model", model, "merges");
  if (!merges.is_array()) refuse(src, "model.merges", merges, "expected a list");
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const json& m = merges[r];
    std::string path = "model.merges[" + std::to_string(r) + "]";
    std::string a, b;
    if (m.is_string()) {
      auto s = m.get<std::string>();
      auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) refuse(src, path, m, "expected \"left right\" (one space)");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    } else {
      refuse(src, path, m, "expected \"left right\" or [\"left\", \"right\"]");
    }
    auto ia = t.vocab.find(a), ib = t.vocab.find(b), im = t.vocab.find(a + b);
    if (ia == t.vocab.end()) refuse(src, path, m, "\"" + a + "\" is not in model.vocab");
    if (ib == t.vocab.end()) refuse(src, path, m, "\"" + b + "\" is not in model.vocab");
    if (im == t.vocab.end()) refuse(src, path, m, "the merged token \"" + a + b + "\" is not in model.vocab");
    uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    if (!t.merges.emplace(key, std::pair{int32_t(r), int32_t(im->second)}).second) refuse(src, path, m, "repeats an earlier merge");
  }
}

void load_added(BpeTokenizer::Impl& t, std::string_view src, const json& list) {
  if (list.is_null()) return;
  if (!list.is_array()) refuse(src, "added_tokens", list, "expected a list");
  std::vector<uint8_t> is_added;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const json& a = list[i];
    std::string path = "added_tokens[" + std::to_string(i) + "]";
    expect_keys(src, path, a, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      if (a.value(flag, false)) refuse(src, path + "." + flag, a[flag], "is not supported (only false)");
    const json& id = field(src, path, a, "id");
    const json& content = field(src, path, a, "content");
    if (!valid_id(id)) refuse(src, path + ".id", id, kIdRange);
    if (!content.is_string() || content.get<std::string>().empty()) refuse(src, path + ".content", content, "expected a non-empty string");
    AddedToken tok{id.get<int64_t>(), content.get<std::string>(), a.value("special", false), a.value("normalized", false)};
    auto n = std::size_t(tok.id + 1);
    if (t.tokens.size() < n) t.tokens.resize(n), t.known.resize(n, 0);
    if (is_added.size() < n) is_added.resize(n, 0);
    auto sid = std::size_t(tok.id);
    // An added token may take the id of a vocab entry (its content wins), not of another added one.
    if (is_added[sid]) refuse(src, path + ".id", id, "is also added token \"" + t.tokens[sid] + "\"");
    is_added[sid] = 1;
    t.tokens[sid] = tok.content;
    t.known[sid] = 1;
    t.vocab[tok.content] = tok.id;
    t.added.push_back(tok);
  }
  t.special.assign(t.tokens.size(), 0);
  for (std::size_t i = 0; i < t.added.size(); ++i) {
    const auto& tok = t.added[i];
    if (tok.special) t.special[std::size_t(tok.id)] = 1;
    t.added_by_byte[tok.normalized ? 1 : 0][static_cast<unsigned char>(tok.content[0])].push_back(int32_t(i));
  }
  for (auto& pass : t.added_by_byte)
    for (auto& v : pass)
      std::stable_sort(v.begin(), v.end(), [&](int32_t x, int32_t y) { return t.added[std::size_t(x)].content.size() > t.added[std::size_t(y)].content.size(); });
}

// post_processor: null, ByteLevel (offsets only), TemplateProcessing (ids around a sequence) or
// a Sequence of them with at most one TemplateProcessing.
void load_post_processor(BpeTokenizer::Impl& t, std::string_view src, const json& post) {
  if (post.is_null()) return;
  std::vector<std::pair<std::string, const json*>> steps;
  const json& type = field(src, "post_processor", post, "type");
  if (type == "Sequence") {
    expect_keys(src, "post_processor", post, {"type", "processors"});
    const json& list = field(src, "post_processor", post, "processors");
    if (!list.is_array()) refuse(src, "post_processor.processors", list, "expected a list");
    for (std::size_t i = 0; i < list.size(); ++i) steps.emplace_back("post_processor.processors[" + std::to_string(i) + "]", &list[i]);
  } else {
    steps.emplace_back("post_processor", &post);
  }
  bool have_template = false;
  for (const auto& [path, step] : steps) {
    const json& ty = field(src, path, *step, "type");
    if (ty == "ByteLevel") {
      expect_keys(src, path, *step, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
      continue;
    }
    if (ty != "TemplateProcessing") refuse(src, path + ".type", ty, "is not supported (ByteLevel and TemplateProcessing are)");
    if (have_template) refuse(src, path, *step, "a second TemplateProcessing is not supported");
    have_template = true;
    // "pair" only applies to encoding two sequences together, which kiln does not offer.
    expect_keys(src, path, *step, {"type", "single", "pair", "special_tokens"});
    const json& specials = field(src, path, *step, "special_tokens");
    const json& single = field(src, path, *step, "single");
    if (!single.is_array()) refuse(src, path + ".single", single, "expected a list");
    bool seen_sequence = false;
    for (std::size_t i = 0; i < single.size(); ++i) {
      std::string ipath = path + ".single[" + std::to_string(i) + "]";
      const json& piece = single[i];
      if (piece.contains("Sequence")) {
        if (seen_sequence || piece["Sequence"].value("id", "") != "A") refuse(src, ipath, piece, "expected one {\"Sequence\": {\"id\": \"A\"}}");
        seen_sequence = true;
        continue;
      }
      if (!piece.contains("SpecialToken") || !piece["SpecialToken"].contains("id") || !piece["SpecialToken"]["id"].is_string())
        refuse(src, ipath, piece, "expected {\"SpecialToken\": {\"id\": ...}} or {\"Sequence\": {\"id\": \"A\"}}");
      std::string name = piece["SpecialToken"]["id"];
      if (!specials.is_object() || !specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array())
        refuse(src, path + ".special_tokens", specials, "has no ids for \"" + name + "\" (used by " + ipath + ")");
      for (const json& id : specials[name]["ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || std::size_t(id.get<int64_t>()) >= t.tokens.size() ||
            !t.known[std::size_t(id.get<int64_t>())])
          refuse(src, path + ".special_tokens[\"" + name + "\"].ids", specials[name]["ids"], "names an id that is no token");
        (seen_sequence ? t.template_suffix : t.template_prefix).push_back(id.get<int64_t>());
      }
    }
    if (!seen_sequence) refuse(src, path + ".single", single, "has no {\"Sequence\": {\"id\": \"A\"}}");
  }
}

// ByteLevel decoder, per token: its characters mapped back to bytes when every one of them is
// a byte-level character, else the token's own UTF-8 bytes (tokenizers' decoders/byte_level.rs).
std::string byte_level_bytes(const std::string& token) {
  std::string out;
  for (std::size_t i = 0; i < token.size();) {
    auto step = byte_level::utf8_step(token, i);
    uint32_t cp = static_cast<unsigned char>(token[i]);
    if (step.valid && step.length > 1) {
      cp &= (0xFF >> (step.length + 1));
      for (std::size_t k = 1; k < step.length; ++k) cp = (cp << 6) | (static_cast<unsigned char>(token[i + k]) & 0x3F);
    }
    int b = step.valid ? byte_level::byte_of_char(cp) : -1;
    if (b < 0) return token;
    out += char(b);
    i += step.length;
  }
  return out;
}

}  // namespace

BpeTokenizer BpeTokenizer::from_json(std::string_view text, std::string_view src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw std::invalid_argument(std::string(src) + ": not valid JSON: " + e.what());
  }
  expect_keys(src, "(top level)", j, {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
                                      "post_processor", "decoder", "model"});
  for (const char* off : {"truncation", "padding", "normalizer"})
    if (j.contains(off) && !j[off].is_null()) refuse(src, off, j[off], "is not supported (only null)");
  auto impl = std::make_unique<Impl>();
  load_model(*impl, src, field(src, "(top level)", j, "model"));
  load_pre_tokenizer(*impl, src, field(src, "(top level)", j, "pre_tokenizer"));
  load_added(*impl, src, j.value("added_tokens", json::array()));
  if (impl->special.size() < impl->tokens.size()) impl->special.resize(impl->tokens.size(), 0);
  const json& decoder = field(src, "(top level)", j, "decoder");
  if (!decoder.is_object() || decoder.value("type", "") != "ByteLevel") refuse(src, "decoder", decoder, "is not supported (only ByteLevel)");
  load_post_processor(*impl, src, j.value("post_processor", json(nullptr)));
  impl->decoded_bytes.resize(impl->tokens.size());
  for (std::size_t id = 0; id < impl->tokens.size(); ++id)
    if (impl->known[id]) impl->decoded_bytes[id] = byte_level_bytes(impl->tokens[id]);
  return BpeTokenizer(std::move(impl));
}

BpeTokenizer BpeTokenizer::from_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error("BpeTokenizer: " + path.string() + " is a directory (give its tokenizer.json)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("BpeTokenizer: cannot open " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path.string());
}

}  // namespace kiln::rollout
