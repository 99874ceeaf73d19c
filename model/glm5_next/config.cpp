#include "model/glm5_next/config.hpp"

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "model/config_json.hpp"

namespace kiln::model::glm5_next {

using config_json::IntRanges;
using nlohmann::json;

double AttentionConfig::softmax_scale() const { return 1.0 / std::sqrt(double(qk_nope_head_dim)); }

int64_t Glm5NextConfig::num_moe_layers() const {
  int64_t n = 0;
  for (bool m : moe_layers) n += m;
  return n;
}

namespace {
// Sane ranges of the integer fields, by HF name: the shared ones (config_json.hpp says why these
// bounds) and this family's: NoPE dims, KDA, indexer, mHC, MTP, FP8 block.
const IntRanges& int_ranges() {
  static const IntRanges r = config_json::with_ranges(config_json::common_int_ranges(), {
      {"qk_rope_head_dim", {0, 4096}},
      {"qk_head_dim", {1, 8192}},
      {"head_dim", {0, 4096}},
      {"pad_token_id", {0, (1 << 22) - 1}},
      {"linear_head_dim", {1, 4096}},
      {"linear_num_heads", {1, 1024}},
      {"linear_conv_kernel_dim", {1, 64}},
      {"index_topk", {1, 1 << 20}},
      {"index_head_dim", {1, 4096}},
      {"index_n_heads", {1, 1024}},
      {"index_kpool", {1, 4096}},
      {"index_topk_freq", {1, 1024}},
      {"index_skip_topk_offset", {0, 1024}},
      {"hc_mult", {1, 64}},
      {"hc_sinkhorn_iters", {1, 1000}},
      {"num_nextn_predict_layers", {0, 16}},
      {"weight_block_size", {1, 1 << 16}},
  });
  return r;
}

[[noreturn]] void invalid(const std::string& field, const std::string& why) {
  throw std::invalid_argument("glm5_next config: field '" + field + "': " + why);
}

config_json::FieldReader reader(const json& j, const std::string& source, const std::string& prefix) {
  return config_json::FieldReader{
      j, source, int_ranges(),
      "it sets the model's sizes; transformers would silently take GLM-5.3-Flash's value", prefix};
}

// Fields transformers writes (or a raw checkpoint config carries) that the text model does not
// need, accepted and ignored, at either level.
const std::set<std::string> kIgnored = {
    "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range", "attention_dropout",
    "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "output_router_logits", "router_aux_loss_coef", "auto_map", "keys_to_ignore_at_inference"};
// The wrapper's own fields (Glm5NextConfig): the vision tower and its token ids.
const std::set<std::string> kWrapper = {
    "architectures", "model_type", "text_config", "vision_config", "image_token_id", "video_token_id",
    "image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id",
    "tie_word_embeddings", "quantization_config"};
// The text fields read below.
const std::set<std::string> kText = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "head_dim",
    "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "mlp_layer_types",
    "attention_bias", "index_topk", "index_head_dim", "index_n_heads", "layer_types", "indexer_types",
    "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "swiglu_limit", "linear_head_dim",
    "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "linear_attn_config", "hc_mult", "hc_eps",
    "hc_sinkhorn_iters", "index_kpool", "index_kpool_always_select_tail", "num_nextn_predict_layers", "model_type",
    "scoring_func", "topk_method"};

// A list of strings, each one of `allowed`.
std::vector<std::string> string_list(const config_json::FieldReader& r, const char* f, const std::set<std::string>& allowed) {
  const auto& v = r.j[f];
  std::string names;
  for (const auto& a : allowed) names += (names.empty() ? "'" : ", '") + a + "'";
  if (!v.is_array()) r.bad(f, "must be a list of " + names + ", got " + config_json::show(v));
  std::vector<std::string> out;
  for (const auto& x : v) {
    if (!x.is_string() || !allowed.count(x.get<std::string>()))
      r.bad(f, "entries must be one of " + names + ", got " + config_json::show(x));
    out.push_back(x.get<std::string>());
  }
  return out;
}

// The kda fields, with transformers' legacy `linear_attn_config` dict overriding them.
void read_kda(const config_json::FieldReader& r, KdaConfig& k) {
  k.num_heads = r.integer("linear_num_heads");
  k.head_dim = r.integer("linear_head_dim");
  k.conv_kernel = r.integer("linear_conv_kernel_dim", 4);
  if (!r.j.contains("linear_lower_bound")) k.lower_bound = -5.0;
  else if (r.j["linear_lower_bound"].is_null()) k.lower_bound = std::nullopt;  // softplus gate
  else k.lower_bound = r.number("linear_lower_bound");
  if (!r.has("linear_attn_config")) return;
  const auto& d = r.j["linear_attn_config"];
  if (!d.is_object()) r.bad("linear_attn_config", "must be an object, got " + config_json::show(d));
  auto rd = r.nested(d, r.prefix + "linear_attn_config.");
  static const std::set<std::string> kKeys = {"head_dim", "num_heads", "short_conv_kernel_size", "gate_lower_bound",
                                              "safe_gate", "kda_layers", "full_attn_layers"};
  for (auto it = d.begin(); it != d.end(); ++it)
    if (!kKeys.count(it.key())) rd.bad(it.key(), "is not a linear_attn_config field kiln knows");
  // The dict's names map onto the flat fields (and their ranges).
  auto int_as = [&](const char* key, const char* flat, int64_t fallback) {
    return rd.has(key) ? rd.integer_value(flat, d[key]) : fallback;
  };
  k.head_dim = int_as("head_dim", "linear_head_dim", k.head_dim);
  k.num_heads = int_as("num_heads", "linear_num_heads", k.num_heads);
  k.conv_kernel = int_as("short_conv_kernel_size", "linear_conv_kernel_dim", k.conv_kernel);
  if (rd.has("gate_lower_bound")) k.lower_bound = rd.number("gate_lower_bound");
  if (rd.boolean("safe_gate", true) && !k.lower_bound) k.lower_bound = -5.0;
}

// indexer_types as transformers' __post_init__ derives them when absent: a pattern string of
// F/S (index_topk_pattern), else "full" where max(i - offset + 1, 0) % freq == 0.
std::vector<IndexerType> read_indexer_types(const config_json::FieldReader& r, int64_t layers) {
  std::vector<IndexerType> out;
  if (r.has("indexer_types")) {
    for (const auto& s : string_list(r, "indexer_types", {"full", "shared"}))
      out.push_back(s == "full" ? IndexerType::full : IndexerType::shared);
    return out;
  }
  if (r.has("index_topk_pattern")) {
    const auto& p = r.j["index_topk_pattern"];
    if (p.is_string()) {
      for (char ch : p.get<std::string>()) {
        if (ch != 'F' && ch != 'S') r.bad("index_topk_pattern", "letters must be F or S, got " + config_json::show(p));
        out.push_back(ch == 'F' ? IndexerType::full : IndexerType::shared);
      }
    } else {
      for (const auto& s : string_list(r, "index_topk_pattern", {"full", "shared"}))
        out.push_back(s == "full" ? IndexerType::full : IndexerType::shared);
    }
    return out;
  }
  const int64_t freq = r.integer("index_topk_freq", 1), offset = r.integer("index_skip_topk_offset", 2);
  for (int64_t i = 0; i < layers; ++i)
    out.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? IndexerType::full : IndexerType::shared);
  return out;
}

void read_text(const config_json::FieldReader& r, Glm5NextConfig& c) {
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.intermediate_size = r.integer("intermediate_size");
  c.num_hidden_layers = r.integer("num_hidden_layers");
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-5);
  c.swiglu_limit = r.number("swiglu_limit", 10.0);
  c.max_position_embeddings = r.integer("max_position_embeddings", 1048576);
  c.num_nextn_predict_layers = r.integer("num_nextn_predict_layers", 0);
  c.tie_word_embeddings = c.tie_word_embeddings || r.boolean("tie_word_embeddings", false);
  c.bos_token_id = r.has("bos_token_id") ? std::optional(r.integer("bos_token_id")) : std::nullopt;
  c.pad_token_id = r.j.contains("pad_token_id") ? (r.has("pad_token_id") ? std::optional(r.integer("pad_token_id"))
                                                                          : std::nullopt)
                                                : std::optional<int64_t>(154820);
  c.eos_token_ids = r.integer_list("eos_token_id");
  if (r.string("hidden_act", "silu") != "silu") r.bad("hidden_act", "only 'silu' (SwiGLU) is supported");
  if (r.boolean("attention_bias", false)) r.bad("attention_bias", "biased attention projections are not supported");

