#pragma once
// Mixture of experts in four steps with four names (Megatron-Core / torchtitan):
//   route (TopKRouter) -> dispatch (tokens to expert order) -> experts (GroupedExperts,
//   plus the shared expert) -> combine (back to token order, weighted sum over top-k).
// Semantics match transformers' Glm4MoeLiteTopkRouter / Glm4MoeLiteExperts (DeepSeek-V3,
// arXiv:2412.19437 §2.1.2: sigmoid scores, score-correction bias for choosing only,
// group-limited selection, normalised weights times routed_scaling_factor).
// Expert parallel (moe_ep.hpp): MoEImpl::set_expert_parallel keeps this rank's slice of the
// experts; dispatch then continues to the owning ranks and back (all-to-all).
// Legend: T tokens, D hidden, E experts, K top-k, F expert intermediate, G groups, P ep ranks.
#include <optional>

#include "model/blocks/basic.hpp"
#include "model/moe_config.hpp"

namespace kiln::parallel {
class Group;
}

namespace kiln::model {

/// Which routed experts a model (or MoE layer) holds: rank `rank` of `ranks` keeps experts
/// [rank*E/ranks, (rank+1)*E/ranks), as ep rank `rank` of an ep group of `ranks` ranks does
/// (moe_ep.hpp). {0, 1}: all of them.
struct ExpertSlice {
  int64_t rank = 0, ranks = 1;
};

struct RouterOptions {
  int64_t hidden = 0, num_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
};

/// The router options of a model's routed experts (MoEConfig: both GLM families' fields).
inline RouterOptions router_options(int64_t hidden, const MoEConfig& m) {
  return RouterOptions{hidden, m.num_experts, m.top_k, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor};
}

struct RouteResult {
  torch::Tensor expert_ids;  ///< [T, K] int64, by descending biased score
  torch::Tensor weights;     ///< [T, K] fp32, from the unbiased scores (differentiable)
};

/// Expert choice from sigmoid scores. scores_TE: [T, E] fp32 (sigmoid of the router logits),
/// bias_E: [E] fp32 score-correction bias. The bias is added (in fp32) only to choose experts,
/// group-limited (group score = sum of its top-2 biased scores; keep topk_group groups);
/// weights are the unbiased scores of the chosen experts, normalised to sum 1 if
/// norm_topk_prob (denominator + 1e-20), times routed_scaling_factor. The normalising sum runs
/// in slot order k = 0, 1, ... (elementwise adds, not a reduction whose order is torch's): the
/// same bits as the engine's kernels::router_topk_weights, whatever T.
/// given_ids_TK: routing replay: use these experts instead of choosing; weights as above.
/// validate: check given ids lie in [0, E) (a host read; skipped for kernel-made ids).
RouteResult route_from_scores(const torch::Tensor& scores_TE, const torch::Tensor& bias_E, const RouterOptions& o,
                              const std::optional<torch::Tensor>& given_ids_TK = std::nullopt, bool validate = true);

/// Step 1, route. Parameters: weight [E, D] (model dtype), e_score_correction_bias [E], kept
/// fp32 whatever the model dtype (see Glm4MoeLiteModelImpl::to_dtype). With
/// set_batch_invariant(true): fp32 logits by invariant_linear, scores by invariant_sigmoid.
class TopKRouterImpl : public torch::nn::Module, public BatchInvariantSwitch {
 public:
  explicit TopKRouterImpl(const RouterOptions& o);
  /// x: [T, D]; logits are computed in fp32 as transformers does.
  /// validate_given: check replayed ids lie in [0, E) (a device sync; callers that checked
  /// already, e.g. the model once for all layers, pass false).
  RouteResult forward(const torch::Tensor& x, const std::optional<torch::Tensor>& given_ids_TK = std::nullopt,
                      bool validate_given = true);
  torch::Tensor weight, e_score_correction_bias;
  const RouterOptions& options() const { return o_; }

