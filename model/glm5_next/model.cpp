#include "model/glm5_next/model.hpp"

#include <memory>
#include <stdexcept>
#include <string>

#include "model/blocks/activation_checkpoint.hpp"
#include "model/checkpoint/safetensors.hpp"
#include "model/config_json.hpp"
#include "model/glm5_next/state_dict_adapter.hpp"

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
    moe = register_module("moe", MoE(router_options(c.hidden_size, c.moe), c.moe.expert_intermediate_size, c.moe.n_shared_experts, ExpertSlice{}, c.swiglu_limit));
  } else {
    mlp = register_module("mlp", SwiGLU(c.hidden_size, c.intermediate_size, c.swiglu_limit));
  }
}

int64_t DecoderLayerImpl::parameter_count(const Glm5NextConfig& c, int64_t layer) {
  const auto i = std::size_t(layer);
  const int64_t D = c.hidden_size;
  int64_t n = 2 * HyperConnectionImpl::parameter_count(D, c.hc) + 2 * RMSNormImpl::parameter_count(D);
  n += c.layer_types[i] == LayerType::linear_attention
           ? KimiDeltaAttentionImpl::parameter_count(D, c.kda)
           : SparseAttentionImpl::parameter_count(D, c.attention, c.indexer, c.indexer_types[i] == IndexerType::full);
  n += c.moe_layers[i] ? MoEImpl::parameter_count(router_options(D, c.moe), c.moe.expert_intermediate_size, c.moe.n_shared_experts)
                       : SwiGLUImpl::parameter_count(D, c.intermediate_size);
  return n;
}

int64_t parameter_count(const Glm5NextConfig& c) {
  int64_t n = 2 * c.vocab_size * c.hidden_size + RMSNormImpl::parameter_count(c.hidden_size);  // embed, lm_head, norm
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) n += DecoderLayerImpl::parameter_count(c, i);
  return n + c.num_nextn_predict_layers * MtpLayerImpl::parameter_count(c);
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
  return finish(w, a, streams, replay_ids, expert_ids);
}

torch::Tensor DecoderLayerImpl::finish(const HcWeights& w, const torch::Tensor& a, const torch::Tensor& streams,
                                       const std::optional<torch::Tensor>& replay_ids, torch::Tensor* expert_ids) {
  auto mid = HyperConnectionImpl::expand(w, a, streams);             // [T, S, D]
  auto w2 = ffn_hc(mid);
  auto h2 = mlp_norm(w2.collapsed);
  auto m = moe ? moe(h2, replay_ids, expert_ids) : mlp(h2);
  return HyperConnectionImpl::expand(w2, m, mid);
}

torch::Tensor DecoderLayerImpl::forward_cached(const torch::Tensor& streams, const torch::Tensor& positions,
                                               const std::vector<CachedSlice>& slices, const CachedLayout& layout,
                                               Glm5NextDecodeCache::Layer& cache, torch::Tensor& topk,
                                               torch::Tensor* expert_ids) {
  auto w = attn_hc(streams);
  auto h = attn_norm(w.collapsed);                                   // [N, D]
  torch::Tensor a;
  if (kda) {
    a = kda->forward_cached(h, slices, cache.kda);
  } else {
    auto r = attn->forward_cached(h, positions, layout, cache.latent, cache.index,
                                  topk.defined() ? std::optional<torch::Tensor>(topk) : std::nullopt);
    a = r.out;
    topk = r.topk_indices;
  }
  return finish(w, a, streams, std::nullopt, expert_ids);
}

Glm5NextModelImpl::Glm5NextModelImpl(const Glm5NextConfig& c, bool random_init) : c_(c) {
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
  if (c.num_nextn_predict_layers > 0) {
    torch::nn::ModuleList mtp_list;  // parameters named mtp.{i}.*
    for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
      mtp.push_back(MtpLayer(c));
      mtp_list->push_back(mtp.back());
    }
    register_module("mtp", mtp_list);
  }
  for (auto& p : indexer_parameters()) p.set_requires_grad(false);  // frozen: see model.hpp
  if (random_init) init_random_weights();
}

