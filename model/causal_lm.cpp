#include "model/causal_lm.hpp"

#include <stdexcept>

#include "model/blocks/batch_invariant.hpp"
#include "model/blocks/logprobs.hpp"
#include "parallel/group.hpp"

namespace kiln::model {

torch::Tensor CausalLM::logits(const ForwardOutput& out) {
  if (batch_invariant_) return invariant_linear(out.hidden, lm_head_weight());  // [T, V]
  return torch::nn::functional::linear(out.hidden, lm_head_weight());  // [T, V]
}

torch::Tensor CausalLM::fp32_logits(const torch::Tensor& hidden_ND) {
  return batch_invariant_ ? invariant_lm_logits(hidden_ND, lm_head_weight()) : lm_logits(hidden_ND, lm_head_weight());
}

namespace {
// The head's inputs: the hidden states [R, D] and targets [R] of `rows` (every row when
// undefined), on the hidden states' device.
std::pair<torch::Tensor, torch::Tensor> head_rows(const ForwardOutput& out, const torch::Tensor& targets,
                                                  const torch::Tensor& rows) {
  if (!rows.defined()) return {out.hidden, targets};
  TORCH_CHECK(rows.dim() == 1, "token_logprobs: rows must be [R] int64, got ", rows.sizes());
  const auto r = rows.to(out.hidden.device(), torch::kInt64);
  return {out.hidden.index_select(0, r), targets.to(out.hidden.device(), torch::kInt64).index_select(0, r)};
}
}  // namespace

torch::Tensor CausalLM::token_logprobs(const ForwardOutput& out, const torch::Tensor& targets, int64_t chunk,
                                       double temperature, const torch::Tensor& rows) {
  auto [hidden, tg] = head_rows(out, targets, rows);
  if (batch_invariant_) return token_logprobs_invariant(hidden, lm_head_weight(), tg, temperature, chunk);
  if (temperature != 1.0) hidden = hidden / temperature;  // logits / T
  return model::token_logprobs(hidden, lm_head_weight(), tg, chunk, kept_logits_bytes_);
}

std::pair<torch::Tensor, torch::Tensor> CausalLM::token_logprobs_and_entropy(const ForwardOutput& out,
                                                                             const torch::Tensor& targets,
                                                                             int64_t chunk, double temperature,
                                                                             const torch::Tensor& rows) {
  auto [hidden, tg] = head_rows(out, targets, rows);
  auto scaled = temperature != 1.0 ? hidden / temperature : hidden;  // logits / T
  auto [lp, ent] = model::token_logprobs_and_entropy(scaled, lm_head_weight(), tg, chunk, kept_logits_bytes_);
  if (batch_invariant_) lp = token_logprobs_invariant(hidden, lm_head_weight(), tg, temperature, chunk);
  return {lp, ent};
}

void CausalLM::set_activation_checkpointing(bool on, int64_t layers) {
  if (layers < 0)
    throw std::invalid_argument("activation checkpointing layers must be >= 0 (0: every layer), got " +
                                std::to_string(layers));
  checkpoint_layers_ = on;
  checkpoint_count_ = layers;
}

void CausalLM::set_kept_logits_bytes(int64_t bytes) {
  if (bytes < 0) throw std::invalid_argument("kept logits bytes must be >= 0, got " + std::to_string(bytes));
  kept_logits_bytes_ = bytes;
}

void CausalLM::set_batch_invariant(bool on) {
  if (on && !supports_batch_invariant())
    throw std::invalid_argument("this model has no batch-invariant forward (the true on-policy mode, "
                                "algorithm.true_on_policy): its package does not implement it; glm4_moe_lite does");
  for (const auto& m : modules(/*include_self=*/false))
    if (auto* s = dynamic_cast<BatchInvariantSwitch*>(m.get())) s->set_batch_invariant(on);
  batch_invariant_ = on;
}

void CausalLM::set_expert_parallel(parallel::Group* ep) {
  if (!ep || ep->size() == 1) return;
  throw std::invalid_argument("this model has no expert parallel (asked for ep group '" + ep->name() + "' of " +
                              std::to_string(ep->size()) + " ranks)");
}

void CausalLM::serve_expert_parallel() {
  if (expert_parallel())
    throw std::logic_error("serve_expert_parallel: this model's package does not implement it (glm4_moe_lite does)");
}

ForwardOutput CausalLM::forward_decode(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, DecodeCache&,
                                       bool) {
  throw std::logic_error("this model has no forward_decode (a decode step on device tensors, e.g. for CUDA graphs): "
                         "has_device_decode() is false");
}

MtpLoss mtp_loss(CausalLM& model, const PackedBatch& batch, const torch::Tensor& hidden, const torch::Tensor& supervised_T,
                 int64_t depths, double weight, double normalizer, int64_t chunk) {
  const int64_t T = batch.input_ids.size(0);
  if (supervised_T.dim() != 1 || supervised_T.size(0) != T)
    throw std::invalid_argument("mtp_loss: supervised must be [T] = [" + std::to_string(T) + "], got " +
                                c10::str(supervised_T.sizes()));
  if (!(weight >= 0) || !(normalizer > 0))
    throw std::invalid_argument("mtp_loss: weight must be >= 0 and normalizer > 0, got " + std::to_string(weight) +
                                " and " + std::to_string(normalizer));
  const auto supervised = supervised_T.to(torch::kCPU, torch::kBool);
  MtpLoss r;
  auto total = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
  for (auto& depth : model.mtp_forward(batch, hidden, depths)) {
    auto mask = supervised.index_select(0, depth.rows + depth.depth);  // [Td] row t+d's target is trained
    // The head runs on the trained rows only (as the policy's: CausalLM::token_logprobs' rows).
    const auto rows = mask.nonzero().squeeze(1);  // [Ts] int64, CPU
    r.tokens += rows.size(0);
    if (rows.size(0) == 0) {  // still a (zero) gradient for this depth's layers
      total = total + depth.hidden.sum().to(torch::kFloat32) * 0;
      continue;
    }
    const auto r_dev = rows.to(depth.hidden.device());
    auto lp = model::token_logprobs(depth.hidden.index_select(0, r_dev), model.lm_head_weight(),
                                    depth.targets.index_select(0, r_dev.to(depth.targets.device())), chunk);  // [Ts] fp32
    total = total - lp.sum();
  }
  if (r.tokens == 0) {
    // Nothing to learn from, yet a backward must reach every MTP parameter (a zero gradient,
    // not none: optimizers and gradient reductions expect the same tensors on every rank).
    for (const auto& p : model.mtp_parameters())
      if (p.requires_grad()) total = total + p.sum().to(torch::kFloat32) * 0;
    total = total + hidden.sum().to(torch::kFloat32) * 0;
  }
  r.ce_sum = total.detach().item<double>();
  r.loss = total * (weight / double(depths) / normalizer);
  return r;
}

}  // namespace kiln::model