 private:
  RouterOptions o_;
};
TORCH_MODULE(TopKRouter);

/// Step 2, dispatch: the T*K (token, slot) pairs sorted by expert (stable). A pair (t, k) is
/// slot t*K + k. The order, its inverse and the counts come from kernels::dispatch_order (one
/// kernel for a decode step's few slots on CUDA, a stable sort otherwise: the same integers).
/// Dispatch and combine move rows by gathers only, forward and backward (no index_add: no
/// atomics, so the same sums in the same order on every run): the backward of the dispatch
/// gathers each slot's gradient back by `row_of_slot` and sums a token's K slots.
struct Dispatched {
  torch::Tensor x;             ///< [T*K, D] token rows in expert order
  torch::Tensor token_index;   ///< [T*K] int64, source token of each row
  torch::Tensor slot;          ///< [T*K] int64, slot (t*K + k) of each row
  torch::Tensor row_of_slot;   ///< [T*K] int64, the row of each slot (slot's inverse permutation)
  torch::Tensor weight_TK;     ///< [T, K] fp32 combine weights in token order (RouteResult::weights)
  torch::Tensor counts;        ///< [E] int64 rows per expert, on x's device
};
/// gather_rows = false: d.x left undefined (GroupedExpertsImpl::forward_and_combine gathers its
/// rows itself).
Dispatched dispatch(const torch::Tensor& x_TD, const RouteResult& r, int64_t num_experts, bool gather_rows = true);

/// Step 3, experts stored grouped: w_gate_up_EFD [E, 2F, D] (gate rows then up rows, as
/// transformers' gate_up_proj), w_down_EDF [E, D, F]. SwiGLU per expert on its rows, clamped
/// at swiglu_limit when set (kernels::swiglu). With set_batch_invariant(true):
/// invariant_grouped_swiglu (no limit).
class GroupedExpertsImpl : public torch::nn::Module, public BatchInvariantSwitch {
 public:
  GroupedExpertsImpl(int64_t num_experts, int64_t hidden, int64_t intermediate,
                     std::optional<double> swiglu_limit = std::nullopt);
  /// x: [T*K, D] in expert order, counts: [E] int64 rows per expert -> [T*K, D].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& counts);
  /// Steps 2 to 4 for training (kernels::routed_experts_combine): x_TD [T, D] in token order and
  /// d from dispatch (d.x not needed) -> combine(forward(d.x, d.counts), d, T), the same values,
  /// with the gathered rows, the activation and the experts' output rows recomputed or not
  /// needed in the backward instead of kept (1.4 GiB per MoE layer at 32768 tokens of
  /// GLM-4.7-Flash). Not batch-invariant (MoEImpl takes it only outside that mode).
  torch::Tensor forward_and_combine(const torch::Tensor& x_TD, const Dispatched& d);
  torch::Tensor w_gate_up_EFD, w_down_EDF;

