#include "model/glm4_moe_lite/config.hpp"

#include "model/config_json.hpp"

#include <cassert>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

namespace kiln::model::glm4_moe_lite {

using nlohmann::json;

double AttentionConfig::softmax_scale() const { return 1.0 / std::sqrt(double(qk_head_dim())); }

int64_t Glm4MoeLiteConfig::num_moe_layers() const {
  int64_t n = 0;
  for (bool m : moe_layers) n += m;
  return n;
}

namespace {
using config_json::IntRange;
using config_json::IntRanges;

// Sane ranges of the integer fields, by HF name: the shared ones (config_json.hpp says why
// these bounds) and this family's RoPE dims and legacy dense-layer count.
const IntRanges& int_ranges() {
  static const IntRanges r = config_json::with_ranges(config_json::common_int_ranges(), {
      {"qk_rope_head_dim", {2, 4096}},
      {"qk_head_dim", {3, 8192}},
      {"head_dim", {2, 4096}},
      {"first_k_dense_replace", {0, 1024}},
  });
  return r;
}

IntRange range_of(const std::string& field) { return config_json::range_of(int_ranges(), field); }
}  // namespace

void Glm4MoeLiteConfig::validate() const {
  auto bad = [](const std::string& field, const std::string& why) {
    throw std::invalid_argument("glm4_moe_lite config: field '" + field + "': " + why);
  };
  auto in_range = [&](const std::string& field, int64_t v) {
    auto r = range_of(field);
    if (v < r.lo || v > r.hi) bad(field, std::to_string(v) + " is outside " + r.str());
  };
  in_range("vocab_size", vocab_size);
  in_range("hidden_size", hidden_size);
  in_range("intermediate_size", intermediate_size);
  in_range("num_hidden_layers", num_hidden_layers);
  in_range("max_position_embeddings", max_position_embeddings);
  in_range("num_attention_heads", attention.num_heads);
  in_range("kv_lora_rank", attention.kv_lora_rank);
  if (attention.q_lora_rank) in_range("q_lora_rank", *attention.q_lora_rank);
  in_range("qk_nope_head_dim", attention.qk_nope_head_dim);
  in_range("qk_rope_head_dim", attention.qk_rope_head_dim);
  in_range("v_head_dim", attention.v_head_dim);
  moe.validate(int_ranges(), bad);
  config_json::check_token_ids("eos_token_id", eos_token_ids, vocab_size, bad);
  config_json::check_token_ids("bos_token_id", {bos_token_id}, vocab_size, bad);
  if (tie_word_embeddings)
    bad("tie_word_embeddings", "tied embeddings are not supported: kiln builds a separate lm_head (GLM-4.7-Flash unties them)");
  if (attention.qk_rope_head_dim % 2)
    bad("qk_rope_head_dim", "must be even (RoPE rotates pairs), got " + std::to_string(attention.qk_rope_head_dim));
  if (!(std::isfinite(attention.rope_theta) && attention.rope_theta > 0))
    bad("rope_theta", "must be a finite number > 0, got " + config_json::show(nlohmann::json(attention.rope_theta)));
  if (!(rms_norm_eps > 0 && rms_norm_eps < 1)) bad("rms_norm_eps", "must be in (0, 1), got " + config_json::show(nlohmann::json(rms_norm_eps)));
  if (int64_t(moe_layers.size()) != num_hidden_layers)
    bad("mlp_layer_types", "has " + std::to_string(moe_layers.size()) + " entries for " +
                               std::to_string(num_hidden_layers) + " layers");
}

namespace {
// Fields transformers writes (or older DeepSeek-style configs carry) that the architecture
// does not need, accepted and ignored.
const std::set<std::string> kIgnored = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
    "attention_dropout", "pad_token_id", "pretraining_tp", "model_type", "num_nextn_predict_layers",
    "qk_head_dim", "auto_map", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "tie_word_embeddings", "id2label", "label2id", "partial_rotary_factor", "head_dim", "ep_size",
    "moe_layer_freq", "first_k_dense_replace", "topk_method", "scoring_func", "rope_scaling", "rope_theta",
    "rope_parameters", "hidden_act", "attention_bias", "num_key_value_heads", "eos_token_id", "bos_token_id",
    "quantization_config", "use_qk_norm", "aux_loss_alpha", "seq_aux", "num_nextn_predict_layers",
    // transformers >= 5.24 writes it: whether forward returns the router logits (for an
    // auxiliary loss), not part of the model's math.
    "output_router_logits"};

using config_json::show;

// The shared field reader with this package's ranges and why a required field is required.
config_json::FieldReader reader(const json& j, const std::string& source) {
  return config_json::FieldReader{
      j, source, int_ranges(),
      "it sets the model's sizes or routing; transformers would silently take GLM-4.7-Flash's value"};
}
}  // namespace

