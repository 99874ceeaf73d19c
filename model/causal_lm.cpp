#include "model/causal_lm.hpp"

#include "model/blocks/logprobs.hpp"

namespace kiln::model {

torch::Tensor CausalLM::logits(const ForwardOutput& out) {
  return torch::nn::functional::linear(out.hidden, lm_head_weight());  // [T, V]
}

torch::Tensor CausalLM::token_logprobs(const ForwardOutput& out, const torch::Tensor& targets, int64_t chunk) {
  return model::token_logprobs(out.hidden, lm_head_weight(), targets, chunk);
}

}  // namespace kiln::model
