#pragma once
// RL losses on packed tokens. Legend: T tokens of a micro-batch, S samples.
//
// Normalisation never depends on how samples fall into micro-batches: every micro-batch's
// loss is divided by a *global* normaliser (all loss tokens of the step for token-mean, all
// samples of the step for sequence-mean), so summing the micro-batches' gradients gives the
// gradient of the step's loss.
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "actors/trainer/trainer_config.hpp"

namespace kiln::trainer {

/// GRPO group-relative advantages (DeepSeekMath, arXiv:2402.03300 §4.1.2): rewards [S] laid
/// out as consecutive groups of `group_size` samples of one prompt; A = r - mean(group),
/// divided by (std(group) + eps) if normalize_std (population std, as verl's grpo estimator).
/// Throws std::invalid_argument naming the first non-finite reward (it would poison its group).
torch::Tensor grpo_advantages(const torch::Tensor& rewards, int64_t group_size, bool normalize_std, double eps = 1e-6);

/// Log-ratios fed to exp() are clamped to [-kMaxLogRatio, kMaxLogRatio] (verl's bound for its
/// PPO ratio and low-variance KL): exp(20) = 4.85e8 is finite in fp32, exp(89) is not.
inline constexpr double kMaxLogRatio = 20.0;

/// x clamped to [-kMaxLogRatio, kMaxLogRatio] in value, with the gradient of x (1) everywhere:
/// past the bound a term keeps pulling back at its largest finite strength instead of
/// letting go (a plain clamp's gradient is 0 there).
torch::Tensor clamp_log_ratio(const torch::Tensor& x);

/// KL(pi || ref) estimators per token from log-probs (Schulman, "Approximating KL
/// divergence", 2020), with r = ref_logprob - logprob:
///   k1 = -r,  k2 = r^2 / 2,  k3 = exp(r) - 1 - r  with r = clamp_log_ratio(r) (k3 only: the
/// others have no exp). So k3(-100 vs ref -5) = e^20 - 21 = 4.852e8, d/dlogprob = 1 - e^20.
enum class KLEstimator { k1, k2, k3 };
KLEstimator kl_estimator_from_string(const std::string& name);  ///< "k1"|"k2"|"k3", else throws
torch::Tensor kl_estimate(const torch::Tensor& logprob, const torch::Tensor& ref_logprob, KLEstimator estimator);

enum class Aggregation { token_mean, sequence_mean };
Aggregation aggregation_from_string(const std::string& name);  ///< "token_mean"|"sequence_mean"


/// One micro-batch's per-token inputs, all [T].
struct PolicyTokens {
  torch::Tensor logprob;           ///< current policy, requires grad
  torch::Tensor old_logprob;       ///< policy before this step's updates (recomputed), no grad
  torch::Tensor behavior_logprob;  ///< what the rollout sampled with
  torch::Tensor ref_logprob;       ///< reference policy (used when kl_coef > 0)
  torch::Tensor advantage;         ///< per token (the sample's advantage broadcast)
  torch::Tensor loss_mask;         ///< 1 on trained (completion) tokens, 0 elsewhere
  torch::Tensor sample_index;      ///< int64, which sample (0..S-1 of the step) a token belongs to
  torch::Tensor entropy;           ///< optional, per-token entropy (differentiable) for the bonus
};

struct PolicyLossResult {
  torch::Tensor loss;  ///< scalar: this micro-batch's share of the step loss (backward it)
  /// The sums below as [kSums] fp64 on the loss's device, in their order (kl and entropy 0 where
  /// their coefficient is), made without reading them back: the trainer adds its micro-batches'
  /// on the device and reads the step's once.
  torch::Tensor sums;
  static constexpr int64_t kSums = 5;
  // Sums over this micro-batch's loss tokens (divide by the step's token count to report); read
  // from `sums` (one device-to-host copy) unless policy_loss was asked not to:
  double pg_sum = 0, kl_sum = 0, entropy_sum = 0, clipped_tokens = 0, tokens = 0;
};

/// PPO clipped surrogate against the old policy (ratio = exp(clamp_log_ratio(logprob -
/// old_logprob))): per token -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A), times
/// the TIS weight, + kl_coef * KL(pi || ref) - entropy_coef * entropy, aggregated per
/// config.aggregation and divided by `normalizer` (token_mean: the step's loss-token count;
/// sequence_mean: the step's sample count; each sample's token losses are first averaged
/// over its own tokens, which needs `sample_tokens` [S]: loss tokens per sample of the step).
/// read_sums = false leaves the doubles of the result at 0 (its `sums` tensor holds them): no
/// wait for the device.
PolicyLossResult policy_loss(const PolicyTokens& t, const PolicyLossConfig& config, double normalizer,
                             const torch::Tensor& sample_tokens = {}, bool read_sums = true);

}  // namespace kiln::trainer
