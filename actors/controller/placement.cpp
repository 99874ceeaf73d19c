#include "actors/controller/placement.hpp"

#include "actors/controller/http_engines.hpp"
#include "actors/controller/local_handles.hpp"
#include "actors/controller/trainer_ranks.hpp"
#include "model/registry.hpp"

namespace kiln::controller {

Actors place_actors(const Config& c, const NodeSite& site, parallel::ProcessGroups* ranks) {
  const auto& p = c.placement;
  auto registry = model::Registry::with_plugins();
  Actors a;
  torch::manual_seed(uint64_t(c.run.seed));  // the trainer node seeds its policy the same way
  if (c.parallel.dp * c.parallel.ep > 1) {
    if (!ranks) throw std::logic_error("several trainer ranks without their process groups");
    a.trainer = std::make_unique<DataParallelTrainer>(c, *ranks, site.gateway);
  } else if (p.trainer == "process")
    a.trainer = std::make_unique<RemoteTrainer>(site, c);
  else
    a.trainer = std::make_unique<LocalTrainer>(registry.build(c.model), c.trainer_for_run(), site.gateway,
                                               uint64_t(c.weight_sync.bucket_mib * (1 << 20)));
  if (c.rollout.backend == "http")
    a.engines = std::make_unique<HttpEngines>(c, site.dir, a.trainer->vocab_size());
  else if (p.mode == "colocated")
    a.engines = std::make_unique<ColocatedEngines>(*a.trainer, c.engine_for_run(), c.algorithm.samples_per_prompt);
  else if (p.mode == "multi_process")
    a.engines = std::make_unique<RemoteEngines>(site, c, *a.trainer);
  else
    a.engines = std::make_unique<LocalEngine>(registry.build(c.model), c.engine_for_run(), site.gateway);
  if (p.reference == "colocated") {
    if (auto* one = dynamic_cast<LocalTrainer*>(a.trainer.get())) one->hold_reference(c.model);  // dp/ep: at init
    a.reference = std::make_unique<ColocatedReference>(*a.trainer);
  } else if (p.reference == "process")
    a.reference = std::make_unique<RemoteReference>(site, c, *a.trainer);
  else
    a.reference = std::make_unique<LocalReference>(registry.build(c.model), a.trainer->weights(false), c.trainer.logprobs);
  return a;
}

}  // namespace kiln::controller
