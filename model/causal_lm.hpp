#pragma once
// The interface every model package implements: what the trainer and the rollout engine see.
// Legend: T tokens, D hidden, V vocabulary, L MoE layers, K experts per token, Ls sparse-
// attention layers (an indexer chooses the keys: glm5_next), W keys one such layer selects.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "messaging/tensor.hpp"
#include "model/blocks/basic.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/blocks/mla.hpp"
#include "model/blocks/moe.hpp"
#include "model/decode_cache.hpp"

namespace kiln::parallel {
class Group;
}

namespace kiln::model {

struct ForwardOptions {
  bool return_routed_experts = false;  ///< fill ForwardOutput::routed_experts
  /// Routing replay ("R3"): [T, L, K] int64 expert ids to use instead of the router's
  /// choice; weights still come from this model's router scores, so gradients flow.
  std::optional<torch::Tensor> replay_routed_experts;
  /// Fill ForwardOutput::topk_indices (models with sparse-attention layers; others ignore it).
  bool return_topk_indices = false;
  /// Indexer replay: [T, Ls, W] int64 key positions (within each document, -1 for none) that
  /// each sparse-attention layer attends to instead of its indexer's choice (e.g. the
  /// rollout's). Refused (std::invalid_argument) by a model without sparse-attention layers.
  std::optional<torch::Tensor> replay_topk_indices;
};

struct ForwardOutput {
  torch::Tensor hidden;          ///< [T, D] after the final norm
  torch::Tensor routed_experts;  ///< [T, L, K] int64 (descending biased score), if asked or replayed
  torch::Tensor topk_indices;    ///< [T, Ls, W] int64 per sparse-attention layer, if asked (see ForwardOptions)
};

/// One logical depth d of multi-token prediction (CausalLM::mtp_forward; DeepSeek-V3 §2.2).
struct MtpDepth {
  int64_t depth = 0;      ///< d >= 1
  torch::Tensor hidden;   ///< [Td, D] the output head's input (after the MTP head's norm), model dtype
  torch::Tensor rows;     ///< [Td] int64 on CPU: packed row t of each entry, ascending
  torch::Tensor targets;  ///< [Td] int64 on hidden's device: input_ids[t + d + 1], in t's document
};

/// What a trainer runs around each decoder layer of CausalLM::forward (fully sharded data
/// parallel: gather a layer's parameters before it runs, free them after; hook the backward).
/// x: [T, D], the hidden states entering / leaving layer `layer` (0-based, in order); each
/// returns x itself or an autograd identity of it. Called with and without grad mode, outside
/// activation checkpointing's recomputed region (a checkpointed layer is called once per
/// forward from the hooks' view).
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual torch::Tensor before_layer(int64_t layer, const torch::Tensor& x) = 0;
  virtual torch::Tensor after_layer(int64_t layer, const torch::Tensor& x) = 0;
};

