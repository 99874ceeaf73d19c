#pragma once
// How evenly a model routes a benchmark's pack, and the balancing of its routers that training
// does, so that two benchmarks compare their experts' grouped GEMMs at the same counts (the
// GEMMs slow down with uneven counts). Used by `kiln bench gpu` (--balance-routing).
#include <torch/torch.h>

#include "model/causal_lm.hpp"
#include "model/glm4_moe_lite/model.hpp"

namespace kiln::experiments {

/// Tokens of `batch` routed to each expert by each MoE layer of `model` (one no-grad forward):
/// [L_moe, E] float64 on the host.
torch::Tensor expert_loads(model::glm4_moe_lite::Glm4MoeLiteModel& model, const model::PackedBatch& batch);

/// Each MoE layer's busiest expert over its mean load, averaged over the layers (loads [L, E]).
double per_layer_max_over_mean(const torch::Tensor& loads);

/// `rounds` rounds of the auxiliary-loss-free balancing update on `batch`: a no-grad forward,
/// then every MoE router's e_score_correction_bias [E] (fp32) += rate * sign(mean load - load),
/// centred. DeepSeek-V3 (arXiv:2412.19437, section 2.1.2) at its rate 1e-3; torchtitan's
/// _update_expert_bias, which tests/bench/bench_torchtitan_ac.py --balance-routing applies to the
/// peer the same way. Returns the loads before the first round ([L_moe, E], as expert_loads).
torch::Tensor balance_routing(model::glm4_moe_lite::Glm4MoeLiteModel& model, const model::PackedBatch& batch, int rounds,
                              double rate = 1e-3);

}  // namespace kiln::experiments
