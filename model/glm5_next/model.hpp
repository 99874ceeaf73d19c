#pragma once
// GLM-5.3-Flash's text model, single device (transformers 5.17's Glm5NextTextModel + lm_head),
// as a kiln::model::CausalLM (the trainer's and the registry's interface):
// embeddings copied into S hyper-connection streams; per layer an attention site (mHC ->
// RMSNorm -> Kimi Delta Attention or sparse attention -> mHC expand) and an MLP site (mHC ->
// RMSNorm -> clamped SwiGLU or MoE -> mHC expand); the mean of the streams, final RMSNorm,
// untied lm_head. With num_nextn_predict_layers > 0, the multi-token-prediction layers
// (mtp.hpp; HF layers.{num_hidden_layers + i}) are built too and run by mtp_forward only.
// Loading and saving go through state_dict_adapter.hpp.
//
// The KPool indexers are frozen: their parameters are built with requires_grad false and the
// indexer runs without gradient, so the RL loss never trains them (DeepSeek-V3.2 §2.1 trains
// the indexer with its own KL objective against dense attention, which kiln does not have);
// the trainer's AdamW skips a parameter without a gradient.
// Legend: T packed tokens, D hidden, S streams, V vocabulary, L MoE layers, K experts per token,
// Ls sparse-attention layers, W positions one sparse layer selects per query.
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "model/blocks/basic.hpp"
#include "model/blocks/moe.hpp"
#include "model/causal_lm.hpp"
#include "model/glm5_next/config.hpp"
#include "model/glm5_next/decode_cache.hpp"
#include "model/glm5_next/hyper_connection.hpp"
#include "model/glm5_next/kda.hpp"
#include "model/glm5_next/mtp.hpp"
#include "model/glm5_next/sparse_attention.hpp"

namespace kiln::model::glm5_next {

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const Glm5NextConfig& c, int64_t layer);
  /// Parameters the constructor registers for layer `layer` of `c`.
  static int64_t parameter_count(const Glm5NextConfig& c, int64_t layer);
  /// streams: [T, S, D] -> [T, S, D]. topk: in, the selection this sparse layer uses instead
  /// of running its indexer (a shared layer's from the layer before; a replayed one), or
  /// undefined; out, this layer's selection if it is a sparse layer. replay_ids: [T, K] experts
  /// to use in a MoE layer (routing replay). expert_ids: [T, K] of a MoE layer, if asked.
  torch::Tensor forward(const torch::Tensor& streams, const torch::Tensor& cu_seqlens, torch::Tensor& topk,
                        const std::optional<torch::Tensor>& replay_ids, torch::Tensor* expert_ids);
  /// Incremental step (KimiDeltaAttentionImpl / SparseAttentionImpl::forward_cached against this
  /// layer's part of the cache): streams [N, S, D] of the new tokens; topk and expert_ids as in
  /// forward (no replay).
  torch::Tensor forward_cached(const torch::Tensor& streams, const torch::Tensor& positions,
                               const std::vector<CachedSlice>& slices, const CachedLayout& layout,
                               Glm5NextDecodeCache::Layer& cache, torch::Tensor& topk, torch::Tensor* expert_ids);

  HyperConnection attn_hc{nullptr}, ffn_hc{nullptr};
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};  ///< HF input_layernorm, post_attention_layernorm
  KimiDeltaAttention kda{nullptr};                ///< linear-attention layers
  SparseAttention attn{nullptr};                  ///< sparse-attention layers
  SwiGLU mlp{nullptr};                            ///< dense layers
  MoE moe{nullptr};                               ///< sparse (MoE) layers

 private:
  // After the token mixer: its output `a` into the streams (weights w), then the MLP site.
  torch::Tensor finish(const HcWeights& w, const torch::Tensor& a, const torch::Tensor& streams,
                       const std::optional<torch::Tensor>& replay_ids, torch::Tensor* expert_ids);
};
TORCH_MODULE(DecoderLayer);

