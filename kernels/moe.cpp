#include "kernels/moe.hpp"

#include "kernels/alignment.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/moe_decode.hpp"
#include "kernels/moe_dispatch.hpp"
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

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The routed experts' three GEMM forms for a weight w [E, N, K] over rows in expert order, by
// the path grouped_swiglu takes: forward y = x w[e]^T [M, N], the input's gradient dx = dy w[e]
// [M, K], the weight's dw[e] = dy_e^T x_e [E, N, K].
struct ExpertGemms {
  enum class Path { kiln, aten, per_expert } path;
  at::Tensor offs;               // [E] int32 end rows, on the device (grouped paths)
  std::vector<int64_t> counts;   // rows per expert, on the host (per_expert)

  // x: any [., D] operand of the experts (for the path); M rows in expert order.
  ExpertGemms(const at::Tensor& x, int64_t M, const at::Tensor& counts_E, const at::Tensor& w1, const at::Tensor& w2) {
    if (!grouped_swiglu_uses_grouped_mm(x, w1)) {
      path = Path::per_expert;
      auto c = counts_E.to(at::kCPU).to(at::kLong).contiguous();
      counts.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
      int64_t sum = 0;
      for (auto n : counts) sum += n;
      TORCH_CHECK(sum == M, "routed_experts_combine: counts sum to ", sum, ", not M = ", M);
      return;
    }
    path = grouped_linear_chosen() && grouped_linear_available(x, w1) && w2.scalar_type() == at::kBFloat16 &&
                   w2.size(2) % 8 == 0
               ? Path::kiln
               : Path::aten;
    offs = counts_E.to(x.device()).cumsum(0).to(at::kInt);
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& w) const {
    if (kiln(GroupedLayout::kRowCol)) return grouped_mm_ragged_m(aligned_contiguous(x), aligned_contiguous(w).transpose(-2, -1), offs);
    if (path != Path::per_expert) return at::_grouped_mm(x.contiguous(), w.transpose(-2, -1), offs);
    auto y = at::empty({x.size(0), w.size(1)}, x.options());
    for_each([&](int64_t e, int64_t s, int64_t n) { y.narrow(0, s, n).copy_(at::linear(x.narrow(0, s, n), w[e])); });
    return y;
  }
  // gu = forward(x, w1) [M, 2F] and rows = forward(swiglu_packed(gu), w2) [M, D]; per expert
  // as grouped_swiglu_ref runs them (each expert's activation its own tensor): its bits.
  std::pair<at::Tensor, at::Tensor> forward_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                                                   std::optional<double> limit) const {
    if (path != Path::per_expert) {
      auto gu = forward(x, w1);
      return {gu, forward(swiglu_packed(gu, limit), w2)};
    }
    auto gu = at::empty({x.size(0), w1.size(1)}, x.options()), rows = at::empty({x.size(0), w2.size(1)}, x.options());
    for_each([&](int64_t e, int64_t s, int64_t n) {
      auto g = gu.narrow(0, s, n);
      g.copy_(at::linear(x.narrow(0, s, n), w1[e]));
      const int64_t F = w2.size(2);
      rows.narrow(0, s, n).copy_(at::linear(swiglu(g.narrow(1, 0, F), g.narrow(1, F, F), limit), w2[e]));
    });
    return {gu, rows};
  }
  at::Tensor input_grad(const at::Tensor& dy, const at::Tensor& w) const {
    if (kiln(GroupedLayout::kRowRow)) return grouped_mm_ragged_m(aligned_contiguous(dy), aligned_contiguous(w), offs);
    if (path != Path::per_expert) return at::_grouped_mm(dy.contiguous(), w.contiguous(), offs);
    auto dx = at::empty({dy.size(0), w.size(2)}, dy.options());
    for_each([&](int64_t e, int64_t s, int64_t n) { dx.narrow(0, s, n).copy_(dy.narrow(0, s, n).mm(w[e])); });
    return dx;
  }
  at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& x) const {
    if (kiln(GroupedLayout::kColRow)) return grouped_mm_ragged_k(aligned_contiguous(dy).t(), aligned_contiguous(x), offs);
    if (path != Path::per_expert) return at::_grouped_mm(dy.contiguous().t(), x.contiguous(), offs);
    auto dw = at::zeros({int64_t(counts.size()), dy.size(1), x.size(1)}, dy.options());
    for_each([&](int64_t e, int64_t s, int64_t n) { dw[e].copy_(dy.narrow(0, s, n).t().mm(x.narrow(0, s, n))); });
    return dw;
  }

 private:
  // Path::kiln and that form not kept on at::_grouped_mm (KILN_GROUPED_GEMM_TILES, kernels/grouped_gemm.hpp).
  bool kiln(GroupedLayout form) const { return path == Path::kiln && grouped_linear_chosen_for(form); }
  template <class Fn>
  void for_each(Fn fn) const {
    int64_t s = 0;
    for (int64_t e = 0; e < int64_t(counts.size()); s += counts[e], ++e)
      if (counts[e] > 0) fn(e, s, counts[e]);
  }
};