void Glm5NextModelImpl::init_random_weights() {
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const auto& name = p.key();
    const bool pooling_gate = name.size() >= 13 && name.compare(name.size() - 13, 13, "compress_gate") == 0;
    const bool matrix = p.value().dim() == 2 || name.find("moe.experts.") != std::string::npos;  // not the [HK, 1, W] convs
    if (matrix && !pooling_gate) p.value().normal_(0.0, 0.02);
  }
}

std::vector<torch::Tensor> Glm5NextModelImpl::indexer_parameters() {
  std::vector<torch::Tensor> out;
  for (auto& l : layers)
    if (l->attn && l->attn->indexer)
      for (auto& p : l->attn->indexer->parameters()) out.push_back(p);
  for (auto& m : mtp)
    for (auto& p : m->attn->indexer->parameters()) out.push_back(p);
  return out;
}

int64_t Glm5NextModelImpl::topk_width() const {
  return c_.indexer.topk + (c_.indexer.always_select_tail ? c_.indexer.kpool - 1 : 0);
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
  for (auto& m : mtp) keep(m->moe->router->e_score_correction_bias);
}

std::vector<torch::Tensor> Glm5NextModelImpl::mtp_parameters() {
  std::vector<torch::Tensor> out;
  for (auto& m : mtp)
    for (auto& p : m->parameters()) out.push_back(p);
  return out;
}

std::vector<MtpDepth> Glm5NextModelImpl::mtp_forward(const PackedBatch& batch, const torch::Tensor& hidden,
                                                     int64_t depths) {
  if (mtp.empty())
    throw std::invalid_argument("glm5_next mtp_forward: this model has no MTP layer (text_config.num_nextn_predict_layers 0)");
  if (depths < 1) throw std::invalid_argument("glm5_next mtp_forward: depths must be >= 1, got " + std::to_string(depths));
  batch.validate();
  const int64_t T = batch.input_ids.size(0);
  if (hidden.dim() != 2 || hidden.size(0) != T || hidden.size(1) != c_.hidden_size)
    throw std::invalid_argument("glm5_next mtp_forward: hidden must be [T, D] = [" + std::to_string(T) + ", " +
                                std::to_string(c_.hidden_size) + "], got " + c10::str(hidden.sizes()));
  const auto dev = embed->weight.device();
  const auto ids = batch.input_ids.to(dev, torch::kInt64);
  const auto cu = batch.cu_seqlens.to(torch::kCPU, torch::kInt64);
  const auto* c = cu.data_ptr<int64_t>();
  const int64_t B = cu.size(0) - 1;
  // Depth d-1's rows of document k start at prev_offset[k] of `previous` (depth 0: the batch's rows).
  std::vector<int64_t> prev_offset(c, c + B);
  torch::Tensor previous = hidden;  // [T_{d-1}, D]
  std::vector<MtpDepth> out;
  for (int64_t d = 1; d <= depths; ++d) {
    std::vector<int64_t> rows, local, cu_d{0}, offset(std::size_t(B), 0);
    for (int64_t k = 0; k < B; ++k) {
      const int64_t m = c[k + 1] - c[k] - d - 1;  // rows of document k at depth d
      offset[std::size_t(k)] = int64_t(rows.size());
      for (int64_t j = 0; j < m; ++j) {
        rows.push_back(c[k] + j);
        local.push_back(prev_offset[std::size_t(k)] + j);
      }
      if (m > 0) cu_d.push_back(int64_t(rows.size()));
    }
    if (rows.empty()) break;  // every document is shorter than d + 2: no deeper depth has rows either
    auto rows_t = torch::tensor(rows, torch::kInt64);
    auto rows_dev = rows_t.to(dev);
    auto e = embed(ids.index_select(0, rows_dev + d));                    // [Td, D] tokens t+d
    auto h = previous.index_select(0, torch::tensor(local, torch::kInt64).to(dev));  // [Td, D]
    auto& layer = mtp[std::size_t(std::min<int64_t>(d, int64_t(mtp.size())) - 1)];
    auto x = layer(e, h, torch::tensor(cu_d, torch::kInt64));
    out.push_back({d, layer->head_norm(x), rows_t, ids.index_select(0, rows_dev + d + 1)});
    previous = x;
    prev_offset = std::move(offset);
  }
  return out;
}

