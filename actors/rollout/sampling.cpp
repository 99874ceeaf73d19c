#include "actors/rollout/sampling.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "kernels/sampling.hpp"
#include "model/blocks/logprobs.hpp"
#include "model/blocks/temperature.hpp"

namespace kiln::rollout {

void SamplingParams::validate() const {
  auto bad = [](const std::string& s) { throw std::invalid_argument("sampling: " + s); };
  if (!(temperature == 0 || temperature >= model::kMinTemperature))
    bad("temperature must be 0 (greedy) or >= 1e-5, got " + std::to_string(temperature));
  if (!(top_p > 0 && top_p <= 1)) bad("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (top_k < 0) bad("top_k must be >= 0, got " + std::to_string(top_k));
  if (max_new_tokens < 1) bad("max_new_tokens must be >= 1, got " + std::to_string(max_new_tokens));
  for (const auto& s : stop_sequences)
    if (s.empty()) bad("stop_sequences must not contain an empty sequence");
}

void write_sampling_rows(const std::vector<const SamplingParams*>& params, const std::vector<int64_t>& steps,
                         int64_t* five, int64_t B) {
  if (int64_t(params.size()) > B || steps.size() != params.size())
    throw std::invalid_argument("write_sampling_rows: " + std::to_string(params.size()) + " params and " +
                                std::to_string(steps.size()) + " steps for " + std::to_string(B) + " rows");
  for (int64_t b = 0; b < B; ++b) {
    const bool real = b < int64_t(params.size());
    // Rows past the params (a graph's padding rows): greedy, no filter.
    const double t = real ? params[std::size_t(b)]->temperature : 0.0,
                 p = real ? std::max(params[std::size_t(b)]->top_p, kTopPFloor) : 1.0;
    std::memcpy(&five[b], &t, sizeof t);
    five[B + b] = real ? params[std::size_t(b)]->top_k : 0;
    std::memcpy(&five[2 * B + b], &p, sizeof p);
    five[3 * B + b] = real ? int64_t(params[std::size_t(b)]->seed) : 0;
    five[4 * B + b] = real ? steps[std::size_t(b)] : 0;
  }
}

SamplingRows::SamplingRows(const torch::Tensor& five) {
  const int64_t B = five.numel() / 5;
  if (five.dim() != 1 || five.numel() != 5 * B || five.scalar_type() != torch::kInt64)
    throw std::invalid_argument("SamplingRows: need a [5 * B] int64 tensor, got " + c10::str(five.sizes()) + " " +
                                c10::toString(five.scalar_type()));
  temperature = five.narrow(0, 0, B).view(torch::kFloat64);
  top_k = five.narrow(0, B, B);
  top_p = five.narrow(0, 2 * B, B).view(torch::kFloat64);
  seed = five.narrow(0, 3 * B, B);
  step = five.narrow(0, 4 * B, B);
}

torch::Tensor SamplingRows::sample(const torch::Tensor& logits_BV, bool kernel) const {
  auto l = logits_BV.to(torch::kFloat32);
  return kernel ? kernels::sample_rows(l, temperature, top_k, top_p, seed, step)
                : kernels::sample_rows_ref(l, temperature, top_k, top_p, seed, step);
}

std::vector<SampledToken> sampled_tokens(const torch::Tensor& out_B3) {
  auto host = out_B3.to(torch::kCPU).contiguous();  // the one read of the batch
  auto h = host.accessor<double, 2>();
  std::vector<SampledToken> out(static_cast<std::size_t>(host.size(0)));
  for (int64_t b = 0; b < host.size(0); ++b) out[std::size_t(b)] = {int64_t(h[b][0]), float(h[b][1]), float(h[b][2])};
  return out;
}

std::vector<SampledToken> sample_tokens(const torch::Tensor& logits_BV, const std::vector<const SamplingParams*>& params,
                                        const std::vector<int64_t>& steps, bool kernel, bool batch_invariant) {
  const int64_t B = logits_BV.size(0);
  if (int64_t(params.size()) != B || int64_t(steps.size()) != B)
    throw std::invalid_argument("sample_tokens: " + std::to_string(B) + " rows but " + std::to_string(params.size()) +
                                " params and " + std::to_string(steps.size()) + " steps");
  if (B == 0) return {};
  torch::NoGradGuard no_grad;
  auto five = torch::empty({5 * B}, torch::kInt64);
  write_sampling_rows(params, steps, five.data_ptr<int64_t>(), B);
  // The kernel reads the parameters on the logits' device, the reference on the host.
  const auto logits = logits_BV.to(torch::kFloat32);
  kernel = kernel && kernels::sample_rows_uses_kernel(logits);
  auto out = SamplingRows(kernel ? five.to(logits.device()) : five).sample(logits, kernel);  // [B, 3] fp64
  if (batch_invariant) {
    if (logits_BV.scalar_type() != torch::kFloat32)
      throw std::invalid_argument(std::string("sample_tokens: the batch-invariant mode takes fp32 logits ") +
                                  "(model::invariant_lm_logits), got " + c10::toString(logits_BV.scalar_type()));
    std::vector<float> temps;
    for (const auto* p : params) temps.push_back(p->temperature == 0 ? 1.f : float(p->temperature));
    auto [z, lse] = model::invariant_tempered_logits(logits, torch::tensor(temps));  // [B, V], [B]
    auto tokens = out.select(1, 0).to(torch::kInt64).unsqueeze(1);                    // [B, 1]
    // elementwise: row b's value depends on row b alone
    out.select(1, 1).copy_((z.gather(1, tokens).squeeze(1) - lse).to(torch::kFloat64));
  }
  return sampled_tokens(out);
}

SampledToken sample_token(const torch::Tensor& logits, const SamplingParams& p, int64_t step) {
  return sample_tokens(logits.reshape({1, -1}), {&p}, {step})[0];
}

}  // namespace kiln::rollout
