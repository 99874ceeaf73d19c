#pragma once
// The trainer core: dynamic micro-batching (samples.hpp), per-token log-probs of the policy,
// the RL loss (losses.hpp), AdamW with gradient-norm clipping and a learning-rate schedule (the
// update in multi-tensor launches: LibTorch's fused at::_fused_adamw_ over torch::optim::AdamW's
// state, fused_adamw.hpp; sharded over ranks in trainer_optimizer.cpp), routing replay.
// Plain class: the trainer actor drives it. Legend: P prompt tokens, n completion tokens,
// L MoE layers, K experts per token.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/trainer/fully_sharded.hpp"
#include "actors/trainer/losses.hpp"
#include "actors/trainer/samples.hpp"
#include "actors/trainer/sharded_adamw.hpp"
#include "actors/trainer/trainer_config.hpp"
#include "model/causal_lm.hpp"
#include "parallel/group.hpp"
#include "parallel/process_group.hpp"

namespace kiln::trainer {

/// The expert-parallel dimensions of a dp x ep mesh the trainer spans (Trainer's constructor).
struct ExpertParallel {
  parallel::Group* experts = nullptr;   ///< "ep": the ranks that split the routed experts
  parallel::Group* replicas = nullptr;  ///< "dp": the ranks that hold the same experts
};

class Trainer {
 public:
  /// `data_parallel`: none = one rank. Otherwise a group of data-parallel ranks (held by
  /// reference; it must outlive the trainer) over which every step is split: each rank trains
  /// on its share of the samples (split_samples), the loss is normalised by the counts of the
  /// whole batch, gradients and AdamW state are sharded (ShardedAdamW), and a step's loss,
  /// gradient, metrics and update equal the one-rank step's on the same batch (up to fp32
  /// summation order). Collective: every rank constructs it, and calls train_step with the
  /// same samples; the policy's parameters become group rank 0's.
  Trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config, parallel::Group* data_parallel = nullptr);
  /// Expert parallel (docs/parallel.md, torchtitan's dp x ep mesh: ep borrows ranks from data
  /// parallel). `data_parallel` spans all W = dp * ep ranks: it splits the batch, and the dense
  /// (non-expert) parameters are replicated on it with their gradients and AdamW state sharded
  /// over it, as above. The policy's routed experts are split over `expert_parallel.experts`
  /// (CausalLM::set_expert_parallel, once every parameter became data_parallel rank 0's; a
  /// policy built holding this ep rank's experts only, expert_slice(), keeps them, made equal
  /// to expert_parallel.replicas rank 0's);
  /// their gradients are summed, and their fp32 masters and AdamW state sharded, over
  /// `expert_parallel.replicas` (the ranks holding the same experts: a second ShardedAdamW).
  /// The clipping norm covers dense and expert gradients together. Every rank runs as many
  /// micro-batches as the rank of its ep group with the most (padding with a forward and
  /// backward of a 2-token document whose loss is multiplied by 0), so that the MoE's
  /// all-to-alls match even on a rank with no sample. A step equals the one-rank step on the
  /// same batch (up to fp32 summation order). Collective over data_parallel. Checkpoints are
  /// refused (save_checkpoint / load_checkpoint name expert parallel); the full HF weights
  /// come from policy().hf_state_dict(), collective over ep. Throws std::invalid_argument
  /// when a group is missing, ep size * replicas size != data_parallel size, or the policy
  /// refuses the split (CausalLM::set_expert_parallel).
  Trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config, parallel::Group& data_parallel,
          ExpertParallel expert_parallel);
  /// Both constructors with config.fsdp and a data-parallel group: each decoder layer's
  /// parameters (CausalLM::decoder_layer_parameters; with expert parallel not its routed
  /// experts, which stay split over ep) are fully sharded over `data_parallel`
  /// (FullyShardedLayers, installed as the policy's layer hooks): during train_step a rank holds
  /// 1/W of them and gathers each layer as the forward and the backward reach it; every rank
  /// runs as many micro-batches as the rank of `data_parallel` with the most (padding as for
  /// expert parallel). The other dense parameters (embedding, final norm, head) are sharded as
  /// without it (ZeRO-2). Between steps the policy is whole. Throws std::invalid_argument when
  /// the policy's family lists no decoder layers. A step that throws part-way (a lost rank)
  /// leaves the layers' parameters freed: the trainer is then unusable (resume from a checkpoint).
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  /// One optimizer step on `samples` (one PPO epoch: the old policy is the current one, so
  /// the ratio starts at 1 and TIS weighs stale samples by exp(old - behaviour)). Samples with
  /// old_logprobs use those as pi_old (all samples or none).
  /// Throws std::invalid_argument, before anything changes, naming the sample: no samples, an
  /// empty prompt or completion, a token id outside the vocabulary, log-prob counts that do not
  /// match the completion (ref_logprobs needed when kl_coef != 0), a non-finite advantage or
  /// log-prob, and with routing replay routed experts of another [P + n - 1, L, K] or an expert id
  /// outside the policy's [0, E) (check_samples). A step whose loss or gradient norm comes out non-finite anyway is skipped
  /// (StepMetrics::skipped_nonfinite), not applied.
  /// With a data-parallel group: collective; the metrics are the whole batch's, equal on every
  /// rank; every rank refuses the same batch, and all skip a non-finite step together. Throws
  /// std::invalid_argument on every rank when the ranks were given different batches (their
  /// sample counts, token counts or contents differ).
  StepMetrics train_step(const std::vector<Sample>& samples);
  /// The step as the RL loop takes it: pi_old from a separate no-grad pass first when
  /// config.recompute_old_logprobs (timed as log_probs_time), then train_step. With a
  /// data-parallel group each rank computes pi_old for its share only (split_samples) and an
  /// all-reduce hands every rank all of them; the batch is checked first, as train_step does.
  StepMetrics step(std::vector<Sample> samples);
  /// Where the last train_step's time went (seconds of wall clock), measured only after
  /// time_phases(true), which synchronises the device at each phase's end (a diagnostic for
  /// benchmarks: the step then overlaps less): forward passes (with the loss), backward passes
  /// (with the reductions they start), the gradient reduction and clipping after them, the
  /// optimizer step with the parameters' gathers.
  struct StepPhases {
    double forward = 0, backward = 0, reduce = 0, optimizer = 0;
  };
  void time_phases(bool on) { time_phases_ = on; }
  const StepPhases& last_phases() const { return phases_; }
  int64_t version() const { return version_; }   ///< optimizer steps taken
  model::CausalLM& policy() { return *policy_; }
  double current_lr() const;
  /// Optimizer state for checkpoints (over master_parameters()); with a data-parallel group
  /// this rank's shard of it; with expert parallel the dense parameters' shard.
  torch::optim::AdamW& optimizer() { return sharded_ ? sharded_->optimizer() : *optimizer_; }
  /// The tensors AdamW updates: the policy's parameters when they are fp32; fp32 copies of
  /// them (master weights, Micikevicius et al. 2018, arXiv:1710.03740) when the policy holds
  /// bf16/fp16 parameters. Gradients are accumulated in the policy's dtype. One rank on CUDA:
  /// their norm is taken as they are and kernels::adamw_step_low_precision steps the masters from
  /// them, scaled by the clip coefficient, writing the rounded masters into the policy in the same
  /// pass (the masters get no .grad()). Otherwise they are copied to the masters in fp32 (one
  /// at::_foreach_copy_), clipped (clip_grad_norm) and applied there (fused_adamw_step); the
  /// policy then gets the rounded masters (one at::_foreach_copy_).
  /// With a data-parallel group: this rank's fp32 master pieces (ShardedAdamW::masters()).
  const std::vector<torch::Tensor>& master_parameters() const { return sharded_ ? sharded_->masters() : masters_; }
  bool uses_master_weights() const { return !low_precision_.empty(); }
  /// The data-parallel group, or nullptr (one rank).
  parallel::Group* data_parallel() const { return dp_; }
  /// The sharded optimizer (nullptr without a data-parallel group): its gradient shard holds
  /// this rank's part of the last step's (clipped) gradient. With expert parallel: of the
  /// dense parameters only (parameters() without routed_expert_parameters(), in order).
  const ShardedAdamW* sharded_optimizer() const { return sharded_.get(); }
  /// With expert parallel: the optimizer of this rank's expert slices (routed_expert_parameters()
  /// in order), sharded over expert_parallel().replicas; otherwise nullptr.
  const ShardedAdamW* expert_optimizer() const { return expert_sharded_.get(); }
  /// The layers' fully sharded state (nullptr unless config.fsdp with a data-parallel group).
  const FullyShardedLayers* fully_sharded() const { return fsdp_.get(); }
  /// The whole model's gradient of the last step ([optimizer_numel()] fp32 on the CPU, the flat
  /// index below; after clipping when it clipped): every rank's shards summed over the
  /// data-parallel group (collective; each element is held by one rank), or the one-rank
  /// masters' gradients (on CUDA, where the masters step from the 16-bit gradients: those
  /// widened and multiplied by the step's clip coefficient, the values the composite's master
  /// gradients held). Zeros where no rank had a gradient. For tests and diagnostics.
  torch::Tensor whole_gradient();
  /// The expert-parallel groups (both nullptr without expert parallel).
  const ExpertParallel& expert_parallel() const { return ep_; }
  /// Re-reads the masters from the policy (after its weights were loaded from a checkpoint).
  void reload_master_weights();
  /// Checkpoints address the optimizer state by the whole model's flat index: parameters() of
  /// the unsplit model in order, each row-major, the routed experts' grouped tensors with all E
  /// experts (ShardedAdamW's index when nothing is split); N = optimizer_numel().
  /// This rank's fp32 masters and AdamW state as parts of that index (one rank: one part over
  /// all N; data parallel: its shard; expert parallel: a part per run of its dense and expert
  /// shards), each with the step counts of the parameters it touches (-1 elsewhere).
  std::vector<FlatAdamWState> optimizer_state_parts();
  /// Sets this rank's masters and AdamW state from `parts` (written at any world size and mesh,
  /// covering optimizer_ranges()), then the parameters from the masters (rounded to their
  /// dtype; with a group: collective, every rank's shards all-gathered). Throws
  /// std::invalid_argument when `parts` do not cover what this rank holds.
  void load_optimizer_state_parts(const std::vector<FlatAdamWState>& parts);
  /// The [begin, end) runs of the whole model's flat index this rank's optimizer holds.
  std::vector<std::pair<int64_t, int64_t>> optimizer_ranges();
  int64_t optimizer_numel() const { return global_numel_; }
  void set_version(int64_t v) { version_ = v; }

 private:
  std::shared_ptr<model::CausalLM> policy_;
  TrainerConfig c_;
  parallel::Group* dp_ = nullptr;
  std::unique_ptr<torch::optim::AdamW> optimizer_;  ///< one rank
  std::unique_ptr<ShardedAdamW> sharded_;           ///< data-parallel ranks (dense only with EP)
  std::unique_ptr<ShardedAdamW> expert_sharded_;    ///< expert parallel: this rank's expert slices
  ExpertParallel ep_;
  std::vector<torch::Tensor> params_, masters_;  ///< same order; masters_[i] is params_[i] when fp32
  std::vector<std::size_t> low_precision_;       ///< indices with a separate fp32 master
  /// One rank on CUDA with fp32 masters: the masters step on the 16-bit gradients and write the
  /// 16-bit parameters in one pass (kernels::adamw_step_low_precision), no fp32 gradient made.
  bool steps_from_low_precision() const;
  torch::Tensor clip_coefficient_;  ///< [] fp32: the last reduce_and_clip_gradients' (that path)
  int64_t version_ = 0;
  // The whole model's flat index (optimizer_state_parts): where params_[i] (this rank's slice
  // of it, with expert parallel) starts; N. Expert parallel: params_ indices of the dense and
  // the expert optimizers' parameters, in their order.
  std::vector<int64_t> global_offset_;
  int64_t global_numel_ = 0;
  std::vector<std::size_t> dense_index_, expert_index_;
  struct GlobalPieces {
    torch::optim::AdamW* optimizer;
    std::vector<FlatPiece> pieces;  ///< param: index in parameters(); offset: in the whole model's index
  };
  std::vector<GlobalPieces> global_pieces();
  /// The sharded optimizers' state over dp_ (dense, layer units, experts) and the parts list.
  void shard_state(const std::vector<bool>& is_expert, const torch::optim::AdamWOptions& options);
  void zero_optimizer_gradients();
  /// After a step's backward passes: the gradients summed into the optimizers' fp32 shards (or
  /// the one-rank masters), clipped to `max_norm` by one norm over the whole model; returns the
  /// norm before clipping. Collective over dp_.
  double reduce_and_clip_gradients(double max_norm);
  /// After reduce_and_clip_gradients: AdamW at `lr` on every optimizer (data parallel: each
  /// shard, then the parameters gathered whole), the policy's parameters rounded from the
  /// masters; the version advanced.
  void apply_update(double lr);
  std::unique_ptr<FullyShardedLayers> fsdp_;  ///< config.fsdp: the decoder layers' units
  /// Every sharded optimizer with the params_ indices of its parameters; `unit`: a layer's
  /// (gathered by fsdp_, not by the optimizer).
  struct Part {
    ShardedAdamW* optimizer;
    std::vector<std::size_t> index;
    bool unit;
  };
  std::vector<Part> parts_;
  bool time_phases_ = false;
  StepPhases phases_;
};

