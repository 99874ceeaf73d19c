#include "model/config_json.hpp"

#include <cassert>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>

namespace kiln::model::config_json {

using nlohmann::json;

std::string IntRange::str() const {
  // Appended piece by piece: "[" + std::to_string(...) trips GCC 12's -Wrestrict false positive.
  std::string s = "[";
  s += std::to_string(lo);
  s += ", ";
  s += std::to_string(hi);
  s += "]";
  return s;
}

json read_config_json(const std::string& dir) {
  auto path = std::filesystem::path(dir) / "config.json";
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("no config.json in '" + dir + "'");
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    throw std::invalid_argument("config.json (" + path.string() + ") is not valid JSON: " + e.what());
  }
}

void write_config_json(const std::string& dir, const json& j) {
  std::ofstream out(std::filesystem::path(dir) / "config.json");
  out << j.dump(2) << "\n";
  out.close();  // checked after the flush: a full disk shows there
  if (!out) throw std::runtime_error("writing config.json in '" + dir + "' failed (disk full, or a file-size limit?)");
}

namespace {
// What a checkpoint of the same model may hold otherwise: token ids and the context length (a
// fine-tune's new end token or longer context; the weights read are the same), how its weights
// are stored (quantization_config: the tensors and their _scale_inv say that) and a vision tower
// the text model does not read.
bool same_model_either_way(const std::string& key) {
  return key == "bos_token_id" || key == "eos_token_id" || key == "pad_token_id" || key == "max_position_embeddings" ||
         key == "quantization_config" || key == "vision_config";
}

void differences(const json& in_use, const json& other, const std::string& at, std::vector<std::string>& out) {
  if (in_use.is_object() && other.is_object()) {
    std::set<std::string> keys;
    for (const auto& [k, v] : in_use.items()) keys.insert(k);
    for (const auto& [k, v] : other.items()) keys.insert(k);
    for (const auto& k : keys) {
      if (same_model_either_way(k)) continue;
      const auto path = at.empty() ? k : at + "." + k;
      if (!in_use.contains(k) || !other.contains(k))
        out.push_back("'" + path + "' " + (other.contains(k) ? show(other[k]) : "absent") + " (in use: " +
                      (in_use.contains(k) ? show(in_use[k]) : "absent") + ")");
      else
        differences(in_use[k], other[k], path, out);
    }
  } else if (in_use != other) {
    out.push_back("'" + at + "' " + show(other) + " (in use: " + show(in_use) + ")");
  }
}
}  // namespace

void check_same_config(const nlohmann::json& in_use, const nlohmann::json& other, const std::string& source) {
  std::vector<std::string> found;
  differences(in_use, other, "", found);
  if (found.empty()) return;
  std::string differ;
  for (std::size_t i = 0; i < found.size() && i < 8; ++i) differ += (i ? ", " : "") + found[i];
  if (found.size() > 8) differ += ", and " + std::to_string(found.size() - 8) + " more";
  throw std::invalid_argument("config.json (" + source + ") describes another model than the one in use: " + differ);
}

IntRanges common_int_ranges() {
  return {
      {"vocab_size", {1, 1 << 22}},
      {"hidden_size", {1, 1 << 16}},
      {"intermediate_size", {1, 1 << 18}},
      {"moe_intermediate_size", {1, 1 << 18}},
      {"num_hidden_layers", {1, 1024}},
      {"num_attention_heads", {1, 1024}},
      {"num_key_value_heads", {1, 1024}},
      {"n_routed_experts", {1, 4096}},
      {"num_experts_per_tok", {1, 4096}},
      {"n_shared_experts", {0, 64}},
      {"n_group", {1, 4096}},
      {"topk_group", {1, 4096}},
      {"kv_lora_rank", {1, 1 << 16}},
      {"q_lora_rank", {1, 1 << 16}},
      {"qk_nope_head_dim", {1, 4096}},
      {"v_head_dim", {1, 4096}},
      {"max_position_embeddings", {1, int64_t(1) << 30}},
      {"bos_token_id", {0, (1 << 22) - 1}},
      {"eos_token_id", {0, (1 << 22) - 1}},
  };
}

