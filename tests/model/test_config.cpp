// glm4_moe_lite config.json reader and Glm4MoeLiteConfig::validate (torch-free; also run under
// ASan+UBSan). The base input is the fixture's config.json, written by transformers 5.17.0.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "model/config_json.hpp"
#include "model/glm4_moe_lite/config.hpp"

using kiln::model::glm4_moe_lite::Glm4MoeLiteConfig;
namespace flavors = kiln::model::glm4_moe_lite::flavors;
using nlohmann::json;

namespace {
json fixture_config() {
  std::ifstream in(std::string(KILN_FIXTURES_DIR) + "/glm4_moe_lite_tiny/config.json");
  REQUIRE(in);
  return json::parse(in);
}

std::string parse_error(const json& j) {
  try {
    Glm4MoeLiteConfig::from_hf_json(j, "c.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(parsed without error)";
}

// The integer fields of the fixture's config.json, each with its range's bounds.
struct IntField {
  const char* name;
  int64_t lo, hi;
};
const IntField kIntFields[] = {
    {"vocab_size", 1, 1 << 22},        {"hidden_size", 1, 1 << 16},        {"intermediate_size", 1, 1 << 18},
    {"moe_intermediate_size", 1, 1 << 18}, {"num_hidden_layers", 1, 1024}, {"num_attention_heads", 1, 1024},
    {"num_key_value_heads", 1, 1024},  {"n_routed_experts", 1, 4096},      {"num_experts_per_tok", 1, 4096},
    {"n_shared_experts", 0, 64},       {"n_group", 1, 4096},               {"topk_group", 1, 4096},
    {"kv_lora_rank", 1, 1 << 16},      {"q_lora_rank", 1, 1 << 16},        {"qk_nope_head_dim", 1, 4096},
    {"qk_rope_head_dim", 2, 4096},     {"v_head_dim", 1, 4096},            {"qk_head_dim", 3, 8192},
    {"max_position_embeddings", 1, int64_t(1) << 30}, {"bos_token_id", 0, (1 << 22) - 1},
    {"eos_token_id", 0, (1 << 22) - 1},
};
}  // namespace

TEST_CASE("config.json: the fixture transformers wrote parses to the debug flavor") {
  auto c = Glm4MoeLiteConfig::from_hf_json(fixture_config(), "fixture");
  CHECK(c.to_hf_json() == flavors::debug().to_hf_json());
}

TEST_CASE("config.json: every integer field out of its sane range is refused, naming the field, value and range") {
  for (const auto& f : kIntFields) {
    const std::string field = f.name;
    CAPTURE(field);
    const std::string range = "[" + std::to_string(f.lo) + ", " + std::to_string(f.hi) + "]";
    auto with = [&](json v) {
      auto j = fixture_config();
      j[f.name] = v;
      return parse_error(j);
    };
    CHECK(with(f.hi + 1).find("field '" + std::string(f.name) + "': " + std::to_string(f.hi + 1) + " is outside " + range) !=
          std::string::npos);
    CHECK(with(f.lo - 1).find("field '" + std::string(f.name) + "': " + std::to_string(f.lo - 1) + " is outside " + range) !=
          std::string::npos);
    CHECK(with(std::numeric_limits<int64_t>::max()).find("'" + std::string(f.name) + "': 9223372036854775807 is outside") !=
          std::string::npos);
    CHECK(with(std::numeric_limits<int64_t>::min()).find("'" + std::string(f.name) + "': -9223372036854775808 is outside") !=
          std::string::npos);
    // Unsigned in the JSON: read as int64 it would wrap to -1.
    CHECK(with(std::numeric_limits<uint64_t>::max()).find("'" + std::string(f.name) + "': 18446744073709551615 is outside") !=
          std::string::npos);
  }
}

TEST_CASE("config.json: the issue's inputs, n_shared_experts = 2^63-1 and hidden_size = 2^31, are named") {
  auto j = fixture_config();
  j["n_shared_experts"] = (uint64_t(1) << 63) - 1;
  CHECK(parse_error(j) == "config.json (c.json): field 'n_shared_experts': 9223372036854775807 is outside [0, 64]");
  j = fixture_config();
  j["hidden_size"] = uint64_t(1) << 31;
  CHECK(parse_error(j) == "config.json (c.json): field 'hidden_size': 2147483648 is outside [1, 65536]");
  // As text, too (nlohmann parses both as unsigned).
  auto text = fixture_config().dump();
  auto at = text.find("\"hidden_size\":64");
  REQUIRE(at != std::string::npos);
  text.replace(at, 16, "\"hidden_size\":2147483648");
  CHECK(parse_error(json::parse(text)) == "config.json (c.json): field 'hidden_size': 2147483648 is outside [1, 65536]");
}

TEST_CASE("config.json: token ids must lie in the vocabulary, each eos id named") {
  auto j = fixture_config();
  j["eos_token_id"] = {1, 96};
  CHECK(parse_error(j).find("field 'eos_token_id': 96 is outside the vocabulary [0, 95]") != std::string::npos);
  j["eos_token_id"] = {1, uint64_t(1) << 40};
  CHECK(parse_error(j).find("field 'eos_token_id': 1099511627776 is outside") != std::string::npos);
  j["eos_token_id"] = {1, "two"};
  CHECK(parse_error(j).find("field 'eos_token_id': must be an integer, got \"two\"") != std::string::npos);
  j = fixture_config();
  j["bos_token_id"] = 200;
  CHECK(parse_error(j).find("field 'bos_token_id': 200 is outside the vocabulary [0, 95]") != std::string::npos);
}

TEST_CASE("config.json: a missing required field is refused by name, never filled with GLM-4.7-Flash's size") {
  for (const char* f : {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                        "v_head_dim"}) {
    const std::string field = f;
    CAPTURE(field);
    auto j = fixture_config();
    j.erase(f);
    CHECK(parse_error(j).find("field '" + std::string(f) + "': missing (required") != std::string::npos);
    if (std::string(f) != "q_lora_rank") {  // q_lora_rank null is a value: no q compression
      j[f] = nullptr;
      CHECK(parse_error(j).find("field '" + std::string(f) + "': missing (required") != std::string::npos);
    }
  }
}

TEST_CASE("config.json: an optional field left out takes transformers' default") {
  auto without = [](const char* f) {
    auto j = fixture_config();
    j.erase(f);
    return Glm4MoeLiteConfig::from_hf_json(j, "c.json");
  };
  CHECK(without("n_group").moe.n_group == 1);
  CHECK(without("topk_group").moe.topk_group == 1);
  CHECK(without("norm_topk_prob").moe.norm_topk_prob);
  CHECK(without("rms_norm_eps").rms_norm_eps == 1e-5);
  CHECK(without("rope_parameters").attention.rope_theta == 10000.0);
  CHECK(without("rope_interleave").attention.rope_interleave);
  CHECK(without("max_position_embeddings").max_position_embeddings == 202752);
  CHECK(without("mlp_layer_types").moe_layers == std::vector<bool>{false, true, true});  // first dense, then sparse
  CHECK(without("bos_token_id").bos_token_id == 0);
  CHECK(without("eos_token_id").eos_token_ids == std::vector<int64_t>{1});
  CHECK_FALSE(without("tie_word_embeddings").tie_word_embeddings);
  for (const char* f : {"architectures", "model_type", "num_key_value_heads", "qk_head_dim", "hidden_act", "attention_bias",
                        "dtype", "transformers_version", "use_cache", "pad_token_id"}) {
    const std::string field = f;
    CAPTURE(field);
    CHECK(without(f).to_hf_json() == flavors::debug().to_hf_json());
  }
}

TEST_CASE("config.json: non-finite and out-of-range real numbers are refused by name") {
  auto j = fixture_config();
  j["rms_norm_eps"] = std::numeric_limits<double>::infinity();
  CHECK(parse_error(j).find("field 'rms_norm_eps': must be a finite number") != std::string::npos);
  j["rms_norm_eps"] = 2.0;
  CHECK(parse_error(j).find("field 'rms_norm_eps': must be in (0, 1), got 2") != std::string::npos);
  j = fixture_config();
  j["routed_scaling_factor"] = -1.0;
  CHECK(parse_error(j).find("field 'routed_scaling_factor': must be a finite number > 0") != std::string::npos);
  j = fixture_config();
  j["rope_parameters"]["rope_theta"] = 0.0;
  CHECK(parse_error(j).find("field 'rope_theta': must be a finite number > 0") != std::string::npos);
}

TEST_CASE("config.json: range errors show a number as JSON writes it, not in %f") {
  auto j = fixture_config();
  j["routed_scaling_factor"] = -1e300;  // %f printed 301 digits
  const auto e = parse_error(j);
  CHECK(e.find("got -1e+300") != std::string::npos);
  CHECK(e.size() < 200);
  j = fixture_config();
  j["rms_norm_eps"] = -1.0;  // %f printed -1.000000
  CHECK(parse_error(j).find("must be in (0, 1), got -1.0") != std::string::npos);
}

TEST_CASE("check_same_config names each field two configs differ in, nested and either way, and passes what "
          "checkpoints of one model may hold otherwise") {
  namespace cj = kiln::model::config_json;
  const json in_use = {{"hidden_size", 64}, {"eos_token_id", 1}, {"max_position_embeddings", 128},
                       {"text_config", {{"rms_norm_eps", 1e-5}, {"pad_token_id", nullptr}}}};
  auto error = [&](const json& other) {
    try {
      cj::check_same_config(in_use, other, "c.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(the same)");
  };
  auto other = in_use;
  other["eos_token_id"] = json::array({1, 2});  // a fine-tune's end tokens, a longer context
  other["max_position_embeddings"] = 4096;
  other["text_config"]["pad_token_id"] = 0;
  other["quantization_config"] = {{"quant_method", "fp8"}};
  CHECK(error(other) == "(the same)");
  other["text_config"]["rms_norm_eps"] = 1e-6;  // nested: named by its path
  other["rope_scaling"] = {{"type", "yarn"}};   // only in the checkpoint: named too
  const auto e = error(other);
  CHECK(e.find("config.json (c.json) describes another model than the one in use") != std::string::npos);
  CHECK(e.find("'text_config.rms_norm_eps' 1e-06 (in use: 1e-05)") != std::string::npos);
  CHECK(e.find("'rope_scaling' {") != std::string::npos);
  CHECK(e.find("(in use: absent)") != std::string::npos);
  auto fewer = in_use;
  fewer.erase("hidden_size");  // only in the model in use
  CHECK(error(fewer).find("'hidden_size' absent (in use: 64)") != std::string::npos);
}

TEST_CASE("tied embeddings are refused by name, read from config.json or built in code") {
  auto j = fixture_config();
  j["tie_word_embeddings"] = true;
  CHECK(parse_error(j).find("field 'tie_word_embeddings': tied embeddings are not supported") != std::string::npos);
  auto c = flavors::debug();
  c.tie_word_embeddings = true;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("field 'tie_word_embeddings'"), std::invalid_argument);
}

TEST_CASE("a config built in code is range-checked by validate() like one read from config.json") {
  auto c = flavors::debug();
  c.hidden_size = int64_t(1) << 31;
  CHECK_THROWS_WITH_AS(c.validate(), "glm4_moe_lite config: field 'hidden_size': 2147483648 is outside [1, 65536]",
                       std::invalid_argument);
  c = flavors::debug();
  c.moe.n_shared_experts = std::numeric_limits<int64_t>::max();
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("field 'n_shared_experts': 9223372036854775807 is outside [0, 64]"),
                       std::invalid_argument);
  c = flavors::debug();
  c.attention.q_lora_rank = 0;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("field 'q_lora_rank': 0 is outside"), std::invalid_argument);
  c = flavors::debug();
  c.eos_token_ids = {c.vocab_size};
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("field 'eos_token_id'"), std::invalid_argument);
  for (const auto& name : flavors::names()) CHECK_NOTHROW(flavors::by_name(name).validate());
}

TEST_CASE("config.json: a deeply nested value is refused by name without recursing through it") {
  // The error message shows the value: dump() of 200,000 levels would overflow the stack.
  auto text = fixture_config().dump();
  auto at = text.find("\"hidden_size\":64");
  REQUIRE(at != std::string::npos);
  const std::size_t depth = 200000;
  text.replace(at, 16, "\"hidden_size\":" + std::string(depth, '[') + std::string(depth, ']'));
  CHECK(parse_error(json::parse(text)) == "config.json (c.json): field 'hidden_size': must be an integer, got a deeply nested array");
  auto j = fixture_config();
  j["architectures"] = json::array({std::string(1000, 'x')});
  CHECK(parse_error(j).find("... (1004 bytes), expected") != std::string::npos);  // long values are cut
}
