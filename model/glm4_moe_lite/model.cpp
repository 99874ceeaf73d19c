#include "model/glm4_moe_lite/model.hpp"

#include "kernels/embedding.hpp"
#include "model/blocks/activation_checkpoint.hpp"
#include "model/blocks/fusions.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "model/checkpoint/safetensors.hpp"
#include "model/config_json.hpp"
#include "parallel/group.hpp"
#include "model/glm4_moe_lite/state_dict_adapter.hpp"

namespace kiln::model::glm4_moe_lite {

namespace {
MLAOptions mla_options(const Glm4MoeLiteConfig& c) {
  const auto& a = c.attention;
  return MLAOptions{c.hidden_size,      a.num_heads,        a.q_lora_rank, a.kv_lora_rank,   a.qk_nope_head_dim,
                    a.qk_rope_head_dim, a.v_head_dim,       a.rope_theta,  a.rope_interleave, a.softmax_scale()};
}
}  // namespace

DecoderLayerImpl::DecoderLayerImpl(const Glm4MoeLiteConfig& c, int64_t index, ExpertSlice experts) {
  attn_norm = register_module("attn_norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  attn = register_module("attn", MLA(mla_options(c)));
  mlp_norm = register_module("mlp_norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (c.moe_layers.at(index)) {
    const auto& m = c.moe;
    moe = register_module("moe", MoE(router_options(c.hidden_size, m), m.expert_intermediate_size, m.n_shared_experts,
                                     experts));
  } else {
    mlp = register_module("mlp", SwiGLU(c.hidden_size, c.intermediate_size));
  }
}

int64_t DecoderLayerImpl::parameter_count(const Glm4MoeLiteConfig& c, int64_t index, ExpertSlice experts) {
  const int64_t n = 2 * RMSNormImpl::parameter_count(c.hidden_size) + MLAImpl::parameter_count(mla_options(c));
  const auto& m = c.moe;
  return n + (c.moe_layers.at(index)
                  ? MoEImpl::parameter_count(router_options(c.hidden_size, m), m.expert_intermediate_size,
                                             m.n_shared_experts, experts)
                  : SwiGLUImpl::parameter_count(c.hidden_size, c.intermediate_size));
}

int64_t parameter_count(const Glm4MoeLiteConfig& c, ExpertSlice experts) {
  int64_t n = 2 * c.vocab_size * c.hidden_size + RMSNormImpl::parameter_count(c.hidden_size);  // embed, lm_head, norm
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) n += DecoderLayerImpl::parameter_count(c, i, experts);
  return n;
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& positions,
                                        const torch::Tensor& cu_seqlens, int64_t max_seqlen,
                                        int64_t position_bound, const std::optional<torch::Tensor>& replay,
                                        torch::Tensor* expert_ids_out) {
  // The residual additions and their gradients' sums inside the norms' passes (RMSNorm::forward_pass/add).
  auto [x_on, y_attn] = attn_norm->forward_pass(x);
  auto [h, y] = mlp_norm->forward_add(x_on, attn(y_attn, positions, cu_seqlens, max_seqlen, position_bound));
  return h + (moe ? moe(y, replay, expert_ids_out, /*validate_replay=*/false) : mlp(y));  // checked in forward()
}

torch::Tensor DecoderLayerImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& positions,
                                               const CachedLayout& layout, torch::Tensor& cache,
                                               torch::Tensor* expert_ids_out) {
  auto h = x + attn->forward_cached(attn_norm(x), positions, layout, cache);
  auto y = mlp_norm(h);
  return h + (moe ? moe(y, std::nullopt, expert_ids_out) : mlp(y));
}

Glm4MoeLiteModel::Glm4MoeLiteModel(Glm4MoeLiteConfig config, ExpertSlice experts, bool random_init)
    : config_(std::move(config)), experts_(experts) {
  config_.validate();
  check_expert_slice(experts_, config_.moe.num_experts, "glm4_moe_lite");
  embed = register_module("embed", torch::nn::Embedding(config_.vocab_size, config_.hidden_size));
  torch::nn::ModuleList list;
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    layers.push_back(DecoderLayer(config_, i, experts_));
    list->push_back(layers.back());
  }
  register_module("layers", list);
  norm = register_module("norm", RMSNorm(config_.hidden_size, config_.rms_norm_eps));
  lm_head = register_module("lm_head",
                            torch::nn::Linear(torch::nn::LinearOptions(config_.hidden_size, config_.vocab_size).bias(false)));
  if (!random_init) return;
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const auto& name = p.key();
    if (name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0) p.value().fill_(1.0);
    else p.value().normal_(0.0, 0.02);
  }
}

