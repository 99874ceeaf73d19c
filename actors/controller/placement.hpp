#pragma once
// Placement: where each actor of a run lives, chosen once at start from config.placement —
// in the controller's process (local_handles.hpp) or in `kiln node` children (remote_handles.hpp):
//   placement.mode       "single_process" | "multi_process" (engines rollout/0..N-1 in nodes)
//                        | "colocated" (an engine in each trainer rank, over its parameters)
//   placement.reference  "controller" | "process" (ref/0 in a node)
//   placement.trainer    "controller" | "process" (trainer/0 in a node; the controller then
//                        holds no model)
//   rollout.backend      "http": the engines are servers at rollout.urls (http_engines.hpp)
//   parallel.dp > 1      the trainer over data-parallel ranks, rank 0 in the controller's
//                        process (trainer_ranks.hpp)
// The loop only sees the handles.
#include <memory>

#include "actors/controller/config.hpp"
#include "actors/controller/handles.hpp"
#include "actors/controller/remote_handles.hpp"
#include "parallel/process_group.hpp"

namespace kiln::controller {

struct Actors {
  std::unique_ptr<TrainerHandle> trainer;
  std::unique_ptr<RolloutEngines> engines;
  std::unique_ptr<ReferencePolicy> reference;
};

/// What a run with one trainer rank holds in host memory, per model parameter, in the
/// controller's process and the `kiln node` processes it starts (nodes run on this machine): the
/// trainer's 16 bytes (weights, gradients and AdamW's two fp32 moments; in bf16 2 + 2 + 4 for the
/// fp32 masters + 8) when model.device is the CPU, and one copy in the model's dtype for each
/// rollout engine (single_process: one; multi_process: rollout_engines, by
/// placement.rollout_device) and for the reference (placement.reference_device for a node)
/// whose device is the CPU. Engines of rollout.backend = "http" or placement.mode = "colocated"
/// hold no copy here. Several trainer ranks: 0 (each rank's build checks its host's share:
/// model::Registry::build's builders_on_host). `parts` names each term, for the refusal.
struct HostBytesPerParameter {
  double bytes = 0;
  std::string parts;
};
HostBytesPerParameter run_host_bytes_per_parameter(const Config& config);

/// Builds the run's actors. The trainer comes first: torch::manual_seed(run.seed), then its
/// policy (in this process or in its node, the same way), whose initial weights the reference
/// takes. Throws std::invalid_argument / std::runtime_error naming what failed (a model that
/// cannot be built, a node that did not start); nodes started before the failure are stopped.
/// `ranks`: this process's (rank 0's) process groups when config.parallel.dp > 1, else null.
Actors place_actors(const Config& config, const NodeSite& site, parallel::ProcessGroups* ranks = nullptr);

}  // namespace kiln::controller