class Glm5NextModelImpl : public CausalLM {
 public:
  /// fp32 on CPU; the indexers' parameters frozen (requires_grad false). `random_init`: every
  /// matrix (embeddings, projections, router, grouped experts, mHC fn) drawn normal(0, 0.02)
  /// from torch's current RNG (transformers' initializer_range, as glm4_moe_lite's builder),
  /// the rest as the modules make it (norm weights and mHC scales 1, biases 0, KDA's conv
  /// uniform, the indexer's pooling gate 1); false: all as the modules make it (routed
  /// experts and routers zero), for a model whose weights are loaded next. Throws
  /// std::invalid_argument for a config that fails validate().
  explicit Glm5NextModelImpl(const Glm5NextConfig& c, bool random_init = false);
  /// Draws every matrix as `random_init` does, where the parameters are now (e.g. after to()
  /// and to_dtype(): a large model drawn on its GPU).
  void init_random_weights();
  /// Packed forward; no state, window or attention crosses a document boundary. Options:
  /// routing replay [T, L, K] and indexer replay [T, Ls, W] (positions within each document,
  /// -1 for none), returned ids as asked (ForwardOutput). Throws std::invalid_argument for a
  /// malformed batch or replay tensor (shape or value range named).
  ForwardOutput forward(const PackedBatch& batch, const ForwardOptions& options = {}) override;
  torch::Tensor lm_head_weight() override { return lm_head->weight; }
  int64_t num_moe_layers() const override { return c_.num_moe_layers(); }
  int64_t experts_per_token() const override { return c_.moe.top_k; }
  int64_t num_experts() const override { return c_.moe.num_experts; }
  int64_t num_sparse_layers() const override;
  /// W: positions one sparse layer selects per query (index_topk, + index_kpool - 1 with the tail).
  int64_t topk_width() const override;
  void load_hf_checkpoint(const std::string& dir) override;
  void save_hf_checkpoint(const std::string& dir, uint64_t max_shard_bytes) override;
  void load_hf_tensors(const std::vector<messaging::Tensor>& tensors) override;
  std::vector<messaging::Tensor> hf_state_dict() override;
  void save_hf_config(const std::string& dir) override;
  void check_hf_config(const std::string& dir) const override;
  /// A Glm5NextDecodeCache: KDA states in slots, sparse layers' latents and indexer key
  /// entries in pages.
  std::unique_ptr<DecodeCache> make_decode_cache(const DecodeCacheShape& shape,
                                                 const torch::TensorOptions& options) const override;
  int64_t decode_cache_bytes(const DecodeCacheShape& shape, torch::Dtype dtype) const override;
  /// Against a Glm5NextDecodeCache; every slice needs a slot. A slice with nothing cached is a
  /// prefill (its KDA layers take the chunked form, as forward); one with cached tokens
  /// continues (recurrent form); the sparse layers attend over the cached and new tokens with
  /// forward's math. With want_routing: routed_experts [N, L, K], topk_indices [N, Ls, W].
  ForwardOutput forward_cached(const torch::Tensor& ids, const torch::Tensor& positions,
                               const std::vector<CachedSlice>& slices, DecodeCache& cache,
                               bool want_routing) override;
  /// No effect: the sparse layers have no absorbed (latent-space) decode form.
  void set_absorbed_decode(bool) override {}
  /// No effect, as set_absorbed_decode.
  void set_decode_kernel(bool) override {}
  int64_t vocab_size() const override { return c_.vocab_size; }
  /// Casts parameters to `dtype`, keeping in fp32 what transformers keeps there
  /// (_keep_in_fp32_modules_strict: the routers' e_score_correction_bias, KDA's conv weights,
  /// dt_bias and A_log).
  void to_dtype(torch::Dtype dtype) override;
  /// The indexers' parameters (the MTP layers' too: frozen; never trained by the RL loss), in
  /// parameters() order.
  std::vector<torch::Tensor> indexer_parameters();
  int64_t mtp_layers() const override { return int64_t(mtp.size()); }
  /// Multi-token prediction (mtp.hpp) over `depths` logical depths, depth d on physical layer
  /// min(d, mtp_layers()) - 1 (GLM-5.3-Flash has one, shared by every depth). Depth d runs over
  /// the first n - d - 1 rows of each document of length n (row t takes token t+d's embedding
  /// and depth d-1's hidden at t, and predicts token t+d+1), so no depth reaches past its
  /// document; a document too short for a depth drops out of it, and the depths after the first
  /// with no rows are not returned. hidden: [T, D] forward's out.hidden for `batch`. Throws
  /// std::invalid_argument for a model without MTP layers, depths < 1 or a hidden of another shape.
  std::vector<MtpDepth> mtp_forward(const PackedBatch& batch, const torch::Tensor& hidden, int64_t depths) override;
  std::vector<torch::Tensor> mtp_parameters() override;
  const Glm5NextConfig& config() const { return c_; }

  torch::nn::Embedding embed{nullptr};  ///< [V, D]
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};   ///< [V, D]
  std::vector<MtpLayer> mtp;            ///< num_nextn_predict_layers of them, registered as "mtp"

 private:
  Glm5NextConfig c_;
};
TORCH_MODULE(Glm5NextModel);

/// Parameters of a Glm5NextModelImpl of config `c` (the main layers, embedding, head and MTP
/// layers; buffers not counted), from the config alone: what building one will allocate, 4 bytes
/// a parameter in fp32 (model::Registry's memory check).
int64_t parameter_count(const Glm5NextConfig& c);

}  // namespace kiln::model::glm5_next
