#include "actors/trainer/losses.hpp"

#include <cmath>
#include <stdexcept>

namespace kiln::trainer {

torch::Tensor grpo_advantages(const torch::Tensor& rewards, int64_t group_size, bool normalize_std, double eps) {
  TORCH_CHECK(group_size > 0 && rewards.dim() == 1 && rewards.size(0) % group_size == 0,
              "grpo_advantages: rewards [S] with S a multiple of group_size ", group_size, ", got ", rewards.sizes());
  auto g = rewards.to(torch::kFloat32).view({-1, group_size});  // [groups, n]
  // One NaN or inf reward makes its whole group's advantages non-finite: refuse it by name.
  auto finite = torch::isfinite(rewards);
  if (!finite.all().item<bool>()) {
    const int64_t i = (~finite).nonzero()[0][0].item<int64_t>();
    const double r = rewards[i].item<double>();
    throw std::invalid_argument("grpo_advantages: reward " + std::to_string(i) + " is " +
                                (std::isnan(r) ? "nan" : std::to_string(r)) + " (rewards must be finite)");
  }
  auto a = g - g.mean(1, true);
  // eps bounds the division when a group's rewards (nearly) agree: |A| <= |r - mean| / eps.
  if (normalize_std) a = a / (g.std(1, /*unbiased=*/false, true) + eps);
  return a.reshape({-1});
}

torch::Tensor clamp_log_ratio(const torch::Tensor& x) {
  // Value: the clamped x, exactly (x - x.detach() is 0). Gradient: 1 through the second term;
  // an infinite x gives the bound and no gradient (inf - inf is NaN, mapped to 0).
  return x.detach().clamp(-kMaxLogRatio, kMaxLogRatio) + (x - x.detach()).nan_to_num(0.0, 0.0, 0.0);
}

KLEstimator kl_estimator_from_string(const std::string& name) {
  if (name == "k1") return KLEstimator::k1;
  if (name == "k2") return KLEstimator::k2;
  if (name == "k3") return KLEstimator::k3;
  throw std::invalid_argument("unknown KL estimator '" + name + "' (k1, k2, k3)");
}

Aggregation aggregation_from_string(const std::string& name) {
  if (name == "token_mean") return Aggregation::token_mean;
  if (name == "sequence_mean") return Aggregation::sequence_mean;
  throw std::invalid_argument("unknown loss aggregation '" + name + "' (token_mean, sequence_mean)");
}

torch::Tensor kl_estimate(const torch::Tensor& logprob, const torch::Tensor& ref_logprob, KLEstimator e) {
  auto r = ref_logprob - logprob;
  switch (e) {
    case KLEstimator::k1: return -r;
    case KLEstimator::k2: return 0.5 * r * r;
    case KLEstimator::k3: {
      auto c = clamp_log_ratio(r);
      return torch::exp(c) - 1 - c;
    }
  }
  return {};
}

PolicyLossResult policy_loss(const PolicyTokens& t, const PolicyLossConfig& c, double normalizer,
                             const torch::Tensor& sample_tokens, bool read_sums) {
  TORCH_CHECK(normalizer > 0, "policy_loss: normalizer must be > 0");
  auto mask = t.loss_mask.to(torch::kFloat32);
  auto ratio = torch::exp(clamp_log_ratio(t.logprob - t.old_logprob));
  auto adv = t.advantage.to(torch::kFloat32);
  auto unclipped = ratio * adv;
  auto clipped = torch::clamp(ratio, 1.0 - c.clip_low, 1.0 + c.clip_high) * adv;
  auto per_token = -torch::min(unclipped, clipped);  // [T]
  if (c.tis_cap > 0) {
    auto w = torch::exp(t.old_logprob - t.behavior_logprob).clamp_max(c.tis_cap).detach();
    per_token = per_token * w;
  }
  PolicyLossResult out;
  torch::Tensor pg, clipped_tokens, tokens, kl_sum = torch::zeros({}, mask.options()),
                                             entropy_sum = torch::zeros({}, mask.options());  // fp32 sums
  {
    torch::NoGradGuard g;
    pg = (per_token * mask).sum();
    clipped_tokens = ((clipped < unclipped).to(torch::kFloat32) * mask).sum();
    tokens = mask.sum();
  }
  if (c.kl_coef != 0) {
    auto kl = kl_estimate(t.logprob, t.ref_logprob, kl_estimator_from_string(c.kl_estimator));
    per_token = per_token + c.kl_coef * kl;
    kl_sum = (kl.detach() * mask).sum();
  }
  if (c.entropy_coef != 0 && t.entropy.defined()) {
    per_token = per_token - c.entropy_coef * t.entropy;
    entropy_sum = (t.entropy.detach() * mask).sum();
  }
  // The order of PolicyLossResult's doubles: pg, kl, entropy, clipped tokens, tokens.
  out.sums = torch::stack({pg, kl_sum, entropy_sum, clipped_tokens, tokens}).to(torch::kFloat64);
  if (read_sums) {
    const auto host = out.sums.cpu();
    const double* v = host.data_ptr<double>();
    out.pg_sum = v[0];
    out.kl_sum = v[1];
    out.entropy_sum = v[2];
    out.clipped_tokens = v[3];
    out.tokens = v[4];
  }
  if (aggregation_from_string(c.aggregation) == Aggregation::token_mean) {
    out.loss = (per_token * mask).sum() / normalizer;
  } else {
    TORCH_CHECK(sample_tokens.defined(), "policy_loss: sequence_mean needs sample_tokens");
    auto per_sample_tokens = sample_tokens.to(torch::kFloat32).index_select(0, t.sample_index).clamp_min(1.0);
    out.loss = (per_token * mask / per_sample_tokens).sum() / normalizer;
  }
  return out;
}

}  // namespace kiln::trainer
