#include "kernels/moe.hpp"

#include "kernels/grouped_gemm.hpp"
#include "kernels/moe_decode.hpp"
#include "kernels/swiglu.hpp"

#include <torch/torch.h>

#ifdef KILN_CUDA
#include "kernels/moe_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
void check_experts(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1, const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3, "grouped_swiglu: x must be [M, D], weights [E, 2F, D] ",
              "and [E, D, F]; got ", x.sizes(), ", ", w1.sizes(), ", ", w2.sizes());
  const int64_t E = w1.size(0), D = x.size(1), F = w2.size(2);
  TORCH_CHECK(w1.size(1) == 2 * F && w1.size(2) == D && w2.size(0) == E && w2.size(1) == D,
              "grouped_swiglu: weights ", w1.sizes(), " and ", w2.sizes(), " do not fit D = ", D);
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == E, "grouped_swiglu: counts must be [E = ", E, "], got ",
              counts.sizes());
}
}  // namespace

bool grouped_swiglu_uses_grouped_mm(const at::Tensor& x, const at::Tensor& w1) {
#ifdef KILN_CUDA
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && w1.scalar_type() == at::kBFloat16 && x.size(1) % 8 == 0 &&
         w1.size(1) % 16 == 0;
#else
  return false;
#endif
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, std::optional<double> limit) {
  if (!limit) return torch::silu(gate) * up;
  return torch::silu(gate.clamp_max(*limit)) * up.clamp(-*limit, *limit);
}

at::Tensor grouped_swiglu_ref(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1,
                              const at::Tensor& w2, std::optional<double> swiglu_limit) {
  check_experts(x, counts, w1, w2);
  auto c = counts.to(torch::kCPU).to(torch::kInt64);
  const auto* n = c.data_ptr<int64_t>();
  TORCH_CHECK(c.sum().item<int64_t>() == x.size(0), "grouped_swiglu: counts sum to ", c.sum().item<int64_t>(),
              ", not M = ", x.size(0));
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (int64_t e = 0; e < c.size(0); ++e) {
    if (n[e] == 0) continue;
    auto rows = x.narrow(0, start, n[e]);                                  // [n, D]
    auto gu = torch::nn::functional::linear(rows, w1[e]);                  // [n, 2F]
    const int64_t F = gu.size(-1) / 2;
    outs.push_back(torch::nn::functional::linear(swiglu(gu.narrow(-1, 0, F), gu.narrow(-1, F, F), swiglu_limit), w2[e]));
    start += n[e];
  }
  if (outs.empty()) return torch::zeros({0, x.size(1)}, x.options());
  return torch::cat(outs, 0);
}

at::Tensor grouped_swiglu(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1, const at::Tensor& w2,
                          std::optional<double> swiglu_limit) {
  check_experts(x, counts, w1, w2);
  // Inference at few rows inside a DecodeExpertsGuard (the rollout engine): the decode kernels.
  if (x.size(0) <= DecodeExpertsGuard::max_rows() && !at::GradMode::is_enabled() &&
      grouped_swiglu_decode_supports(x, w1, w2))
    return grouped_swiglu_decode(x, counts, w1, w2, swiglu_limit);
  if (!grouped_swiglu_uses_grouped_mm(x, w1)) return grouped_swiglu_ref(x, counts, w1, w2, swiglu_limit);
  // offs[e] = end row of expert e (int32, on the device). Weights go in as [E, D, 2F] and
  // [E, F, D] views with the reduction dim contiguous, the layout the Hopper kernel takes.
  auto offs = counts.to(x.device()).cumsum(0).to(torch::kInt32);
  if (grouped_linear_chosen() && grouped_linear_available(x, w1) && w2.scalar_type() == at::kBFloat16 &&
      w2.size(2) % 8 == 0) {
    // kiln's grouped GEMM (kernels/grouped_gemm.hpp), when chosen: tiles chosen per layout, the
    // weight gradients written in the weights' own [E, out, in] layout.
    auto gu = grouped_linear(x, w1, offs);                          // [M, 2F]
    return grouped_linear(swiglu_packed(gu, swiglu_limit), w2, offs);  // [M, D]
  }
  auto gu = at::_grouped_mm(x.contiguous(), w1.transpose(-2, -1), offs);  // [M, 2F]
  auto act = swiglu_packed(gu, swiglu_limit);  // [M, F]: one kernel each way (kernels/swiglu.hpp)
  return at::_grouped_mm(act.contiguous(), w2.transpose(-2, -1), offs);    // [M, D]
}

