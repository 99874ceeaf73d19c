#include "model/causal_lm.hpp"

#include <stdexcept>

#include "model/blocks/logprobs.hpp"
#include "parallel/group.hpp"

namespace kiln::model {

torch::Tensor CausalLM::logits(const ForwardOutput& out) {
  return torch::nn::functional::linear(out.hidden, lm_head_weight());  // [T, V]
}

torch::Tensor CausalLM::token_logprobs(const ForwardOutput& out, const torch::Tensor& targets, int64_t chunk) {
  return model::token_logprobs(out.hidden, lm_head_weight(), targets, chunk);
}

void CausalLM::set_expert_parallel(parallel::Group* ep) {
  if (!ep || ep->size() == 1) return;
  throw std::invalid_argument("this model has no expert parallel (asked for ep group '" + ep->name() + "' of " +
                              std::to_string(ep->size()) + " ranks)");
}

ForwardOutput CausalLM::forward_decode(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, DecodeCache&,
                                       bool) {
  throw std::logic_error("this model has no forward_decode (a decode step on device tensors, e.g. for CUDA graphs): "
                         "has_device_decode() is false");
}

}  // namespace kiln::model
