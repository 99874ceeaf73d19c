#include "actors/controller/grpo.hpp"

#include <stdexcept>

#include "actors/controller/staleness.hpp"
#include "actors/trainer/losses.hpp"

namespace kiln::controller {

Groups build_groups(const std::vector<rollout::Completion>& completions, const std::vector<float>& rewards,
                    std::vector<std::vector<float>> ref_logprobs, const AlgorithmConfig& a, int64_t trainer_version) {
  const std::size_t n = std::size_t(a.samples_per_prompt), S = completions.size();
  if (rewards.size() != S || ref_logprobs.size() != S || n == 0 || S % n != 0)
    throw std::invalid_argument("build_groups: " + std::to_string(S) + " completions, " +
                                std::to_string(rewards.size()) + " rewards, " + std::to_string(ref_logprobs.size()) +
                                " reference log-prob rows for groups of " + std::to_string(n));
  auto r = torch::tensor(rewards);  // [S]
  auto adv_t = trainer::grpo_advantages(r, int64_t(n), a.normalize_std).contiguous();
  const float* adv = adv_t.data_ptr<float>();
  Groups out;
  for (std::size_t g = 0; g < S / n; ++g) {
    auto group = r.narrow(0, int64_t(g * n), int64_t(n));
    if (a.filter_zero_variance && (group.max() - group.min()).item<float>() == 0) {
      ++out.filtered;
      continue;
    }
    if (too_stale(completions, g * n, n, trainer_version, a.staleness)) {
      ++out.stale_dropped;
      continue;
    }
    for (std::size_t i = g * n; i < (g + 1) * n; ++i) {
      const auto& comp = completions[i];
      trainer::Sample s;
      s.prompt = comp.prompt;
      s.completion = comp.tokens;
      s.behavior_logprobs = comp.logprobs;
      s.routed_experts = comp.routed_experts;
      s.topk_indices = comp.topk_indices;
      s.ref_logprobs = std::move(ref_logprobs[i]);
      s.advantage = adv[i];
      out.samples.push_back(std::move(s));
    }
  }
  return out;
}

}  // namespace kiln::controller
