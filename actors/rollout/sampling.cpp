#include "actors/rollout/sampling.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>

#include "model/blocks/logprobs.hpp"

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

std::vector<SampledToken> sample_tokens(const torch::Tensor& logits_BV, const std::vector<const SamplingParams*>& params,
                                        const std::vector<at::Generator*>& generators, bool batch_invariant) {
  const int64_t B = logits_BV.size(0);
  if (int64_t(params.size()) != B || int64_t(generators.size()) != B)
    throw std::invalid_argument("sample_tokens: " + std::to_string(B) + " rows but " + std::to_string(params.size()) +
                                " params and " + std::to_string(generators.size()) + " generators");
  std::vector<SampledToken> out(static_cast<std::size_t>(B));
  if (B == 0) return out;
  torch::NoGradGuard no_grad;
  auto l = logits_BV.to(torch::kFloat32);                                       // [B, V]
  std::vector<float> temps, us;
  bool any_filter = false;
  for (int64_t b = 0; b < B; ++b) {
    const auto& p = *params[std::size_t(b)];
    temps.push_back(p.temperature == 0 ? 1.f : float(p.temperature));
    // One uniform per row from the request's own CPU generator, drawn for greedy rows too
    // (so that a request's stream does not depend on its neighbours).
    us.push_back(torch::rand({1}, *generators[std::size_t(b)], torch::kFloat64).item<float>());
    any_filter |= p.temperature != 0 && ((p.top_k > 0 && p.top_k < l.size(1)) || p.top_p < 1.0);
  }
  torch::Tensor logp;  // [B, V]
  if (batch_invariant) {
    if (logits_BV.scalar_type() != torch::kFloat32)
      throw std::invalid_argument(std::string("sample_tokens: the batch-invariant mode takes fp32 logits ") +
                                  "(model::invariant_lm_logits), got " + c10::toString(logits_BV.scalar_type()));
    auto [z, lse] = model::invariant_tempered_logits(l, torch::tensor(temps));
    logp = z - lse.unsqueeze(1);  // elementwise: row b's values depend on row b alone
  } else {
    logp = torch::log_softmax(l / torch::tensor(temps).to(l.device()).unsqueeze(1), -1);
  }
  auto probs = logp.exp();
  auto entropy = -(probs * logp).nan_to_num(0.0).sum(-1);                      // [B]
  auto filtered = probs;
  if (any_filter) {
    filtered = probs.clone();
    for (int64_t b = 0; b < B; ++b) {
      const auto& p = *params[std::size_t(b)];
      if (p.temperature == 0) continue;
      auto row = filtered[b];
      if (p.top_k > 0 && p.top_k < row.size(0)) {
        auto kth = std::get<0>(row.topk(p.top_k)).min();
        row.copy_(torch::where(row >= kth, row, torch::zeros_like(row)));
      }
      if (p.top_p < 1.0) {
        auto [sorted, order] = row.sort(-1, /*descending=*/true);
        auto before = sorted.cumsum(-1) - sorted;  // mass strictly above each token
        auto keep_sorted = before < p.top_p * sorted.sum();
        auto keep = torch::zeros_like(keep_sorted).scatter(0, order, keep_sorted);
        row.copy_(torch::where(keep, row, torch::zeros_like(row)));
      }
    }
  }
  auto cdf = filtered.cumsum(-1);                                               // [B, V]
  // Target strictly below the total so that rounding never lands past the last kept token.
  auto target = (torch::tensor(us).to(l.device()) * (1 - 1e-6)).unsqueeze(1) * cdf.narrow(1, cdf.size(1) - 1, 1);
  auto sampled = torch::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).squeeze(1).clamp_max(l.size(1) - 1);
  auto greedy = l.argmax(-1);
  std::vector<uint8_t> is_greedy;
  for (int64_t b = 0; b < B; ++b) is_greedy.push_back(params[std::size_t(b)]->temperature == 0);
  auto tokens = torch::where(torch::tensor(is_greedy).to(l.device()).to(torch::kBool), greedy, sampled);  // [B]
  auto picked = logp.gather(1, tokens.unsqueeze(1)).squeeze(1);
  auto host = torch::stack({tokens.to(torch::kFloat64), picked.to(torch::kFloat64), entropy.to(torch::kFloat64)})
                  .to(torch::kCPU);  // one read: [3, B]
  auto h = host.accessor<double, 2>();
  for (int64_t b = 0; b < B; ++b) out[std::size_t(b)] = {int64_t(h[0][b]), float(h[1][b]), float(h[2][b])};
  return out;
}

SampledToken sample_token(const torch::Tensor& logits, const SamplingParams& p, at::Generator& generator) {
  return sample_tokens(logits.reshape({1, -1}), {&p}, {&generator})[0];
}

}  // namespace kiln::rollout