/// The trainer of this rank of `ranks`' mesh (dimensions "dp" and "ep"; kiln run's trainer
/// ranks): without ranks, one rank; with ep of size 1, data parallel over "dp"; else expert
/// parallel over the world with the experts split over "ep" and replicated over "dp".
/// Collective over `ranks` (as the constructors are).
std::unique_ptr<Trainer> make_trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config,
                                      parallel::ProcessGroups* ranks);
/// The routed experts this rank of `ranks`' mesh keeps ({ep rank, ep size}; all without
/// ranks): what to build its policy with (model::Registry::build), so that a rank loading an
/// HF checkpoint reads only its own experts.
model::ExpertSlice expert_slice_of(parallel::ProcessGroups* ranks);
/// The trainer ranks of `ranks`' launch on this host (LOCAL_WORLD_SIZE; 1 without ranks): how
/// many build their policy on this host at once (model::Registry::build's builders_on_host).
int ranks_on_this_host(parallel::ProcessGroups* ranks);

/// Per-completion-token log-probs of `samples` under `model` (no grad), e.g. the reference
/// policy: result[i] has samples[i].completion.size() values. An expert-parallel model
/// (model.expert_parallel()): collective over its ep group, every rank running as many
/// forward passes as the rank with the most micro-batches (samples may be empty). With
/// `routing_replay`, routed experts of another shape or with an id outside [0, E) are refused
/// by sample before any forward (check_routed_experts: std::invalid_argument "log-probs: sample
/// I ...").
std::vector<std::vector<float>> completion_logprobs(model::CausalLM& model, const std::vector<Sample>& samples,
                                                    int64_t max_tokens_per_microbatch, bool routing_replay,
                                                    double temperature = 1.0);
/// The same, with the settings the trainer and the reference share.
inline std::vector<std::vector<float>> completion_logprobs(model::CausalLM& model, const std::vector<Sample>& samples,
                                                           const LogprobConfig& c) {
  return completion_logprobs(model, samples, c.max_tokens_per_microbatch, c.routing_replay, c.temperature);
}

}  // namespace kiln::trainer