  auto& a = c.attention;
  a.num_heads = r.integer("num_attention_heads");
  if (r.has("num_key_value_heads") && r.integer("num_key_value_heads") != a.num_heads)
    r.bad("num_key_value_heads", "MLA expands keys and values per head: must equal num_attention_heads (" +
                                     std::to_string(a.num_heads) + "), got " + std::to_string(r.integer("num_key_value_heads")));
  a.q_lora_rank = r.integer("q_lora_rank");  // null refused: the DSA indexer reads the compressed query
  a.kv_lora_rank = r.integer("kv_lora_rank");
  a.qk_nope_head_dim = r.integer("qk_nope_head_dim");
  a.v_head_dim = r.integer("v_head_dim");
  if (r.integer("qk_rope_head_dim", 0) != 0)
    r.bad("qk_rope_head_dim", "must be 0: GLM-5.3-Flash's sparse attention is NoPE (transformers refuses it too), got " +
                                  std::to_string(r.integer("qk_rope_head_dim")));
  if (r.has("qk_head_dim") && r.integer("qk_head_dim") != a.qk_nope_head_dim)
    r.bad("qk_head_dim", "is " + std::to_string(r.integer("qk_head_dim")) + " but qk_nope_head_dim + qk_rope_head_dim = " +
                             std::to_string(a.qk_nope_head_dim));
  if (r.has("head_dim") && r.integer("head_dim") != 0)
    r.bad("head_dim", "must be 0 (transformers sets it to qk_rope_head_dim), got " + std::to_string(r.integer("head_dim")));