IntRanges with_ranges(IntRanges base, const IntRanges& extra) {
  for (const auto& [k, v] : extra) base.insert_or_assign(k, v);
  return base;
}

void check_token_ids(const std::string& field, const std::vector<int64_t>& ids, int64_t vocab_size,
                     const std::function<void(const std::string&, const std::string&)>& bad) {
  for (auto id : ids)
    if (id < 0 || id >= vocab_size)
      bad(field, std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab_size - 1) + "]");
}

IntRange range_of(const IntRanges& ranges, const std::string& field) {
  auto it = ranges.find(field);
  assert(it != ranges.end() && "every integer field read or validated has a range in its package's table");
  return it->second;
}

bool shallow(const json& v, int levels) {
  if (!v.is_structured()) return true;
  if (levels == 0) return false;
  for (const auto& x : v)
    if (!shallow(x, levels - 1)) return false;
  return true;
}

std::string show(const json& v) {
  // dump() recurses once per level: a config.json of a million '[' would overflow the stack.
  if (!shallow(v, 4)) return v.is_array() ? "a deeply nested array" : "a deeply nested object";
  std::string s = v.dump();
  if (s.size() <= 120) return s;
  std::size_t cut = 100;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
  return s.substr(0, cut) + "... (" + std::to_string(s.size()) + " bytes)";
}

void FieldReader::bad(const std::string& field, const std::string& why) const {
  throw std::invalid_argument("config.json (" + source + "): field '" + prefix + field + "': " + why);
}

void FieldReader::missing(const char* f) const { bad(f, "missing (required: " + missing_why + ")"); }

int64_t FieldReader::integer(const char* f, std::optional<int64_t> fallback) const {
  if (!has(f)) {
    if (fallback) return *fallback;
    missing(f);
  }
  return integer_value(f, j[f]);
}

int64_t FieldReader::integer_value(const std::string& f, const json& v) const {
  if (!v.is_number_integer()) bad(f, "must be an integer, got " + show(v));
  const auto r = range_of(ranges, f);
  const bool inside = v.is_number_unsigned()
                          ? v.get<uint64_t>() >= uint64_t(r.lo) && v.get<uint64_t>() <= uint64_t(r.hi)
                          : v.get<int64_t>() >= r.lo && v.get<int64_t>() <= r.hi;
  if (!inside) bad(f, show(v) + " is outside " + r.str());
  return v.get<int64_t>();
}

double FieldReader::number(const char* f, std::optional<double> fallback) const {
  if (!has(f)) {
    if (fallback) return *fallback;
    missing(f);
  }
  if (!j[f].is_number()) bad(f, "must be a number, got " + show(j[f]));
  const double v = j[f].get<double>();
  if (!std::isfinite(v)) bad(f, "must be a finite number, got " + show(nlohmann::json(v)));
  return v;
}

bool FieldReader::boolean(const char* f, bool fallback) const {
  if (!has(f)) return fallback;
  if (!j[f].is_boolean()) bad(f, "must be true or false, got " + show(j[f]));
  return j[f].get<bool>();
}

std::string FieldReader::string(const char* f, const std::string& fallback) const {
  if (!has(f)) return fallback;
  if (!j[f].is_string()) bad(f, "must be a string, got " + show(j[f]));
  return j[f].get<std::string>();
}

std::vector<int64_t> FieldReader::integer_list(const char* f) const {
  std::vector<int64_t> out;
  if (!has(f)) return out;
  const auto& e = j[f];
  if (e.is_number_integer()) out.push_back(integer_value(f, e));
  else if (e.is_array()) {
    for (const auto& x : e) out.push_back(integer_value(f, x));
  } else bad(f, "must be an integer or a list of integers, got " + show(e));
  return out;
}

}  // namespace kiln::model::config_json