ForwardOutput Glm4MoeLiteModel::forward(const PackedBatch& batch, const ForwardOptions& options) {
  batch.validate();
  const int64_t T = batch.input_ids.size(0), L = num_moe_layers(), K = config_.moe.top_k;
  if (options.replay_topk_indices)
    throw std::invalid_argument("glm4_moe_lite has no sparse-attention layers: replay_topk_indices must not be set");
  if (options.replay_routed_experts) {
    const auto& r = *options.replay_routed_experts;
    if (r.dim() != 3 || r.size(0) != T || r.size(1) != L || r.size(2) != K)
      throw std::invalid_argument("replay_routed_experts must be [T, L, K] = [" + std::to_string(T) + ", " +
                                  std::to_string(L) + ", " + std::to_string(K) + "]");
  }
  const bool want_ids = options.return_routed_experts || options.replay_routed_experts.has_value();
  std::vector<torch::Tensor> ids;
  // Inputs may live on the host; the model's device decides (cu_seqlens stays on the host).
  const auto dev = embed->weight.device();
  auto positions = to_model_device(batch.position_ids, dev);
  // Document bounds on the device once (int32, FlashAttention's type), not once per layer.
  const auto cu_host = batch.cu_seqlens.to(torch::kCPU).contiguous();  // already on the host by contract
  const auto* cu = cu_host.data_ptr<int64_t>();
  int64_t max_seqlen = 0;
  for (int64_t b = 0; b + 1 < cu_host.size(0); ++b) max_seqlen = std::max(max_seqlen, cu[b + 1] - cu[b]);
  // MLA's rope reads a cos/sin table of position_bound rows on CUDA (MLAImpl::forward): every
  // position below it, and within the model's max_position_embeddings. Read on the host, where
  // the trainer packs its batches (PackedBatch numbers each document 0..len-1; a continued
  // sequence may start later).
  int64_t position_bound = 0;
  if (T > 0) {
    const auto pos_host = batch.position_ids.to(torch::kCPU);
    const auto [lo_t, hi_t] = torch::aminmax(pos_host);
    const int64_t lo = lo_t.item<int64_t>(), hi = hi_t.item<int64_t>();
    if (lo < 0) throw std::invalid_argument("position_ids must be >= 0, got " + std::to_string(lo));
    if (hi >= config_.max_position_embeddings)
      throw std::invalid_argument("position_ids must be < max_position_embeddings = " +
                                  std::to_string(config_.max_position_embeddings) + " (config.json), got " +
                                  std::to_string(hi));
    position_bound = hi + 1;
  }
  auto cu_dev = to_model_device(batch.cu_seqlens, dev, torch::kInt32);
  std::optional<torch::Tensor> replay_all;
  if (options.replay_routed_experts) {
    // Expert ids in [0, E), checked once for every layer, where the ids live (on the host
    // as the trainer packs them: no device sync).
    const auto& r = *options.replay_routed_experts;
    if (r.numel() > 0 && (r.min().item<int64_t>() < 0 || r.max().item<int64_t>() >= config_.moe.num_experts))
      throw std::invalid_argument("replay_routed_experts must lie in [0, " + std::to_string(config_.moe.num_experts) + ")");
    replay_all = to_model_device(r, dev, torch::kInt64);
  }
  // With the training fusions (model/blocks/fusions.hpp) kernels::embedding: the weight's
  // gradient written in one pass (kernels/embedding.hpp).
  const auto ids_dev = to_model_device(batch.input_ids, dev);
  auto x = training_fusions() ? kernels::embedding(embed->weight, ids_dev) : embed(ids_dev);  // [T, D]
  int64_t moe_index = 0, layer_index = 0;
  for (auto& layer : layers) {
    if (layer_hooks_) x = layer_hooks_->before_layer(layer_index, x);
    std::optional<torch::Tensor> replay;
    torch::Tensor chosen;
    if (layer->is_moe() && replay_all) replay = replay_all->select(1, moe_index);  // [T, K]
    const bool want_chosen = layer->is_moe() && want_ids;
    if (checkpoints_layer(layer_index)) {  // the recomputation in the backward writes the same ids again
      auto out_ids = std::make_shared<torch::Tensor>();
      x = checkpointed(
          [l = layer.ptr(), positions, cu_dev, max_seqlen, position_bound, replay, out_ids,
           want_chosen](const torch::Tensor& in) {
            return l->forward(in, positions, cu_dev, max_seqlen, position_bound, replay,
                              want_chosen ? out_ids.get() : nullptr);
          },
          x);
      chosen = *out_ids;
    } else {
      x = layer(x, positions, cu_dev, max_seqlen, position_bound, replay, want_chosen ? &chosen : nullptr);
    }
    if (layer_hooks_) x = layer_hooks_->after_layer(layer_index, x);
    ++layer_index;
    if (layer->is_moe()) {
      if (want_ids) ids.push_back(chosen);
      ++moe_index;
    }
  }
  ForwardOutput out;
  out.hidden = norm(x);
  if (want_ids) out.routed_experts = L ? torch::stack(ids, 1) : torch::empty({T, 0, K}, torch::kInt64);
  return out;
}

