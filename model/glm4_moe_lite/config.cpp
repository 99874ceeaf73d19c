#include "model/glm4_moe_lite/config.hpp"

#include <cmath>
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

void Glm4MoeLiteConfig::validate() const {
  auto bad = [](const std::string& field, const std::string& why) {
    throw std::invalid_argument("glm4_moe_lite config: field '" + field + "': " + why);
  };
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) bad(field, "must be > 0, got " + std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", attention.num_heads);
  positive("kv_lora_rank", attention.kv_lora_rank);
  positive("qk_nope_head_dim", attention.qk_nope_head_dim);
  positive("v_head_dim", attention.v_head_dim);
  positive("n_routed_experts", moe.num_experts);
  positive("num_experts_per_tok", moe.top_k);
  positive("n_group", moe.n_group);
  positive("topk_group", moe.topk_group);
  positive("moe_intermediate_size", moe.expert_intermediate_size);
  if (attention.q_lora_rank && *attention.q_lora_rank <= 0) bad("q_lora_rank", "must be > 0 or null");
  if (attention.qk_rope_head_dim <= 0 || attention.qk_rope_head_dim % 2)
    bad("qk_rope_head_dim", "must be a positive even number, got " + std::to_string(attention.qk_rope_head_dim));
  if (!(attention.rope_theta > 0)) bad("rope_theta", "must be > 0");
  if (!(rms_norm_eps > 0)) bad("rms_norm_eps", "must be > 0");
  if (int64_t(moe_layers.size()) != num_hidden_layers)
    bad("mlp_layer_types", "has " + std::to_string(moe_layers.size()) + " entries for " +
                               std::to_string(num_hidden_layers) + " layers");
  if (moe.num_experts % moe.n_group)
    bad("n_group", std::to_string(moe.n_group) + " does not divide n_routed_experts " + std::to_string(moe.num_experts));
  if (moe.topk_group > moe.n_group)
    bad("topk_group", std::to_string(moe.topk_group) + " exceeds n_group " + std::to_string(moe.n_group));
  if (moe.n_group > 1 && moe.num_experts / moe.n_group < 2)
    bad("n_group", "group-limited routing scores each group by its top-2 experts: needs >= 2 experts per group");
  if (moe.top_k > moe.topk_group * (moe.num_experts / moe.n_group))
    bad("num_experts_per_tok", std::to_string(moe.top_k) + " exceeds the experts in the " +
                                   std::to_string(moe.topk_group) + " selected group(s)");
  if (moe.n_shared_experts < 0) bad("n_shared_experts", "must be >= 0");
  if (!(moe.routed_scaling_factor > 0)) bad("routed_scaling_factor", "must be > 0");
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
    "quantization_config", "use_qk_norm", "aux_loss_alpha", "seq_aux", "num_nextn_predict_layers"};

struct Reader {
  const json& j;
  std::string source;
  [[noreturn]] void bad(const std::string& field, const std::string& why) const {
    throw std::invalid_argument("config.json (" + source + "): field '" + field + "': " + why);
  }
  bool has(const char* f) const { return j.contains(f) && !j[f].is_null(); }
  int64_t integer(const char* f, std::optional<int64_t> fallback = std::nullopt) const {
    if (!has(f)) {
      if (fallback) return *fallback;
      bad(f, "is required");
    }
    if (!j[f].is_number_integer()) bad(f, "must be an integer, got " + j[f].dump());
    return j[f].get<int64_t>();
  }
  double number(const char* f, std::optional<double> fallback = std::nullopt) const {
    if (!has(f)) {
      if (fallback) return *fallback;
      bad(f, "is required");
    }
    if (!j[f].is_number()) bad(f, "must be a number, got " + j[f].dump());
    return j[f].get<double>();
  }
  bool boolean(const char* f, bool fallback) const {
    if (!has(f)) return fallback;
    if (!j[f].is_boolean()) bad(f, "must be true or false, got " + j[f].dump());
    return j[f].get<bool>();
  }
  std::string string(const char* f, const std::string& fallback) const {
    if (!has(f)) return fallback;
    if (!j[f].is_string()) bad(f, "must be a string, got " + j[f].dump());
    return j[f].get<std::string>();
  }
};
}  // namespace