int64_t Glm5NextModelImpl::num_sparse_layers() const {
  int64_t n = 0;
  for (auto t : c_.layer_types) n += t == LayerType::sparse_attention;
  return n;
}

ForwardOutput Glm5NextModelImpl::forward(const PackedBatch& batch, const ForwardOptions& o) {
  batch.validate();
  const int64_t T = batch.input_ids.size(0), W = topk_width();
  auto check_replay = [&](const std::optional<torch::Tensor>& r, const char* what, int64_t layers, int64_t width) {
    if (r && (r->dim() != 3 || r->size(0) != T || r->size(1) != layers || r->size(2) != width))
      throw std::invalid_argument(std::string("glm5_next forward: ") + what + " must be [T, L, W] = [" +
                                  std::to_string(T) + ", " + std::to_string(layers) + ", " + std::to_string(width) +
                                  "], got " + c10::str(r->sizes()));
  };
  check_replay(o.replay_routed_experts, "replay_routed_experts", num_moe_layers(), c_.moe.top_k);
  check_replay(o.replay_topk_indices, "replay_topk_indices", num_sparse_layers(), W);
  const auto dev = embed->weight.device();
  std::optional<torch::Tensor> replay_experts, replay_topk;
  if (o.replay_routed_experts) {
    const auto& r = *o.replay_routed_experts;
    if (r.numel() > 0 && (r.min().item<int64_t>() < 0 || r.max().item<int64_t>() >= c_.moe.num_experts))
      throw std::invalid_argument("glm5_next forward: replay_routed_experts must lie in [0, " +
                                  std::to_string(c_.moe.num_experts) + ")");
    replay_experts = r.to(dev, torch::kInt64);
  }
  if (o.replay_topk_indices) {
    // A selection names positions within the query's document: at most the query's own (a
    // later one would let it see the future), -1 for none.
    auto r = o.replay_topk_indices->to(dev, torch::kInt64);
    auto own = batch.position_ids.to(dev, torch::kInt64).view({T, 1, 1});
    if (r.numel() > 0 && (r.lt(-1).any().item<bool>() || r.gt(own).any().item<bool>()))
      throw std::invalid_argument("glm5_next forward: replay_topk_indices must lie in [-1, the query's position "
                                  "within its document]");
    replay_topk = r;
  }
  const bool want_experts = o.return_routed_experts || replay_experts.has_value();
  auto cu = batch.cu_seqlens.to(torch::kCPU, torch::kInt64);
  auto streams = hc_streams_from_embeddings(embed(batch.input_ids.to(dev)), c_.hc.streams);  // [T, S, D]
  torch::Tensor topk;  // the last sparse layer's selection, handed to a shared layer
  std::vector<torch::Tensor> experts, selections;
  int64_t moe_i = 0, sparse_i = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const bool sparse = c_.layer_types[i] == LayerType::sparse_attention, moe = c_.moe_layers[i];
    // transformers hands a selection only to the very next layer; a replayed one replaces it.
    if (!sparse || c_.indexer_types[i] != IndexerType::shared) topk = torch::Tensor();
    if (sparse && replay_topk) topk = replay_topk->select(1, sparse_i);
    std::optional<torch::Tensor> replay_ids;
    if (moe && replay_experts) replay_ids = replay_experts->select(1, moe_i);  // [T, K]
    torch::Tensor ids;
    const bool want_ids = moe && want_experts;
    if (checkpoints_layer(int64_t(i)) && torch::GradMode::is_enabled()) {
      // The recomputation in the backward writes the same ids and selection again.
      auto out_ids = std::make_shared<torch::Tensor>(), out_topk = std::make_shared<torch::Tensor>();
      streams = checkpointed(
          [l = layers[i].ptr(), cu, topk, replay_ids, out_ids, out_topk, want_ids](const torch::Tensor& in) {
            auto t = topk;
            auto r = l->forward(in, cu, t, replay_ids, want_ids ? out_ids.get() : nullptr);
            *out_topk = t;
            return r;
          },
          streams);
      ids = *out_ids;
      if (sparse) topk = *out_topk;
    } else {
      streams = layers[i](streams, cu, topk, replay_ids, want_ids ? &ids : nullptr);
    }
    if (moe) {
      ++moe_i;
      if (want_experts) experts.push_back(ids);
    }
    if (sparse) {
      ++sparse_i;
      if (o.return_topk_indices) selections.push_back(topk);
    }
  }
  ForwardOutput out;
  out.hidden = norm(hc_head(streams));                                    // [T, D]
  if (want_experts)
    out.routed_experts = experts.empty() ? torch::empty({T, 0, c_.moe.top_k}, torch::kInt64) : torch::stack(experts, 1);
  if (o.return_topk_indices)  // [T, Ls, W]
    out.topk_indices = selections.empty() ? torch::empty({T, 0, W}, torch::kInt64) : torch::stack(selections, 1);
  return out;
}

