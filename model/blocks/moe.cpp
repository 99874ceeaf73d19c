#include "model/blocks/moe.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/moe.hpp"
#include "kernels/moe_dispatch.hpp"
#include "kernels/side_stream.hpp"
#include "model/blocks/fusions.hpp"
#include "model/blocks/moe_ep.hpp"
#include "model/blocks/recompute.hpp"

namespace kiln::model {

RouteResult route_from_scores(const torch::Tensor& scores_TE, const torch::Tensor& bias_E, const RouterOptions& o,
                              const std::optional<torch::Tensor>& given_ids_TK, bool validate) {
  const int64_t T = scores_TE.size(0), E = o.num_experts, K = o.top_k;
  torch::Tensor ids;
  if (given_ids_TK) {
    ids = given_ids_TK->to(torch::kInt64);
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.size(1) == K, "replayed expert ids must be [T, K] = [", T,
                ", ", K, "], got ", ids.sizes());
    TORCH_CHECK(!validate || ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < E),
                "replayed expert ids must lie in [0, ", E, ")");
  } else {
    torch::NoGradGuard no_grad;
    auto choice = scores_TE.detach() + bias_E.to(torch::kFloat32);  // [T, E], fp32: bias never rounded
    if (o.n_group > 1) {
      auto grouped = choice.view({T, o.n_group, E / o.n_group});                           // [T, G, E/G]
      auto group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);                        // [T, G]
      auto keep = std::get<1>(group_scores.topk(o.topk_group, -1, true, false));            // [T, topk_group]
      auto mask = torch::zeros_like(group_scores, torch::kBool).scatter_(1, keep, true);    // [T, G]
      mask = mask.unsqueeze(-1).expand({T, o.n_group, E / o.n_group}).reshape({T, E});
      choice = choice.masked_fill(~mask, -std::numeric_limits<float>::infinity());
    }
    ids = std::get<1>(choice.topk(K, -1, /*largest=*/true, /*sorted=*/true));  // [T, K]
  }
  auto w = scores_TE.gather(1, ids);  // [T, K] unbiased scores: gradients reach the router
  // Slot order, as kernels::router_topk_weights sums: one flipped last bit of a routing weight
  // was the default mode's whole train/rollout gap under routing replay.
  if (o.norm_topk_prob) w = w / (kernels::sum_in_slot_order(w) + 1e-20);
  return RouteResult{ids, w * o.routed_scaling_factor};
}

TopKRouterImpl::TopKRouterImpl(const RouterOptions& o) : o_(o) {
  weight = register_parameter("weight", torch::zeros({o.num_experts, o.hidden}));
  e_score_correction_bias = register_buffer("e_score_correction_bias", torch::zeros({o.num_experts}));
}