Glm4MoeLiteConfig Glm4MoeLiteConfig::from_hf_json(const json& j, const std::string& source) {
  Reader r{j, source};
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
    if (!ok) r.bad("architectures", "is " + arch.dump() + ", expected [\"Glm4MoeLiteForCausalLM\"]");
  }
  if (r.has("model_type") && r.string("model_type", "") != "glm4_moe_lite")
    r.bad("model_type", "is '" + r.string("model_type", "") + "', expected 'glm4_moe_lite'");

  Glm4MoeLiteConfig c;
  c.vocab_size = r.integer("vocab_size", 154880);
  c.hidden_size = r.integer("hidden_size", 2048);
  c.intermediate_size = r.integer("intermediate_size", 10240);
  c.num_hidden_layers = r.integer("num_hidden_layers", 47);
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-5);
  c.max_position_embeddings = r.integer("max_position_embeddings", 202752);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (c.tie_word_embeddings) r.bad("tie_word_embeddings", "tied embeddings are not supported (GLM-4.7-Flash unties them)");
  c.bos_token_id = r.integer("bos_token_id", 0);
  if (r.has("eos_token_id")) {
    const auto& e = j["eos_token_id"];
    c.eos_token_ids.clear();
    if (e.is_number_integer()) c.eos_token_ids.push_back(e.get<int64_t>());
    else if (e.is_array()) {
      for (const auto& x : e) {
        if (!x.is_number_integer()) r.bad("eos_token_id", "must hold integers, got " + e.dump());
        c.eos_token_ids.push_back(x.get<int64_t>());
      }
    } else r.bad("eos_token_id", "must be an integer or a list of integers");
  }

  auto& a = c.attention;
  a.num_heads = r.integer("num_attention_heads", 20);
  if (r.has("num_key_value_heads") && r.integer("num_key_value_heads") != a.num_heads)
    r.bad("num_key_value_heads", "MLA expands keys and values per head: must equal num_attention_heads (" +
                                     std::to_string(a.num_heads) + "), got " + std::to_string(r.integer("num_key_value_heads")));
  if (j.contains("q_lora_rank") && j["q_lora_rank"].is_null()) a.q_lora_rank = std::nullopt;
  else a.q_lora_rank = r.integer("q_lora_rank", 768);
  a.kv_lora_rank = r.integer("kv_lora_rank", 512);
  a.qk_nope_head_dim = r.integer("qk_nope_head_dim", 192);
  a.qk_rope_head_dim = r.integer("qk_rope_head_dim", 64);
  a.v_head_dim = r.integer("v_head_dim", 256);
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
    Reader rr{rp, source};
    rope_type = rr.string("rope_type", rr.string("type", "default"));
    theta = rr.number("rope_theta", r.number("rope_theta", 10000.0));
    if (rr.has("partial_rotary_factor") && rr.number("partial_rotary_factor") != 1.0)
      r.bad("rope_parameters.partial_rotary_factor", "only 1.0 is supported");
  } else {
    theta = r.number("rope_theta", 10000.0);
    if (r.has("rope_scaling")) {
      const auto& rs = j["rope_scaling"];
      Reader rr{rs, source};
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
  if (r.string("scoring_func", "sigmoid") != "sigmoid") r.bad("scoring_func", "only 'sigmoid' routing is supported");
  if (r.string("topk_method", "noaux_tc") != "noaux_tc") r.bad("topk_method", "only 'noaux_tc' is supported");

  auto& m = c.moe;
  m.num_experts = r.integer("n_routed_experts", 64);
  m.top_k = r.integer("num_experts_per_tok", 4);
  m.n_group = r.integer("n_group", 1);
  m.topk_group = r.integer("topk_group", 1);
  m.expert_intermediate_size = r.integer("moe_intermediate_size", 1536);
  m.n_shared_experts = r.integer("n_shared_experts", 1);
  m.norm_topk_prob = r.boolean("norm_topk_prob", true);
  m.routed_scaling_factor = r.number("routed_scaling_factor", 1.8);

  c.moe_layers.clear();
  if (r.has("mlp_layer_types")) {
    const auto& t = j["mlp_layer_types"];
    if (!t.is_array()) r.bad("mlp_layer_types", "must be a list of 'dense' | 'sparse'");
    for (const auto& x : t) {
      if (!x.is_string() || (x != "dense" && x != "sparse"))
        r.bad("mlp_layer_types", "entries must be 'dense' or 'sparse', got " + x.dump());
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
  j["moe_intermediate_size"] = moe.expert_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = attention.num_heads;
  j["num_key_value_heads"] = attention.num_heads;
  j["n_shared_experts"] = moe.n_shared_experts;
  j["n_routed_experts"] = moe.num_experts;
  j["routed_scaling_factor"] = moe.routed_scaling_factor;
  j["kv_lora_rank"] = attention.kv_lora_rank;
  j["q_lora_rank"] = attention.q_lora_rank ? json(*attention.q_lora_rank) : json(nullptr);
  j["qk_rope_head_dim"] = attention.qk_rope_head_dim;
  j["v_head_dim"] = attention.v_head_dim;
  j["qk_nope_head_dim"] = attention.qk_nope_head_dim;
  j["n_group"] = moe.n_group;
  j["topk_group"] = moe.topk_group;
  j["num_experts_per_tok"] = moe.top_k;
  j["norm_topk_prob"] = moe.norm_topk_prob;
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
