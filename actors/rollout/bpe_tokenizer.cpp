#include "actors/rollout/bpe_tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cassert>
#include <fstream>
#include <mutex>
#include <queue>
#include <shared_mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

#include "actors/rollout/byte_level.hpp"
#include "actors/rollout/pretokenizer_regex.hpp"

namespace kiln::rollout {

namespace {

using json = nlohmann::json;

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// GPT-2's pattern: what ByteLevel with use_regex = true splits with (tokenizers' byte_level.rs).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// tokenizers' BPE cache holds up to 10,000 words; pieces this long or longer are not cached.
constexpr std::size_t kCacheCapacity = 10000;
constexpr std::size_t kCacheMaxPieceBytes = 256;

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

}  // namespace

struct BpeTokenizer::Impl {
  std::vector<PretokenizerRegex> splits;  // applied in order; each cuts every piece of the one before
  bool ignore_merges = false;
  StringMap<int64_t> vocab;
  std::vector<std::string> tokens;          // id -> token string ("" where no token)
  std::vector<std::string> decoded_bytes;   // id -> bytes after the ByteLevel decoder
  std::vector<uint8_t> known;               // id -> 1 when the id has a token
  std::vector<uint8_t> special;             // id -> 1 for special added tokens
  std::array<int32_t, 256> byte_id{};       // byte -> id of its byte-level character
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged)
  std::vector<AddedToken> added;
  // Added tokens by first byte, longest first: [0] normalized = false, [1] normalized = true.
  std::array<std::array<std::vector<int32_t>, 256>, 2> added_by_byte;
  // TemplateProcessing's single-sequence template: ids before and after $A.
  std::vector<int64_t> template_prefix, template_suffix;
  mutable std::shared_mutex cache_mutex;
  mutable StringMap<std::vector<int32_t>> cache;

  void bpe(std::string_view piece, std::vector<int64_t>& out, std::string& scratch) const;
  void encode_plain(std::string_view text, std::vector<int64_t>& out) const;
};