  auto& x = c.indexer;
  x.n_heads = r.integer("index_n_heads");
  x.head_dim = r.integer("index_head_dim");
  x.topk = r.integer("index_topk");
  x.kpool = r.integer("index_kpool", 16);
  x.always_select_tail = r.boolean("index_kpool_always_select_tail", true);

  c.hc.streams = r.integer("hc_mult");
  c.hc.eps = r.number("hc_eps", 1e-6);
  c.hc.sinkhorn_iters = r.integer("hc_sinkhorn_iters", 20);

  read_kda(r, c.kda);
  c.moe = MoEConfig::from_hf_fields(r);

  // Per-layer schedules: given, or derived as transformers' __post_init__.
  c.layer_types.clear();
  if (r.has("layer_types")) {
    // transformers renames "full_attention" to "deepseek_sparse_attention".
    for (const auto& s : string_list(r, "layer_types", {"linear_attention", "deepseek_sparse_attention", "full_attention"}))
      c.layer_types.push_back(s == "linear_attention" ? LayerType::linear_attention : LayerType::sparse_attention);
  } else {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back(i % 4 != 3 ? LayerType::linear_attention : LayerType::sparse_attention);
  }
  c.indexer_types = read_indexer_types(r, c.num_hidden_layers);
  c.moe_layers.clear();
  if (r.has("mlp_layer_types")) {
    for (const auto& s : string_list(r, "mlp_layer_types", {"dense", "sparse"})) c.moe_layers.push_back(s == "sparse");
  } else {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.moe_layers.push_back(i >= 3);
  }
}

// quantization_config: FP8 e4m3 with block scales (the published checkpoint), or refused.
void read_quantization(const config_json::FieldReader& r, Glm5NextConfig& c) {
  if (!r.has("quantization_config")) return;
  const auto& q = r.j["quantization_config"];
  if (!q.is_object()) r.bad("quantization_config", "must be an object, got " + config_json::show(q));
  auto rq = r.nested(q, "quantization_config.");
  if (rq.string("quant_method", "") != "fp8")
    rq.bad("quant_method", "only 'fp8' (e4m3 weights with block scales) is supported, got " + config_json::show(q["quant_method"]));
  if (rq.string("fmt", "e4m3") != "e4m3") rq.bad("fmt", "only 'e4m3' is supported, got " + config_json::show(q["fmt"]));
  std::pair<int64_t, int64_t> block{128, 128};
  if (rq.has("weight_block_size")) {
    const auto& b = q["weight_block_size"];
    if (!b.is_array() || b.size() != 2) rq.bad("weight_block_size", "must be [rows, cols], got " + config_json::show(b));
    block = {rq.integer_value("weight_block_size", b[0]), rq.integer_value("weight_block_size", b[1])};
  }
  c.fp8_weight_block = block;
}
}  // namespace

