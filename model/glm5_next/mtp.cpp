#include "model/glm5_next/mtp.hpp"

namespace kiln::model::glm5_next {

MtpLayerImpl::MtpLayerImpl(const Glm5NextConfig& c) {
  const int64_t D = c.hidden_size;
  enorm = register_module("enorm", RMSNorm(D, c.rms_norm_eps));
  hnorm = register_module("hnorm", RMSNorm(D, c.rms_norm_eps));
  eh_proj = register_module("eh_proj", torch::nn::Linear(torch::nn::LinearOptions(2 * D, D).bias(false)));
  attn_norm = register_module("attn_norm", RMSNorm(D, c.rms_norm_eps));
  attn = register_module("attn", SparseAttention(D, c.attention, c.indexer, c.rms_norm_eps, /*with_indexer=*/true));
  mlp_norm = register_module("mlp_norm", RMSNorm(D, c.rms_norm_eps));
  moe = register_module("moe", MoE(router_options(D, c.moe), c.moe.expert_intermediate_size, c.moe.n_shared_experts, ExpertSlice{}, c.swiglu_limit));
  head_norm = register_module("head_norm", RMSNorm(D, c.rms_norm_eps));
}

int64_t MtpLayerImpl::parameter_count(const Glm5NextConfig& c) {
  const int64_t D = c.hidden_size;
  return 5 * RMSNormImpl::parameter_count(D) + 2 * D * D +
         SparseAttentionImpl::parameter_count(D, c.attention, c.indexer, /*with_indexer=*/true) +
         MoEImpl::parameter_count(router_options(D, c.moe), c.moe.expert_intermediate_size, c.moe.n_shared_experts);
}

torch::Tensor MtpLayerImpl::forward(const torch::Tensor& embedded, const torch::Tensor& previous,
                                    const torch::Tensor& cu_seqlens) {
  auto x = eh_proj(torch::cat({enorm(embedded), hnorm(previous)}, -1));  // [T, 2D] -> [T, D]
  x = x + attn(attn_norm(x), cu_seqlens).out;
  return x + moe(mlp_norm(x), std::nullopt, nullptr);
}

}  // namespace kiln::model::glm5_next