namespace {

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
    if (!id.is_number_integer() || id.get<int64_t>() < 0) refuse(src, "model.vocab[\"" + tok + "\"]", id, "expected an id >= 0");
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
    if (!id.is_number_integer() || id.get<int64_t>() < 0) refuse(src, path + ".id", id, "expected an id >= 0");
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
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("BpeTokenizer: cannot open " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path.string());
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::Impl::bpe(std::string_view piece, std::vector<int64_t>& out, std::string& scratch) const {
  if (piece.size() < kCacheMaxPieceBytes) {
    std::shared_lock lock(cache_mutex);
    if (auto it = cache.find(piece); it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> result;
  if (ignore_merges) {  // a piece that is a whole vocab entry is that entry
    scratch.clear();
    for (char c : piece) scratch += byte_level::char_of_byte(uint8_t(c));
    if (auto it = vocab.find(scratch); it != vocab.end()) result.push_back(int32_t(it->second));
  }
  if (result.empty()) {
    // Symbols are byte spans [i, next[i]) linked by prev/next; a merge joins i with next[i].
    const std::size_t n = piece.size();
    std::vector<int32_t> id(n), prev(n), next(n);
    for (std::size_t i = 0; i < n; ++i) {
      id[i] = byte_id[static_cast<unsigned char>(piece[i])];
      prev[i] = int32_t(i) - 1;
      next[i] = int32_t(i + 1);
    }
    struct Cand { int32_t rank, pos, left, right, merged; };
    auto later = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
    std::priority_queue<Cand, std::vector<Cand>, decltype(later)> heap(later);
    auto push = [&](int32_t i) {
      if (i < 0 || std::size_t(next[std::size_t(i)]) >= n) return;
      int32_t j = next[std::size_t(i)];
      auto it = merges.find((uint64_t(uint32_t(id[std::size_t(i)])) << 32) | uint32_t(id[std::size_t(j)]));
      if (it != merges.end()) heap.push({it->second.first, i, id[std::size_t(i)], id[std::size_t(j)], it->second.second});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(int32_t(i));
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      auto i = std::size_t(c.pos);
      // Stale when either side has merged since: a symbol's id only changes by growing.
      if (id[i] != c.left || std::size_t(next[i]) >= n || id[std::size_t(next[i])] != c.right) continue;
      auto j = std::size_t(next[i]);
      id[i] = c.merged;
      id[j] = -1;
      next[i] = next[j];
      if (std::size_t(next[i]) < n) prev[std::size_t(next[i])] = int32_t(i);
      push(prev[i]);
      push(int32_t(i));
    }
    for (std::size_t i = 0; i < n; i = std::size_t(next[i])) result.push_back(id[i]);
  }
  out.insert(out.end(), result.begin(), result.end());
  if (piece.size() < kCacheMaxPieceBytes) {
    std::unique_lock lock(cache_mutex);
    if (cache.size() < kCacheCapacity) cache.emplace(std::string(piece), std::move(result));
  }
}

void BpeTokenizer::Impl::encode_plain(std::string_view text, std::vector<int64_t>& out) const {
  if (text.empty()) return;
  // Split k cuts each piece of split k - 1; the last split's pieces go to BPE.
  std::vector<std::string_view> pieces{text}, next;
  for (const auto& split : splits) {
    next.clear();
    for (auto piece : pieces) split.split(piece, next);
    pieces.swap(next);
  }
  std::string scratch;
  for (auto piece : pieces) bpe(piece, out, scratch);
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (auto bad = byte_level::first_invalid_utf8(text); bad != text.size())
    throw std::invalid_argument("BpeTokenizer::encode: the text is not valid UTF-8 at byte " + std::to_string(bad) + " of " +
                                std::to_string(text.size()));
  const Impl& t = *impl_;
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens) out = t.template_prefix;
  // Pass `pass` cuts out the added tokens of that pass (leftmost, then longest), handing the text
  // between them to pass + 1; after pass 1 comes the pre-tokenizer and BPE.
  auto cut = [&](auto& self, int pass, std::string_view s) -> void {
    if (pass == 2) return t.encode_plain(s, out);
    std::size_t last = 0;
    for (std::size_t i = 0; i < s.size();) {
      const auto& cands = t.added_by_byte[std::size_t(pass)][static_cast<unsigned char>(s[i])];
      const AddedToken* hit = nullptr;
      for (int32_t k : cands)
        if (s.substr(i).starts_with(t.added[std::size_t(k)].content)) { hit = &t.added[std::size_t(k)]; break; }
      if (!hit) { ++i; continue; }
      if (i > last) self(self, pass + 1, s.substr(last, i - last));
      out.push_back(hit->id);
      i += hit->content.size();
      last = i;
    }
    if (last < s.size()) self(self, pass + 1, s.substr(last));
  };
  cut(cut, 0, text);
  if (add_special_tokens) out.insert(out.end(), t.template_suffix.begin(), t.template_suffix.end());
  return out;
}

std::string BpeTokenizer::decode(std::span<const int64_t> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::string bytes;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    int64_t id = ids[k];
    if (id < 0 || std::size_t(id) >= t.tokens.size() || !t.known[std::size_t(id)])
      throw std::out_of_range("BpeTokenizer::decode: id " + std::to_string(id) + " at position " + std::to_string(k) +
                              " is not a token of this tokenizer (vocab size " + std::to_string(t.tokens.size()) + ")");
    if (skip_special_tokens && t.special[std::size_t(id)]) continue;
    bytes += t.decoded_bytes[std::size_t(id)];
  }
  return byte_level::utf8_lossy(bytes);
}

int64_t BpeTokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

const std::string& BpeTokenizer::id_to_token(int64_t id) const {
  if (id < 0 || std::size_t(id) >= impl_->tokens.size() || !impl_->known[std::size_t(id)])
    throw std::out_of_range("BpeTokenizer::id_to_token: id " + std::to_string(id) + " is not a token of this tokenizer");
  return impl_->tokens[std::size_t(id)];
}

int64_t BpeTokenizer::vocab_size() const { return int64_t(impl_->tokens.size()); }
const std::vector<AddedToken>& BpeTokenizer::added_tokens() const { return impl_->added; }

}  // namespace kiln::rollout
