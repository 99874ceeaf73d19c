#include "actors/rollout/sampling.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>

namespace kiln::rollout {

void SamplingParams::validate() const {
  auto bad = [](const std::string& s) { throw std::invalid_argument("sampling: " + s); };
  if (!(temperature >= 0)) bad("temperature must be >= 0, got " + std::to_string(temperature));
  if (!(top_p > 0 && top_p <= 1)) bad("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (top_k < 0) bad("top_k must be >= 0, got " + std::to_string(top_k));
  if (max_new_tokens < 1) bad("max_new_tokens must be >= 1, got " + std::to_string(max_new_tokens));
  for (const auto& s : stop_sequences)
    if (s.empty()) bad("stop_sequences must not contain an empty sequence");
}

at::Generator make_generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

SampledToken sample_token(const torch::Tensor& logits, const SamplingParams& p, at::Generator& generator) {
  auto l = logits.to(torch::kFloat32).to(torch::kCPU).reshape({-1});  // [V]
  const bool greedy = p.temperature == 0;
  auto logp = torch::log_softmax(greedy ? l : l / p.temperature, -1);  // [V]
  SampledToken out;
  out.entropy = -(logp.exp() * logp).nan_to_num(0.0).sum().item<float>();
  if (greedy) {
    out.token = l.argmax().item<int64_t>();
  } else {
    auto probs = logp.exp();
    if (p.top_k > 0 && p.top_k < probs.size(0)) {
      auto kth = std::get<0>(probs.topk(p.top_k)).min();
      probs = torch::where(probs >= kth, probs, torch::zeros_like(probs));
    }
    if (p.top_p < 1.0) {
      auto [sorted, order] = probs.sort(-1, /*descending=*/true);
      auto before = sorted.cumsum(-1) - sorted;  // mass strictly above each token
      auto keep_sorted = before < p.top_p * sorted.sum();
      auto keep = torch::zeros_like(keep_sorted).scatter(0, order, keep_sorted);
      probs = torch::where(keep, probs, torch::zeros_like(probs));
    }
    out.token = torch::multinomial(probs, 1, false, generator).item<int64_t>();
  }
  out.logprob = logp[out.token].item<float>();
  return out;
}

}  // namespace kiln::rollout
