#include "actors/controller/placement.hpp"

#include "actors/controller/http_engines.hpp"
#include "actors/controller/local_handles.hpp"
#include "actors/controller/trainer_ranks.hpp"
#include "model/registry.hpp"

namespace kiln::controller {

namespace {
// Before anything is built, on the CPU with one trainer rank: the host memory this process will
// hold for the run, per parameter: the trainer's 16 bytes (weights, gradients and AdamW's two fp32
// moments; in bf16 also the fp32 masters: 2 + 2 + 4 + 8) when it is here, and a copy in the
// model's dtype for an in-process engine and reference. Refused by name when it exceeds what is
// available, instead of being killed part way (each build then checks itself again).
void check_run_fits_host(const Config& c, const model::Registry& registry) {
  const auto& p = c.placement;
  if (c.model.device != "cpu" || c.parallel.dp * c.parallel.ep > 1) return;
  const double copy = c.model.dtype == "bf16" ? 2 : 4;
  double per_parameter = 0;
  std::string parts;
  auto add = [&](double bytes, const std::string& what) {
    per_parameter += bytes;
    parts += (parts.empty() ? "" : ", ") + what;
  };
  if (p.trainer != "process") add(16, "the trainer's weights, gradients and AdamW state (16 B)");
  if (c.rollout.backend != "http" && p.mode != "colocated" && p.mode != "multi_process")
    add(copy, "the engine's copy (" + std::to_string(int(copy)) + " B)");
  if (p.reference != "process") add(copy, "the reference's copy (" + std::to_string(int(copy)) + " B)");
  if (per_parameter == 0) return;
  registry.check_fits_host(c.model.package, c.model.flavor, c.model.checkpoint, per_parameter,
                           "in this process for the run on the CPU (" + parts + " a parameter)");
}
}  // namespace

Actors place_actors(const Config& c, const NodeSite& site, parallel::ProcessGroups* ranks) {
  const auto& p = c.placement;
  auto registry = model::Registry::with_plugins();
  check_run_fits_host(c, registry);
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