RouteResult TopKRouterImpl::forward(const torch::Tensor& x, const std::optional<torch::Tensor>& given_ids_TK,
                                    bool validate_given) {
  if (batch_invariant_) {
    auto logits = invariant_linear(x.to(torch::kFloat32), weight.to(torch::kFloat32));  // [T, E] fp32
    return route_from_scores(invariant_sigmoid(logits), e_score_correction_bias, o_, given_ids_TK, validate_given);
  }
  // fp32 without split-K (cuBLAS splits this [E x D] GEMM at every row count): a token's
  // routing weights are the same bits in a decode step and in the trainer's micro-batch.
  auto logits = unsplit_linear_fp32(x, weight);  // [T, E] fp32 (its backward in bf16 for a bf16 model)
  if (!given_ids_TK && o_.n_group == 1 && logits.is_cuda()) {
    // Fused sigmoid + bias + top-k (kernels/moe.hpp) picks the experts. Inference: the weights
    // from the same kernel; training: from the differentiable scores below.
    if (!torch::GradMode::is_enabled()) {
      auto [ids, w] = kernels::router_topk_weights(logits, e_score_correction_bias.to(torch::kFloat32), o_.top_k,
                                                   o_.norm_topk_prob, o_.routed_scaling_factor);
      return RouteResult{ids, w};
    }
    auto ids = kernels::router_topk(logits.detach(), e_score_correction_bias.to(torch::kFloat32), o_.top_k);
    return route_from_scores(logits.sigmoid(), e_score_correction_bias, o_, ids, /*validate=*/false);
  }
  return route_from_scores(logits.sigmoid(), e_score_correction_bias, o_, given_ids_TK, validate_given);
}

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = x.index_select(0, index) for x [N, D], where every row of x is read by `group` rows of y
// (index[inverse[n*group + j]] == n): the backward is a gather too, g.index_select(0, inverse)
// [N*group, D], summed over each row's `group` reads — instead of index_select's own backward,
// an index_add whose atomics add a token's K gradients in a different order on every run.
struct GatherRows : public torch::autograd::Function<GatherRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& index,
                               const torch::Tensor& inverse, int64_t group) {
    ctx->save_for_backward({inverse});
    ctx->saved_data["group"] = group;
    ctx->saved_data["rows"] = x.size(0);
    return kernels::gather_rows(x, index);  // index_select's values, 16-byte vectors on CUDA
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto inverse = ctx->get_saved_variables()[0];
    const int64_t group = ctx->saved_data["group"].toInt(), rows = ctx->saved_data["rows"].toInt();
    if (group > 1 && grads[0].is_cuda()) {
      // A row's `group` reads summed in fp32 by the combine kernel with unit weights: one pass
      // where the gather and the sum over them ran two.
      auto ones = at::ones({rows, group}, grads[0].options().dtype(torch::kFloat32));
      return {kernels::moe_combine(grads[0], inverse, ones), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    auto g = kernels::gather_rows(grads[0], inverse);  // [rows*group, D]
    if (group > 1) g = g.view({rows, group, g.size(1)}).sum(1);
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// y = moe_combine(rows, row_of_slot, weights) with moe_combine_backward as its backward: one
// kernel each way on CUDA, where autograd's formula ran a gather, an fp32 [T, K, D] product, a
// sum over K and their backward (~1 ms per MoE layer at 8192 tokens, 64 experts top-4 on an
// H200), and the forward that the rollout engine runs without grad.
struct CombineRows : public torch::autograd::Function<CombineRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& rows, const torch::Tensor& row_of_slot,
                               const torch::Tensor& weights) {
    ctx->save_for_backward({rows, row_of_slot, weights});
    return kernels::moe_combine(rows, row_of_slot, weights);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto g = kernels::moe_combine_backward(saved[0], saved[1], saved[2], grads[0].to(saved[0].scalar_type()));
    return {g.rows_MD, torch::Tensor(), g.weights_TK};
  }
};
}  // namespace

Dispatched dispatch(const torch::Tensor& x_TD, const RouteResult& r, int64_t num_experts, bool gather_rows) {
  const int64_t K = r.expert_ids.size(1);
  // The order on the device, of static shape and without a host read (capturable in a CUDA
  // graph): one kernel for a decode step's few slots, a stable sort otherwise.
  auto o = kernels::dispatch_order(r.expert_ids.to(torch::kInt64), num_experts);
  Dispatched d;
  d.slot = o.slot;
  d.token_index = o.token_index;                                                 // [T*K]
  d.row_of_slot = o.row_of_slot;
  if (gather_rows) d.x = GatherRows::apply(x_TD, d.token_index, d.row_of_slot, K);  // [T*K, D]
  d.weight_TK = r.weights;                                                       // [T, K]
  d.counts = o.counts;                                                           // [E]
  return d;
}

GroupedExpertsImpl::GroupedExpertsImpl(int64_t num_experts, int64_t hidden, int64_t intermediate,
                                       std::optional<double> swiglu_limit)
    : limit_(swiglu_limit) {
  w_gate_up_EFD = register_parameter("w_gate_up_EFD", torch::zeros({num_experts, 2 * intermediate, hidden}));
  w_down_EDF = register_parameter("w_down_EDF", torch::zeros({num_experts, hidden, intermediate}));
}

