#include "actors/controller/placement.hpp"

#include <algorithm>
#include <cstdio>

#include "actors/controller/http_engines.hpp"
#include "actors/controller/local_handles.hpp"
#include "actors/controller/trainer_ranks.hpp"
#include "model/registry.hpp"

namespace kiln::controller {

HostBytesPerParameter run_host_bytes_per_parameter(const Config& c, int trainer_ranks_on_host,
                                                   double rank_parameter_share) {
  HostBytesPerParameter out;
  const auto& p = c.placement;
  const double copy = c.model.dtype == "bf16" ? 2 : 4;
  const std::string copy_text = std::to_string(int(copy)) + " B";
  auto add = [&](double bytes, const std::string& what) {
    out.bytes += bytes;
    out.parts += (out.parts.empty() ? "" : ", ") + what;
  };
  auto on_cpu = [](const std::string& device) { return device == "cpu"; };
  auto number = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3g", v);
    return std::string(text);
  };
  const int64_t ranks = c.parallel.dp * c.parallel.ep;
  if (on_cpu(c.model.device)) {
    if (ranks == 1) {
      if (copy == 4) add(16, "the trainer's weights, gradients and AdamW's moments (16 B)");
      else add(20, "the trainer's bf16 weights and gradients, fp32 masters, their gradients and AdamW's moments (20 B)");
    } else {
      const double per_rank = 2 * copy + 4 + 16.0 / double(c.parallel.dp);
      const double share = rank_parameter_share;
      add(double(trainer_ranks_on_host) * share * per_rank,
          std::to_string(trainer_ranks_on_host) + " trainer ranks on this machine, each its weights and gradients (2 x " +
              copy_text + "), the fp32 gradient it reduces (4 B) and 1/" + std::to_string(c.parallel.dp) +
              " of the fp32 masters, their gradients and AdamW's moments (16 B)" +
              (share < 1 ? " over its " + number(100 * share) + "% of the parameters" : std::string()));
      if (p.reference == "colocated")
        add(double(trainer_ranks_on_host) * share * copy,
            "a colocated reference's copy in each (" + copy_text + (share < 1 ? " of its share)" : ")"));
    }
  }
  if (c.rollout.backend != "http") {
    if (p.mode == "multi_process") {
      int64_t engines = 0;
      for (int64_t i = 0; i < p.rollout_engines; ++i) engines += on_cpu(p.engine_device(std::size_t(i), c.model.device));
      if (engines > 0)
        add(double(engines) * copy, engines == 1 ? "the engine's copy (" + copy_text + ")"
                                                 : std::to_string(engines) + " engines' copies (" + copy_text + " each)");
    } else if (p.mode != "colocated" && on_cpu(c.model.device)) {
      add(copy, "the engine's copy (" + copy_text + ")");
    }
  }
  const auto reference_device =
      p.reference == "process" && !p.reference_device.empty() ? p.reference_device : c.model.device;
  if (on_cpu(reference_device) && !(p.reference == "colocated" && ranks > 1))
    add(copy, "the reference's copy (" + copy_text + ")");
  if (c.algorithm.staleness > 0 && p.mode != "colocated" && p.trainer != "process" &&
      c.weight_sync.transport != "collective")
    add(3 * copy, "up to 3 host snapshots of the weights for rollouts ahead (algorithm.staleness > 0; " + copy_text +
                      " each)");
  return out;
}

namespace {
// Before anything is built: the run as this machine will hold it (run_host_bytes_per_parameter),
// refused by name when it exceeds what is available, instead of being killed part way (each
// build then checks itself again). `ranks`: rank 0's groups with several trainer ranks.
void check_run_fits_host(const Config& c, const model::Registry& registry, parallel::ProcessGroups* ranks) {
  const int on_host = ranks ? std::max(1, ranks->launch().local_world_size) : 1;
  double share = 1.0;
  if (c.parallel.ep > 1) {  // an expert-parallel rank's parameters over the whole model's
    const auto whole = registry.parameter_count(c.model.package, c.model.flavor, c.model.checkpoint);
    const auto part = registry.parameter_count(c.model.package, c.model.flavor, c.model.checkpoint,
                                               {0, int(c.parallel.ep)});
    if (whole > 0 && part > 0) share = double(part) / double(whole);
  }
  const auto need = run_host_bytes_per_parameter(c, on_host, share);
  if (need.bytes == 0) return;
  registry.check_fits_host(c.model.package, c.model.flavor, c.model.checkpoint, need.bytes,
                           "on this machine for the run (the controller's process, the trainer ranks and the kiln "
                           "nodes it starts: " +
                               need.parts + " a parameter)");
}
}  // namespace

Actors place_actors(const Config& c, const NodeSite& site, parallel::ProcessGroups* ranks) {
  const auto& p = c.placement;
  auto registry = model::Registry::with_plugins();
  check_run_fits_host(c, registry, ranks);
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
    a.engines = std::make_unique<HttpEngines>(c, site.dir, a.trainer->vocab_size(), a.trainer->routing_shape());
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