Glm4MoeLiteConfig Glm4MoeLiteConfig::from_hf_json(const json& j, const std::string& source) {
  auto r = reader(j, source);
  if (!j.is_object()) r.bad("(root)", "config.json must be a JSON object");
  static const std::set<std::string> kUsed = {
      "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
      "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
      "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
      "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "rope_interleave",
      "mlp_layer_types"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!kUsed.count(it.key()) && !kIgnored.count(it.key())) r.bad(it.key(), "is not a glm4_moe_lite config field");
  if (r.has("architectures")) {
    const auto& arch = j["architectures"];
    bool ok = arch.is_array();
    for (const auto& x : arch) ok = ok && x.is_string() && x == "Glm4MoeLiteForCausalLM";
    if (!ok) r.bad("architectures", "is " + show(arch) + ", expected [\"Glm4MoeLiteForCausalLM\"]");
  }
  if (r.has("model_type") && r.string("model_type", "") != "glm4_moe_lite")
    r.bad("model_type", "is '" + r.string("model_type", "") + "', expected 'glm4_moe_lite'");

  Glm4MoeLiteConfig c;
  // Required: the fields whose transformers default is GLM-4.7-Flash's own size or routing
  // value. Optional (transformers' default): generic values, derived ones, and ids; README.md.
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.intermediate_size = r.integer("intermediate_size");
  c.num_hidden_layers = r.integer("num_hidden_layers");
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-5);
  c.max_position_embeddings = r.integer("max_position_embeddings", 202752);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);  // true is refused by validate()
  c.bos_token_id = r.integer("bos_token_id", 0);
  if (r.has("eos_token_id")) c.eos_token_ids = r.integer_list("eos_token_id");

  auto& a = c.attention;
  a.num_heads = r.integer("num_attention_heads");
  if (r.has("num_key_value_heads") && r.integer("num_key_value_heads") != a.num_heads)
    r.bad("num_key_value_heads", "MLA expands keys and values per head: must equal num_attention_heads (" +
                                     std::to_string(a.num_heads) + "), got " + std::to_string(r.integer("num_key_value_heads")));
  if (!j.contains("q_lora_rank")) r.missing("q_lora_rank");  // null (no q compression) is a value
  if (j["q_lora_rank"].is_null()) a.q_lora_rank = std::nullopt;
  else a.q_lora_rank = r.integer("q_lora_rank");
  a.kv_lora_rank = r.integer("kv_lora_rank");
  a.qk_nope_head_dim = r.integer("qk_nope_head_dim");
  a.qk_rope_head_dim = r.integer("qk_rope_head_dim");
  a.v_head_dim = r.integer("v_head_dim");
  a.rope_interleave = r.boolean("rope_interleave", true);
  if (r.has("qk_head_dim") && r.integer("qk_head_dim") != a.qk_head_dim())
    r.bad("qk_head_dim", "is " + std::to_string(r.integer("qk_head_dim")) + " but qk_nope_head_dim + qk_rope_head_dim = " +
                             std::to_string(a.qk_head_dim()));
  if (r.has("head_dim") && r.integer("head_dim") != a.qk_rope_head_dim)
    r.bad("head_dim", "must equal qk_rope_head_dim (" + std::to_string(a.qk_rope_head_dim) + ") in glm4_moe_lite");
  // RoPE: rope_parameters (transformers >= 5), else legacy rope_theta / rope_scaling.
  std::string rope_type = "default";
  double theta = 10000.0;
  if (r.has("rope_parameters")) {
    const auto& rp = j["rope_parameters"];
    if (!rp.is_object()) r.bad("rope_parameters", "must be an object");
    auto rr = r.nested(rp);
    rope_type = rr.string("rope_type", rr.string("type", "default"));
    theta = rr.number("rope_theta", r.number("rope_theta", 10000.0));
    if (rr.has("partial_rotary_factor") && rr.number("partial_rotary_factor") != 1.0)
      r.bad("rope_parameters.partial_rotary_factor", "only 1.0 is supported");
  } else {
    theta = r.number("rope_theta", 10000.0);
    if (r.has("rope_scaling")) {
      const auto& rs = j["rope_scaling"];
      auto rr = r.nested(rs);
      rope_type = rr.string("rope_type", rr.string("type", "default"));
    }
  }
  if (rope_type != "default")
    r.bad("rope_parameters.rope_type", "'" + rope_type + "' is not supported (GLM-4.7-Flash uses 'default', no YaRN)");
  a.rope_theta = theta;
  if (r.has("partial_rotary_factor") && r.number("partial_rotary_factor") != 1.0)
    r.bad("partial_rotary_factor", "only 1.0 is supported");
  if (r.string("hidden_act", "silu") != "silu") r.bad("hidden_act", "only 'silu' (SwiGLU) is supported");
  if (r.boolean("attention_bias", false)) r.bad("attention_bias", "biased attention projections are not supported");

  c.moe = MoEConfig::from_hf_fields(r);

  c.moe_layers.clear();
  if (r.has("mlp_layer_types")) {
    const auto& t = j["mlp_layer_types"];
    if (!t.is_array()) r.bad("mlp_layer_types", "must be a list of 'dense' | 'sparse'");
    for (const auto& x : t) {
      if (!x.is_string() || (x != "dense" && x != "sparse"))
        r.bad("mlp_layer_types", "entries must be 'dense' or 'sparse', got " + show(x));
      c.moe_layers.push_back(x == "sparse");
    }
  } else {
    int64_t dense = r.integer("first_k_dense_replace", 1);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.moe_layers.push_back(i >= dense);
  }
  if (r.has("first_k_dense_replace") && r.has("mlp_layer_types")) {
    int64_t dense = r.integer("first_k_dense_replace");
    for (int64_t i = 0; i < int64_t(c.moe_layers.size()); ++i)
      if (c.moe_layers[i] != (i >= dense))
        r.bad("first_k_dense_replace", std::to_string(dense) + " contradicts mlp_layer_types at layer " + std::to_string(i));
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("config.json (" + source + "): " + e.what());
  }
  return c;
}