 private:
  std::optional<double> limit_;
};
TORCH_MODULE(GroupedExperts);

/// Step 4, combine: y[t] = sum over k of weight_TK[t, k] * rows[row_of_slot[t*K + k]], the K
/// products and their sum in fp32 (k in order), rounded once to rows' dtype. rows: [T*K, D]
/// in d's row order -> [T, D]. batch_invariant (the true on-policy mode): the K fp32 products
/// added elementwise in slot order ((p_0 + p_1) + p_2) + ..., so that a token's sum does not
/// depend on how many tokens share the launch. Without gradients (inference, not
/// batch_invariant): kernels::moe_combine, one kernel on CUDA.
torch::Tensor combine(const torch::Tensor& rows, const Dispatched& d, int64_t num_tokens, bool batch_invariant = false);

/// The MoE feed-forward: routed experts plus shared experts (one SwiGLU of width
/// n_shared * F), as Glm4MoeLiteMoE; with swiglu_limit, routed and shared experts clamp as
/// Glm5NextTextMoE's do. With set_batch_invariant(true) (its router, experts and shared expert
/// have their own switches): the combine in slot order. With gradients, on one rank, outside
/// that mode and with recompute_in_backward() (model/blocks/recompute.hpp): steps 2 to 4 by
/// GroupedExpertsImpl::forward_and_combine.
class MoEImpl : public torch::nn::Module, public BatchInvariantSwitch {
 public:
  /// `slice`: build only those routed experts (grouped tensors [E/ranks, ...]), e.g. to load a
  /// checkpoint's share of an ep rank without ever holding all E. Throws std::invalid_argument
  /// when E is not a multiple of slice.ranks or slice.rank is outside [0, slice.ranks).
  /// `swiglu_limit`: clamp routed and shared experts (kernels::swiglu).
  MoEImpl(const RouterOptions& o, int64_t expert_intermediate, int64_t n_shared_experts, ExpertSlice slice = {},
          std::optional<double> swiglu_limit = std::nullopt);
  /// Parameters the constructor registers: the router's weight [E, D], this slice's experts
  /// (gate/up [E/ranks, 2F, D], down [E/ranks, D, F]) and the shared experts' SwiGLU.
  static int64_t parameter_count(const RouterOptions& o, int64_t expert_intermediate, int64_t n_shared_experts,
                                 ExpertSlice slice = {});
  /// x: [T, D] -> [T, D]; *expert_ids_out gets the [T, K] choice (or the replayed ids; ids
  /// are global, in [0, E), with or without expert parallel). With expert parallel: collective
  /// over the ep group in forward and backward (moe_ep.hpp), whatever T is.
  torch::Tensor forward(const torch::Tensor& x, const std::optional<torch::Tensor>& replay_ids_TK,
                        torch::Tensor* expert_ids_out, bool validate_replay = true);
  /// Expert parallel over `ep` (held by reference; it must outlive the module): keeps experts
  /// [j*E/P, (j+1)*E/P) of ep rank j, slicing experts->w_gate_up_EFD / w_down_EDF along E in
  /// place (same parameter objects, now [E/P, ...]): call it once the full weights are in
  /// place. The router stays whole. A layer built with a slice keeps it: `ep` must then be
  /// slice.ranks ranks and this process its rank slice.rank (nothing is sliced). nullptr or a
  /// group of one rank: no-op. Throws std::invalid_argument when E is not a multiple of P, the
  /// experts are already sliced, or a built slice does not match `ep`.
  void set_expert_parallel(parallel::Group* ep);
  /// This rank's part of one expert-parallel forward without tokens of its own (inference): the
  /// ep exchanges forward() makes, with zero rows sent, and the rows the other ranks send run
  /// through this rank's experts and go back to them. What an idle engine of a lockstep
  /// rollout (actors/rollout/lockstep.hpp) does for each MoE layer while another rank's engine
  /// runs a forward. Collective over the ep group; no-op without expert parallel. No autograd.
  void serve_expert_parallel();
  /// The ep group, or nullptr.
  parallel::Group* expert_parallel() const { return ep_; }
  /// The routed experts this layer holds.
  ExpertSlice expert_slice() const { return slice_; }
  TopKRouter router{nullptr};
  GroupedExperts experts{nullptr};
  SwiGLU shared{nullptr};  ///< null when n_shared_experts == 0

 private:
  /// forward() without the shared experts: router, dispatch, routed experts, combine.
  torch::Tensor routed(const torch::Tensor& x, const std::optional<torch::Tensor>& replay_ids_TK,
                       torch::Tensor* expert_ids_out, bool validate_replay);
  parallel::Group* ep_ = nullptr;
  ExpertSlice slice_;
};
TORCH_MODULE(MoE);

/// Throws std::invalid_argument (prefixed by `where`) unless `slice` splits `num_experts`
/// evenly and its rank lies in [0, ranks).
void check_expert_slice(const ExpertSlice& slice, int64_t num_experts, const std::string& where);

}  // namespace kiln::model