class CausalLM : public torch::nn::Module {
 public:
  /// Packed forward: no token attends across a document boundary. Throws
  /// std::invalid_argument for a malformed batch or replay tensor.
  virtual ForwardOutput forward(const PackedBatch& batch, const ForwardOptions& options = {}) = 0;
  virtual torch::Tensor lm_head_weight() = 0;  ///< [V, D]
  virtual int64_t num_moe_layers() const = 0;
  virtual int64_t experts_per_token() const = 0;
  /// E: routed experts of each MoE layer (the whole model's, with expert parallel too); a
  /// routing-replay id lies in [0, E).
  virtual int64_t num_experts() const = 0;
  /// Ls: sparse-attention layers (an indexer chooses their keys: ForwardOutput::topk_indices);
  /// 0 for a model without them (the default).
  virtual int64_t num_sparse_layers() const { return 0; }
  /// W: key positions one sparse-attention layer selects per query; 0 without such layers.
  virtual int64_t topk_width() const { return 0; }
  /// Loads weights from an HF checkpoint directory (safetensors, sharded or not). Throws
  /// checkpoint::CheckpointError listing missing and unexpected keys, or naming the tensor
  /// whose shape or dtype does not fit.
  virtual void load_hf_checkpoint(const std::string& dir) = 0;
  /// Writes config.json and HF-named safetensors shards of at most max_shard_bytes.
  virtual void save_hf_checkpoint(const std::string& dir, uint64_t max_shard_bytes) = 0;
  /// Loads HF-named tensors (the full set the model needs, e.g. from weight sync). Throws
  /// checkpoint::CheckpointError like load_hf_checkpoint.
  virtual void load_hf_tensors(const std::vector<messaging::Tensor>& tensors) = 0;
  /// Where each HF-named tensor the model reads is written, for loads of any subset of them
  /// (SGLang's update_weights_from_distributed): HF name -> a view of the parameter or buffer
  /// it fills, of that HF tensor's shape, in the parameter's dtype and on its device; writing a
  /// view (copy_, under torch::NoGradGuard) writes the weight. The package's state-dict adapter
  /// maps the names. Throws std::invalid_argument for a model that cannot take HF tensors as it
  /// is (e.g. one holding an ep rank's share of the experts), or a family that does not map
  /// them (the default: glm5_next so far).
  virtual std::map<std::string, torch::Tensor> hf_targets() {
    throw std::invalid_argument("this model family does not map HF tensor names to its weights for partial loads "
                                "(CausalLM::hf_targets): load a whole checkpoint instead");
  }
  /// Whether HF tensor `name`, though not among hf_targets(), is one that loads skip (a part of
  /// the checkpoint the model does not build, such as the MTP layer). Default: none.
  virtual bool hf_key_skipped(const std::string& name) const { return false; }
  /// The weights under HF names (CPU, contiguous; grouped tensors split as HF lays them out).
  virtual std::vector<messaging::Tensor> hf_state_dict() = 0;
  /// The HF-named weights this rank holds, for a checkpoint that every rank writes a part of
  /// (no gather): with expert parallel, the routed experts of this rank's slice under their
  /// global HF names (expert ids j*E/P ...), and the other weights when `with_dense`; without
  /// expert parallel, hf_state_dict() when `with_dense`, else nothing. Not collective.
  virtual std::vector<messaging::Tensor> hf_state_dict_local(bool with_dense) {
    return with_dense ? hf_state_dict() : std::vector<messaging::Tensor>{};
  }
  /// Writes DIR/config.json, the HF config of this model (what save_hf_checkpoint writes beside
  /// the weights). Throws checkpoint::CheckpointError when it cannot be written.
  virtual void save_hf_config(const std::string& dir) = 0;
  /// Tensors an inference engine may fuse, which weight sync must therefore deliver in one
  /// bucket: groups of name patterns, `{}` standing for the layer index, under HF names
  /// (hf_state_dict) or kiln's (named_parameters). None by default.
  virtual std::vector<std::vector<std::string>> weight_sync_groups(bool hf_names = true) const { return {}; }