void Glm5NextConfig::validate() const {
  auto in_range = [&](const std::string& field, int64_t v) {
    auto r = config_json::range_of(int_ranges(), field);
    if (v < r.lo || v > r.hi) invalid(field, std::to_string(v) + " is outside " + r.str());
  };
  in_range("vocab_size", vocab_size);
  in_range("hidden_size", hidden_size);
  in_range("intermediate_size", intermediate_size);
  in_range("num_hidden_layers", num_hidden_layers);
  in_range("max_position_embeddings", max_position_embeddings);
  in_range("num_nextn_predict_layers", num_nextn_predict_layers);
  in_range("num_attention_heads", attention.num_heads);
  in_range("q_lora_rank", attention.q_lora_rank);
  in_range("kv_lora_rank", attention.kv_lora_rank);
  in_range("qk_nope_head_dim", attention.qk_nope_head_dim);
  in_range("v_head_dim", attention.v_head_dim);
  in_range("linear_num_heads", kda.num_heads);
  in_range("linear_head_dim", kda.head_dim);
  in_range("linear_conv_kernel_dim", kda.conv_kernel);
  in_range("index_n_heads", indexer.n_heads);
  in_range("index_head_dim", indexer.head_dim);
  in_range("index_topk", indexer.topk);
  in_range("index_kpool", indexer.kpool);
  in_range("hc_mult", hc.streams);
  in_range("hc_sinkhorn_iters", hc.sinkhorn_iters);
  if (fp8_weight_block) {
    in_range("weight_block_size", fp8_weight_block->first);
    in_range("weight_block_size", fp8_weight_block->second);
  }
  config_json::check_token_ids("eos_token_id", eos_token_ids, vocab_size, invalid);
  if (bos_token_id) config_json::check_token_ids("bos_token_id", {*bos_token_id}, vocab_size, invalid);
  if (pad_token_id) config_json::check_token_ids("pad_token_id", {*pad_token_id}, vocab_size, invalid);
  if (tie_word_embeddings)
    invalid("tie_word_embeddings", "tied embeddings are not supported: kiln builds a separate lm_head (GLM-5.3-Flash unties them)");
  if (!(rms_norm_eps > 0 && rms_norm_eps < 1)) invalid("rms_norm_eps", "must be in (0, 1), got " + config_json::show(nlohmann::json(rms_norm_eps)));
  if (!(std::isfinite(swiglu_limit) && swiglu_limit > 0))
    invalid("swiglu_limit", "must be a finite number > 0, got " + config_json::show(nlohmann::json(swiglu_limit)));
  if (!(hc.eps >= 0 && hc.eps < 1)) invalid("hc_eps", "must be in [0, 1), got " + config_json::show(nlohmann::json(hc.eps)));
  if (kda.lower_bound && !(std::isfinite(*kda.lower_bound) && *kda.lower_bound < 0))
    invalid("linear_lower_bound", "must be a finite number < 0 (a log-space decay), got " + config_json::show(nlohmann::json(*kda.lower_bound)));
  if (indexer.topk % indexer.kpool)
    invalid("index_topk", std::to_string(indexer.topk) + " is not a multiple of index_kpool " + std::to_string(indexer.kpool));
  const auto L = std::size_t(num_hidden_layers);
  auto count = [&](const char* field, std::size_t n) {
    if (n != L) invalid(field, "has " + std::to_string(n) + " entries for " + std::to_string(L) + " layers");
  };
  count("layer_types", layer_types.size());
  count("indexer_types", indexer_types.size());
  count("mlp_layer_types", moe_layers.size());
  for (std::size_t i = 0; i < L; ++i) {
    if (layer_types[i] != LayerType::sparse_attention || indexer_types[i] != IndexerType::shared) continue;
    // transformers hands a full layer's selection to the next layer only (a linear layer
    // returns none), so a shared layer needs a full sparse layer right before it.
    if (i == 0 || layer_types[i - 1] != LayerType::sparse_attention || indexer_types[i - 1] != IndexerType::full)
      invalid("indexer_types", "layer " + std::to_string(i) +
                                   " is a shared sparse-attention layer but layer " + (i == 0 ? std::string("-1 does not exist") : std::to_string(i - 1) + " is not a sparse-attention layer with a full indexer"));
  }
  moe.validate(int_ranges(), invalid);
}

