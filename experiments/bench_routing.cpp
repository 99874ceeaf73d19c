#include "experiments/bench_routing.hpp"

#include <vector>

namespace kiln::experiments {

torch::Tensor expert_loads(model::glm4_moe_lite::Glm4MoeLiteModel& model, const model::PackedBatch& batch) {
  torch::NoGradGuard ng;
  model::ForwardOptions fo;
  fo.return_routed_experts = true;
  const auto ids = model.forward(batch, fo).routed_experts.to(torch::kCPU);  // [T, L, K]
  std::vector<torch::Tensor> per_layer;
  for (int64_t l = 0; l < ids.size(1); ++l)
    per_layer.push_back(
        torch::bincount(ids.select(1, l).flatten(), {}, model.config().moe.num_experts).to(torch::kFloat64));
  return torch::stack(per_layer);
}

double per_layer_max_over_mean(const torch::Tensor& loads) {
  return (std::get<0>(loads.max(1)) / loads.mean(1)).mean().item<double>();
}

torch::Tensor balance_routing(model::glm4_moe_lite::Glm4MoeLiteModel& model, const model::PackedBatch& batch, int rounds,
                              double rate) {
  const auto before = expert_loads(model, batch);
  std::vector<torch::Tensor> biases;
  for (auto& layer : model.layers)
    if (layer->is_moe()) biases.push_back(layer->moe->router->e_score_correction_bias);
  torch::NoGradGuard ng;
  for (int round = 0; round < rounds; ++round) {
    const auto loads = expert_loads(model, batch);
    for (std::size_t l = 0; l < biases.size(); ++l) {
      const auto load = loads[int64_t(l)];
      auto delta = rate * torch::sign(load.mean() - load);
      biases[l].add_((delta - delta.mean()).to(biases[l].device(), biases[l].scalar_type()));
    }
  }
  return before;
}

}  // namespace kiln::experiments