std::unique_ptr<DecodeCache> Glm5NextModelImpl::make_decode_cache(const DecodeCacheShape& shape,
                                                                  const torch::TensorOptions& options) const {
  return std::make_unique<Glm5NextDecodeCache>(c_, shape, options);
}

int64_t Glm5NextModelImpl::decode_cache_bytes(const DecodeCacheShape& shape, torch::Dtype dtype) const {
  return Glm5NextDecodeCache::bytes(c_, shape, dtype);
}

ForwardOutput Glm5NextModelImpl::forward_cached(const torch::Tensor& ids, const torch::Tensor& positions,
                                                const std::vector<CachedSlice>& slices, DecodeCache& cache,
                                                bool want_routing) {
  auto* c = dynamic_cast<Glm5NextDecodeCache*>(&cache);
  if (!c || c->layers.size() != layers.size())
    throw std::invalid_argument("glm5_next forward_cached: the cache is not this model's (make_decode_cache: a "
                                "Glm5NextDecodeCache of " + std::to_string(layers.size()) + " layers)");
  torch::NoGradGuard no_grad;
  const int64_t N = ids.size(0);
  const CachedLayout layout(slices, c->page_size(), ids.device());  // the same pages in every sparse layer
  auto streams = hc_streams_from_embeddings(embed(ids), c_.hc.streams);  // [N, S, D]
  torch::Tensor topk;  // the last sparse layer's selection, handed to a shared layer
  std::vector<torch::Tensor> experts, selections;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const bool sparse = c_.layer_types[i] == LayerType::sparse_attention;
    if (!sparse || c_.indexer_types[i] != IndexerType::shared) topk = torch::Tensor();
    torch::Tensor chosen;
    streams = layers[i]->forward_cached(streams, positions, slices, layout, c->layers[i], topk,
                                        c_.moe_layers[i] && want_routing ? &chosen : nullptr);
    if (c_.moe_layers[i] && want_routing) experts.push_back(chosen);
    if (sparse && want_routing) selections.push_back(topk);
  }
  ForwardOutput out;
  out.hidden = norm(hc_head(streams));  // [N, D]
  if (want_routing) {
    out.routed_experts = experts.empty() ? torch::empty({N, 0, c_.moe.top_k}, torch::kInt64) : torch::stack(experts, 1);
    out.topk_indices = selections.empty() ? torch::empty({N, 0, topk_width()}, torch::kInt64) : torch::stack(selections, 1);
  }
  return out;
}

void Glm5NextModelImpl::load_hf_checkpoint(const std::string& dir) {
  auto ckpt = checkpoint::Checkpoint::open(dir);
  load_hf_state_dict(*this, ckpt);
}

void Glm5NextModelImpl::save_hf_checkpoint(const std::string& dir, uint64_t max_shard_bytes) {
  glm5_next::save_hf_checkpoint(*this, dir, max_shard_bytes);
}

void Glm5NextModelImpl::load_hf_tensors(const std::vector<messaging::Tensor>& tensors) {
  load_hf_state_dict(*this, tensors);
}

std::vector<messaging::Tensor> Glm5NextModelImpl::hf_state_dict() { return to_hf_state_dict(*this); }

void Glm5NextModelImpl::save_hf_config(const std::string& dir) { glm5_next::save_hf_config(*this, dir); }

void Glm5NextModelImpl::check_hf_config(const std::string& dir) const {
  config_json::check_dir_config(c_, dir);
}

}  // namespace kiln::model::glm5_next
