// glm5_next config.json reader and Glm5NextConfig::validate (torch-free). The base input is the
// fixture's config.json, written by transformers 5.17.0 (tests/fixtures/make_glm5_next_fixture.py).
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "model/glm5_next/config.hpp"

using kiln::model::glm5_next::Glm5NextConfig;
using kiln::model::glm5_next::IndexerType;
using kiln::model::glm5_next::LayerType;
namespace flavors = kiln::model::glm5_next::flavors;
using nlohmann::json;

namespace {
json fixture_config() {
  std::ifstream in(std::string(KILN_FIXTURES_DIR) + "/glm5_next_tiny/config.json");
  REQUIRE(in);
  return json::parse(in);
}

std::string parse_error(const json& j) {
  try {
    Glm5NextConfig::from_hf_json(j, "dir/config.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(parsed without error)";
}
}  // namespace

TEST_CASE("glm5_next config.json: the fixture transformers wrote parses to the debug flavor") {
  auto c = Glm5NextConfig::from_hf_json(fixture_config(), "fixture");
  auto written = c.to_hf_json();
  CHECK(written["vision_config"] == fixture_config()["vision_config"]);  // kept for transformers, unread
  written.erase("vision_config");
  CHECK(written == flavors::debug().to_hf_json());
  CHECK(c.layer_types[0] == LayerType::linear_attention);
  CHECK(c.layer_types[2] == LayerType::sparse_attention);
  CHECK(c.indexer_types[2] == IndexerType::shared);
  CHECK(c.kda.lower_bound == -5.0);
  CHECK(c.swiglu_limit == 0.3);
  CHECK(c.hc.streams == 4);
  CHECK(c.num_moe_layers() == 3);
  // and what it writes reads back the same
  CHECK(Glm5NextConfig::from_hf_json(c.to_hf_json(), "round trip").to_hf_json() == c.to_hf_json());
}

TEST_CASE("glm5_next config.json: the flat (text-only) form reads like the nested one") {
  json j = fixture_config();
  json flat = j["text_config"];
  flat["architectures"] = j["architectures"];
  flat["model_type"] = "glm5_next";
  flat.erase("vision_config");
  CHECK(Glm5NextConfig::from_hf_json(flat, "flat").to_hf_json() == flavors::debug().to_hf_json());
}

TEST_CASE("glm5_next config.json: a missing required field is refused by name, with the file") {
  for (const char* f : {"hidden_size", "vocab_size", "linear_num_heads", "linear_head_dim", "hc_mult", "index_topk",
                        "n_routed_experts", "q_lora_rank", "num_hidden_layers"}) {
    CAPTURE(f);
    json j = fixture_config();
    j["text_config"].erase(f);
    auto e = parse_error(j);
    CHECK(e.find("config.json (dir/config.json): field 'text_config." + std::string(f) + "': missing") == 0);
  }
}

TEST_CASE("glm5_next config.json: bad values are refused by name") {
  struct Case {
    const char* field;
    json value;
    const char* says;
  };
  const Case cases[] = {
      {"hidden_size", int64_t(1) << 31, "text_config.hidden_size': 2147483648 is outside [1, 65536]"},
      {"layer_types", json::array({"linear_attention", "mamba", "linear_attention", "linear_attention"}),
       "text_config.layer_types': entries must be one of"},
      {"layer_types", json::array({"linear_attention"}), "field 'layer_types': has 1 entries for 4 layers"},
      {"indexer_types", json::array({"full", "shared", "shared", "full"}),
       "layer 1 is a shared sparse-attention layer but layer 0 is not a sparse-attention layer with a full indexer"},
      {"indexer_types", json::array({"full", "full", "sometimes", "full"}), "text_config.indexer_types': entries"},
      {"qk_rope_head_dim", 64, "text_config.qk_rope_head_dim': must be 0"},
      {"swiglu_limit", -1.0, "field 'swiglu_limit': must be a finite number > 0"},
      {"swiglu_limit", "big", "text_config.swiglu_limit': must be a number"},
      {"linear_lower_bound", 2.0, "field 'linear_lower_bound': must be a finite number < 0"},
      {"index_topk", 5, "field 'index_topk': 5 is not a multiple of index_kpool 2"},
      {"hc_mult", 0, "text_config.hc_mult': 0 is outside [1, 64]"},
      {"hc_eps", 1.5, "field 'hc_eps': must be in [0, 1)"},
      {"num_nextn_predict_layers", 99, "text_config.num_nextn_predict_layers': 99 is outside [0, 16]"},
      {"num_key_value_heads", 2, "text_config.num_key_value_heads': MLA expands"},
      {"q_lora_rank", nullptr, "text_config.q_lora_rank': missing"},
      {"mlp_layer_types", json::array({"dense", "sparse", "sparse"}), "field 'mlp_layer_types': has 3 entries"},
      {"eos_token_id", 96, "field 'eos_token_id': 96 is outside the vocabulary [0, 95]"},
      {"n_group", 3, "field 'n_group': 3 does not divide n_routed_experts 8"},
      {"made_up_field", 1, "text_config.made_up_field': is not a glm5_next text config field"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.field);
    json j = fixture_config();
    j["text_config"][c.field] = c.value;
    auto e = parse_error(j);
    CAPTURE(e);
    CHECK(e.find("config.json (dir/config.json): ") == 0);
    CHECK(e.find(c.says) != std::string::npos);
  }
  json j = fixture_config();
  j["tie_word_embeddings"] = true;
  CHECK(parse_error(j).find("field 'tie_word_embeddings': tied embeddings are not supported") != std::string::npos);
  j = fixture_config();
  j["architectures"] = {"Glm4MoeLiteForCausalLM"};
  CHECK(parse_error(j).find("field 'architectures'") != std::string::npos);
  j = fixture_config();
  j["quantization_config"] = {{"quant_method", "awq"}};
  CHECK(parse_error(j).find("field 'quantization_config.quant_method': only 'fp8'") != std::string::npos);
}

TEST_CASE("glm5_next config.json: optional fields take transformers' defaults and schedules") {
  json j = fixture_config();
  auto& t = j["text_config"];
  for (const char* f : {"layer_types", "indexer_types", "mlp_layer_types", "swiglu_limit", "hc_eps", "hc_sinkhorn_iters",
                        "linear_conv_kernel_dim", "linear_lower_bound", "index_kpool", "rms_norm_eps"})
    t.erase(f);
  t["num_hidden_layers"] = 8;
  t["index_topk"] = 16;  // a multiple of the default kpool 16
  auto c = Glm5NextConfig::from_hf_json(j, "defaults");
  // layer i is linear unless i % 4 == 3; the first three MLPs dense; every indexer full.
  for (int64_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    CHECK((c.layer_types[std::size_t(i)] == LayerType::sparse_attention) == (i % 4 == 3));
    CHECK(c.moe_layers[std::size_t(i)] == (i >= 3));
    CHECK(c.indexer_types[std::size_t(i)] == IndexerType::full);
  }
  CHECK(c.swiglu_limit == 10.0);
  CHECK(c.hc.eps == 1e-6);
  CHECK(c.hc.sinkhorn_iters == 20);
  CHECK(c.kda.conv_kernel == 4);
  CHECK(c.kda.lower_bound == -5.0);
  CHECK(c.indexer.kpool == 16);
  CHECK(c.rms_norm_eps == 1e-5);
  // linear_lower_bound: null is the softplus gate; the legacy linear_attn_config dict overrides.
  t["linear_lower_bound"] = nullptr;
  CHECK_FALSE(Glm5NextConfig::from_hf_json(j, "softplus").kda.lower_bound.has_value());
  t["linear_attn_config"] = {{"num_heads", 4}, {"head_dim", 8}, {"short_conv_kernel_size", 3}, {"safe_gate", true}};
  auto d = Glm5NextConfig::from_hf_json(j, "dict");
  CHECK(d.kda.num_heads == 4);
  CHECK(d.kda.head_dim == 8);
  CHECK(d.kda.conv_kernel == 3);
  CHECK(d.kda.lower_bound == -5.0);  // safe_gate with no bound: -5
  // index_topk_pattern "FFSF..." sets indexer_types when they are absent.
  t.erase("linear_attn_config");
  t["layer_types"] = json::array({"linear_attention", "full_attention", "full_attention", "linear_attention",
                                  "linear_attention", "linear_attention", "linear_attention", "linear_attention"});
  t["index_topk_pattern"] = "FFSFFFFF";
  auto p = Glm5NextConfig::from_hf_json(j, "pattern");
  CHECK(p.layer_types[1] == LayerType::sparse_attention);  // "full_attention" is transformers' old name
  CHECK(p.indexer_types[2] == IndexerType::shared);
}

TEST_CASE("glm5_next flavors: the published size and its 5-layer crop and debug and the FP8 block size") {
  auto f = flavors::glm53_flash();
  CHECK(f.num_hidden_layers == 45);
  CHECK(f.moe.num_experts == 288);
  CHECK(f.num_nextn_predict_layers == 1);
  CHECK(f.layer_types[3] == LayerType::sparse_attention);
  CHECK(f.layer_types[4] == LayerType::linear_attention);
  CHECK(f.kda.qkv_dim() == 8192);
  CHECK(f.fp8_weight_block == std::pair<int64_t, int64_t>{128, 128});
  auto crop = flavors::by_name("glm53_flash_5l");
  CHECK(crop.num_hidden_layers == 5);
  CHECK(crop.layer_types.size() == 5);
  CHECK(crop.num_nextn_predict_layers == 1);
  CHECK_FALSE(crop.fp8_weight_block.has_value());
  CHECK_THROWS_WITH_AS(flavors::by_name("huge"), doctest::Contains("glm53_flash, glm53_flash_5l, debug"),
                       std::invalid_argument);
  // the published flavor's config.json reads back to itself, FP8 block included
  auto back = Glm5NextConfig::from_hf_json(f.to_hf_json(), "published");
  CHECK(back.to_hf_json() == f.to_hf_json());
  json j = f.to_hf_json();
  j["quantization_config"]["weight_block_size"] = {128, 64};
  CHECK(Glm5NextConfig::from_hf_json(j, "q").fp8_weight_block == std::pair<int64_t, int64_t>{128, 64});
}
