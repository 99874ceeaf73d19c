#pragma once
// The trainer core: dynamic micro-batching, per-token log-probs of the policy, the RL loss
// (losses.hpp), AdamW with gradient-norm clipping and a learning-rate schedule, routing replay.
// Plain class: the trainer actor drives it. Legend: P prompt tokens, n completion tokens,
// L MoE layers, K experts per token.
#include <memory>
#include <string>
#include <vector>

#include "actors/trainer/losses.hpp"
#include "model/causal_lm.hpp"

namespace kiln::trainer {

/// One trained sample: a prompt and the completion the rollout produced for it.
struct Sample {
  std::vector<int64_t> prompt, completion;
  std::vector<float> behavior_logprobs;  ///< [n] as the rollout returned them
  std::vector<float> ref_logprobs;       ///< [n] reference policy (empty when KL is off)
  /// [n] pi_old: the trainer's policy before this step, from a separate no-grad pass (verl's
  /// "recompute old log-prob"); empty: the training forward's own values, detached (equal in
  /// exact arithmetic with one PPO epoch; the separate pass runs at the rollout's shapes).
  std::vector<float> old_logprobs;
  torch::Tensor routed_experts;          ///< [P + n - 1, L, K] or undefined (no replay)
  float advantage = 0;
  int64_t tokens() const { return int64_t(prompt.size() + completion.size()); }
};

struct TrainerConfig {
  int64_t max_tokens_per_microbatch = 4096;
  double lr = 1e-3;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;
  double grad_clip = 1.0;            ///< max global gradient norm; <= 0 turns clipping off
  std::string lr_schedule = "constant";  ///< "constant" | "cosine" (after linear warmup)
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;           ///< for "cosine"
  double min_lr_ratio = 0.1;         ///< cosine floor, fraction of lr
  bool routing_replay = true;        ///< use the rollout's expert ids in the training forward
  /// Sampling temperature of the rollouts: log-probs are log_softmax(logits / temperature),
  /// the convention of actors/rollout/sampling.hpp, so that ratios compare like with like.
  double temperature = 1.0;
  int64_t logprob_chunk = 1024;
  PolicyLossConfig loss;
  void validate() const;             ///< throws std::invalid_argument naming the field
};

struct StepMetrics {
  double loss = 0, pg_loss = 0, kl = 0, clip_fraction = 0, grad_norm = 0, lr = 0;
  double entropy = 0;  ///< mean policy entropy over trained tokens (computed when entropy_coef > 0)
  double train_rollout_logprob_abs_diff = 0;  ///< mean |policy - behaviour| log-prob over trained tokens
  int64_t micro_batches = 0, tokens = 0, loss_tokens = 0;
  double actor_train_time = 0;  ///< seconds
  /// The step's loss or gradient norm was NaN or inf: it changed no parameter, no optimizer
  /// state (moments, step count, lr) and no version; loss and grad_norm above show the values.
  bool skipped_nonfinite = false;
  std::string skip_reason;  ///< why, e.g. "loss is inf"; empty when the step was taken
};

/// Splits samples (by index, in order) into micro-batches of at most `max_tokens` tokens; a
/// sample longer than max_tokens gets a micro-batch of its own.
std::vector<std::vector<std::size_t>> plan_micro_batches(const std::vector<Sample>& samples, int64_t max_tokens);

class Trainer {
 public:
  Trainer(std::shared_ptr<model::CausalLM> policy, TrainerConfig config);
  /// One optimizer step on `samples` (one PPO epoch: the old policy is the current one, so
  /// the ratio starts at 1 and TIS weighs stale samples by exp(old - behaviour)). Samples with
  /// old_logprobs use those as pi_old (all samples or none).
  /// Throws std::invalid_argument, before anything changes, naming the sample: no samples, an
  /// empty prompt or completion, a token id outside the vocabulary, log-prob counts that do not
  /// match the completion (ref_logprobs needed when kl_coef != 0), a non-finite advantage or
  /// log-prob. A step whose loss or gradient norm comes out non-finite anyway is skipped
  /// (StepMetrics::skipped_nonfinite), not applied.
  StepMetrics train_step(const std::vector<Sample>& samples);
  int64_t version() const { return version_; }   ///< optimizer steps taken
  model::CausalLM& policy() { return *policy_; }
  double current_lr() const;
  /// Optimizer state for checkpoints (over master_parameters()).
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  /// The tensors AdamW updates: the policy's parameters when they are fp32; fp32 copies of
  /// them (master weights, Micikevicius et al. 2018, arXiv:1710.03740) when the policy holds
  /// bf16/fp16 parameters. Gradients are accumulated in the policy's dtype, copied to the
  /// masters in fp32, clipped and applied there; the policy then gets the rounded masters.
  const std::vector<torch::Tensor>& master_parameters() const { return masters_; }
  bool uses_master_weights() const { return !low_precision_.empty(); }
  /// Re-reads the masters from the policy (after its weights were loaded from a checkpoint).
  void reload_master_weights();
  void set_version(int64_t v) { version_ = v; }

 private:
  std::shared_ptr<model::CausalLM> policy_;
  TrainerConfig c_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<torch::Tensor> params_, masters_;  ///< same order; masters_[i] is params_[i] when fp32
  std::vector<std::size_t> low_precision_;       ///< indices with a separate fp32 master
  int64_t version_ = 0;
};

/// Per-completion-token log-probs of `samples` under `model` (no grad), e.g. the reference
/// policy: result[i] has samples[i].completion.size() values.
std::vector<std::vector<float>> completion_logprobs(model::CausalLM& model, const std::vector<Sample>& samples,
                                                    int64_t max_tokens_per_microbatch, bool routing_replay,
                                                    double temperature = 1.0);

}  // namespace kiln::trainer