json Glm4MoeLiteConfig::to_hf_json() const {
  json j;
  j["architectures"] = {"Glm4MoeLiteForCausalLM"};
  j["model_type"] = "glm4_moe_lite";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = attention.num_heads;
  j["num_key_value_heads"] = attention.num_heads;
  j["kv_lora_rank"] = attention.kv_lora_rank;
  j["q_lora_rank"] = attention.q_lora_rank ? json(*attention.q_lora_rank) : json(nullptr);
  j["qk_rope_head_dim"] = attention.qk_rope_head_dim;
  j["v_head_dim"] = attention.v_head_dim;
  j["qk_nope_head_dim"] = attention.qk_nope_head_dim;
  moe.to_hf_fields(j);
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = false;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", attention.rope_theta}};
  j["rope_interleave"] = attention.rope_interleave;
  json types = json::array();
  for (bool s : moe_layers) types.push_back(s ? "sparse" : "dense");
  j["mlp_layer_types"] = types;
  j["attention_bias"] = false;
  j["bos_token_id"] = bos_token_id;
  j["eos_token_id"] = eos_token_ids.size() == 1 ? json(eos_token_ids[0]) : json(eos_token_ids);
  j["dtype"] = "float32";
  return j;
}

namespace flavors {

Glm4MoeLiteConfig glm47_flash() {
  Glm4MoeLiteConfig c;  // the defaults are the published values
  c.moe_layers.assign(c.num_hidden_layers, true);
  c.moe_layers[0] = false;
  c.eos_token_ids = {154820, 154827, 154829};
  c.bos_token_id = 0;
  c.validate();
  return c;
}

Glm4MoeLiteConfig debug() {
  Glm4MoeLiteConfig c;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 48;
  c.num_hidden_layers = 3;
  c.max_position_embeddings = 4096;
  c.moe_layers = {false, true, true};
  c.attention = AttentionConfig{4, 32, 32, 16, 8, 16, 10000.0, true};
  c.moe = MoEConfig{8, 2, 2, 1, 16, 1, true, 1.8};
  c.eos_token_ids = {1};
  c.validate();
  return c;
}

Glm4MoeLiteConfig glm47_flash_layers(int64_t layers) {
  auto c = glm47_flash();
  c.num_hidden_layers = layers;
  c.moe_layers.assign(layers, true);
  c.moe_layers[0] = false;
  c.validate();
  return c;
}

std::vector<std::string> names() { return {"glm47_flash", "debug", "glm47_flash_4l", "glm47_flash_8l", "glm47_flash_16l"}; }

Glm4MoeLiteConfig by_name(const std::string& name) {
  if (name == "glm47_flash") return glm47_flash();
  if (name == "debug") return debug();
  if (name == "glm47_flash_4l") return glm47_flash_layers(4);
  if (name == "glm47_flash_8l") return glm47_flash_layers(8);
  if (name == "glm47_flash_16l") return glm47_flash_layers(16);
  std::string known;
  for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("glm4_moe_lite has no flavor '" + name + "' (flavors: " + known + ")");
}

}  // namespace flavors
}  // namespace kiln::model::glm4_moe_lite
