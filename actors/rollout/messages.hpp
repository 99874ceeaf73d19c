#pragma once
// Wire schema of the rollout family (rollout.*), spoken by the rollout actor
// (actors/rollout/rollout_service.hpp). docs/wire-format.md is the contract.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "messaging/schema.hpp"
#include "actors/rollout/engine_options.hpp"
#include "model/model_spec.hpp"

namespace kiln::messaging {

/// Rollout in another process: the engine to build (answered with RolloutReady). Weights
/// arrive as weight_sync.bucket/commit before the first rollout.generate.
struct RolloutInit {
  static constexpr std::string_view kType = "rollout.init";
  static constexpr uint32_t kVersion = 9;  ///< v4: engine.absorbed_decode; v5: engine.cuda_graphs; v6: engine.mla_decode_kernel; v7: engine.sampling_kernel, engine.moe_decode_kernel; v8: engine.true_on_policy; v9: engine.overlap_schedule
  model::ModelSpec model;         ///< device must be "cpu" (engine processes run on the CPU so far)
  rollout::EngineOptions engine;  ///< cache, batch and the testing step delay
  MSGPACK_DEFINE_MAP(model, engine);
};
struct RolloutReady {
  static constexpr std::string_view kType = "rollout.ready";
  static constexpr uint32_t kVersion = 1;
  int64_t policy_version = 0;
  MSGPACK_DEFINE_MAP(policy_version);
};
/// One generation request inside RolloutGenerate (not a message type by itself).
struct RolloutRequestSpec {
  uint64_t id = 0;
  std::vector<int64_t> prompt;
  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = 0, max_new_tokens = 1;
  uint64_t seed = 0;
  std::vector<int64_t> stop_token_ids;
  MSGPACK_DEFINE_MAP(id, prompt, temperature, top_p, top_k, max_new_tokens, seed, stop_token_ids);
};
/// Generate these requests to completion (answered with RolloutResult).
struct RolloutGenerate {
  static constexpr std::string_view kType = "rollout.generate";
  static constexpr uint32_t kVersion = 1;
  std::vector<RolloutRequestSpec> requests;
  MSGPACK_DEFINE_MAP(requests);
};
struct RolloutCompletionSpec {
  uint64_t id = 0;
  std::vector<int64_t> tokens, policy_versions;
  std::vector<float> logprobs, entropies;
  std::string finish_reason;  ///< "stop" | "length"
  double time_to_first_token_s = 0;
  MSGPACK_DEFINE_MAP(id, tokens, policy_versions, logprobs, entropies, finish_reason, time_to_first_token_s);
};
/// The completions, in finish order; tensor i is completion i's routed experts [P + n - 1, L, K] I64.
struct RolloutResult {
  static constexpr std::string_view kType = "rollout.result";
  static constexpr uint32_t kVersion = 1;
  std::vector<RolloutCompletionSpec> completions;
  MSGPACK_DEFINE_MAP(completions);
};

/// Every type above is spoken by a program that includes this header.
inline const bool kRolloutMessages = declare_message_types<RolloutInit, RolloutReady, RolloutGenerate, RolloutResult>();

}  // namespace kiln::messaging