Glm5NextConfig Glm5NextConfig::from_hf_json(const json& j, const std::string& source) {
  auto root = reader(j, source, "");
  if (!j.is_object()) root.bad("(root)", "config.json must be a JSON object");
  const bool nested = root.has("text_config");
  if (nested && !j["text_config"].is_object()) root.bad("text_config", "must be an object, got " + config_json::show(j["text_config"]));
  const json& t = nested ? j["text_config"] : j;
  auto r = reader(t, source, nested ? "text_config." : "");
  // Another model's config (e.g. glm4_moe_lite's) is named by its type, before its fields.
  if (root.has("model_type") && root.string("model_type", "") != "glm5_next" && root.string("model_type", "") != "glm5_next_text")
    root.bad("model_type", "is '" + root.string("model_type", "") + "', expected 'glm5_next'");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!kWrapper.count(it.key()) && !kIgnored.count(it.key()) && !(!nested && kText.count(it.key())))
      root.bad(it.key(), "is not a glm5_next config field");
  if (nested)
    for (auto it = t.begin(); it != t.end(); ++it)
      if (!kText.count(it.key()) && !kIgnored.count(it.key())) r.bad(it.key(), "is not a glm5_next text config field");
  if (root.has("architectures")) {
    const auto& arch = j["architectures"];
    bool ok = arch.is_array();
    for (const auto& x : arch) ok = ok && x.is_string() && x == "Glm5NextForConditionalGeneration";
    if (!ok) root.bad("architectures", "is " + config_json::show(arch) + ", expected [\"Glm5NextForConditionalGeneration\"]");
  }
  if (nested && r.has("model_type") && r.string("model_type", "") != "glm5_next_text")
    r.bad("model_type", "is '" + r.string("model_type", "") + "', expected 'glm5_next_text'");

  Glm5NextConfig c;
  c.tie_word_embeddings = root.boolean("tie_word_embeddings", false);
  read_text(r, c);
  read_quantization(root, c);
  if (root.has("vision_config")) c.vision_config_json = j["vision_config"].dump();
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("config.json (" + source + "): " + e.what());
  }
  return c;
}

json Glm5NextConfig::to_hf_json() const {
  json t;
  t["model_type"] = "glm5_next_text";
  t["vocab_size"] = vocab_size;
  t["hidden_size"] = hidden_size;
  t["intermediate_size"] = intermediate_size;
  t["num_hidden_layers"] = num_hidden_layers;
  t["num_attention_heads"] = attention.num_heads;
  t["num_key_value_heads"] = attention.num_heads;
  moe.to_hf_fields(t);
  t["kv_lora_rank"] = attention.kv_lora_rank;
  t["q_lora_rank"] = attention.q_lora_rank;
  t["qk_rope_head_dim"] = 0;
  t["qk_nope_head_dim"] = attention.qk_nope_head_dim;
  t["v_head_dim"] = attention.v_head_dim;
  t["hidden_act"] = "silu";
  t["attention_bias"] = false;
  t["max_position_embeddings"] = max_position_embeddings;
  t["rms_norm_eps"] = rms_norm_eps;
  t["swiglu_limit"] = swiglu_limit;
  t["linear_head_dim"] = kda.head_dim;
  t["linear_num_heads"] = kda.num_heads;
  t["linear_conv_kernel_dim"] = kda.conv_kernel;
  t["linear_lower_bound"] = kda.lower_bound ? json(*kda.lower_bound) : json(nullptr);
  t["hc_mult"] = hc.streams;
  t["hc_eps"] = hc.eps;
  t["hc_sinkhorn_iters"] = hc.sinkhorn_iters;
  t["index_topk"] = indexer.topk;
  t["index_head_dim"] = indexer.head_dim;
  t["index_n_heads"] = indexer.n_heads;
  t["index_kpool"] = indexer.kpool;
  t["index_kpool_always_select_tail"] = indexer.always_select_tail;
  json lt = json::array(), it = json::array(), mt = json::array();
  for (auto x : layer_types) lt.push_back(x == LayerType::linear_attention ? "linear_attention" : "deepseek_sparse_attention");
  for (auto x : indexer_types) it.push_back(x == IndexerType::full ? "full" : "shared");
  for (bool s : moe_layers) mt.push_back(s ? "sparse" : "dense");
  t["layer_types"] = lt;
  t["indexer_types"] = it;
  t["mlp_layer_types"] = mt;
  if (num_nextn_predict_layers) t["num_nextn_predict_layers"] = num_nextn_predict_layers;
  t["tie_word_embeddings"] = false;
  t["bos_token_id"] = bos_token_id ? json(*bos_token_id) : json(nullptr);
  t["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  t["eos_token_id"] = eos_token_ids.empty() ? json(nullptr)
                      : eos_token_ids.size() == 1 ? json(eos_token_ids[0])
                                                  : json(eos_token_ids);
  json j;
  j["architectures"] = {"Glm5NextForConditionalGeneration"};
  j["model_type"] = "glm5_next";
  j["text_config"] = t;
  j["tie_word_embeddings"] = false;
  j["dtype"] = "float32";
  if (!vision_config_json.empty()) j["vision_config"] = json::parse(vision_config_json);
  if (fp8_weight_block)
    j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                                {"weight_block_size", {fp8_weight_block->first, fp8_weight_block->second}}};
  return j;
}

