#pragma once
// GLM-5.3-Flash configuration (transformers 5.17 `Glm5NextTextConfig` under `Glm5NextConfig`,
// model_type "glm5_next"): a hybrid of Kimi Delta Attention (linear) layers and NoPE
// multi-latent attention layers with DeepSeek sparse attention (KPool indexer), manifold-
// constrained hyper-connections between layers, clamped SwiGLU experts and dense MLPs, and a
// multi-token-prediction layer stored after the main layers. A tree of small structs, flavors
// as named functions. No LibTorch.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/moe_config.hpp"

namespace kiln::model::glm5_next {

/// Kimi Delta Attention (Kimi Linear, arXiv:2510.26692; transformers'
/// Glm5NextTextLinearAttention). Keys, queries and values have num_heads heads of head_dim.
struct KdaConfig {
  int64_t num_heads = 64;     ///< linear_num_heads
  int64_t head_dim = 128;     ///< linear_head_dim (keys and values alike)
  int64_t conv_kernel = 4;    ///< linear_conv_kernel_dim: causal depthwise short convolution width
  /// linear_lower_bound: the forget gate is lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
  /// (log-space decay in (lower_bound, 0)); nullopt: -exp(A_log) * softplus(f + dt_bias).
  std::optional<double> lower_bound = -5.0;
  int64_t qkv_dim() const { return num_heads * head_dim; }
};

/// NoPE multi-latent attention of the sparse layers (DeepSeek-V2 §2.1 without the rotary part:
/// qk_rope_head_dim is 0, so no position enters attention at all).
struct AttentionConfig {
  int64_t num_heads = 64;
  int64_t q_lora_rank = 1536;  ///< required by DSA: the indexer reads the compressed query
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 256;
  int64_t v_head_dim = 256;
  /// Softmax scale 1/sqrt(qk_nope_head_dim).
  double softmax_scale() const;
};

/// DeepSeek sparse attention's indexer with KPool compression (transformers'
/// Glm5NextTextIndexer): keys pooled in groups of kpool tokens, top-k pools (topk / kpool of
/// them) expanded to token positions, plus the unfinished tail pool when always_select_tail.
struct IndexerConfig {
  int64_t n_heads = 32;     ///< index_n_heads
  int64_t head_dim = 128;   ///< index_head_dim
  int64_t topk = 2048;      ///< index_topk (tokens), a multiple of kpool
  int64_t kpool = 16;       ///< index_kpool
  bool always_select_tail = true;  ///< index_kpool_always_select_tail
};

/// Manifold-constrained hyper-connections (mHC; transformers' Glm5NextTextHyperConnection):
/// `streams` residual streams; per site, pre/post/combination weights from the RMS-normalised
/// streams (normalised with the model's rms_norm_eps), the combination matrix projected onto
/// the doubly stochastic matrices by sinkhorn_iters Sinkhorn-Knopp steps with floor eps.
struct HyperConnectionConfig {
  int64_t streams = 4;         ///< hc_mult
  double eps = 1e-6;           ///< hc_eps: Sinkhorn floor and the floor added to `pre`
  int64_t sinkhorn_iters = 20; ///< hc_sinkhorn_iters
};

enum class LayerType { linear_attention, sparse_attention };  ///< HF "linear_attention" | "deepseek_sparse_attention"
enum class IndexerType { full, shared };  ///< HF "full" (runs the indexer) | "shared" (reuses the previous layer's)

struct Glm5NextConfig {
  int64_t vocab_size = 154880;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 12288;  ///< dense MLP layers
  int64_t num_hidden_layers = 45;
  double rms_norm_eps = 1e-5;
  /// SwiGLU clamp (experts, shared experts, dense MLPs): gate clamped to <= limit, up to
  /// [-limit, limit], before silu(gate) * up.
  double swiglu_limit = 10.0;
  int64_t max_position_embeddings = 1048576;
  /// Multi-token-prediction layers stored after the main ones (HF key prefix
  /// layers.{num_hidden_layers}); num_nextn_predict_layers, 0 when absent.
  int64_t num_nextn_predict_layers = 0;
  bool tie_word_embeddings = false;  ///< true is refused by validate()
  std::vector<LayerType> layer_types;      ///< per layer (HF layer_types)
  std::vector<IndexerType> indexer_types;  ///< per layer (HF indexer_types; read on sparse layers)
  std::vector<bool> moe_layers;            ///< per layer: true = sparse (MoE); HF mlp_layer_types
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id = 154820;
  /// FP8 checkpoint: the block of one weight scale, [rows, cols] (quantization_config
  /// weight_block_size); nullopt for a bf16/fp32 checkpoint.
  std::optional<std::pair<int64_t, int64_t>> fp8_weight_block;
  /// The checkpoint's vision_config as read (JSON text; kiln does not use it), written back by
  /// to_hf_json so that transformers rebuilds the same tower; empty when absent.
  std::string vision_config_json;
  KdaConfig kda;
  AttentionConfig attention;
  IndexerConfig indexer;
  HyperConnectionConfig hc;
  MoEConfig moe{288, 8, 1, 1, 2048, 1, true, 2.5};

  int64_t num_moe_layers() const;
  /// Checks every integer field against its sane range (the table in config.cpp), the
  /// per-layer lists' lengths, that a shared indexer layer directly follows a sparse layer
  /// with a full indexer (transformers hands the selection only to the next layer), index_topk
  /// a multiple of index_kpool, token ids in the vocabulary; refuses tie_word_embeddings.
  /// Throws std::invalid_argument "glm5_next config: field 'x': ..." (HF's name).
  void validate() const;
  /// Parses an HF config.json of model_type glm5_next: the text fields nested under
  /// text_config (or flat at the top level, as transformers also accepts); vision_config is
  /// accepted and not read (kiln is text-only). Unknown fields, unsupported, out-of-range or
  /// contradictory values and missing required fields are refused: std::invalid_argument
  /// "config.json (SOURCE): field 'text_config.x': ...". Required: the fields whose
  /// transformers default is GLM-5.3-Flash's own size (README.md lists them); the others take
  /// transformers' default, per-layer lists derived as transformers' __post_init__ does.
  static Glm5NextConfig from_hf_json(const nlohmann::json& j, const std::string& source);
  /// An HF config.json (nested text_config; the vision_config read, if any) that transformers'
  /// Glm5NextConfig loads back to the same text model.
  nlohmann::json to_hf_json() const;
};

/// Named flavors.
namespace flavors {
/// GLM-5.3-Flash at transformers 5.17's defaults for zai-org/GLM-5.3-Flash (45 layers, every
/// fourth a sparse-attention layer, 288 experts, one MTP layer).
Glm5NextConfig glm53_flash();
/// The first `layers` layers of glm53_flash (same widths, MTP kept): the validation crop.
Glm5NextConfig glm53_flash_layers(int64_t layers);
/// Tiny, every path on (two KDA layers around a full and a shared sparse layer, dense first
/// MLP, 2 expert groups, 4 streams, a clamp that bites): the fixture's text config.
Glm5NextConfig debug();
std::vector<std::string> names();
/// Flavor by name ("glm53_flash", "glm53_flash_5l", "debug"); throws std::invalid_argument
/// listing the names.
Glm5NextConfig by_name(const std::string& name);
}  // namespace flavors

}  // namespace kiln::model::glm5_next