torch::Tensor GroupedExpertsImpl::forward(const torch::Tensor& x, const torch::Tensor& counts) {
  // Grouped GEMM on CUDA bf16, one GEMM pair per expert elsewhere (kernels/moe.hpp).
  if (batch_invariant_) return invariant_grouped_swiglu(x, counts, w_gate_up_EFD, w_down_EDF, limit_);
  return kernels::grouped_swiglu(x, counts, w_gate_up_EFD, w_down_EDF, limit_);
}

torch::Tensor GroupedExpertsImpl::forward_and_combine(const torch::Tensor& x_TD, const Dispatched& d) {
  return kernels::routed_experts_combine(x_TD, d.token_index, d.slot, d.row_of_slot, d.counts, w_gate_up_EFD, w_down_EDF,
                                         d.weight_TK, limit_);
}

torch::Tensor combine(const torch::Tensor& rows, const Dispatched& d, int64_t num_tokens, bool batch_invariant) {
  const int64_t K = d.weight_TK.size(1), D = rows.size(1);
  // One kernel on CUDA (the fp32 sum over k in k order) and one for its backward; LibTorch's
  // ops elsewhere.
  if (!batch_invariant) {
    if (!torch::GradMode::is_enabled()) return kernels::moe_combine(rows, d.row_of_slot, d.weight_TK);
    return CombineRows::apply(rows, d.row_of_slot, d.weight_TK);
  }
  auto by_slot = GatherRows::apply(rows, d.row_of_slot, d.slot, 1).view({num_tokens, K, D});  // [T, K, D]
  auto weighted = by_slot * d.weight_TK.unsqueeze(-1);                                          // [T, K, D] fp32
  // The true on-policy mode: elementwise adds in slot order ((w_0 + w_1) + w_2) + ..., not a
  // reduction kernel, whose split of the K terms may depend on the number of tokens.
  auto y = weighted.select(1, 0);
  for (int64_t k = 1; k < K; ++k) y = y + weighted.select(1, k);
  return y.to(rows.scalar_type());  // [T, D]
}

void check_expert_slice(const ExpertSlice& slice, int64_t num_experts, const std::string& where) {
  if (slice.ranks < 1 || slice.rank < 0 || slice.rank >= slice.ranks)
    throw std::invalid_argument(where + ": expert slice rank " + std::to_string(slice.rank) + " of " +
                                std::to_string(slice.ranks) + " ranks is not a rank of them");
  if (num_experts % slice.ranks != 0)
    throw std::invalid_argument(where + ": " + std::to_string(num_experts) + " experts do not split over " +
                                std::to_string(slice.ranks) + " expert-parallel ranks");
}

MoEImpl::MoEImpl(const RouterOptions& o, int64_t expert_intermediate, int64_t n_shared_experts, ExpertSlice slice,
                 std::optional<double> swiglu_limit)
    : slice_(slice) {
  check_expert_slice(slice, o.num_experts, "MoE");
  router = register_module("router", TopKRouter(o));
  experts = register_module(
      "experts", GroupedExperts(o.num_experts / slice.ranks, o.hidden, expert_intermediate, swiglu_limit));
  if (n_shared_experts > 0)
    shared = register_module("shared", SwiGLU(o.hidden, expert_intermediate * n_shared_experts, swiglu_limit));
}

int64_t MoEImpl::parameter_count(const RouterOptions& o, int64_t expert_intermediate, int64_t n_shared_experts,
                                 ExpertSlice slice) {
  const int64_t experts = o.num_experts / std::max<int64_t>(1, slice.ranks);
  return o.num_experts * o.hidden + experts * 3 * expert_intermediate * o.hidden +
         (n_shared_experts > 0 ? SwiGLUImpl::parameter_count(o.hidden, expert_intermediate * n_shared_experts) : 0);
}

torch::Tensor MoEImpl::forward(const torch::Tensor& x, const std::optional<torch::Tensor>& replay_ids_TK,
                               torch::Tensor* expert_ids_out, bool validate_replay) {
  // Training on CUDA with the overlap switch (fusions.hpp): the shared experts on a second
  // stream beside everything routed (kernels::run_beside), their sum joined on this stream.
  if (shared && x.is_cuda() && torch::GradMode::is_enabled() && !batch_invariant_ && shared_expert_overlap()) {
    auto [y, s] = kernels::run_beside(
        x.device(), [&] { return routed(x, replay_ids_TK, expert_ids_out, validate_replay); }, [&] { return shared(x); },
        {x});
    return y + s;
  }
  auto y = routed(x, replay_ids_TK, expert_ids_out, validate_replay);
  return shared ? y + shared(x) : y;
}