std::unique_ptr<DecodeCache> Glm4MoeLiteModel::make_decode_cache(const DecodeCacheShape& shape,
                                                                 const torch::TensorOptions& options) const {
  return std::make_unique<PagedCache>(num_layers(), cache_width(), shape, options);
}

int64_t Glm4MoeLiteModel::decode_cache_bytes(const DecodeCacheShape& shape, torch::Dtype dtype) const {
  return PagedCache::bytes(num_layers(), cache_width(), shape, dtype);
}

ForwardOutput Glm4MoeLiteModel::forward_cached(const torch::Tensor& ids, const torch::Tensor& positions,
                                               const std::vector<CachedSlice>& slices, DecodeCache& cache,
                                               bool want_experts) {
  auto* paged = dynamic_cast<PagedCache*>(&cache);
  if (!paged || int64_t(paged->layers.size()) != config_.num_hidden_layers)
    throw std::invalid_argument("glm4_moe_lite forward_cached: the cache is not this model's (make_decode_cache: a "
                                "PagedCache of " + std::to_string(config_.num_hidden_layers) + " layers)");
  const CachedLayout layout(slices, paged->layers.front().size(1), ids.device());  // the same pages in every layer
  return run_cached(ids, positions, layout, *paged, want_experts);
}

ForwardOutput Glm4MoeLiteModel::forward_decode(const torch::Tensor& ids, const torch::Tensor& positions,
                                               const torch::Tensor& block_table, DecodeCache& cache,
                                               bool want_experts) {
  auto* paged = dynamic_cast<PagedCache*>(&cache);
  if (!paged || int64_t(paged->layers.size()) != config_.num_hidden_layers)
    throw std::invalid_argument("glm4_moe_lite forward_decode: the cache is not this model's (make_decode_cache: a "
                                "PagedCache of " + std::to_string(config_.num_hidden_layers) + " layers)");
  if (ids.dim() != 1 || ids.sizes() != positions.sizes())
    throw std::invalid_argument("glm4_moe_lite forward_decode: ids and positions must both be [B], got " +
                                c10::str(ids.sizes()) + " and " + c10::str(positions.sizes()));
  const CachedLayout layout(positions, block_table, paged->layers.front().size(1));
  return run_cached(ids, positions, layout, *paged, want_experts);
}

ForwardOutput Glm4MoeLiteModel::run_cached(const torch::Tensor& ids, const torch::Tensor& positions,
                                           const CachedLayout& layout, PagedCache& paged, bool want_experts) {
  auto& caches = paged.layers;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> ids_per_layer;
  auto x = embed(ids);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    torch::Tensor chosen;
    x = layers[l]->forward_cached(x, positions, layout, caches[l], layers[l]->is_moe() && want_experts ? &chosen : nullptr);
    if (layers[l]->is_moe() && want_experts) ids_per_layer.push_back(chosen);
  }
  ForwardOutput out;
  out.hidden = norm(x);
  if (want_experts)
    out.routed_experts = ids_per_layer.empty() ? torch::empty({ids.size(0), 0, config_.moe.top_k}, torch::kInt64)
                                               : torch::stack(ids_per_layer, 1);
  return out;
}

