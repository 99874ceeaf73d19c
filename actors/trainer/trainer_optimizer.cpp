// Trainer's optimizer state: how it is sharded over the ranks (dense, fully sharded layers,
// experts), and the whole model's flat view of it that checkpoints read and write at any mesh.
#include <unordered_map>

#include "actors/trainer/trainer.hpp"

namespace kiln::trainer {

void Trainer::shard_state(const std::vector<bool>& is_expert, const torch::optim::AdamWOptions& options) {
  // Fully sharded: each decoder layer's parameters (not its expert-parallel experts) a unit.
  std::vector<std::vector<std::pair<std::size_t, torch::Tensor>>> layers;
  std::vector<bool> in_layer(params_.size(), false);
  if (c_.fsdp) {
    const auto by_layer = policy_->decoder_layer_parameters();
    if (by_layer.empty())
      throw std::invalid_argument(
          "parallel.fsdp: this policy's model family does not list its decoder layers' parameters "
          "(CausalLM::decoder_layer_parameters), so it cannot be sharded by layer");
    std::unordered_map<const void*, std::size_t> where;
    for (std::size_t i = 0; i < params_.size(); ++i) where[params_[i].unsafeGetTensorImpl()] = i;
    for (const auto& layer : by_layer) {
      layers.emplace_back();
      for (const auto& t : layer) {
        const auto it = where.find(t.unsafeGetTensorImpl());
        if (it == where.end())
          throw std::invalid_argument("parallel.fsdp: decoder layer " + std::to_string(layers.size() - 1) +
                                      " lists a tensor that is not one of the policy's parameters");
        if (is_expert[it->second]) continue;
        in_layer[it->second] = true;
        layers.back().emplace_back(it->second, params_[it->second]);
      }
    }
  }
  // The head (final norm, lm_head): one more unit, so that its gradient (the largest dense
  // tensor's) is reduced while the layers' backward runs.
  std::vector<std::pair<std::size_t, torch::Tensor>> head;
  if (c_.fsdp) {
    std::unordered_map<const void*, std::size_t> where;
    for (std::size_t i = 0; i < params_.size(); ++i) where[params_[i].unsafeGetTensorImpl()] = i;
    for (const auto& t : policy_->head_parameters()) {
      const auto it = where.find(t.unsafeGetTensorImpl());
      if (it == where.end() || in_layer[it->second] || is_expert[it->second])
        throw std::invalid_argument(
            "parallel.fsdp: the policy's head_parameters() lists a tensor that is not one of its parameters outside "
            "the decoder layers");
      in_layer[it->second] = true;
      head.emplace_back(it->second, params_[it->second]);
    }
  }
  std::vector<torch::Tensor> dense, experts;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (in_layer[i]) continue;
    (is_expert[i] ? expert_index_ : dense_index_).push_back(i);
    (is_expert[i] ? experts : dense).push_back(params_[i]);
  }
  const auto reduce = c_.reduce_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  sharded_ = std::make_unique<ShardedAdamW>(dense, *dp_, options, reduce);
  parts_.push_back(Part{sharded_.get(), dense_index_, false});
  if (!layers.empty()) {
    fsdp_ = std::make_unique<FullyShardedLayers>(layers, *dp_, options, c_.reshard_after_forward, head, reduce);
    for (std::size_t u = 0; u < fsdp_->units(); ++u) parts_.push_back(Part{&fsdp_->optimizer(u), fsdp_->index(u), true});
    policy_->set_layer_hooks(fsdp_.get());
  }
  if (ep_.replicas) {
    expert_sharded_ = std::make_unique<ShardedAdamW>(experts, *ep_.replicas, options, reduce);
    parts_.push_back(Part{expert_sharded_.get(), expert_index_, false});
  }
}

void Trainer::reload_master_weights() {
  if (dp_) {
    for (auto& part : parts_) part.optimizer->reload_from_parameters();
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto i : low_precision_) masters_[i].copy_(params_[i]);
}

