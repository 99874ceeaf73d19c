#pragma once
// The routed-experts configuration both GLM families share (no LibTorch).
#include <cstdint>
#include <functional>
#include <string>

#include "model/config_json.hpp"

namespace kiln::model {

/// Routed experts with a sigmoid top-k router (DeepSeek-V3, arXiv:2412.19437 §2.1.2,
/// "noaux_tc"): n_group groups of which topk_group are kept, top_k experts per token, weights
/// normalised (norm_topk_prob) and times routed_scaling_factor; n_shared_experts shared
/// experts of width n_shared_experts * expert_intermediate_size. Sizes have no default: each
/// package's config sets them.
struct MoEConfig {
  int64_t num_experts = 0;               ///< n_routed_experts
  int64_t top_k = 0;                     ///< num_experts_per_tok
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t expert_intermediate_size = 0;  ///< moe_intermediate_size
  int64_t n_shared_experts = 0;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;

  /// Checks each integer field against `ranges` (by HF name) and the fields against each
  /// other (n_group divides the experts, topk_group <= n_group, >= 2 experts per group when
  /// grouped, top_k fits in the kept groups, a finite factor > 0); calls bad(HF field name,
  /// why), which must throw, for the first fault.
  void validate(const config_json::IntRanges& ranges,
                const std::function<void(const std::string&, const std::string&)>& bad) const;
  /// Reads the HF fields n_routed_experts, num_experts_per_tok, moe_intermediate_size,
  /// n_shared_experts, routed_scaling_factor (required), n_group, topk_group (default 1),
  /// norm_topk_prob (default true); refuses scoring_func other than "sigmoid" and topk_method
  /// other than "noaux_tc". Throws as FieldReader does.
  static MoEConfig from_hf_fields(const config_json::FieldReader& r);
  /// Writes the fields from_hf_fields reads into `j`.
  void to_hf_fields(nlohmann::json& j) const;
};

}  // namespace kiln::model