  /// The decoding state forward_cached keeps for an engine of `shape` (model/decode_cache.hpp:
  /// the engine addresses pages and slots; what they hold is this model's), zeroed, in
  /// `options` (the model's dtype and device).
  virtual std::unique_ptr<DecodeCache> make_decode_cache(const DecodeCacheShape& shape,
                                                         const torch::TensorOptions& options) const = 0;
  /// Bytes make_decode_cache allocates for `shape` in `dtype`.
  virtual int64_t decode_cache_bytes(const DecodeCacheShape& shape, torch::Dtype dtype) const = 0;
  /// Incremental decoding: ids/positions [N] the new tokens of all slices (positions within
  /// each sequence), `slices` in row order, `cache` this model's make_decode_cache (entries of
  /// the new tokens written, slot states advanced). Returns hidden [N, D] and, if want_routing,
  /// routed_experts [N, L, K] and (models with sparse-attention layers) topk_indices [N, Ls, W].
  /// Inference only. Throws std::invalid_argument for a cache of another model.
  virtual ForwardOutput forward_cached(const torch::Tensor& ids, const torch::Tensor& positions,
                                       const std::vector<CachedSlice>& slices, DecodeCache& cache,
                                       bool want_routing) = 0;
  /// Whether forward_decode exists for this model.
  virtual bool has_device_decode() const { return false; }
  /// A decode step given as device tensors of static shape, with no host data and no host
  /// sync (what a captured CUDA graph replays; the rollout engine's rollout.cuda_graphs): B
  /// sequences add one token each, ids [B] int64 at positions [B] int64 (= the tokens of that
  /// sequence already in the cache), its pages block_table [B, W] int64 (W * page size >
  /// every position; entries past a sequence's pages may be any valid page, they are masked).
  /// The new tokens' cache entries are written; attention always takes this model's
  /// latent-space form when it has one (set_absorbed_decode(true)'s). Returns hidden [B, D]
  /// and, if want_routing, routed_experts [B, L, K]. Inference only. Throws std::logic_error
  /// for a model without it (has_device_decode), std::invalid_argument for a cache of another
  /// model or inputs of other shapes.
  virtual ForwardOutput forward_decode(const torch::Tensor& ids, const torch::Tensor& positions,
                                       const torch::Tensor& block_table, DecodeCache& cache, bool want_routing);
  /// Decode steps of forward_cached in latent space on CUDA too (MLAImpl::set_absorbed_decode);
  /// off: the training path's kernels over expanded keys and values. No effect on a model
  /// without such a form.
  virtual void set_absorbed_decode(bool on) = 0;
  /// Latent-space decode steps on CUDA compute their attention with the paged-cache kernel
  /// (MLAImpl::set_decode_kernel: each cached latent read once in place) instead of gathering
  /// the padded latents. No effect on a model without such a form.
  virtual void set_decode_kernel(bool on) = 0;
  virtual int64_t vocab_size() const = 0;

  /// Expert parallel for the routed experts (blocks/moe_ep.hpp) over `ep` (held by reference;
  /// it must outlive the model): every MoE layer keeps ep rank j's experts [j*E/P, (j+1)*E/P)
  /// (its grouped tensors sliced along E, the same parameter objects). Call it once the full
  /// weights are in place and equal on the ep ranks. Afterwards forward (and its backward) is
  /// collective over `ep`, as is hf_state_dict (it gathers the full experts); loading HF
  /// weights is refused. nullptr or one rank: no-op. Throws std::invalid_argument when the
  /// model has no expert parallel, E is not a multiple of P, or it was set already.
  virtual void set_expert_parallel(parallel::Group* ep);
  /// The ep group, or nullptr.
  virtual parallel::Group* expert_parallel() const { return nullptr; }
  /// With expert parallel: this rank's part of one forward (or forward_cached) that the other
  /// ep ranks run while this one has no tokens: every MoE layer in order serves the rows sent
  /// to its experts (MoEImpl::serve_expert_parallel). Collective over the ep group. Without
  /// expert parallel: no-op. Throws std::logic_error for a model with an ep group whose package
  /// does not implement it.
  virtual void serve_expert_parallel();
  /// The routed experts this model holds: all ({0, 1}) unless it was built holding one ep
  /// rank's (a package's from_hf_dir_experts) or set_expert_parallel sliced them.
  virtual ExpertSlice expert_slice() const { return {}; }
  /// The routed experts' grouped tensors (with expert parallel: this rank's slices), a subset
  /// of parameters(), in parameters() order. None by default.
  virtual std::vector<torch::Tensor> routed_expert_parameters() { return {}; }

  /// Activation checkpointing per decoder layer (blocks/activation_checkpoint.hpp) in forward()
  /// with gradients on: each checkpointed layer keeps only its input, and runs again in the
  /// backward. Same loss and gradients; less memory, one more forward of those layers per step.
  /// `layers` > 0 checkpoints only the first `layers` decoder layers (Megatron's
  /// --recompute-method block --recompute-num-layers): the others keep their activations, a
  /// trade between the two; 0 checkpoints every layer. Throws std::invalid_argument for
  /// layers < 0.
  void set_activation_checkpointing(bool on, int64_t layers = 0);
  bool activation_checkpointing() const { return checkpoint_layers_; }
  int64_t activation_checkpointing_layers() const { return checkpoint_count_; }
  /// Whether forward() checkpoints decoder layer `index` (0-based): what a package's forward asks.
  bool checkpoints_layer(int64_t index) const {
    return checkpoint_layers_ && (checkpoint_count_ == 0 || index < checkpoint_count_);
  }
  /// How many bytes of 16-bit logits token_logprobs may keep from its forward for its backward
  /// (blocks/logprobs.hpp: all [T, V] when they fit, else the leading whole chunks that fit, the
  /// rest recomputed; 0 recomputes all). Default kKeepLogitsMaxBytes (4 GiB). Throws
  /// std::invalid_argument for a negative value.
  void set_kept_logits_bytes(int64_t bytes);
  int64_t kept_logits_bytes() const { return kept_logits_bytes_; }

