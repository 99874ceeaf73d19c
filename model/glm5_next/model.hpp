#pragma once
// GLM-5.3-Flash's text model, single device (transformers 5.17's Glm5NextTextModel + lm_head):
// embeddings copied into S hyper-connection streams; per layer an attention site (mHC ->
// RMSNorm -> Kimi Delta Attention or sparse attention -> mHC expand) and an MLP site (mHC ->
// RMSNorm -> clamped SwiGLU or MoE -> mHC expand); the mean of the streams, final RMSNorm,
// untied lm_head. The MTP layer is not built. Not yet a CausalLM (no cached decoding for the
// rollout engine): the packed forward the parity tests check; loading and saving are in
// state_dict_adapter.hpp.
// Legend: T packed tokens, D hidden, S streams, V vocabulary, L MoE layers, K experts per token.
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "model/blocks/basic.hpp"
#include "model/blocks/moe.hpp"
#include "model/glm5_next/config.hpp"
#include "model/glm5_next/hyper_connection.hpp"
#include "model/glm5_next/kda.hpp"
#include "model/glm5_next/sparse_attention.hpp"

namespace kiln::model::glm5_next {

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const Glm5NextConfig& c, int64_t layer);
  /// streams: [T, S, D] -> [T, S, D]. topk: in, the selection this sparse layer uses instead
  /// of running its indexer (a shared layer's from the layer before; a replayed one), or
  /// undefined; out, this layer's selection if it is a sparse layer. replay_ids: [T, K] experts
  /// to use in a MoE layer (routing replay). expert_ids: [T, K] of a MoE layer, if asked.
  torch::Tensor forward(const torch::Tensor& streams, const torch::Tensor& cu_seqlens, torch::Tensor& topk,
                        const std::optional<torch::Tensor>& replay_ids, torch::Tensor* expert_ids);

  HyperConnection attn_hc{nullptr}, ffn_hc{nullptr};
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};  ///< HF input_layernorm, post_attention_layernorm
  KimiDeltaAttention kda{nullptr};                ///< linear-attention layers
  SparseAttention attn{nullptr};                  ///< sparse-attention layers
  SwiGLU mlp{nullptr};                            ///< dense layers
  MoE moe{nullptr};                               ///< sparse (MoE) layers
};
TORCH_MODULE(DecoderLayer);

struct Glm5NextForwardOptions {
  bool return_routed_experts = false;  ///< fill Glm5NextOutput::routed_experts
  bool return_topk_indices = false;    ///< fill Glm5NextOutput::topk_indices
  /// Routing replay: [T, L, K] int64 experts per MoE layer, used instead of the routers'
  /// choice (weights still from this model's router scores, so gradients reach the routers).
  std::optional<torch::Tensor> replay_routed_experts;
  /// Indexer replay: [T, Ls, W] int64 selections per sparse layer (positions within each
  /// document, -1 for none), used instead of the indexers' (e.g. the rollout's).
  std::optional<torch::Tensor> replay_topk_indices;
};

struct Glm5NextOutput {
  torch::Tensor hidden;          ///< [T, D] after the final norm
  torch::Tensor routed_experts;  ///< [T, L, K] int64 (descending biased score), if asked
  torch::Tensor topk_indices;    ///< [T, Ls, W] int64 per sparse layer (shared ones repeat it), if asked
};

class Glm5NextModelImpl : public torch::nn::Module {
 public:
  explicit Glm5NextModelImpl(const Glm5NextConfig& c);
  /// Packed forward; no state, window or attention crosses a document boundary. Throws
  /// std::invalid_argument for a malformed batch or replay tensor (shape named).
  Glm5NextOutput forward(const PackedBatch& batch, const Glm5NextForwardOptions& options = {});
  int64_t num_moe_layers() const { return c_.num_moe_layers(); }
  int64_t num_sparse_layers() const;
  /// Casts parameters to `dtype`, keeping in fp32 what transformers keeps there
  /// (_keep_in_fp32_modules_strict: the routers' e_score_correction_bias, KDA's conv weights,
  /// dt_bias and A_log).
  void to_dtype(torch::Dtype dtype);
  /// [T, V] logits.
  torch::Tensor logits(const Glm5NextOutput& out) { return lm_head(out.hidden); }
  const Glm5NextConfig& config() const { return c_; }

  torch::nn::Embedding embed{nullptr};  ///< [V, D]
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};   ///< [V, D]

 private:
  Glm5NextConfig c_;
};
TORCH_MODULE(Glm5NextModel);

}  // namespace kiln::model::glm5_next
