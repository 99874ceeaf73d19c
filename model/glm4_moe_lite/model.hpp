#pragma once
// GLM-4.7-Flash (transformers Glm4MoeLiteForCausalLM): embedding, decoder layers (MLA +
// dense SwiGLU or MoE, pre-norm residuals), final RMSNorm, untied lm_head.
// Internal parameter names (the state-dict adapter maps HF names onto them):
//   embed.weight, norm.weight, lm_head.weight,
//   layers.{i}.attn_norm.weight, layers.{i}.attn.{q_a,q_a_norm,q_b,q,kv_a,kv_a_norm,kv_b,o}.weight,
//   layers.{i}.mlp_norm.weight, layers.{i}.mlp.{gate,up,down}.weight (dense layers),
//   layers.{i}.moe.router.{weight,e_score_correction_bias}, layers.{i}.moe.experts.{w_gate_up_EFD,
//   w_down_EDF}, layers.{i}.moe.shared.{gate,up,down}.weight (MoE layers).
#include "model/blocks/mla.hpp"
#include "model/blocks/moe.hpp"
#include "model/causal_lm.hpp"
#include "model/glm4_moe_lite/config.hpp"

namespace kiln::model::glm4_moe_lite {

class DecoderLayerImpl : public torch::nn::Module {
 public:
  /// `experts`: the routed experts a MoE layer holds (MoEImpl).
  DecoderLayerImpl(const Glm4MoeLiteConfig& c, int64_t index, ExpertSlice experts = {});
  /// Parameters the constructor registers for layer `index` of `c` (`experts`' share of the routed experts).
  static int64_t parameter_count(const Glm4MoeLiteConfig& c, int64_t index, ExpertSlice experts = {});
  /// x: [T, D] -> [T, D]. cu_seqlens [B+1] (any device, int32/int64), max_seqlen its longest
  /// document (0: read off cu_seqlens), position_bound above every position (MLAImpl::forward).
  /// For MoE layers, replay/expert_ids_out as in MoEImpl::forward.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cu_seqlens,
                        int64_t max_seqlen, int64_t position_bound, const std::optional<torch::Tensor>& replay_ids_TK,
                        torch::Tensor* expert_ids_out);
  /// Incremental step (MLAImpl::forward_cached); expert ids as in forward().
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& positions, const CachedLayout& layout,
                               torch::Tensor& cache,
                               torch::Tensor* expert_ids_out);
  bool is_moe() const { return !moe.is_empty(); }
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  MLA attn{nullptr};
  SwiGLU mlp{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(DecoderLayer);

class Glm4MoeLiteModel : public CausalLM {
 public:
  /// Builds the model with weights drawn as transformers' _init_weights does (normal, std
  /// 0.02; norms 1; router bias 0) from torch's current RNG. fp32 on CPU. `experts`: only
  /// those routed experts are built (each MoE layer's grouped tensors [E/ranks, ...]); such a
  /// model loads HF weights (only its experts' tensors are read) and takes part in expert
  /// parallel over a group whose rank it is (set_expert_parallel). Throws
  /// std::invalid_argument for a config that fails validate() or a slice that does not split E.
  /// `random_init` false: the weights are left as the modules make them (mostly zeros), for a
  /// model whose every weight is loaded next (from_hf_dir: the normal draw of ~30e9 fp32
  /// values cost a minute per process at full size).
  explicit Glm4MoeLiteModel(Glm4MoeLiteConfig config, ExpertSlice experts = {}, bool random_init = true);
  const Glm4MoeLiteConfig& config() const { return config_; }

  ForwardOutput forward(const PackedBatch& batch, const ForwardOptions& options = {}) override;
  torch::Tensor lm_head_weight() override { return lm_head->weight; }
  int64_t num_moe_layers() const override { return config_.num_moe_layers(); }
  int64_t experts_per_token() const override { return config_.moe.top_k; }
  int64_t num_experts() const override { return config_.moe.num_experts; }
  void load_hf_checkpoint(const std::string& dir) override;
  /// With expert parallel: collective over the ep group, as hf_state_dict.
  void save_hf_checkpoint(const std::string& dir, uint64_t max_shard_bytes) override;
  void to_dtype(torch::Dtype dtype) override;
  void load_hf_tensors(const std::vector<messaging::Tensor>& tensors) override;
  std::map<std::string, torch::Tensor> hf_targets() override;
  bool hf_key_skipped(const std::string& name) const override;
  /// With expert parallel: collective over the ep group (each grouped expert tensor is
  /// gathered, gather_experts), the full HF state on every ep rank.
  std::vector<messaging::Tensor> hf_state_dict() override;
  std::vector<messaging::Tensor> hf_state_dict_local(bool with_dense) override;
  void save_hf_config(const std::string& dir) override;
  void check_hf_config(const std::string& dir) const override;
  void set_expert_parallel(parallel::Group* ep) override;
  parallel::Group* expert_parallel() const override { return ep_; }
  void serve_expert_parallel() override;
  ExpertSlice expert_slice() const override { return experts_; }
  std::vector<torch::Tensor> routed_expert_parameters() override;
  std::vector<std::vector<torch::Tensor>> decoder_layer_parameters() override {
    std::vector<std::vector<torch::Tensor>> out;
    for (auto& l : layers) out.push_back(l->parameters());
    return out;
  }
  /// The final norm and lm_head (untied: GLM-4.7-Flash's tie_word_embeddings is false).
  std::vector<torch::Tensor> head_parameters() override { return {norm->weight, lm_head->weight}; }
  std::vector<std::vector<std::string>> weight_sync_groups(bool hf_names = true) const override;
  /// Every block has its batch-invariant form (the true on-policy mode).
  bool supports_batch_invariant() const override { return true; }
  void set_absorbed_decode(bool on) override {
    for (auto& l : layers) l->attn->set_absorbed_decode(on);
  }
  void set_decode_kernel(bool on) override {
    for (auto& l : layers) l->attn->set_decode_kernel(on);
  }
  /// A PagedCache (model/decode_cache.hpp): per layer [G, Z, cache_width()], no slot state.
  std::unique_ptr<DecodeCache> make_decode_cache(const DecodeCacheShape& shape,
                                                 const torch::TensorOptions& options) const override;
  int64_t decode_cache_bytes(const DecodeCacheShape& shape, torch::Dtype dtype) const override;
  /// Against the PagedCache of make_decode_cache (MLAImpl::forward_cached per layer).
  ForwardOutput forward_cached(const torch::Tensor& ids, const torch::Tensor& positions,
                               const std::vector<CachedSlice>& slices, DecodeCache& cache,
                               bool want_routing) override;
  bool has_device_decode() const override { return true; }
  /// MLAImpl::forward_cached per layer over CachedLayout(positions, block_table): absorbed
  /// (latent-space) attention over the padded pages, the MoE's dispatch on the device.
  ForwardOutput forward_decode(const torch::Tensor& ids, const torch::Tensor& positions,
                               const torch::Tensor& block_table, DecodeCache& cache, bool want_routing) override;
  int64_t num_layers() const { return config_.num_hidden_layers; }
  /// Width of one cache entry: kv_lora_rank + qk_rope_head_dim.
  int64_t cache_width() const { return config_.attention.kv_lora_rank + config_.attention.qk_rope_head_dim; }
  int64_t vocab_size() const override { return config_.vocab_size; }

  torch::nn::Embedding embed{nullptr};
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  void refuse_load_under_expert_parallel(const char* what) const;
  /// The layers over `layout` (forward_cached's and forward_decode's common part).
  ForwardOutput run_cached(const torch::Tensor& ids, const torch::Tensor& positions, const CachedLayout& layout,
                           PagedCache& paged, bool want_routing);
  Glm4MoeLiteConfig config_;
  parallel::Group* ep_ = nullptr;
  ExpertSlice experts_;
};

/// Reads DIR/config.json, builds the model and loads DIR's weights; with `experts`, only those
/// routed experts are built and read (an ep rank's share: the other experts' bytes are never
/// read from the memory-mapped files). Throws std::invalid_argument (config, slice) or
/// checkpoint::CheckpointError (weights).
std::shared_ptr<Glm4MoeLiteModel> from_hf_dir(const std::string& dir, ExpertSlice experts = {});

/// Parameters of a Glm4MoeLiteModel of config `c` holding `experts`' share of the routed experts
/// (buffers not counted), from the config alone: what building one will allocate, 4 bytes a
/// parameter in fp32 (model::Registry's memory check).
int64_t parameter_count(const Glm4MoeLiteConfig& c, ExpertSlice experts = {});

}  // namespace kiln::model::glm4_moe_lite