  /// The true on-policy mode (experiment key algorithm.true_on_policy; docs/gpu.md): forward,
  /// forward_cached, logits and token_logprobs run batch-invariant ops
  /// (blocks/batch_invariant.hpp, kernels/batch_invariant.hpp), so that a token's hidden state
  /// and log-prob have the same bits whatever batch, pack or cache step computed them: the
  /// trainer's packed forward equals the rollout engine's prefill and decode exactly (with
  /// routing replay). Slower; gradients are the ordinary ops'. Turns the switch of every block
  /// of this model that has one (BatchInvariantSwitch). Throws std::invalid_argument when
  /// turning it on for a model whose package does not implement it (supports_batch_invariant).
  void set_batch_invariant(bool on);
  bool batch_invariant() const { return batch_invariant_; }
  /// Whether every block of this model's forward and forward_cached has a batch-invariant form
  /// (glm4_moe_lite; not the default).
  virtual bool supports_batch_invariant() const { return false; }

  /// Each decoder layer's parameters (a subset of parameters(), in its order; with expert
  /// parallel the routed experts' slices included), layer by layer: the units fully sharded
  /// data parallel gathers. Empty: the model cannot be sharded by layer (the default).
  virtual std::vector<std::vector<torch::Tensor>> decoder_layer_parameters() { return {}; }
  /// The parameters used only after the last decoder layer's output, in parameters() order
  /// (the final norm, an untied lm_head): fully sharded data parallel gathers them as one more
  /// unit while the last layer runs and reduces their gradient as the backward enters it. Empty
  /// (the default): they stay with the embedding, reduced after the backward.
  virtual std::vector<torch::Tensor> head_parameters() { return {}; }
  /// Hooks forward() calls around every decoder layer (held by pointer; nullptr: none). A model
  /// whose decoder_layer_parameters() is not empty must call them (layer_hooks()).
  void set_layer_hooks(LayerHooks* hooks) { layer_hooks_ = hooks; }
  LayerHooks* layer_hooks() const { return layer_hooks_; }

  /// Casts parameters to `dtype`, keeping what must stay fp32 (router bias) in fp32.
  virtual void to_dtype(torch::Dtype dtype) = 0;

  /// Physical multi-token-prediction layers the model built (0: none, the default).
  virtual int64_t mtp_layers() const { return 0; }
  /// Multi-token prediction from forward's out.hidden [T, D] of `batch`: one MtpDepth per
  /// depth 1..depths that has rows (none crosses a document boundary), predicted through
  /// lm_head_weight(). Throws std::invalid_argument for a model without MTP layers (the default).
  virtual std::vector<MtpDepth> mtp_forward(const PackedBatch& batch, const torch::Tensor& hidden, int64_t depths) {
    throw std::invalid_argument("this model has no multi-token-prediction layer (CausalLM::mtp_forward)");
  }
  /// The MTP layers' parameters (a subset of parameters()); empty without MTP layers.
  virtual std::vector<torch::Tensor> mtp_parameters() { return {}; }
  /// Checks that DIR/config.json, when DIR holds one, describes this model: parsed by the
  /// package (every field checked) and compared field by field with this model's
  /// (config_json::check_same_config). For loads into a model in use (kiln serve's
  /// /update_weights_from_disk), where a checkpoint whose tensors fit may still be of a model with
  /// another activation, RoPE or norm epsilon. A DIR without config.json passes (weight-sync
  /// directories hold the tensors only). Throws std::invalid_argument naming the file and fields.
  /// Default (a package that does not override it: plugins built before it): no check, the
  /// tensors' names, shapes, dtypes and values are still checked by the load. Last among the
  /// virtuals, so that a plugin built against the header before it keeps its vtable.
  virtual void check_hf_config(const std::string& /*dir*/) const {}

