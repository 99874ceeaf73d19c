#include "model/moe_config.hpp"

#include <cmath>

namespace kiln::model {

void MoEConfig::validate(const config_json::IntRanges& ranges,
                         const std::function<void(const std::string&, const std::string&)>& bad) const {
  for (const auto& [field, v] : {std::pair<const char*, int64_t>{"n_routed_experts", num_experts},
                                 {"num_experts_per_tok", top_k}, {"n_group", n_group}, {"topk_group", topk_group},
                                 {"moe_intermediate_size", expert_intermediate_size},
                                 {"n_shared_experts", n_shared_experts}}) {
    const auto r = config_json::range_of(ranges, field);
    if (v < r.lo || v > r.hi) bad(field, std::to_string(v) + " is outside " + r.str());
  }
  if (num_experts % n_group)
    bad("n_group", std::to_string(n_group) + " does not divide n_routed_experts " + std::to_string(num_experts));
  if (topk_group > n_group) bad("topk_group", std::to_string(topk_group) + " exceeds n_group " + std::to_string(n_group));
  if (n_group > 1 && num_experts / n_group < 2)
    bad("n_group", "group-limited routing scores each group by its top-2 experts: needs >= 2 experts per group");
  if (top_k > topk_group * (num_experts / n_group))
    bad("num_experts_per_tok",
        std::to_string(top_k) + " exceeds the experts in the " + std::to_string(topk_group) + " selected group(s)");
  if (!(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0))
    bad("routed_scaling_factor", "must be a finite number > 0, got " + config_json::show(nlohmann::json(routed_scaling_factor)));
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
  if (r.string("scoring_func", "sigmoid") != "sigmoid") r.bad("scoring_func", "only 'sigmoid' routing is supported");
  if (r.string("topk_method", "noaux_tc") != "noaux_tc") r.bad("topk_method", "only 'noaux_tc' is supported");
  return m;
}

void MoEConfig::to_hf_fields(nlohmann::json& j) const {
  j["n_routed_experts"] = num_experts;
  j["num_experts_per_tok"] = top_k;
  j["n_group"] = n_group;
  j["topk_group"] = topk_group;
  j["moe_intermediate_size"] = expert_intermediate_size;
  j["n_shared_experts"] = n_shared_experts;
  j["norm_topk_prob"] = norm_topk_prob;
  j["routed_scaling_factor"] = routed_scaling_factor;
}

}  // namespace kiln::model
