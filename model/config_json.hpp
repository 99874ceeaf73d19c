#pragma once
// Reading an HF config.json field by field, each refused by name: the reader every model
// package's config parser uses (no LibTorch). Errors are std::invalid_argument
// "config.json (SOURCE): field 'x': why".
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kiln::model::config_json {

/// The sane range [lo, hi] of an integer field.
struct IntRange {
  int64_t lo, hi;
  std::string str() const;  ///< "[lo, hi]"
};
/// Integer ranges by HF field name: every integer field a package reads has one.
using IntRanges = std::map<std::string, IntRange>;

/// Ranges of the fields both GLM families (and DeepSeek-V3) share: sizes, MLA ranks and heads,
/// routing, token ids. Wide enough for every published model of them (the largest,
/// DeepSeek-V3: vocab 129k, hidden 7168, 256 experts, 128 heads, 61 layers; GLM-5.3-Flash: 288
/// experts) with room to spare; narrow enough that no product of them overflows int64 and a
/// typo (2^31, 2^63-1) is named here, not by the allocator or as a negative dimension.
IntRanges common_int_ranges();
/// `base` with `extra` added (an entry of `extra` replaces base's).
IntRanges with_ranges(IntRanges base, const IntRanges& extra);

/// Each id in [0, vocab_size): else bad(field, "ID is outside the vocabulary [0, V-1]").
void check_token_ids(const std::string& field, const std::vector<int64_t>& ids, int64_t vocab_size,
                     const std::function<void(const std::string&, const std::string&)>& bad);

/// DIR/config.json parsed. Throws std::invalid_argument "no config.json in 'DIR'" or
/// "config.json (PATH) is not valid JSON: ...".
nlohmann::json read_config_json(const std::string& dir);
/// Writes `j` (indented) to DIR/config.json; throws std::runtime_error naming DIR on failure.
void write_config_json(const std::string& dir, const nlohmann::json& j);
/// That `other` (a checkpoint's config as its package writes it: parsed, then to_hf_json) and
/// `in_use` (the loaded model's, the same way) hold the same fields with the same values, nested
/// objects field by field, except what checkpoints of one model may hold otherwise: token ids
/// (bos/eos/pad_token_id), max_position_embeddings, quantization_config and vision_config.
/// Throws std::invalid_argument "config.json (SOURCE) describes another model than the one in
/// use: 'text_config.field' X (in use: Y), ..." naming up to 8 fields that differ.
void check_same_config(const nlohmann::json& in_use, const nlohmann::json& other, const std::string& source);
/// A package's CausalLM::check_hf_config: when DIR holds a config.json, it parsed by the
/// package's Config (from_hf_json: every field checked) and compared with `in_use`'s
/// (check_same_config over both to_hf_json forms); a DIR without one passes.
template <class Config>
void check_dir_config(const Config& in_use, const std::string& dir) {
  const auto path = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::exists(path)) return;
  const auto other = Config::from_hf_json(read_config_json(dir), path.string());
  check_same_config(in_use.to_hf_json(), other.to_hf_json(), path.string());
}

/// The range of `field` in `ranges` (asserts that it has one: a missing entry is a bug).
IntRange range_of(const IntRanges& ranges, const std::string& field);

/// A JSON value for an error message: at most ~120 bytes, never a deep recursion.
std::string show(const nlohmann::json& v);
/// Whether `v` nests at most `levels` arrays or objects deep (recursing at most that far).
bool shallow(const nlohmann::json& v, int levels);

/// Reads the fields of one JSON object `j` (held by reference: it must outlive the reader).
/// `missing_why` completes the message for an absent required field ("missing (required:
/// <missing_why>)").
struct FieldReader {
  const nlohmann::json& j;
  std::string source;
  const IntRanges& ranges;
  std::string missing_why;
  std::string prefix;  ///< prepended to field names in messages ("text_config." for a nested object)

  /// Throws std::invalid_argument "config.json (SOURCE): field 'PREFIXFIELD': WHY".
  [[noreturn]] void bad(const std::string& field, const std::string& why) const;
  /// Present and not null.
  bool has(const char* f) const { return j.contains(f) && !j[f].is_null(); }
  [[noreturn]] void missing(const char* f) const;
  /// An integer field checked against its range. Absent or null: `fallback`, or refused by
  /// name when there is none (a required field).
  int64_t integer(const char* f, std::optional<int64_t> fallback = std::nullopt) const;
  /// `v` as the integer field `f`, checked against f's range in the JSON's own type (2^64-1
  /// read as int64 would be -1).
  int64_t integer_value(const std::string& f, const nlohmann::json& v) const;
  /// A finite real field; absent or null: `fallback` or refused as missing.
  double number(const char* f, std::optional<double> fallback = std::nullopt) const;
  bool boolean(const char* f, bool fallback) const;
  std::string string(const char* f, const std::string& fallback) const;
  /// An integer or a list of integers (e.g. eos_token_id), each range-checked as field `f`;
  /// absent or null: empty.
  std::vector<int64_t> integer_list(const char* f) const;
  /// A reader of the object `sub` (a nested field), same source, ranges and message; its
  /// fields are named `sub_prefix` + name in messages.
  FieldReader nested(const nlohmann::json& sub, const std::string& sub_prefix = "") const {
    return FieldReader{sub, source, ranges, missing_why, sub_prefix};
  }
};

}  // namespace kiln::model::config_json
