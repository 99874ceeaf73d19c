#pragma once
// Wire schema of the reference-logprob family (ref.*), spoken by the reference actor
// (actors/reference/ref_service.hpp). docs/wire-format.md is the contract.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "messaging/schema.hpp"
#include "actors/trainer/trainer_config.hpp"
#include "model/model_spec.hpp"

namespace kiln::messaging {

/// Reference policy in another process (answered with RefReady). Its weights arrive next as
/// weight_sync.bucket/commit (the run's initial policy), then RefLogprobs requests.
struct RefInit {
  static constexpr std::string_view kType = "ref.init";
  static constexpr uint32_t kVersion = 4;  ///< v4: logprobs.true_on_policy
  model::ModelSpec model;           ///< device must be "cpu" so far
  trainer::LogprobConfig logprobs;  ///< the trainer's: micro-batch tokens, routing replay, temperature
  MSGPACK_DEFINE_MAP(model, logprobs);
};
struct RefReady {
  static constexpr std::string_view kType = "ref.ready";
  static constexpr uint32_t kVersion = 1;
  int64_t weights_version = -1;  ///< -1 until weights arrived
  MSGPACK_DEFINE_MAP(weights_version);
};
/// One sample inside RefLogprobs (not a message type by itself).
struct RefSampleSpec {
  uint64_t id = 0;
  std::vector<int64_t> prompt, completion;
  MSGPACK_DEFINE_MAP(id, prompt, completion);
};
/// Per-token reference log-probs of these samples' completions (answered with
/// RefLogprobsResult). Tensor i, when present for every sample, is sample i's routed experts
/// [P + n - 1, L, K] I64 (routing replay); no tensors: the reference routes itself.
struct RefLogprobs {
  static constexpr std::string_view kType = "ref.logprobs";
  static constexpr uint32_t kVersion = 1;
  std::vector<RefSampleSpec> samples;
  MSGPACK_DEFINE_MAP(samples);
};
struct RefLogprobsResult {
  static constexpr std::string_view kType = "ref.logprobs.result";
  static constexpr uint32_t kVersion = 1;
  std::vector<std::vector<float>> logprobs;  ///< [samples][completion tokens], request order
  MSGPACK_DEFINE_MAP(logprobs);
};

/// Every type above is spoken by a program that includes this header.
inline const bool kReferenceMessages = declare_message_types<RefInit, RefReady, RefLogprobs, RefLogprobsResult>();

}  // namespace kiln::messaging