// kernels::routed_experts_combine (kernels/moe.hpp): keeps gu [M, 2F] and what the caller holds.
struct RoutedExpertsCombine : public torch::autograd::Function<RoutedExpertsCombine> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& weights, const at::Tensor& token_index, const at::Tensor& slot,
                            const at::Tensor& row_of_slot, const at::Tensor& counts, std::optional<double> limit) {
    const ExpertGemms g(x, token_index.size(0), counts, w1, w2);
    at::Tensor gu, y;
    {
      // gu [M, 2F] kept; the gathered rows, the activation and rows [M, D] freed here
      auto [gu_, rows] = g.forward_swiglu(gather_rows(x, token_index), w1, w2, limit);
      gu = gu_;
      y = moe_combine(rows, row_of_slot, weights);  // [T, D]
    }
    ctx->save_for_backward({x, w1, w2, weights, token_index, slot, row_of_slot, counts, gu});
    ctx->saved_data["limit"] = limit ? c10::IValue(*limit) : c10::IValue();
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w1 = s[1], &w2 = s[2], &weights = s[3], &token_index = s[4], &slot = s[5],
               &row_of_slot = s[6], &counts = s[7], &gu = s[8];
    const auto lim = ctx->saved_data["limit"];
    const std::optional<double> limit = lim.isNone() ? std::nullopt : std::optional<double>(lim.toDouble());
    const int64_t T = weights.size(0), K = weights.size(1);
    const ExpertGemms g(x, token_index.size(0), counts, w1, w2);
    auto grad_rows = gather_rows(grads[0].to(x.scalar_type()), token_index);  // [M, D], unweighted
    auto h = g.input_grad(grad_rows, w2);                                                      // [M, F]
    auto r = swiglu_routed_backward(gu, h, weights.reshape({-1}).index_select(0, slot), limit);
    h = at::Tensor();
    at::Tensor dx, dw1, dw2, dweights;
    if (ctx->needs_input_grad(2)) dw2 = g.weight_grad(grad_rows, r.act_w);  // [E, D, F]
    grad_rows = at::Tensor(), r.act_w = at::Tensor();
    if (ctx->needs_input_grad(1)) dw1 = g.weight_grad(r.dgu, gather_rows(x, token_index));  // [E, 2F, D]
    if (ctx->needs_input_grad(0)) {
      auto dx_rows = g.input_grad(r.dgu, w1);  // [M, D]
      r.dgu = at::Tensor();
      // A token's K rows summed in fp32 in k order by the combine kernel with unit weights.
      dx = x.is_cuda() ? moe_combine(dx_rows, row_of_slot, at::ones({T, K}, weights.options()))
                       : dx_rows.index_select(0, row_of_slot).view({T, K, x.size(1)}).sum(1);
    }
    if (ctx->needs_input_grad(3)) dweights = r.dw_row.index_select(0, row_of_slot).view({T, K});
    return {dx, dw1, dw2, dweights, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor routed_experts_combine(const at::Tensor& x, const at::Tensor& token_index, const at::Tensor& slot,
                                  const at::Tensor& row_of_slot, const at::Tensor& counts, const at::Tensor& w1,
                                  const at::Tensor& w2, const at::Tensor& weights, std::optional<double> swiglu_limit) {
  check_experts(x, counts, w1, w2);
  const int64_t M = token_index.numel();
  TORCH_CHECK(token_index.dim() == 1 && slot.dim() == 1 && row_of_slot.dim() == 1 && slot.size(0) == M &&
                  row_of_slot.size(0) == M,
              "routed_experts_combine: token_index, slot and row_of_slot must be [M], got ", token_index.sizes(), ", ",
              slot.sizes(), " and ", row_of_slot.sizes());
  TORCH_CHECK(weights.dim() == 2 && weights.numel() == M && weights.size(0) == x.size(0) &&
                  weights.scalar_type() == at::kFloat,
              "routed_experts_combine: weights must be [T, K] fp32 with T = ", x.size(0), " and T*K = M = ", M,
              ", got ", weights.sizes(), " ", weights.scalar_type());
  return RoutedExpertsCombine::apply(x, w1, w2, weights, token_index, slot, row_of_slot, counts, swiglu_limit);
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
