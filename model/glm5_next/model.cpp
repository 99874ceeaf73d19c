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
    moe = register_module("moe", MoE(ro, c.moe.expert_intermediate_size, c.moe.n_shared_experts, ExpertSlice{}, c.swiglu_limit));
  } else {
    mlp = register_module("mlp", SwiGLU(c.hidden_size, c.intermediate_size, c.swiglu_limit));
  }
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& streams, const torch::Tensor& cu_seqlens, torch::Tensor& topk,
                                        const std::optional<torch::Tensor>& replay_ids, torch::Tensor* expert_ids) {
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
  auto m = moe ? moe(h2, replay_ids, expert_ids) : mlp(h2);
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

int64_t Glm5NextModelImpl::num_sparse_layers() const {
  int64_t n = 0;
  for (auto t : c_.layer_types) n += t == LayerType::sparse_attention;
  return n;
}

Glm5NextOutput Glm5NextModelImpl::forward(const PackedBatch& batch, const Glm5NextForwardOptions& o) {
  batch.validate();
  const int64_t T = batch.input_ids.size(0);
  auto check_replay = [&](const std::optional<torch::Tensor>& r, const char* what, int64_t layers, int64_t width) {
    if (r && (r->dim() != 3 || r->size(0) != T || r->size(1) != layers || r->size(2) != width))
      throw std::invalid_argument(std::string(what) + " must be [T, L, W] = [" + std::to_string(T) + ", " +
                                  std::to_string(layers) + ", " + std::to_string(width) + "], got " +
                                  c10::str(r->sizes()));
  };
  const int64_t W = c_.indexer.topk + (c_.indexer.always_select_tail ? c_.indexer.kpool - 1 : 0);
  check_replay(o.replay_routed_experts, "replay_routed_experts", num_moe_layers(), c_.moe.top_k);
  check_replay(o.replay_topk_indices, "replay_topk_indices", num_sparse_layers(), W);
  auto streams = hc_streams_from_embeddings(embed(batch.input_ids), c_.hc.streams);  // [T, S, D]
  torch::Tensor topk;  // the last sparse layer's selection, handed to a shared layer
  std::vector<torch::Tensor> experts, selections;
  int64_t moe_i = 0, sparse_i = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const bool sparse = c_.layer_types[i] == LayerType::sparse_attention;
    // transformers hands a selection only to the very next layer; a replayed one replaces it.
    if (!sparse || c_.indexer_types[i] != IndexerType::shared) topk = torch::Tensor();
    if (sparse && o.replay_topk_indices) topk = o.replay_topk_indices->select(1, sparse_i).to(torch::kInt64);
    std::optional<torch::Tensor> replay_ids;
    if (c_.moe_layers[i] && o.replay_routed_experts) replay_ids = o.replay_routed_experts->select(1, moe_i);
    torch::Tensor ids;
    streams = layers[i](streams, batch.cu_seqlens, topk, replay_ids, o.return_routed_experts ? &ids : nullptr);
    if (c_.moe_layers[i]) {
      ++moe_i;
      if (o.return_routed_experts) experts.push_back(ids);
    }
    if (sparse) {
      ++sparse_i;
      if (o.return_topk_indices) selections.push_back(topk);
    }
  }
  Glm5NextOutput out;
  out.hidden = norm(hc_head(streams));                                // [T, D]
  if (!experts.empty()) out.routed_experts = torch::stack(experts, 1);  // [T, L, K]
  if (!selections.empty()) out.topk_indices = torch::stack(selections, 1);  // [T, Ls, W]
  return out;
}

}  // namespace kiln::model::glm5_next
