#pragma once
// GLM-4.7-Flash configuration (transformers `Glm4MoeLiteConfig`, model_type "glm4_moe_lite"):
// a DeepSeek-V3 layer at other sizes. A tree of small structs, flavors as named functions.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/moe_config.hpp"

namespace kiln::model::glm4_moe_lite {

/// Multi-head Latent Attention (DeepSeek-V2 §2.1). Dims per head unless noted.
struct AttentionConfig {
  int64_t num_heads = 20;
  std::optional<int64_t> q_lora_rank = 768;  ///< nullopt: q_proj directly from hidden
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 192;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 256;
  double rope_theta = 1e6;
  bool rope_interleave = true;  ///< rotate adjacent pairs (x0, x1), as DeepSeek/GLM checkpoints expect
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  /// Softmax scale 1/sqrt(qk_head_dim): rope_type "default" has no YaRN mscale.
  double softmax_scale() const;
};

using kiln::model::MoEConfig;

struct Glm4MoeLiteConfig {
  int64_t vocab_size = 154880;
  int64_t hidden_size = 2048;
  int64_t intermediate_size = 10240;  ///< dense SwiGLU layers
  int64_t num_hidden_layers = 47;
  double rms_norm_eps = 1e-5;
  int64_t max_position_embeddings = 202752;
  bool tie_word_embeddings = false;  ///< true is refused by validate(): kiln's lm_head is its own weight
  std::vector<bool> moe_layers;  ///< per layer: true = sparse (MoE), false = dense; mlp_layer_types
  std::vector<int64_t> eos_token_ids = {1};
  int64_t bos_token_id = 0;
  AttentionConfig attention;
  MoEConfig moe{64, 4, 1, 1, 1536, 1, true, 1.8};  ///< GLM-4.7-Flash's routing

  int64_t num_moe_layers() const;
  /// Checks every integer field against its sane range (hidden_size in [1, 65536], ...: the
  /// table in config.cpp), token ids against the vocabulary, and internal consistency; refuses
  /// tie_word_embeddings. Throws std::invalid_argument naming the field (HF's name) and value:
  /// "glm4_moe_lite config: field 'hidden_size': 2147483648 is outside [1, 65536]".
  void validate() const;
  /// Parses an HF config.json. Every field the architecture uses is read; fields HF writes
  /// but kiln does not need are accepted; unknown fields, unsupported, out-of-range or
  /// contradictory values, and missing required fields are rejected: std::invalid_argument
  /// "config.json (SOURCE): field 'x': ...". Required: the fields whose transformers default
  /// is GLM-4.7-Flash's own size or routing value (README.md lists them); the others take
  /// transformers' default when absent or null.
  static Glm4MoeLiteConfig from_hf_json(const nlohmann::json& j, const std::string& source);
  /// An HF config.json that transformers' Glm4MoeLiteConfig loads back to the same model.
  nlohmann::json to_hf_json() const;
};

/// Named flavors.
namespace flavors {
/// GLM-4.7-Flash as published (zai-org/GLM-4.7-Flash config.json).
Glm4MoeLiteConfig glm47_flash();
/// Tiny, every path on (q_lora, 2 expert groups, shared expert, dense first layer): tests.
Glm4MoeLiteConfig debug();
/// GLM-4.7-Flash widths with `layers` layers (GPU benchmarks that fit one GPU).
Glm4MoeLiteConfig glm47_flash_layers(int64_t layers);
/// Every flavor name `by_name` accepts.
std::vector<std::string> names();
/// Flavor by name ("glm47_flash", "debug", "glm47_flash_4l", "glm47_flash_8l",
/// "glm47_flash_16l"); throws std::invalid_argument listing the names.
Glm4MoeLiteConfig by_name(const std::string& name);
}  // namespace flavors

}  // namespace kiln::model::glm4_moe_lite
