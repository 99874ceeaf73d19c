#pragma once
// Every message type kiln sends, declared once: a struct with its wire name (kType), its
// schema version (kVersion) and its payload fields (MSGPACK_DEFINE_MAP: field names are the
// msgpack map keys). `MessageTypes` lists them all; the decoder rejects any other type name.
// Adding a type: write the struct here (or in a header included here), add it to
// MessageTypes, document it in docs/wire-format.md. Changing a type's fields: bump kVersion.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <msgpack.hpp>

#include "messaging/envelope.hpp"

namespace kiln::messaging {

/// Answer to a failed request (Kind::error). code is an ErrorCode name.
struct ErrorReply {
  static constexpr std::string_view kType = "error";
  static constexpr uint32_t kVersion = 1;
  std::string code;
  std::string message;
  MSGPACK_DEFINE_MAP(code, message);
};

/// Liveness probe; any actor answers with Pong.
struct Ping {
  static constexpr std::string_view kType = "ping";
  static constexpr uint32_t kVersion = 1;
  std::string note;
  MSGPACK_DEFINE_MAP(note);
};
struct Pong {
  static constexpr std::string_view kType = "pong";
  static constexpr uint32_t kVersion = 1;
  std::string node;   ///< node name of the answering process
  std::string actor;  ///< logical name of the answering actor
  std::string note;   ///< Ping::note, echoed
  MSGPACK_DEFINE_MAP(node, actor, note);
};

/// A node joins a graph: it announces the actors it hosts at `endpoint`.
struct GraphJoin {
  static constexpr std::string_view kType = "graph.join";
  static constexpr uint32_t kVersion = 1;
  std::string node;
  std::string endpoint;             ///< where the node's gateway is bound
  std::vector<std::string> actors;  ///< logical names it hosts
  MSGPACK_DEFINE_MAP(node, endpoint, actors);
};
/// Asks the graph's root where an actor lives.
struct GraphLookup {
  static constexpr std::string_view kType = "graph.lookup";
  static constexpr uint32_t kVersion = 1;
  std::string actor;
  MSGPACK_DEFINE_MAP(actor);
};
/// The root's directory (actor name -> endpoint), the answer to join and lookup.
struct GraphDirectory {
  static constexpr std::string_view kType = "graph.directory";
  static constexpr uint32_t kVersion = 1;
  std::map<std::string, std::string> actors;
  MSGPACK_DEFINE_MAP(actors);
};

/// Diagnostics: the receiver answers DiagEchoResult with the same tensors and their CRC-32s.
struct DiagEcho {
  static constexpr std::string_view kType = "diag.echo";
  static constexpr uint32_t kVersion = 1;
  std::string note;
  MSGPACK_DEFINE_MAP(note);
};
struct DiagEchoResult {
  static constexpr std::string_view kType = "diag.echo_result";
  static constexpr uint32_t kVersion = 1;
  std::string node;
  std::vector<uint32_t> crc32;   ///< per received tensor, zlib CRC-32 of its bytes
  std::vector<uint64_t> nbytes;  ///< per received tensor
  MSGPACK_DEFINE_MAP(node, crc32, nbytes);
};
/// Diagnostics: the receiver waits `milliseconds` before answering Pong (a slow actor).
struct DiagSleep {
  static constexpr std::string_view kType = "diag.sleep";
  static constexpr uint32_t kVersion = 1;
  uint32_t milliseconds = 0;
  MSGPACK_DEFINE_MAP(milliseconds);
};

/// Benchmark payload: one tensor per message, sequence number for ordering checks.
struct BenchChunk {
  static constexpr std::string_view kType = "bench.chunk";
  static constexpr uint32_t kVersion = 1;
  uint64_t seq = 0;
  MSGPACK_DEFINE_MAP(seq);
};

/// Weight sync: one bucket of a new policy version; the tensors travel as tensor frames under
/// their HF names. Answered with WeightSyncAck.
struct WeightSyncBucket {
  static constexpr std::string_view kType = "weight_sync.bucket";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  int64_t index = 0, count = 0;  ///< this bucket's place among the version's buckets
  MSGPACK_DEFINE_MAP(version, index, count);
};
/// Weight sync: after the last bucket, the sender's manifest (every tensor's name and CRC-32).
/// The receiver checks every received tensor against it and applies the version only if all
/// match; otherwise it answers with an error naming each tensor that differs.
struct WeightSyncCommit {
  static constexpr std::string_view kType = "weight_sync.commit";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  std::vector<std::string> names;
  std::vector<uint32_t> crc32;
  MSGPACK_DEFINE_MAP(version, names, crc32);
};
struct WeightSyncAck {
  static constexpr std::string_view kType = "weight_sync.ack";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;
  int64_t tensors = 0;  ///< received so far in this version
  MSGPACK_DEFINE_MAP(version, tensors);
};

/// Rollout in another process: what the remote engine builds (answered with RolloutReady).
struct RolloutInit {
  static constexpr std::string_view kType = "rollout.init";
  static constexpr uint32_t kVersion = 2;
  std::string package, flavor, checkpoint;  ///< model registry name + flavor, or HF checkpoint dir
  int64_t cache_blocks = 0, block_size = 0, max_batch = 0;
  int64_t step_delay_ms = 0;                ///< testing: sleep per engine step
  std::string dtype = "fp32";               ///< "fp32" | "bf16": the engine's weights and cache
  MSGPACK_DEFINE_MAP(package, flavor, checkpoint, cache_blocks, block_size, max_batch, step_delay_ms, dtype);
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

/// Reference policy in another process (answered with RefReady). Its weights arrive next as
/// weight_sync.bucket/commit (the run's initial policy), then RefLogprobs requests.
struct RefInit {
  static constexpr std::string_view kType = "ref.init";
  static constexpr uint32_t kVersion = 2;
  std::string package, flavor, checkpoint;  ///< model registry name + flavor, or HF checkpoint dir
  int64_t max_tokens_per_microbatch = 4096;
  bool routing_replay = true;
  double temperature = 1.0;                 ///< log-probs of logits / temperature
  std::string dtype = "fp32";               ///< "fp32" | "bf16": the reference's weights
  MSGPACK_DEFINE_MAP(package, flavor, checkpoint, max_tokens_per_microbatch, routing_replay, temperature, dtype);
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

/// The policy trainer in another process (actor trainer/N, answered with TrainerReady): builds
/// the policy as a one-process run does (torch::manual_seed(seed), then the registry), on
/// `device` in `dtype`, with the trainer settings (actors/trainer/trainer.hpp TrainerConfig).
struct TrainerOptimSpec {
  double lr = 1e-3, weight_decay = 0, grad_clip = 1.0;
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0, total_steps = 0;
  MSGPACK_DEFINE_MAP(lr, weight_decay, grad_clip, lr_schedule, warmup_steps, total_steps);
};
struct TrainerLossSpec {
  double clip_low = 0.2, clip_high = 0.28, kl_coef = 0;
  std::string kl_estimator = "k3", aggregation = "token_mean";
  double tis_cap = 2.0, entropy_coef = 0;
  MSGPACK_DEFINE_MAP(clip_low, clip_high, kl_coef, kl_estimator, aggregation, tis_cap, entropy_coef);
};
struct TrainerInit {
  static constexpr std::string_view kType = "trainer.init";
  static constexpr uint32_t kVersion = 1;
  std::string package, flavor, checkpoint;  ///< model registry name + flavor, or HF checkpoint dir
  std::string device = "cpu", dtype = "fp32";
  int64_t seed = 1;
  int64_t max_tokens_per_microbatch = 4096;
  bool routing_replay = true;
  double temperature = 1.0;
  bool recompute_old_logprobs = false;  ///< pi_old from a separate no-grad pass (log_probs_time)
  double bucket_mib = 64;               ///< weight-sync bucket size for trainer.push_weights
  TrainerOptimSpec optim;
  TrainerLossSpec loss;
  MSGPACK_DEFINE_MAP(package, flavor, checkpoint, device, dtype, seed, max_tokens_per_microbatch, routing_replay,
                     temperature, recompute_old_logprobs, bucket_mib, optim, loss);
};
/// Answer to trainer.init and trainer.load.
struct TrainerReady {
  static constexpr std::string_view kType = "trainer.ready";
  static constexpr uint32_t kVersion = 1;
  int64_t policy_version = 0;
  int64_t vocab_size = 0;
  MSGPACK_DEFINE_MAP(policy_version, vocab_size);
};
/// Load a checkpoint written by trainer.save (or by a one-process run) into the policy and
/// optimizer (answered with TrainerReady: the saved version).
struct TrainerLoad {
  static constexpr std::string_view kType = "trainer.load";
  static constexpr uint32_t kVersion = 1;
  std::string dir;
  MSGPACK_DEFINE_MAP(dir);
};
/// One sample inside TrainerTrain (not a message type by itself).
struct TrainerSampleSpec {
  uint64_t id = 0;
  std::vector<int64_t> prompt, completion;
  std::vector<float> behavior_logprobs;  ///< [n] from the rollout
  std::vector<float> ref_logprobs;       ///< [n] or empty (KL off)
  float advantage = 0;
  MSGPACK_DEFINE_MAP(id, prompt, completion, behavior_logprobs, ref_logprobs, advantage);
};
/// One optimizer step on these samples (answered with TrainerStepResult). Tensor i, when
/// present for every sample, is sample i's routed experts [P + n - 1, L, K] I64 (routing replay).
struct TrainerTrain {
  static constexpr std::string_view kType = "trainer.train";
  static constexpr uint32_t kVersion = 1;
  std::vector<TrainerSampleSpec> samples;
  MSGPACK_DEFINE_MAP(samples);
};
struct TrainerStepResult {
  static constexpr std::string_view kType = "trainer.step_result";
  static constexpr uint32_t kVersion = 1;
  double loss = 0, pg_loss = 0, kl = 0, clip_fraction = 0, grad_norm = 0, lr = 0, entropy = 0;
  double train_rollout_logprob_abs_diff = 0;
  int64_t micro_batches = 0, tokens = 0, loss_tokens = 0;
  double actor_train_time = 0, log_probs_time = 0;  ///< seconds
  int64_t policy_version = 0;                       ///< after the step
  MSGPACK_DEFINE_MAP(loss, pg_loss, kl, clip_fraction, grad_norm, lr, entropy, train_rollout_logprob_abs_diff,
                     micro_batches, tokens, loss_tokens, actor_train_time, log_probs_time, policy_version);
};
/// Stream the current policy version to each target actor (weight_sync.bucket/commit, checked
/// by the receiver) before answering TrainerPushed; an error names the target that failed.
struct TrainerPushWeights {
  static constexpr std::string_view kType = "trainer.push_weights";
  static constexpr uint32_t kVersion = 1;
  std::vector<std::string> targets;
  MSGPACK_DEFINE_MAP(targets);
};
struct TrainerPushed {
  static constexpr std::string_view kType = "trainer.pushed";
  static constexpr uint32_t kVersion = 1;
  int64_t policy_version = 0;
  MSGPACK_DEFINE_MAP(policy_version);
};
/// Write a checkpoint (actors/trainer/checkpoint.hpp) into `dir` (answered with TrainerPushed:
/// the saved version).
struct TrainerSave {
  static constexpr std::string_view kType = "trainer.save";
  static constexpr uint32_t kVersion = 1;
  std::string dir;
  int64_t step = 0;
  std::string prompt_rng;
  MSGPACK_DEFINE_MAP(dir, step, prompt_rng);
};

using MessageTypes = std::tuple<ErrorReply, Ping, Pong, GraphJoin, GraphLookup, GraphDirectory,
                                DiagEcho, DiagEchoResult, DiagSleep, BenchChunk, WeightSyncBucket,
                                WeightSyncCommit, WeightSyncAck, RolloutInit, RolloutReady, RolloutGenerate,
                                RolloutResult, RefInit, RefReady, RefLogprobs, RefLogprobsResult, TrainerInit,
                                TrainerReady, TrainerLoad, TrainerTrain, TrainerStepResult, TrainerPushWeights,
                                TrainerPushed, TrainerSave>;

/// Schema version of a declared type, or nullopt if `type` is not declared.
std::optional<uint32_t> message_type_version(std::string_view type);

/// Builds an envelope of message type T with `value` packed as its payload.
template <class T>
Envelope make_envelope(const T& value, Kind kind, std::string sender, std::string receiver) {
  Envelope env;
  env.type = std::string(T::kType);
  env.type_version = T::kVersion;
  env.kind = kind;
  env.sender = std::move(sender);
  env.receiver = std::move(receiver);
  msgpack::sbuffer buf;
  msgpack::pack(buf, value);
  env.payload.assign(buf.data(), buf.size());
  return env;
}

/// Decodes the payload of `env` as T. Errors: unknown_type if env.type is not T's,
/// bad_message naming the type when the payload does not decode as T's fields.
Expected<msgpack::object_handle> unpack_payload(const Envelope& env);
/// "{key: type, ...}" of a payload map, for error messages.
std::string describe_payload(const msgpack::object& map);
template <class T>
Expected<T> payload_as(const Envelope& env) {
  if (env.type != T::kType)
    return make_error(ErrorCode::unknown_type,
                      "expected message type '" + std::string(T::kType) + "', got '" + env.type + "'");
  auto handle = unpack_payload(env);
  if (!handle) return handle.error();
  try {
    T value;
    handle->get().convert(value);
    return value;
  } catch (const std::exception& e) {
    return make_error(ErrorCode::bad_message, "payload of '" + env.type +
                                                  "' does not match its schema (a field has the wrong type or range; "
                                                  "got " + describe_payload(handle->get()) + "): " + e.what());
  }
}

/// An Kind::error envelope answering `request` with (code, message).
Envelope make_error_reply(const Envelope& request, const Error& error, std::string sender);
/// Turns an error envelope into an Error (remote_error unless the code names another).
Error error_from_reply(const Envelope& reply);

}  // namespace kiln::messaging