torch::Tensor MoEImpl::routed(const torch::Tensor& x, const std::optional<torch::Tensor>& replay_ids_TK,
                              torch::Tensor* expert_ids_out, bool validate_replay) {
  auto r = router(x, replay_ids_TK, validate_replay);
  if (expert_ids_out) *expert_ids_out = r.expert_ids;
  // Training on one rank: dispatch, experts and combine as one function that keeps less for
  // the backward (GroupedExpertsImpl::forward_and_combine); the same forward.
  const bool combined = !ep_ && !batch_invariant_ && !experts->batch_invariant() && torch::GradMode::is_enabled() &&
                        recompute_in_backward();
  auto d = dispatch(x, r, router->options().num_experts, /*gather_rows=*/!combined);
  torch::Tensor rows;  // [T*K, D] expert outputs in d's order
  if (combined) {
    return experts->forward_and_combine(x, d);
  }
  if (ep_) {
    auto rd = dispatch_to_ranks(d, *ep_);
    auto y_local = experts(rd.x, rd.counts);  // [R, D]
    // With no local rows the experts return a tensor cut off from rd.x: keep it connected,
    // or this rank would skip both all-to-alls' backward that the others enter.
    if (rd.x.size(0) == 0) y_local = rd.x * 0;
    rows = return_to_ranks(y_local, rd, *ep_);
  } else {
    rows = experts(d.x, d.counts);
  }
  return combine(rows, d, x.size(0), batch_invariant_);
}

void MoEImpl::serve_expert_parallel() {
  if (!ep_) return;
  torch::NoGradGuard no_grad;
  const auto& w = experts->w_gate_up_EFD;  // [El, 2F, D]
  Dispatched none;  // no token of this rank's: zero rows for every expert
  none.x = torch::empty({0, w.size(2)}, w.options());
  none.counts = torch::zeros({router->options().num_experts}, w.options().dtype(torch::kInt64));
  auto rd = dispatch_to_ranks(none, *ep_);
  return_to_ranks(experts(rd.x, rd.counts), rd, *ep_);  // [R, D] back to the ranks that sent them
}

void MoEImpl::set_expert_parallel(parallel::Group* ep) {
  if (!ep || ep->size() == 1) return;
  const int64_t E = router->options().num_experts, P = ep->size();
  if (!ep_ && slice_.ranks > 1) {  // built holding one rank's experts: they must be ep's rank's
    if (slice_.ranks != P || slice_.rank != ep->rank())
      throw std::invalid_argument("set_expert_parallel: the layer holds the experts of rank " +
                                  std::to_string(slice_.rank) + " of " + std::to_string(slice_.ranks) +
                                  ", but this process is rank " + std::to_string(ep->rank()) + " of ep group '" +
                                  ep->name() + "' (" + std::to_string(P) + " ranks)");
    ep_ = ep;
    return;
  }
  if (ep_ || experts->w_gate_up_EFD.size(0) != E)
    throw std::invalid_argument("set_expert_parallel: the experts are already sliced (" +
                                std::to_string(experts->w_gate_up_EFD.size(0)) + " of " + std::to_string(E) + ")");
  if (E % P != 0)
    throw std::invalid_argument("set_expert_parallel: " + std::to_string(E) + " experts do not split over the " +
                                std::to_string(P) + " ranks of ep group '" + ep->name() + "'");
  const int64_t El = E / P, first = ep->rank() * El;
  torch::NoGradGuard no_grad;
  for (auto* w : {&experts->w_gate_up_EFD, &experts->w_down_EDF})
    w->set_data(w->narrow(0, first, El).clone());  // [E, ...] -> [El, ...], the same parameter
  ep_ = ep;
  slice_ = {ep->rank(), P};
}

}  // namespace kiln::model