at::Tensor router_topk_ref(const at::Tensor& logits, const at::Tensor& bias, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && bias.dim() == 1 && bias.size(0) == logits.size(1), "router_topk: logits must be ",
              "[T, E] and bias [E], got ", logits.sizes(), " and ", bias.sizes());
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "router_topk: k = ", k, " outside [1, E]");
  auto choice = logits.to(torch::kFloat32).sigmoid() + bias.to(torch::kFloat32);
  return std::get<1>(choice.topk(k, -1, /*largest=*/true, /*sorted=*/true));
}

at::Tensor sum_in_slot_order(const at::Tensor& w) {
  auto sum = w.narrow(1, 0, 1);  // [T, 1], then + slot 1, + slot 2, ...
  for (int64_t k = 1; k < w.size(1); ++k) sum = sum + w.narrow(1, k, 1);
  return sum;
}

std::pair<at::Tensor, at::Tensor> router_topk_weights_ref(const at::Tensor& logits, const at::Tensor& bias, int64_t k,
                                                          bool norm_topk_prob, double routed_scaling_factor) {
  auto ids = router_topk_ref(logits, bias, k);
  auto w = logits.to(torch::kFloat32).sigmoid().gather(1, ids);  // [T, K]
  if (norm_topk_prob) w = w / (sum_in_slot_order(w) + 1e-20);  // k order, as the kernel
  return {ids, w * routed_scaling_factor};
}

std::pair<at::Tensor, at::Tensor> router_topk_weights(const at::Tensor& logits, const at::Tensor& bias, int64_t k,
                                                      bool norm_topk_prob, double routed_scaling_factor) {
#ifdef KILN_CUDA
  if (logits.is_cuda() && logits.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
      logits.dim() == 2 && logits.size(1) <= 512 && k <= 16) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == logits.size(1), "router_topk_weights: logits must be [T, E] and ",
                "bias [E], got ", logits.sizes(), " and ", bias.sizes());
    TORCH_CHECK(k >= 1 && k <= logits.size(1), "router_topk_weights: k = ", k, " outside [1, E]");
    auto ids = torch::empty({logits.size(0), k}, logits.options().dtype(torch::kInt64));
    auto w = torch::empty({logits.size(0), k}, logits.options());
    cuda::router_topk(logits.contiguous(), bias.contiguous(), ids, &w, norm_topk_prob, routed_scaling_factor);
    return {ids, w};
  }
#endif
  return router_topk_weights_ref(logits, bias, k, norm_topk_prob, routed_scaling_factor);
}

at::Tensor router_topk(const at::Tensor& logits, const at::Tensor& bias, int64_t k) {
#ifdef KILN_CUDA
  if (logits.is_cuda() && logits.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
      logits.size(1) <= 512 && k <= 16) {
    TORCH_CHECK(logits.dim() == 2 && bias.dim() == 1 && bias.size(0) == logits.size(1), "router_topk: logits must ",
                "be [T, E] and bias [E], got ", logits.sizes(), " and ", bias.sizes());
    TORCH_CHECK(k >= 1 && k <= logits.size(1), "router_topk: k = ", k, " outside [1, E]");
    auto ids = torch::empty({logits.size(0), k}, logits.options().dtype(torch::kInt64));
    cuda::router_topk(logits.contiguous(), bias.contiguous(), ids);
    return ids;
  }
#endif
  return router_topk_ref(logits, bias, k);
}

}  // namespace kiln::kernels