  /// [T, V] logits in the model's dtype.
  torch::Tensor logits(const ForwardOutput& out);
  /// [N, V] fp32 logits of hidden states [N, D], where they live, as the trainer's log-prob head
  /// computes them (blocks/logprobs.hpp's lm_logits; in the batch-invariant mode
  /// invariant_lm_logits, the trainer's bits): what the rollout engine samples from.
  torch::Tensor fp32_logits(const torch::Tensor& hidden_ND);
  /// [T] fp32 log-probs of targets under logits / temperature (see blocks/logprobs.hpp: the
  /// hidden states divided by the temperature, then token_logprobs; in the batch-invariant mode
  /// token_logprobs_invariant, the rollout sampler's formula), never [T, V] in fp32.
  /// rows: [R] int64 packed rows (any device) to compute, e.g. the completion tokens of an RL
  /// batch; only their head GEMMs run (2*R*V*D FLOPs forward, not 2*T*V*D), and a row's value
  /// is the one the whole batch would give it (up to the GEMM's blocking; bitwise in the
  /// batch-invariant mode). Undefined: every row. -> [R] (or [T]) fp32.
  torch::Tensor token_logprobs(const ForwardOutput& out, const torch::Tensor& targets, int64_t chunk = 1024,
                               double temperature = 1.0, const torch::Tensor& rows = {});
  /// token_logprobs and each row's entropy of softmax(logits / temperature) (an entropy bonus),
  /// from one pass of the head over the same rows: -> {[R] log-probs, [R] entropy} fp32 (blocks/
  /// logprobs.hpp's token_logprobs_and_entropy). In the batch-invariant mode the log-probs are
  /// token_logprobs' (the invariant head, the rollout's bits) and the entropy the ordinary head's.
  std::pair<torch::Tensor, torch::Tensor> token_logprobs_and_entropy(const ForwardOutput& out,
                                                                     const torch::Tensor& targets, int64_t chunk,
                                                                     double temperature,
                                                                     const torch::Tensor& rows = {});
 protected:
  bool checkpoint_layers_ = false;  ///< set_activation_checkpointing
  int64_t checkpoint_count_ = 0;    ///< set_activation_checkpointing's layers (0: all)
  int64_t kept_logits_bytes_ = kKeepLogitsMaxBytes;  ///< set_kept_logits_bytes
  bool batch_invariant_ = false;    ///< set_batch_invariant
  LayerHooks* layer_hooks_ = nullptr;  ///< set_layer_hooks
};

/// The multi-token-prediction loss of one packed micro-batch (DeepSeek-V3 §2.2: lambda / D
/// times the sum over depths of each depth's cross-entropy), as kiln's trainer adds it:
/// weight / depths * sum_d sum_{t supervised at d} -log p_d(token t+d+1) / normalizer, where row t
/// is supervised at depth d when row t+d's own next-token target is (`supervised_T` [T] bool:
/// the rows whose target the policy loss trains, e.g. completion tokens), and `normalizer` is
/// the whole batch's count the policy loss divides by (so micro-batches and data-parallel ranks
/// add up). Log-probs in fp32 per chunk (blocks/logprobs.hpp), the output head on the
/// supervised entries only.
struct MtpLoss {
  torch::Tensor loss;   ///< [] fp32, differentiable; 0 with gradient edges to the MTP layers (zero gradients) when nothing is supervised
  double ce_sum = 0;    ///< sum of the supervised entries' cross-entropies, all depths
  int64_t tokens = 0;   ///< supervised entries, all depths
};
/// Throws std::invalid_argument as mtp_forward does, or for a supervised_T of another length,
/// weight < 0 or normalizer <= 0.
MtpLoss mtp_loss(CausalLM& model, const PackedBatch& batch, const torch::Tensor& hidden, const torch::Tensor& supervised_T,
                 int64_t depths, double weight, double normalizer, int64_t chunk = 1024);

}  // namespace kiln::model
