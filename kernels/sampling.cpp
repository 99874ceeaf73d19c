#include "kernels/sampling.hpp"

#include <torch/torch.h>

#include "kernels/philox.hpp"

#ifdef KILN_CUDA
#include "kernels/sampling_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
           const at::Tensor& seed, const at::Tensor& step, bool same_device) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "sample_rows: logits must be [B, V] with V >= 1, got ",
              logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "sample_rows: logits must be fp32, got ", logits.scalar_type());
  const int64_t B = logits.size(0);
  const std::pair<const at::Tensor*, at::ScalarType> params[] = {
      {&temperature, at::kDouble}, {&top_k, at::kLong}, {&top_p, at::kDouble}, {&seed, at::kLong}, {&step, at::kLong}};
  const char* names[] = {"temperature", "top_k", "top_p", "seed", "step"};
  for (int i = 0; i < 5; ++i) {
    const auto& t = *params[i].first;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == params[i].second, "sample_rows: ", names[i],
                " must be [B = ", B, "] ", params[i].second, ", got ", t.sizes(), " ", t.scalar_type());
    TORCH_CHECK(!same_device || t.device() == logits.device(), "sample_rows: ", names[i], " is on ", t.device(), ", the logits on ",
                logits.device());
  }
}
}  // namespace

bool sample_rows_uses_kernel(const at::Tensor& logits) {
#ifdef KILN_CUDA
  return logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
         logits.size(1) <= cuda::kMaxVocab;
#else
  (void)logits;
  return false;
#endif
}

at::Tensor sample_rows_ref(const at::Tensor& logits_BV, const at::Tensor& temperature, const at::Tensor& top_k,
                           const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step) {
  check(logits_BV, temperature, top_k, top_p, seed, step, /*same_device=*/false);
  torch::NoGradGuard no_grad;
  const int64_t B = logits_BV.size(0), V = logits_BV.size(1);
  auto out = torch::empty({B, 3}, logits_BV.options().dtype(torch::kFloat64));
  if (B == 0) return out;
  const auto T = temperature.cpu(), K = top_k.cpu(), P = top_p.cpu(), S = seed.cpu(), N = step.cpu();
  const auto* t = T.data_ptr<double>();
  const auto* k = K.data_ptr<int64_t>();
  const auto* p = P.data_ptr<double>();
  const auto* s = S.data_ptr<int64_t>();
  const auto* n = N.data_ptr<int64_t>();
  std::vector<float> temps, us;
  std::vector<uint8_t> greedy;
  bool any_filter = false;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(t[b] >= 0 && p[b] > 0 && p[b] <= 1 && k[b] >= 0 && n[b] >= 0, "sample_rows: row ", b,
                ": temperature ", t[b], " (>= 0), top_p ", p[b], " (in (0, 1]), top_k ", k[b], " (>= 0), step ", n[b],
                " (>= 0)");
    greedy.push_back(!(t[b] > 0));
    temps.push_back(greedy.back() ? 1.f : float(t[b]));
    us.push_back(philox_uniform(uint64_t(s[b]), uint64_t(n[b])));
    any_filter |= !greedy.back() && ((k[b] > 0 && k[b] < V) || p[b] < 1.0);
  }
  const auto l = logits_BV;
  auto logp = torch::log_softmax(l / torch::tensor(temps).to(l.device()).unsqueeze(1), -1);  // [B, V]
  auto probs = logp.exp();
  auto entropy = -(probs * logp).nan_to_num(0.0).sum(-1);  // [B]
  auto filtered = probs;
  if (any_filter) {
    filtered = probs.clone();
    for (int64_t b = 0; b < B; ++b) {
      if (greedy[std::size_t(b)]) continue;
      auto row = filtered[b];
      if (k[b] > 0 && k[b] < V) {
        auto kth = std::get<0>(row.topk(k[b])).min();
        row.copy_(torch::where(row >= kth, row, torch::zeros_like(row)));
      }
      if (p[b] < 1.0) {
        auto [sorted, order] = row.sort(-1, /*descending=*/true);
        auto before = sorted.cumsum(-1) - sorted;  // mass strictly above each token
        auto keep_sorted = before < p[b] * sorted.sum();
        // The smallest kept probability; tokens equal to it are kept too (as the kernel does).
        auto edge = sorted.masked_select(keep_sorted).min();
        row.copy_(torch::where(row >= edge, row, torch::zeros_like(row)));
      }
    }
  }
  auto cdf = filtered.cumsum(-1);  // [B, V]
  // Target strictly below the total so that rounding never lands past the last kept token.
  auto target = (torch::tensor(us).to(l.device()) * (1 - 1e-6)).unsqueeze(1) * cdf.narrow(1, V - 1, 1);
  auto sampled = torch::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).squeeze(1).clamp_max(V - 1);
  auto tokens = torch::where(torch::tensor(greedy).to(l.device()).to(torch::kBool), l.argmax(-1), sampled);  // [B]
  auto picked = logp.gather(1, tokens.unsqueeze(1)).squeeze(1);
  out.copy_(torch::stack({tokens.to(torch::kFloat64), picked.to(torch::kFloat64), entropy.to(torch::kFloat64)}, 1));
  return out;
}

at::Tensor sample_rows(const at::Tensor& logits_BV, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step) {
#ifdef KILN_CUDA
  if (sample_rows_uses_kernel(logits_BV)) {
    check(logits_BV, temperature, top_k, top_p, seed, step, /*same_device=*/true);
    auto out = torch::empty({logits_BV.size(0), 3}, logits_BV.options().dtype(torch::kFloat64));
    cuda::sample_rows(logits_BV.contiguous(), temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                      seed.contiguous(), step.contiguous(), out);
    return out;
  }
#endif
  return sample_rows_ref(logits_BV, temperature, top_k, top_p, seed, step);
}

}  // namespace kiln::kernels
