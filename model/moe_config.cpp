#include "model/moe_config.hpp"

#include <cmath>

namespace kiln::model {

void MoEConfig::check_consistency(const std::function<void(const std::string&, const std::string&)>& bad) const {
  if (num_experts % n_group)
    bad("n_group", std::to_string(n_group) + " does not divide n_routed_experts " + std::to_string(num_experts));
  if (topk_group > n_group) bad("topk_group", std::to_string(topk_group) + " exceeds n_group " + std::to_string(n_group));
  if (n_group > 1 && num_experts / n_group < 2)
    bad("n_group", "group-limited routing scores each group by its top-2 experts: needs >= 2 experts per group");
  if (top_k > topk_group * (num_experts / n_group))
    bad("num_experts_per_tok",
        std::to_string(top_k) + " exceeds the experts in the " + std::to_string(topk_group) + " selected group(s)");
  if (!(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0))
    bad("routed_scaling_factor", "must be a finite number > 0, got " + std::to_string(routed_scaling_factor));
}

MoEConfig MoEConfig::from_hf_fields(const config_json::FieldReader& r) {
  MoEConfig m;
  m.num_experts = r.integer("n_routed_experts");
  m.top_k = r.integer("num_experts_per_tok");
  m.n_group = r.integer("n_group", 1);
  m.topk_group = r.integer("topk_group", 1);
  m.expert_intermediate_size = r.integer("moe_intermediate_size");
  m.n_shared_experts = r.integer("n_shared_experts");
  m.norm_topk_prob = r.boolean("norm_topk_prob", true);
  m.routed_scaling_factor = r.number("routed_scaling_factor");
  return m;
}

}  // namespace kiln::model
