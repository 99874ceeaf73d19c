#pragma once
// A step's samples as the trainer takes them: the Sample type, the checks that refuse a batch
// before anything changes, packing into micro-batches (model::PackedBatch with the rows whose
// targets are completion tokens), and the split of a step over data-parallel ranks.
// Legend: P prompt tokens, n completion tokens, T packed tokens, Tc completion tokens of a
// micro-batch, L MoE layers, K experts per token, Ls sparse-attention layers, W selections.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "model/causal_lm.hpp"
#include "parallel/group.hpp"

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
  /// [P + n - 1, Ls, W] the rollout's sparse-attention selections (glm5_next's indexers:
  /// positions within the sample, -1 for none), or undefined (the policy's indexers choose).
  torch::Tensor topk_indices;
  float advantage = 0;
  int64_t tokens() const { return int64_t(prompt.size() + completion.size()); }
};


/// Splits samples (by index, in order) into micro-batches of at most `max_tokens` tokens; a
/// sample longer than max_tokens gets a micro-batch of its own.
std::vector<std::vector<std::size_t>> plan_micro_batches(const std::vector<Sample>& samples, int64_t max_tokens);
/// The same over the samples at `indices` (in that order); returns indices into `samples`.
std::vector<std::vector<std::size_t>> plan_micro_batches(const std::vector<Sample>& samples,
                                                         const std::vector<std::size_t>& indices, int64_t max_tokens);

/// Splits a step's samples over `ranks` data-parallel ranks, balanced by tokens (prompt +
/// completion): longest first (ties: lower index), each to the rank with the fewest tokens so
/// far (ties: lower rank). result[r]: rank r's sample indices, ascending; a rank may get none
/// when there are fewer samples than ranks. Deterministic: every rank computes the same split.
std::vector<std::vector<std::size_t>> split_samples(const std::vector<Sample>& samples, int ranks);

/// A packed micro-batch and where each sample's completion tokens sit in it.
struct Packed {
  model::PackedBatch batch;
  std::optional<torch::Tensor> replay;       ///< [T, L, K] int64 routed experts (routing replay)
  std::optional<torch::Tensor> replay_topk;  ///< [T, Ls, W] int64 sparse-attention selections
  torch::Tensor targets;                     ///< [T] int64 next-token targets
  torch::Tensor completion_positions;        ///< [Tc] int64 rows whose target is a completion token
  std::vector<int64_t> completion_sample;    ///< [Tc] index into `idx` of the row's sample (host)
};

/// The samples at `idx` packed in that order (prompt + completion per document). `replay`: keep
/// the rollout's routed experts / selections when every sample has them at [P + n - 1] rows
/// (the last token's row repeats the one before: it feeds no trained output).
Packed pack(const std::vector<Sample>& samples, const std::vector<std::size_t>& idx, bool replay);

/// [sum of n over idx] fp32: `field` (a per-completion-token vector) of the samples at `idx`,
/// concatenated in that order.
torch::Tensor per_token(const std::vector<Sample>& samples, const std::vector<std::size_t>& idx,
                        const std::vector<float> Sample::*field);

/// Refuses, by sample index (std::invalid_argument "train_step: sample I ..."), what a step
/// cannot train on or would be poisoned by: no samples, an empty prompt or completion, a token
/// id outside [0, policy.vocab_size()), per-token vectors of the wrong length or with a NaN/inf
/// (reference log-probs only when `need_ref`), old log-probs on some samples only, a non-finite
/// advantage; with `routing_replay` (the step replays them), routed experts not [P + n - 1, L, K]
/// of the policy's MoE layers and experts per token, or holding an id outside [0,
/// policy.num_experts()). A NaN or inf would reach every parameter through the update, and
/// every later update through AdamW's moments; a bad expert id would otherwise stop the step
/// inside the model's forward, naming no sample, and rows of another count turn replay off for
/// the whole micro-batch (pack).
void check_samples(const std::vector<Sample>& samples, const model::CausalLM& policy, bool need_ref,
                   bool routing_replay);
/// The routed-expert part of check_samples, for any pass that replays them (the reference's and
/// the old log-probs' too): std::invalid_argument "`what`: sample I has routed experts of
/// shape ..." or "... routed expert id X outside [0, E)".
void check_routed_experts(const std::vector<Sample>& samples, const model::CausalLM& policy, const std::string& what);
/// Why one sample's routed experts `r` (any dtype and device) do not fit a policy of `layers` MoE
/// layers, `per_token` experts per token and `experts` experts for `rows` = P + n - 1 rows: "has
/// routed experts of shape [...], not [rows, L, K] (...)" or "has routed expert id X outside [0,
/// E) (the policy's experts)"; empty when they fit. The check check_routed_experts makes, for
/// callers that know the shape but not the policy (the controller, on resume).
std::string routed_experts_fault(const torch::Tensor& r, int64_t rows, int64_t layers, int64_t per_token,
                                 int64_t experts);

/// Why a step with this loss and gradient norm must not be applied ("loss is nan", ...), or ""
/// when both are finite.
std::string nonfinite_reason(double loss, double grad_norm);

/// Throws std::invalid_argument, on every rank of `group` alike (one all-reduce), when its
/// ranks were not given the same batch: each would train on its share of a different one.
/// Compares the sample count, the token count and a 62-bit FNV-1a hash of the token ids,
/// log-probs and advantages (maximum and minimum over the group).
void check_same_batch(parallel::Group& group, const std::vector<Sample>& samples);

}  // namespace kiln::trainer