namespace {
// The one-rank optimizer's pieces: each whole master at its parameter's flat offset.
std::vector<FlatPiece> whole_pieces(const std::vector<torch::Tensor>& masters) {
  std::vector<FlatPiece> out;
  int64_t offset = 0;
  for (std::size_t i = 0; i < masters.size(); ++i) {
    out.push_back(FlatPiece{i, offset, masters[i]});
    offset += masters[i].numel();
  }
  return out;
}

// Runs of `pieces` (in flat order) that follow each other without a gap: [begin, end).
std::vector<std::pair<int64_t, int64_t>> runs_of(const std::vector<FlatPiece>& pieces) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& p : pieces) {
    const int64_t lo = p.offset, hi = p.offset + p.master.numel();
    if (!runs.empty() && runs.back().second == lo) runs.back().second = hi;
    else runs.emplace_back(lo, hi);
  }
  return runs;
}
}  // namespace

std::vector<Trainer::GlobalPieces> Trainer::global_pieces() {
  if (!dp_) return {{optimizer_.get(), whole_pieces(masters_)}};
  // Each optimizer's own index translated into the whole model's.
  std::vector<GlobalPieces> out;
  for (auto& part : parts_) {
    GlobalPieces g{&part.optimizer->optimizer(), {}};
    for (const auto& p : part.optimizer->pieces()) {
      const std::size_t i = part.index[p.param];
      g.pieces.push_back(FlatPiece{i, global_offset_[i] + (p.offset - part.optimizer->param_offset(p.param)), p.master});
    }
    out.push_back(std::move(g));
  }
  return out;
}

torch::Tensor Trainer::whole_gradient() {
  auto device = dp_ ? dp_->device() : params_.empty() ? torch::Device(torch::kCPU) : params_.front().device();
  auto out = torch::zeros({global_numel_}, torch::TensorOptions(torch::kFloat32).device(device));
  torch::NoGradGuard no_grad;
  if (steps_from_low_precision()) {  // the masters have no .grad(): the 16-bit ones, as the kernel read them
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& g = params_[i].grad();
      if (!g.defined()) continue;
      auto wide = g.to(torch::kFloat32).reshape({-1});
      if (params_[i].scalar_type() != torch::kFloat32 && clip_coefficient_.defined()) wide.mul_(clip_coefficient_);
      out.narrow(0, global_offset_[i], params_[i].numel()).copy_(wide);
    }
    return out.to(torch::kCPU);
  }
  for (auto& g : global_pieces())
    for (const auto& p : g.pieces)
      if (p.master.grad().defined()) out.narrow(0, p.offset, p.master.numel()).copy_(p.master.grad().reshape({-1}));
  if (dp_) dp_->all_reduce(out);  // each element is held by exactly one rank
  return out.to(torch::kCPU);
}

std::vector<FlatAdamWState> Trainer::optimizer_state_parts() {
  std::vector<FlatAdamWState> parts;
  for (auto& g : global_pieces())
    for (const auto& [begin, end] : runs_of(g.pieces)) {
      std::vector<FlatPiece> inside;
      for (const auto& p : g.pieces)
        if (p.offset >= begin && p.offset < end) inside.push_back(p);
      parts.push_back(read_flat_state(*g.optimizer, inside, begin, end, params_.size()));
    }
  return parts;
}

std::vector<std::pair<int64_t, int64_t>> Trainer::optimizer_ranges() {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (auto& g : global_pieces())
    for (const auto& r : runs_of(g.pieces)) out.push_back(r);
  return out;
}

void Trainer::load_optimizer_state_parts(const std::vector<FlatAdamWState>& parts) {
  for (auto& g : global_pieces()) write_flat_state(*g.optimizer, g.pieces, parts);
  if (dp_) {
    for (auto& part : parts_)
      if (!part.unit) part.optimizer->gather_parameters();
    if (fsdp_) fsdp_->gather_all();
    return;
  }
  torch::NoGradGuard no_grad;  // fp32 policies: the masters are the parameters
  for (auto i : low_precision_) params_[i].copy_(masters_[i]);
}

void Trainer::zero_optimizer_gradients() {
  if (!dp_) return optimizer_->zero_grad();
  for (auto& part : parts_) part.optimizer->zero_grad();
}

}  // namespace kiln::trainer
