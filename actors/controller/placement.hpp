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

/// What a run holds in host memory, per parameter of the whole model, in the controller's
/// process, its trainer ranks on this host and the `kiln node` processes it starts (nodes run on
/// this machine), counted before anything is built:
/// - one trainer rank on the CPU: in fp32 16 bytes (weights, gradients, AdamW's two moments); in
///   bf16 20 (bf16 weights and gradients, fp32 masters and their gradients, the moments);
/// - several (parallel.dp x parallel.ep), `trainer_ranks_on_host` of them here on the CPU: each
///   its weights and gradients in the model's dtype, the full fp32 gradient it reduces, and 1/dp
///   of the fp32 masters, their gradients and the moments (16 bytes: trainer::ShardedAdamW), over
///   `rank_parameter_share` of the parameters (an expert-parallel rank's experts; 1 without
///   expert parallel), and with a colocated reference a copy of its share;
/// - one copy in the model's dtype for each rollout engine (single_process: one; multi_process:
///   rollout_engines, by placement.rollout_device) and for the reference (placement.reference_device
///   for a node) whose device is the CPU; none for rollout.backend = "http" or placement.mode =
///   "colocated" engines;
/// - with algorithm.staleness > 0 and the controller taking the weights as tensors (not colocated
///   engines, not a trainer node, which pushes from its live policy, not weight_sync.transport =
///   "collective"), up to 3 host snapshots of the weights (one loading into the engines, one
///   pending, the next being made), whatever the trainer's device: CausalLM::hf_state_dict is on
///   the host.
/// `parts` names each term, for the refusal.
struct HostBytesPerParameter {
  double bytes = 0;
  std::string parts;
};
HostBytesPerParameter run_host_bytes_per_parameter(const Config& config, int trainer_ranks_on_host = 1,
                                                   double rank_parameter_share = 1.0);

/// Builds the run's actors. The trainer comes first: torch::manual_seed(run.seed), then its
/// policy (in this process or in its node, the same way), whose initial weights the reference
/// takes. Throws std::invalid_argument / std::runtime_error naming what failed (a model that
/// cannot be built, a node that did not start); nodes started before the failure are stopped.
/// `ranks`: this process's (rank 0's) process groups when config.parallel.dp > 1, else null.
Actors place_actors(const Config& config, const NodeSite& site, parallel::ProcessGroups* ranks = nullptr);

}  // namespace kiln::controller