namespace flavors {

Glm5NextConfig glm53_flash() {
  Glm5NextConfig c;  // the member defaults are transformers 5.17's for zai-org/GLM-5.3-Flash
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    c.layer_types.push_back(i % 4 != 3 ? LayerType::linear_attention : LayerType::sparse_attention);
    c.indexer_types.push_back(IndexerType::full);
    c.moe_layers.push_back(i >= 3);
  }
  c.num_nextn_predict_layers = 1;
  c.fp8_weight_block = std::pair<int64_t, int64_t>{128, 128};
  c.validate();
  return c;
}

Glm5NextConfig glm53_flash_layers(int64_t layers) {
  auto c = glm53_flash();
  if (layers < 1 || layers > c.num_hidden_layers)
    invalid("num_hidden_layers", "a crop keeps 1.." + std::to_string(c.num_hidden_layers) + " layers, got " + std::to_string(layers));
  c.num_hidden_layers = layers;
  c.layer_types.resize(std::size_t(layers));
  c.indexer_types.resize(std::size_t(layers));
  c.moe_layers.resize(std::size_t(layers));
  c.fp8_weight_block.reset();  // crops are written in bf16
  c.validate();
  return c;
}

Glm5NextConfig debug() {
  Glm5NextConfig c;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 48;
  c.num_hidden_layers = 4;
  c.max_position_embeddings = 4096;
  c.swiglu_limit = 0.3;
  c.layer_types = {LayerType::linear_attention, LayerType::sparse_attention, LayerType::sparse_attention,
                   LayerType::linear_attention};
  c.indexer_types = {IndexerType::full, IndexerType::full, IndexerType::shared, IndexerType::full};
  c.moe_layers = {false, true, true, true};
  c.kda = KdaConfig{2, 16, 4, -5.0};
  c.attention = AttentionConfig{4, 32, 32, 16, 16};
  c.indexer = IndexerConfig{2, 16, 4, 2, true};
  c.hc = HyperConnectionConfig{4, 1e-6, 20};
  c.moe = MoEConfig{8, 2, 2, 1, 16, 1, true, 2.5};
  c.eos_token_ids = {1};
  c.bos_token_id = 0;
  c.pad_token_id = 95;
  c.validate();
  return c;
}

std::vector<std::string> names() { return {"glm53_flash", "glm53_flash_5l", "debug"}; }

Glm5NextConfig by_name(const std::string& name) {
  if (name == "glm53_flash") return glm53_flash();
  if (name == "glm53_flash_5l") return glm53_flash_layers(5);
  if (name == "debug") return debug();
  std::string known;
  for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("glm5_next has no flavor '" + name + "' (flavors: " + known + ")");
}

}  // namespace flavors
}  // namespace kiln::model::glm5_next