void Glm4MoeLiteModel::set_expert_parallel(parallel::Group* ep) {
  if (!ep || ep->size() == 1) return;
  if (ep_) throw std::invalid_argument("set_expert_parallel: already set (ep group '" + ep_->name() + "')");
  if (config_.moe.num_experts % ep->size() != 0)  // before any layer is sliced
    throw std::invalid_argument("set_expert_parallel: " + std::to_string(config_.moe.num_experts) +
                                " experts do not split over the " + std::to_string(ep->size()) + " ranks of ep group '" +
                                ep->name() + "'");
  for (auto& layer : layers)
    if (layer->is_moe()) layer->moe->set_expert_parallel(ep);
  ep_ = ep;
  experts_ = {ep->rank(), ep->size()};
}

void Glm4MoeLiteModel::serve_expert_parallel() {
  for (auto& layer : layers)  // in forward's order: the exchanges meet the other ranks' layer by layer
    if (layer->is_moe()) layer->moe->serve_expert_parallel();
}

std::vector<torch::Tensor> Glm4MoeLiteModel::routed_expert_parameters() {
  std::vector<torch::Tensor> out;
  for (auto& layer : layers)
    if (layer->is_moe()) {
      out.push_back(layer->moe->experts->w_gate_up_EFD);
      out.push_back(layer->moe->experts->w_down_EDF);
    }
  return out;
}

void Glm4MoeLiteModel::refuse_load_under_expert_parallel(const char* what) const {
  if (ep_)
    throw std::invalid_argument(std::string(what) + ": the model's experts are split over ep group '" + ep_->name() +
                                "' (expert parallel): load the full weights before set_expert_parallel");
}

void Glm4MoeLiteModel::load_hf_tensors(const std::vector<messaging::Tensor>& tensors) {
  refuse_load_under_expert_parallel("load_hf_tensors");
  load_hf_state_dict(*this, tensors);
}

std::map<std::string, torch::Tensor> Glm4MoeLiteModel::hf_targets() {
  refuse_load_under_expert_parallel("hf_targets");
  return glm4_moe_lite::hf_targets(*this);
}
bool Glm4MoeLiteModel::hf_key_skipped(const std::string& name) const { return glm4_moe_lite::hf_key_skipped(*this, name); }

std::vector<messaging::Tensor> Glm4MoeLiteModel::hf_state_dict() { return to_hf_state_dict(*this); }
std::vector<messaging::Tensor> Glm4MoeLiteModel::hf_state_dict_local(bool with_dense) {
  return to_hf_state_dict_local(*this, with_dense);
}
std::vector<std::vector<std::string>> Glm4MoeLiteModel::weight_sync_groups(bool hf_names) const {
  return glm4_moe_lite::weight_sync_groups(hf_names);
}

void Glm4MoeLiteModel::to_dtype(torch::Dtype dtype) {
  this->to(dtype);
  // The score-correction bias decides expert choice by differences of ~1e-3: keep it fp32
  // (transformers: _keep_in_fp32_modules_strict = ["e_score_correction_bias"]).
  for (auto& layer : layers)
    if (layer->is_moe()) {
      auto& b = layer->moe->router->e_score_correction_bias;
      b.set_data(b.to(torch::kFloat32));
    }
}

void Glm4MoeLiteModel::load_hf_checkpoint(const std::string& dir) {
  refuse_load_under_expert_parallel("load_hf_checkpoint");
  auto ckpt = checkpoint::Checkpoint::open(dir);
  load_hf_state_dict(*this, ckpt);
}

void Glm4MoeLiteModel::save_hf_checkpoint(const std::string& dir, uint64_t max_shard_bytes) {
  checkpoint::write_checkpoint(dir, to_hf_state_dict(*this), max_shard_bytes);
  save_hf_config(dir);
}

void Glm4MoeLiteModel::save_hf_config(const std::string& dir) {
  try {
    config_json::write_config_json(dir, config_.to_hf_json());
  } catch (const std::runtime_error& e) {
    throw checkpoint::CheckpointError(e.what());
  }
}

void Glm4MoeLiteModel::check_hf_config(const std::string& dir) const {
  config_json::check_dir_config(config_, dir);
}

std::shared_ptr<Glm4MoeLiteModel> from_hf_dir(const std::string& dir, ExpertSlice experts) {
  auto j = config_json::read_config_json(dir);
  auto path = (std::filesystem::path(dir) / "config.json").string();
  auto model = std::make_shared<Glm4MoeLiteModel>(Glm4MoeLiteConfig::from_hf_json(j, path), experts,
                                                  /*random_init=*/false);  // every weight is read below
  model->load_hf_checkpoint(dir);
  return model;
}

}  // namespace kiln::model::glm4_moe_lite
