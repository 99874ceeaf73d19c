#pragma once
// Engines that generate in lockstep over an expert-parallel model, and the engine colocated
// with a trainer rank (placement.mode = "colocated", docs/parallel.md).
//
// With expert parallel (CausalLM::expert_parallel) every forward is collective over the ep
// group: each MoE layer sends its tokens' rows to the ranks that hold their experts and
// serves the rows the others send (model/blocks/moe_ep.hpp). The engines of the ep ranks, each
// with its own requests (data-parallel attention, expert-parallel MoE: SGLang's DP-attention +
// EP), therefore step together: before each step the ranks agree (an all-reduce) whether any
// of them has work; each rank then runs its engine's step, and a rank whose step ran no
// forward (no work left, or only shared prompts taken) serves the others' rows through its
// experts instead (CausalLM::serve_expert_parallel). Every rank thus enters each MoE layer's
// exchanges once per step, whatever its own batch.
#include <functional>
#include <memory>
#include <vector>

#include "actors/rollout/engine.hpp"

namespace kiln::rollout {

/// Generates `requests` on `engine` to completion, in lockstep with the engines of the other
/// ranks of engine.model().expert_parallel() doing the same with theirs (each rank
/// its own requests, any number, none included); without an ep group, as Engine::generate.
/// Every request is checked on every rank first (Engine::check) and the ranks agree on it: a
/// request refused anywhere makes every rank throw std::invalid_argument (the refusing rank's
/// message; the others name the group) with nothing submitted. `between_steps` runs after each
/// step. Completions sorted by id. Collective over the ep group; throws std::logic_error for a
/// paused engine, parallel::CollectiveError when a rank is lost.
std::vector<Completion> generate_in_lockstep(Engine& engine, std::vector<GenerationRequest> requests,
                                             const std::function<void()>& between_steps = {});

/// The rollout engine of a trainer rank, over the rank's own policy module: no second copy of
/// the weights and no weight sync (the engine reads what the optimizer wrote, in place); its
/// cache is allocated once, here. verl's hybrid engine and slime's colocated mode do the same
/// with a separate inference engine that shares the GPU; here the engine is kiln's own, run
/// between training steps (the trainer and the engine never run at once: synchronous RL).
class ColocatedEngine {
 public:
  /// Throws what Engine's constructor throws (cuda_graphs with an expert-parallel policy).
  ColocatedEngine(std::shared_ptr<model::CausalLM> policy, const EngineOptions& options);
  /// generate_in_lockstep at policy version `version` (the trainer's optimizer steps: what the
  /// completions' policy_versions say).
  std::vector<Completion> generate(std::vector<GenerationRequest> requests, int64_t version,
                                   const std::function<void()>& between_steps = {});
  const EngineOptions& options() const { return engine_.options(); }

 private:
  Engine engine_;
};

}  // namespace kiln::rollout
