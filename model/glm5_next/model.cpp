#include "model/glm5_next/model.hpp"

#include <string>

namespace kiln::model::glm5_next {

DecoderLayerImpl::DecoderLayerImpl(const Glm5NextConfig& c, int64_t layer) {
  const auto i = std::size_t(layer);
  attn_hc = register_module("attn_hc", HyperConnection(c.hidden_size, c.hc, c.rms_norm_eps));
  ffn_hc = register_module("ffn_hc", HyperConnection(c.hidden_size, c.hc, c.rms_norm_eps));
  attn_norm = register_module("attn_norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  mlp_norm = register_module("mlp_norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (c.layer_types[i] == LayerType::linear_attention)
    kda = register_module("kda", KimiDeltaAttention(c.hidden_size, c.kda, c.rms_norm_eps));
  else
    attn = register_module("attn", SparseAttention(c.hidden_size, c.attention, c.indexer, c.rms_norm_eps,
                                                   c.indexer_types[i] == IndexerType::full));
  if (c.moe_layers[i]) {
    RouterOptions ro{c.hidden_size, c.moe.num_experts, c.moe.top_k, c.moe.n_group, c.moe.topk_group,
                     c.moe.norm_topk_prob, c.moe.routed_scaling_factor};
    moe = register_module("moe", MoE(ro, c.moe.expert_intermediate_size, c.moe.n_shared_experts, c.swiglu_limit));
  } else {
    mlp = register_module("mlp", SwiGLU(c.hidden_size, c.intermediate_size, c.swiglu_limit));
  }
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& streams, const torch::Tensor& cu_seqlens, torch::Tensor& topk,
                                        torch::Tensor* expert_ids) {
  auto w = attn_hc(streams);
  auto h = attn_norm(w.collapsed);                                   // [T, D]
  torch::Tensor a;
  if (kda) {
    a = kda(h, cu_seqlens);
  } else {
    auto r = attn(h, cu_seqlens, topk.defined() ? std::optional<torch::Tensor>(topk) : std::nullopt);
    a = r.out;
    topk = r.topk_indices;
  }
  auto mid = HyperConnectionImpl::expand(w, a, streams);             // [T, S, D]
  auto w2 = ffn_hc(mid);
  auto h2 = mlp_norm(w2.collapsed);
  auto m = moe ? moe(h2, std::nullopt, expert_ids) : mlp(h2);
  return HyperConnectionImpl::expand(w2, m, mid);
}

Glm5NextModelImpl::Glm5NextModelImpl(const Glm5NextConfig& c) : c_(c) {
  c.validate();
  embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  torch::nn::ModuleList list;  // registered as "layers": parameters named layers.{i}.*
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers.push_back(DecoderLayer(c, i));
    list->push_back(layers.back());
  }
  register_module("layers", list);
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
}

void Glm5NextModelImpl::to_dtype(torch::Dtype dtype) {
  to(dtype);
  torch::NoGradGuard no_grad;
  auto keep = [](torch::Tensor& t) { t.set_data(t.to(torch::kFloat)); };
  for (auto& l : layers) {
    if (l->kda)
      for (auto* t : {&l->kda->q_conv, &l->kda->k_conv, &l->kda->v_conv, &l->kda->dt_bias, &l->kda->A_log}) keep(*t);
    if (l->moe) keep(l->moe->router->e_score_correction_bias);
  }
}

Glm5NextOutput Glm5NextModelImpl::forward(const PackedBatch& batch, bool return_routed_experts) {
  batch.validate();
  auto streams = hc_streams_from_embeddings(embed(batch.input_ids), c_.hc.streams);  // [T, S, D]
  torch::Tensor topk;  // the last sparse layer's selection, handed to a shared layer
  std::vector<torch::Tensor> experts;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    // transformers hands a selection only to the very next layer.
    if (c_.layer_types[i] != LayerType::sparse_attention || c_.indexer_types[i] != IndexerType::shared) topk = torch::Tensor();
    torch::Tensor ids;
    streams = layers[i](streams, batch.cu_seqlens, topk, return_routed_experts ? &ids : nullptr);
    if (return_routed_experts && ids.defined()) experts.push_back(ids);
  }
  Glm5NextOutput out;
  out.hidden = norm(hc_head(streams));                                // [T, D]
  if (return_routed_experts && !experts.empty()) out.routed_experts = torch::stack(experts, 1);  // [T, L, K]
  return out;
}

}  // namespace kiln::model::glm5_next
