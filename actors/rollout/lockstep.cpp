#include "actors/rollout/lockstep.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/moe_decode.hpp"
#include "parallel/group.hpp"

namespace kiln::rollout {

namespace {
// The largest of `value` over the group's ranks.
int64_t max_over(parallel::Group& group, int64_t value) {
  auto t = torch::tensor({value}, torch::TensorOptions(torch::kInt64).device(group.device()));
  group.all_reduce(t, parallel::ReduceOp::max);
  return t.item<int64_t>();
}
}  // namespace

std::vector<Completion> generate_in_lockstep(Engine& engine, std::vector<GenerationRequest> requests,
                                             const std::function<void()>& between_steps) {
  if (engine.paused()) throw std::logic_error("generate_in_lockstep: the engine is paused");
  parallel::Group* ep = engine.model().expert_parallel();
  std::string refused;
  for (const auto& r : requests) {
    try {
      engine.check(r);
    } catch (const std::exception& e) {
      refused = e.what();
      break;
    }
  }
  if (ep && max_over(*ep, refused.empty() ? 0 : 1) != 0 && refused.empty())
    throw std::invalid_argument("another rank of ep group '" + ep->name() +
                                "' refused its requests (its error names the fault); nothing generated");
  if (!refused.empty()) throw std::invalid_argument(refused);
  for (auto& r : requests) engine.submit(std::move(r));
  std::vector<Completion> out;
  while (ep ? max_over(*ep, engine.has_work() ? 1 : 0) != 0 : engine.has_work()) {
    const int64_t before = engine.forwards();
    if (engine.has_work())
      for (auto& c : engine.step()) out.push_back(std::move(c));
    if (ep && engine.forwards() == before) {  // the others' rows, this step, by the experts' kernels a step uses
      const kernels::DecodeExpertsGuard experts_kernel(engine.options().moe_decode_kernel);
      engine.model().serve_expert_parallel();
    }
    if (between_steps) between_steps();
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}

ColocatedEngine::ColocatedEngine(std::shared_ptr<model::CausalLM> policy, const EngineOptions& options)
    : engine_(std::move(policy), options) {}

std::vector<Completion> ColocatedEngine::generate(std::vector<GenerationRequest> requests, int64_t version,
                                                  const std::function<void()>& between_steps) {
  engine_.pause();  // between generations: the optimizer wrote the weights in place
  engine_.weights_written(version);
  engine_.resume();
  return generate_in_lockstep(engine_, std::move(requests), between_steps);
}

}  // namespace kiln::rollout
